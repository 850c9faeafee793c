"""The Node.js client and agent (clients/node) against a real mesh, with Node's test runner."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.embedded import EmbeddedMesh
from mesh import BrokerConfig, LocalMesh
from tests.helpers.direct import (
    answers_to_bad_direct_calls,
    assert_said_alike,
    python_agent_answers,
)
from tests.helpers.health import NOT_SERVING, SERVING, health_of, watching
from tests.helpers.node import NODE_DIR, kill_if_running, start_node_example

NODE_TESTS = (
    "a Node agent takes part in a group chat beside the Python agents",
    "runs every gateway pattern from plain objects",
    "hands a task to another agent with its context, read back as message.handoff",
    "a Node agent takes its step in a hand-off workflow after a Python agent",
    "sends a batch in one call: each message goes in or is refused on its own",
    "tools run under each agent's allow-list",
    "a plain subscription acknowledges receipt when asked, too",
    "a subscription naming its instance takes it off the agent when it is lost",
    "a Node agent hears when the broker refuses its answer, instead of losing it",
    "a Node agent says NOT_SERVING as it stops, and finishes what it was handling",
    "calls an agent directly on its own server, Node or Python (RT-011 peer-to-peer)",
    "a Node agent acknowledges receipt when asked, before it answers (RF-009 ACK)",
    "a send refused by a full queue is tried again (RT-011 backoff) and goes in once",
    "broadcasts to the agents of a type, and says whose queue could not take",
    "the declarations name every export of lib/mesh.js, and nothing else",
    "each declared class has the public methods of its implementation",
    "a message as read off the wire has the fields its declaration gives it",
    "a handler hears through its signal that the requester gave up",
    "a handler that passes on its signal gives up what it asked when its requester does",
    "a Node agent forwards a request: the next agent, Node or Python, answers the requester",
    "content travels as JSON.stringify reads it; what JSON cannot carry is a TypeError",
    "a closed client says so on every call, a MeshError like every other",
    "a resumed watch that fell behind catches up by itself",
    "sends written together go out together, in order, never past what a frame may carry",
    "a plain gRPC server registered for push is called by the broker with each message",
    "a Node agent served for push answers the broker's calls, with no session of its own",
    "an answer JSON cannot carry reaches the requester as an ERROR at once, saying why",
    "TLS files that cannot be used are said as the client or server is made, naming them",
    "an agent's health port is a port, 0 for any free one, or -1 for none",
    "an agent waits for its broker a number of milliseconds, 0 or more",
    "a process serving several Node agents is ready while every one takes its messages",
    "a handler that throws RetryLater has the message again then, taking the next meanwhile",
)
"""Tests of clients/node/test/ whose names the run must show."""


async def start_echo_agent(agent_id: str, broker: str) -> tuple[asyncio.subprocess.Process, str]:
    """clients/node/examples/echo-agent.js serving agent_id against broker, in a process of
    its own; the process and the address of the agent's server once it serves."""
    return await start_node_example("echo-agent.js", agent_id, broker)


async def node_program(script: str, cwd: Path, env: dict[str, str]) -> Any:
    """``node SCRIPT`` in ``cwd``: what it printed, read as JSON, once it ended with status 0."""
    run = await asyncio.create_subprocess_exec(
        "node", script, cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, err = await run.communicate()
    assert run.returncode == 0, err.decode()
    return json.loads(out)


async def stop_echo_agent(node: asyncio.subprocess.Process) -> None:
    """Stops it as a service manager would (SIGTERM): it must end cleanly, with status 0."""
    if node.returncode is None:
        node.terminate()
        async with asyncio.timeout(15):
            assert await node.wait() == 0


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_node_client_and_agent_pass_their_tests(embedded: EmbeddedMesh) -> None:
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("clients/node dependencies are missing: run `make setup`")
    env = {
        **os.environ,
        "AGENTMESH_BROKER": embedded.broker.address,
        "AGENTMESH_GATEWAY": embedded.gateway.address,
    }
    process = await asyncio.create_subprocess_exec(
        "node",
        "--test",
        "--test-reporter=spec",
        "test/",
        cwd=NODE_DIR,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(120):
        out, _ = await process.communicate()
    text = out.decode()
    assert process.returncode == 0, text
    for name in NODE_TESTS:  # each ran (and, with fail 0 below, passed)
        assert name in text, name
    assert "\N{INFORMATION SOURCE} fail 0" in text  # the spec reporter's summary
    assert "CONTRIBUTION NodeExpertAgent: Buy AAPL (confidence 0.75)" in text


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_typescript_program_compiles_against_the_declarations_and_runs(
    embedded: EmbeddedMesh, tmp_path: Path
) -> None:
    """clients/node/test/types/tour.ts, strict: tsc compiles it (and refuses each misuse it
    marks), and compiled, installed as a user's program would be, it runs against the mesh."""
    if not (NODE_DIR / "node_modules" / "typescript").exists():
        pytest.fail("clients/node dependencies are missing: run `make setup`")
    build = tmp_path / "tour"
    tsc = await asyncio.create_subprocess_exec(
        str(NODE_DIR / "node_modules" / ".bin" / "tsc"),
        "-p", "test/types", "--noEmit", "false", "--outDir", str(build),
        cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    async with asyncio.timeout(120):
        out, _ = await tsc.communicate()
    assert tsc.returncode == 0, out.decode()
    # The package as a dependency of the program: node_modules/agentmesh-client.
    (build / "node_modules").mkdir()
    (build / "node_modules" / "agentmesh-client").symlink_to(NODE_DIR)
    env = {
        **os.environ,
        "AGENTMESH_BROKER": embedded.broker.address,
        "AGENTMESH_GATEWAY": embedded.gateway.address,
    }
    assert await node_program("tour.js", build, env) == {
        "received": ["now", "later"],
        "sum": 6,
        "unknownAgent": "NOT_FOUND",
        "batchViolation": "content",
        "state": {"left": 2},
        "filtering": "COMPLETED",
    }


FULL_GATEWAY_PROGRAM = """
const { GatewayClient } = require(process.env.MESH_JS);
const address = process.env.AGENTMESH_GATEWAY;
const chat = (client, query) => client.groupChat({ agentIds: ['SlowExpert'], query });
(async () => {
  const impatient = new GatewayClient(address, { retryDelaysMs: [] });
  const refusal = await chat(impatient, 'now').then(() => null, (err) => ({
    code: err.codeName, reason: err.reason, retryAfterMs: err.retryAfterMs }));
  impatient.close();
  const retries = [];
  const patient = new GatewayClient(address, { onRetry: ({ attempt, code, delayMs, error }) =>
    retries.push({ attempt, code, delayMs, reason: error.reason }) });
  const events = await chat(patient, 'later');
  patient.close();
  const result = events[events.length - 1];
  console.log(JSON.stringify({ refusal, retries: retries.slice(0, 1), first: events[0].kind,
    result: [result.kind, result.data.status] }));
})().catch((err) => { console.error(err); process.exit(1); });
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_gateway_client_starts_a_run_the_full_gateway_refused_again(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    """The gateway runs its limit: a Node GatewayClient's run is refused before it starts
    (TOO_MANY_RUNS, with its RetryInfo), and started again after the backoff (onRetry hears
    of it) until a place frees; with retryDelaysMs [] the caller gets the refusal."""
    from tests.helpers.gateways import full_gateway

    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("clients/node dependencies are missing: run `make setup`")
    (tmp_path / "full.js").write_text(FULL_GATEWAY_PROGRAM)
    async with full_gateway(mesh) as full:
        env = {
            **os.environ,
            "AGENTMESH_GATEWAY": full.address,
            "MESH_JS": str(NODE_DIR / "lib" / "mesh.js"),
        }
        program = asyncio.create_task(node_program("full.js", tmp_path, env))
        await full.refused_at_least(2)  # (the impatient client's, then the patient one's)
        full.release.set()
        told = await program
    assert told == {
        "refusal": {"code": "RESOURCE_EXHAUSTED", "reason": "TOO_MANY_RUNS", "retryAfterMs": 500},
        "retries": [
            {"attempt": 1, "code": "RESOURCE_EXHAUSTED", "delayMs": 500, "reason": "TOO_MANY_RUNS"}
        ],
        "first": "GROUP_CREATED",
        "result": ["RESULT", "COMPLETED"],
    }
    assert full.asked == ["held0", "later"]


STARTING_GATEWAY_PROGRAM = """
const { GatewayClient } = require(process.env.MESH_JS);
const address = process.env.AGENTMESH_GATEWAY;
(async () => {
  const once = new GatewayClient(address, { retryDelaysMs: [] });
  const refused = await once.patternStats().then(() => null, (err) => err.codeName);
  once.close();
  const retries = [];
  const client = new GatewayClient(address, { onRetry: ({ attempt, code }) => {
    retries.push([attempt, code]);
    if (attempt === 1) console.log('refused once');
  } });
  const stats = await client.patternStats();
  client.close();
  console.log(JSON.stringify({ refused, first: retries[0],
    runs: stats.find((p) => p.pattern === 'GROUP_CHAT').runs }));
})().catch((err) => { console.error(err); process.exit(1); });
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_gateway_clients_figures_wait_for_a_gateway_that_is_starting(
    mesh: LocalMesh, tmp_path: Path
) -> None:
    """Nothing listens at the gateway's address yet (it is restarting): the Node.js
    GatewayClient's patternStats is refused (UNAVAILABLE), asked again after the backoff, and
    answered once the gateway serves; with retryDelaysMs [] the caller gets the refusal."""
    from gateway.server import serve_gateway
    from mesh import SecurityConfig
    from tests.helpers.processes import free_port

    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("clients/node dependencies are missing: run `make setup`")
    (tmp_path / "starting.js").write_text(STARTING_GATEWAY_PROGRAM)
    port = free_port()
    node = await asyncio.create_subprocess_exec(
        "node", "starting.js", cwd=tmp_path,
        env={**os.environ, "AGENTMESH_GATEWAY": f"127.0.0.1:{port}",
             "MESH_JS": str(NODE_DIR / "lib" / "mesh.js")},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert node.stdout is not None
    async with asyncio.timeout(30):
        assert await node.stdout.readline() == b"refused once\n"
        gateway = await serve_gateway(mesh.address, port=port, security=SecurityConfig())
        try:
            out, err = await node.communicate()
        finally:
            await gateway.stop()
    assert node.returncode == 0, err.decode()
    assert json.loads(out) == {"refused": "UNAVAILABLE", "first": [1, "UNAVAILABLE"], "runs": 0}


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_node_client_speaks_tls_with_a_token_and_is_held_to_its_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """... and reads its token file again: a rotated token goes on, a revoked one is refused
    (the broker reads its credentials file again, looking every 0.2 s here)."""
    import mesh.security
    from mesh import LocalMesh, SecurityConfig
    from mesh.certs import write_dev_certificates

    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("clients/node dependencies are missing: run `make setup`")
    monkeypatch.setattr(mesh.security, "RENEWAL_LOOK_SECONDS", 0.2)
    certs = write_dev_certificates(tmp_path / "certs")
    token = "node-payment-token-0123456789"
    credentials = tmp_path / "credentials.json"
    credentials.write_text(
        json.dumps(
            {"principals": [{"name": "node", "token": token, "agents": ["NodePaymentAgent"]}]}
        )
    )
    security = SecurityConfig(
        tls_cert=str(certs["server"]),
        tls_key=str(certs["server_key"]),
        credentials_file=str(credentials),
    )
    async with LocalMesh(security=security) as mesh:
        env = {
            **os.environ,
            "AGENTMESH_SECURE_BROKER": mesh.address,
            "AGENTMESH_TLS_CA": str(certs["ca"]),
            "AGENTMESH_TOKEN": token,
            "AGENTMESH_SECURE_CREDENTIALS": str(credentials),
        }
        process = await asyncio.create_subprocess_exec(
            "node",
            "--test",
            "--test-reporter=spec",
            "test/secure.test.js",
            cwd=NODE_DIR,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        async with asyncio.timeout(60):
            out, _ = await process.communicate()
    text = out.decode()
    assert process.returncode == 0, text
    assert "talks TLS with a bearer token" in text
    assert "reads its token file again" in text
    assert "pass 4\n" in text and "skipped 0\n" in text, text


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_agent_is_back_in_service_after_a_broker_restart() -> None:
    from mesh import connect
    from mesh.client import NO_RETRY
    from tests.helpers.processes import (
        BROKER_READY,
        free_port,
        request_once_back,
        start,
        stop,
        wait_killed,
    )

    port = free_port()
    address = f"127.0.0.1:{port}"
    broker = await start("broker", "--port", str(port), ready=BROKER_READY)
    node = None
    try:
        node, node_at = await start_echo_agent("NodeEchoAgent", address)
        async with (
            connect(address, agent_id="Caller", retry=NO_RETRY) as client,
            watching(node_at, "mesh.v1.AgentService") as readiness,
        ):
            first = await client.request("NodeEchoAgent", {"action": "echo", "n": 1}, timeout=5)
            assert first.content["echo"] == {"action": "echo", "n": 1}
            assert await readiness.until(SERVING) == [SERVING]

            # The broker dies and comes back on its port, remembering nothing (memory store):
            # the Node agent registers and subscribes again by itself. Meanwhile it is not
            # ready, though its process serves (liveness).
            await wait_killed(broker)
            assert await readiness.until(NOT_SERVING) == [NOT_SERVING]
            assert await health_of(node_at) == SERVING
            broker = await start("broker", "--port", str(port), ready=BROKER_READY)
            assert await readiness.until(SERVING) == [SERVING]
            again = await request_once_back(client, "NodeEchoAgent", {"action": "echo", "n": 2})
            assert again.content["echo"] == {"action": "echo", "n": 2}
            assert again.content["pid"] == node.pid  # the same process, never restarted
        await stop_echo_agent(node)
    finally:
        await kill_if_running(node)
        await stop(broker)


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_agent_started_before_its_broker_waits_for_it() -> None:
    """With AGENTMESH_WAIT_FOR_BROKER (waitForBrokerMs), a Node agent started before its
    broker waits for it, its server up and not ready meanwhile, then takes its messages;
    without, its start fails once its client's retries are spent, as before."""
    from mesh import connect
    from tests.helpers.processes import BROKER_READY, free_port, start, stop

    async def early_agent(broker: str, wait: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            "node", "examples/echo-agent.js", "NodeEarlyAgent", cwd=NODE_DIR,
            env={**os.environ, "AGENTMESH_BROKER": broker, "AGENTMESH_WAIT_FOR_BROKER": wait},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip

    port = free_port()
    address = f"127.0.0.1:{port}"
    node = await early_agent(address, "30")
    assert node.stdout is not None
    broker = None

    async def line_with(text: str) -> str:
        assert node.stdout is not None
        async with asyncio.timeout(30):
            while text not in (line := (await node.stdout.readline()).decode()):
                assert line, f"the Node agent ended before saying {text!r}"
        return line

    try:
        waiting = await line_with("waits for its broker")
        at = waiting.split(" at ", 1)[1].split(" ", 1)[0]
        assert await health_of(at) == SERVING  # (liveness)
        assert await health_of(at, "mesh.v1.AgentService") == NOT_SERVING  # (readiness)
        broker = await start("broker", "--port", str(port), ready=BROKER_READY)
        assert f"NodeEarlyAgent serving on {at}" in await line_with("serving on")
        async with connect(address, agent_id="Caller") as client:
            answer = await client.request("NodeEarlyAgent", {"action": "echo", "n": 1}, timeout=5)
            assert answer.content["pid"] == node.pid
        await stop_echo_agent(node)
    finally:
        await kill_if_running(node)
        if broker is not None:
            await stop(broker)
    # Without the variable: the start fails, saying why.
    ended = await early_agent(f"127.0.0.1:{free_port()}", "")
    async with asyncio.timeout(30):
        out, _ = await ended.communicate()
    assert ended.returncode == 1 and "UNAVAILABLE" in out.decode(), out.decode()
    assert "waits for its broker" not in out.decode()


FAILING_LEDGER = """
const { serveAgent } = require('./lib/mesh.js');
const tries = [];
const seen = [];
(async () => {
  const agent = await serveAgent({
    broker: process.argv[1], agentId: 'NodeLedger',
    handler: async (message, context) => {
      tries.push(performance.now());
      seen.push(context.maxDeliveryAttempts);
      throw new Error('the ledger is locked');
    },
  });
  console.log(JSON.stringify('serving'));
  while (tries.length < 5) await new Promise((resolve) => { setTimeout(resolve, 20); });
  console.log(JSON.stringify({ gaps: tries.slice(1).map((at, i) => at - tries[i]), seen }));
  await agent.stop();
})().catch((error) => { console.error(error); process.exit(1); });
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_agent_backs_off_until_the_last_attempt_of_its_broker() -> None:
    """serveAgent reads the broker's number of delivery attempts from each delivery (its
    handler's context says it) and waits out RT-011's backoff before each of a broker's five
    (2 s before the fifth too), where it stopped waiting after RT-011's default fourth."""
    config = BrokerConfig(sweep_interval=0.05, max_delivery_attempts=5)
    async with LocalMesh(config) as local, local.client("NodeBookkeeper") as client:
        node = await asyncio.create_subprocess_exec(
            "node", "-e", FAILING_LEDGER, local.address, cwd=NODE_DIR,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert node.stdout is not None
        try:
            async with asyncio.timeout(30):
                assert json.loads(await node.stdout.readline()) == "serving"
                wrecked = await client.handoff("NodeLedger", "wreck")
                said = json.loads(await node.stdout.readline())
                while not await client.dead_letters("NodeLedger"):  # noqa: ASYNC110 - broker state
                    await asyncio.sleep(0.05)
                assert await node.wait() == 0
        finally:
            await kill_if_running(node)
        assert said["seen"] == [5] * 5
        gaps = said["gaps"]
        assert gaps[0] >= 99 and gaps[1] >= 499 and gaps[2] >= 1999, gaps
        assert gaps[3] >= 1999, gaps  # (before: at once, after RT-011's fourth)
        [dead] = await client.dead_letters("NodeLedger")
        assert dead.message.message_id == wrecked.message_id
        assert dead.reason == "nacked after 5 delivery attempts"


NEW_CLIENTS_AFTER_A_RESTART = """
const readline = require('node:readline');
const { MeshClient } = require('./lib/mesh.js');
const address = process.argv[1];
const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const said = (what) => console.log(JSON.stringify(what));
(async () => {
  const older = new MeshClient(address, { agentId: 'Older', retryDelaysMs: [] });
  await older.register('Older');
  said('registered');
  await lines.next(); // the broker is down
  said(await older.register('Older').then(() => 'OK', (error) => error.codeName));
  await lines.next(); // the broker is back
  const news = [];
  for (let n = 0; n < 3; n += 1) {
    const client = new MeshClient(address, { agentId: `New${n}`, retryDelaysMs: [] });
    news.push(await client.register(`New${n}`).then((info) => info.agentId,
      (error) => `${error.codeName}: ${error.message}`));
    client.close();
  }
  said(news);
  older.close();
})();
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_new_node_client_reaches_a_restarted_broker_while_an_older_one_waits() -> None:
    """Each Node client has its own connection: one made once the broker is back is not held to
    the reconnect backoff of an older client of the process (grpc-js's process-wide pool made
    its calls fail at once, though the broker was serving)."""
    from tests.helpers.processes import BROKER_READY, free_port, start, stop, wait_killed

    port = free_port()
    address = f"127.0.0.1:{port}"
    broker = await start("broker", "--port", str(port), ready=BROKER_READY)
    node = await asyncio.create_subprocess_exec(
        "node", "-e", NEW_CLIENTS_AFTER_A_RESTART, address, cwd=NODE_DIR,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert node.stdin is not None and node.stdout is not None

    async def said() -> Any:
        async with asyncio.timeout(30):
            return json.loads(await node.stdout.readline())

    try:
        assert await said() == "registered"
        await wait_killed(broker)
        node.stdin.write(b"down\n")
        assert await said() == "UNAVAILABLE"
        await asyncio.sleep(1.0)  # (the older client's connection backs off meanwhile)
        broker = await start("broker", "--port", str(port), ready=BROKER_READY)
        node.stdin.write(b"up\n")
        node.stdin.close()
        assert await said() == ["New0", "New1", "New2"]
        async with asyncio.timeout(15):
            assert await node.wait() == 0
    finally:
        await kill_if_running(node)
        await stop(broker)


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_agent_serves_health_and_reflection_for_plain_grpc_tools() -> None:
    """As every server of the mesh: buf curl finds a Node agent's methods by reflection and
    calls them; grpc.health.v1 says SERVING."""
    import sys

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.helpers.processes import BROKER_READY, free_port, start, stop

    buf = str(Path(sys.executable).parent / "buf")
    port = free_port()
    broker = await start("broker", "--port", str(port), ready=BROKER_READY)
    node = None
    try:
        node, address = await start_echo_agent("NodeToolsAgent", f"127.0.0.1:{port}")

        async def buf_curl(*args: str) -> str:
            process = await asyncio.create_subprocess_exec(
                buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge", *args,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            async with asyncio.timeout(60):
                out, _ = await process.communicate()
            assert process.returncode == 0, out.decode()
            return out.decode()

        methods = (await buf_curl("--list-methods", f"http://{address}")).split()
        assert methods == [
            "mesh.v1.AgentService/DescribeAgent",
            "mesh.v1.AgentService/HandleMessage",
            "mesh.v1.AgentService/NotifyDeregistered",
        ]
        card = await buf_curl(f"http://{address}/mesh.v1.AgentService/DescribeAgent")
        assert '"agentId": "NodeToolsAgent"' in card, card
        answer = await buf_curl(
            "-d",
            '{"message": {"from_agent": "cli", "to_agent": "NodeToolsAgent",'
            ' "content": {"action": "ping"}}}',
            f"http://{address}/mesh.v1.AgentService/HandleMessage",
        )
        assert '"servedBy": "NodeToolsAgent"' in answer, answer
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "mesh.v1.AgentService"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await stop_echo_agent(node)
    finally:
        await kill_if_running(node)
        await stop(broker)


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_agent_whose_process_dies_is_taken_off_its_agents_instances() -> None:
    """Two Node processes serve one agent; each is killed (SIGKILL: no deregistration) and
    leaves the agent's instances as its session breaks; the agent stays, with none."""
    from mesh.testing import LocalMesh
    from tests.helpers.processes import instances_become

    async with LocalMesh() as mesh, mesh.client("Caller") as client:
        nodes = []
        try:
            for _ in range(2):
                nodes.append(await start_echo_agent("NodeTwinEcho", mesh.address))
            (first, first_at), (second, second_at) = nodes
            await instances_become(client, "NodeTwinEcho", (first_at, second_at))
            first.kill()
            await first.wait()
            info = await instances_become(client, "NodeTwinEcho", (second_at,))
            assert info.address == second_at
            second.kill()
            await second.wait()
            info = await instances_become(client, "NodeTwinEcho", ())
            assert info.address == ""
            # As the Node client reads it: no instance, and since when.
            script = (
                "const { MeshClient } = require('./lib/mesh');"
                f"const c = new MeshClient('{mesh.address}');"
                "c.listAgents().then((agents) => {"
                " console.log(JSON.stringify(agents.find((a) => a.agentId === 'NodeTwinEcho')));"
                " c.close(); });"
            )
            reader = await asyncio.create_subprocess_exec(
                "node", "-e", script, cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE
            )
            async with asyncio.timeout(30):
                read = json.loads((await reader.communicate())[0])
            assert read["instances"] == [] and read["address"] == ""
            assert info.lost_at is not None
            assert read["lostAt"] == info.lost_at.isoformat(timespec="milliseconds").replace(
                "+00:00", "Z"
            )
        finally:
            for node, _ in nodes:
                if node.returncode is None:
                    node.kill()
                    await node.wait()


PACKED_PROGRAM = """
const { MeshClient, PROTO_ROOT } = require('agentmesh-client');
(async () => {
  const client = new MeshClient(process.env.AGENTMESH_BROKER, { agentId: 'PackedApp' });
  await client.register();
  await client.send('PackedApp', { action: 'note', parameters: { n: 1 } });
  const got = await client.receive();
  console.log(JSON.stringify({ protoRoot: PROTO_ROOT, got: got.map((m) => m.content) }));
  await client.close();
})().catch((error) => { console.error(error); process.exit(1); });
"""


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
async def test_the_packed_node_client_carries_the_contract_and_runs_from_it(
    embedded: EmbeddedMesh, tmp_path: Path
) -> None:
    """`npm pack` bundles proto/mesh/v1 into the package (and takes the copy away after):
    installed from its tarball in a program of no repository, the client reads the contract
    from the package and talks to the mesh."""
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("clients/node dependencies are missing: run `make setup`")
    # Packed from a copy, as the repository lays it out: the tests running beside this one
    # read clients/node itself.
    repo = tmp_path / "repo"
    package = repo / "clients" / "node"
    for part in ("lib", "scripts"):
        shutil.copytree(NODE_DIR / part, package / part)
    shutil.copy(NODE_DIR / "package.json", package)
    shutil.copytree(NODE_DIR.parents[1] / "proto" / "mesh", repo / "proto" / "mesh")
    pack = await asyncio.create_subprocess_exec(
        "npm", "pack", "--json", "--pack-destination", str(tmp_path), cwd=package,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(120):
        out, err = await pack.communicate()
    assert pack.returncode == 0, err.decode()
    [packed] = json.loads(out)
    files = {f["path"] for f in packed["files"]}
    protos = sorted(p.name for p in (repo / "proto" / "mesh" / "v1").glob("*.proto"))
    assert {f"proto/mesh/v1/{name}" for name in protos} <= files
    assert {"lib/mesh.js", "lib/mesh.d.ts", "package.json"} <= files
    assert not (package / "proto").exists()  # (the copy is gone again)
    # Installed where no repository is: node_modules/agentmesh-client from the tarball, its
    # dependencies found on NODE_PATH.
    app = tmp_path / "app"
    installed = app / "node_modules" / "agentmesh-client"
    installed.mkdir(parents=True)
    untar = await asyncio.create_subprocess_exec(
        "tar", "-xzf", str(tmp_path / packed["filename"]), "--strip-components=1",
        cwd=installed,
    )  # fmt: skip
    assert await untar.wait() == 0
    (app / "main.js").write_text(PACKED_PROGRAM)
    env = {
        **os.environ,
        "AGENTMESH_BROKER": embedded.broker.address,
        "NODE_PATH": str(NODE_DIR / "node_modules"),
    }
    result = await node_program("main.js", app, env)
    assert result["protoRoot"] == str(installed / "proto")
    assert result["got"] == [{"action": "note", "parameters": {"n": 1}}]


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_agent_serves_tls_and_the_broker_pushes_to_it(tmp_path: Path) -> None:
    """A Node agent's own server speaks TLS from AGENTMESH_TLS_CERT and _KEY, as a Python
    agent's does; with AGENTMESH_TLS_CLIENT_AUTH=none its CA is its client's alone, and it asks
    its callers for no certificate; AGENTMESH_AGENT_HEALTH_PORT gives it a plaintext health
    port. A broker with the CA (its client side) pushes each message to it over TLS."""
    from mesh import SecurityConfig, connect
    from mesh.certs import write_dev_certificates
    from tests.helpers.health import tls_health

    certs = write_dev_certificates(tmp_path / "certs")
    server, key, ca = (str(certs[name]) for name in ("server", "server_key", "ca"))
    tls = {
        "AGENTMESH_TLS_CERT": server,
        "AGENTMESH_TLS_KEY": key,
        "AGENTMESH_TLS_CA": ca,
        "AGENTMESH_TLS_CLIENT_AUTH": "none",
        "AGENTMESH_AGENT_HEALTH_PORT": "0",
    }
    broker = SecurityConfig(tls_cert=server, tls_key=key, tls_ca=ca, tls_client_auth="none")
    async with LocalMesh(security=broker) as mesh:
        node, address = await start_node_example(
            "echo-agent.js", "NodeTlsPushAgent", mesh.address, "push", env=tls
        )
        try:
            # Its health port: grpc.health.v1 in plaintext, for probes that cannot speak TLS.
            assert node.stdout is not None
            said = (await asyncio.wait_for(node.stdout.readline(), 10)).decode()
            assert said.startswith("NodeTlsPushAgent health on 127.0.0.1:"), said
            health_at = said.rsplit(" ", 1)[-1].strip()
            assert await health_of(health_at, "mesh.v1.AgentService") == SERVING
            caller = SecurityConfig(tls_ca=ca)
            async with connect(mesh.address, agent_id="Caller", security=caller) as client:
                answer = await client.request("NodeTlsPushAgent", {"action": "echo"}, timeout=10)
            assert answer.content["servedBy"] == "NodeTlsPushAgent"
            assert await tls_health(address, certs["ca"]) == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as plaintext:
                await health_of(address)
            assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await stop_echo_agent(node)


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_agent_takes_renewed_certificates_without_a_restart(tmp_path: Path) -> None:
    """A Node agent's TLS files, renewed in place as a Kubernetes Secret's volume is (by
    another CA's here, so that which one a connection got shows): its server (mutual TLS, with
    AGENTMESH_TLS_CA) uses the new certificate and the new CA from the next connection on, and
    files renewed into junk leave the last good ones in use; after a CA rotation and a broker
    restart its client connects again trusting the CA its file holds now, and serves."""
    from mesh import SecurityConfig, connect
    from mesh.certs import write_dev_certificates
    from tests.helpers.health import tls_health
    from tests.helpers.processes import BROKER_READY, free_port, request_once_back, start, stop
    from tests.helpers.secrets import SecretVolume

    first, second = (
        write_dev_certificates(tmp_path / name, clients=["caller"]) for name in ("first", "second")
    )

    def tls_files(certs: dict[str, Path]) -> dict[str, Path]:
        return {"ca.crt": certs["ca"], "tls.crt": certs["server"], "tls.key": certs["server_key"]}

    broker_files = SecretVolume(tmp_path / "broker", tls_files(first))
    agent_files = SecretVolume(tmp_path / "agent", tls_files(first))
    port = free_port()
    address = f"127.0.0.1:{port}"
    tls = ("--tls-cert", broker_files["tls.crt"], "--tls-key", broker_files["tls.key"])
    serve = ("broker", "--port", str(port), "--metrics-port", "-1", *tls)
    broker = await start(*serve, ready=BROKER_READY)
    node = None
    try:
        node, node_at = await start_node_example(
            "echo-agent.js", "NodeRenewingAgent", address,
            env={"AGENTMESH_TLS_CA": agent_files["ca.crt"],
                 "AGENTMESH_TLS_CERT": agent_files["tls.crt"],
                 "AGENTMESH_TLS_KEY": agent_files["tls.key"]},
        )  # fmt: skip
        assert node.stdout is not None

        def caller(certs: dict[str, Path]) -> tuple[Path, Path, Path]:
            return certs["ca"], certs["caller"], certs["caller_key"]

        async def request(certs: dict[str, Path], n: int) -> Any:
            security = SecurityConfig(tls_ca=str(certs["ca"]))
            async with connect(address, agent_id="Caller", security=security) as client:
                return await request_once_back(
                    client, "NodeRenewingAgent", {"action": "echo", "n": n}
                )

        assert (await request(first, 1)).content["echo"] == {"action": "echo", "n": 1}
        assert await tls_health(node_at, *caller(first)) == SERVING
        assert await tls_health(node_at, first["ca"]) == "UNAVAILABLE"  # (no certificate)

        agent_files.write({"ca.crt": b"junk", "tls.crt": b"junk", "tls.key": b"junk"})
        async with asyncio.timeout(10):
            line = (await node.stdout.readline()).decode()
        assert "changed into what cannot be used, so what was read before stays in use" in line
        assert await tls_health(node_at, *caller(first)) == SERVING

        broker_files.renew(tls_files(second))
        agent_files.renew(tls_files(second))
        await asyncio.sleep(2.5)  # (Node looks at its files every second)
        assert await tls_health(node_at, *caller(second)) == SERVING
        assert await tls_health(node_at, *caller(first)) == "UNAVAILABLE"

        # The agent's session to the broker is a connection made before: it goes on. A broker
        # restarted (a pod rolled) takes the agent's next connection, made with the new CA.
        await stop(broker)
        broker = await start(*serve, ready=BROKER_READY)
        answer = await request(second, 2)
        assert answer.content["echo"] == {"action": "echo", "n": 2}
        assert answer.content["pid"] == node.pid  # the same process, never restarted
        await stop_echo_agent(node)
    finally:
        await kill_if_running(node)
        await stop(broker)


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_agents_own_server_holds_its_callers_to_the_credentials_file(
    tmp_path: Path,
) -> None:
    """With AGENTMESH_CREDENTIALS_FILE (as the secured overlay gives each agent's pod) a Node
    agent's server takes a direct call only with a token the file names, sent as an agent its
    caller may act as, as a Python agent's does; it reads the file again when it changes."""
    from tests.helpers.guarded import check_direct_calls_are_held_to_credentials, write_credentials

    credentials = tmp_path / "credentials.json"
    write_credentials(credentials)
    async with LocalMesh() as mesh:
        env = {"AGENTMESH_CREDENTIALS_FILE": str(credentials)}
        node, address = await start_node_example(
            "echo-agent.js", "NodeGuarded", mesh.address, env=env
        )
        try:
            assert node.stdout is not None
            stdout = node.stdout

            async def warned() -> str:
                return (await stdout.readline()).decode()

            await check_direct_calls_are_held_to_credentials(
                address, "NodeGuarded", credentials, warned
            )
            await stop_echo_agent(node)
        finally:
            await kill_if_running(node)


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_npm_test_starts_a_mesh_of_its_own_when_given_none(tmp_path: Path) -> None:
    """`npm test` in clients/node, with no AGENTMESH_BROKER and AGENTMESH_GATEWAY, starts
    `agentmesh up` for the run (scripts/mesh-up.js) on free ports, outside the repository,
    and stops it after."""
    script = (
        "require('./scripts/mesh-up').meshUp().then(async (mesh) => {"
        " console.log(JSON.stringify([mesh.broker, mesh.gateway]));"
        " await new Promise((resolve) => process.stdin.once('data', resolve));"
        " await mesh.stop(); console.log('stopped'); process.exit(0); })"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTMESH_")}
    node = await asyncio.create_subprocess_exec(
        "node", "-e", script, cwd=NODE_DIR, env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert node.stdin is not None and node.stdout is not None
    try:
        async with asyncio.timeout(90):
            broker, gateway = json.loads(await node.stdout.readline())
        assert await health_of(broker, "mesh.v1.BrokerService") == SERVING
        assert await health_of(gateway, "mesh.v1.GatewayService") == SERVING
        node.stdin.write(b"\n")
        async with asyncio.timeout(30):
            assert await node.stdout.readline() == b"stopped\n"
            assert await node.wait() == 0
        with pytest.raises(grpc.aio.AioRpcError):
            await health_of(broker)
        assert not (NODE_DIR / "traces").exists() and not (NODE_DIR / "logs").exists()
    finally:
        await kill_if_running(node)


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_agents_mutual_tls_server_holds_callers_to_their_certificates(
    tmp_path: Path,
) -> None:
    """A Node agent's server with mutual TLS: a caller's certificate names who it is, acting
    as the agent of its name alone, as a Python agent's server holds it."""
    from mesh import SecurityConfig
    from mesh.certs import write_dev_certificates
    from tests.helpers.guarded import check_direct_calls_are_held_to_certificates, mutual_tls_env

    issued = write_dev_certificates(tmp_path / "certs", clients=["PaymentAgent"])
    server, key = str(issued["server"]), str(issued["server_key"])
    env = mutual_tls_env(issued)
    async with LocalMesh(security=SecurityConfig(tls_cert=server, tls_key=key)) as mesh:
        node, address = await start_node_example(
            "echo-agent.js", "NodeMutual", mesh.address, env=env
        )
        try:
            await check_direct_calls_are_held_to_certificates(address, "NodeMutual", issued)
            await stop_echo_agent(node)
        finally:
            await kill_if_running(node)


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_agent_refuses_bad_direct_calls_as_the_python_agents_do() -> None:
    """Plain gRPC to the agents' own servers, the same bad requests to a Node.js agent and to
    a Python one: each refused INVALID_ARGUMENT, saying the same. Before, the Node.js agent
    answered garbage INTERNAL, a timestamp a JavaScript Date cannot hold UNKNOWN, and took
    and echoed an undefined type or priority, a ttl out of range, NaN and 2 MiB messages."""
    async with LocalMesh() as mesh:
        python = await python_agent_answers(mesh, "NodeBadCalls")
        node, node_at = await start_echo_agent("NodeBadCalls", mesh.address)
        try:
            nodes = await answers_to_bad_direct_calls(node_at, "NodeBadCalls")
            assert node.returncode is None  # (the Node.js agent still serves)
        finally:
            await stop_echo_agent(node)
    assert_said_alike(nodes, python)


FAILING_DESK = """
const { serveAgent } = require('./lib/mesh.js');
(async () => {
  const agent = await serveAgent({
    broker: process.argv[1], agentId: 'FailingDesk',
    handler: async () => { throw new Error('the ledger at /srv/ledger is locked'); },
  });
  console.log(JSON.stringify(agent.address));
  process.on('SIGTERM', async () => { await agent.stop(); process.exit(0); });
})().catch((error) => { console.error(error); process.exit(1); });
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_direct_call_whose_handler_fails_is_answered_alike_by_node_and_python() -> None:
    """A handler that throws, called directly: a request is answered with an ERROR saying
    why, and a hand-off (nobody waits for an answer) INTERNAL "the handler failed", its error
    said in the agent's own log, by a Node.js agent as by a Python one. Before, the Node.js
    agent sent the error's text as the status's details."""
    from mesh import AgentContext, Message, agent
    from mesh.v1 import agent_pb2, agent_pb2_grpc, message_pb2

    @agent("FailingDesk")
    async def failing(message: Message, ctx: AgentContext) -> None:
        raise RuntimeError("the ledger at /srv/ledger is locked")

    async def answers(address: str) -> list[tuple[str, str]]:
        said = []
        async with grpc.aio.insecure_channel(address) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            for kind, content in (
                (message_pb2.MESSAGE_TYPE_REQUEST, {"action": "post"}),
                (
                    message_pb2.MESSAGE_TYPE_HANDOFF,
                    {"action": "post", "parameters": {"task_description": "post it"}},
                ),
            ):
                message = message_pb2.Message(
                    from_agent="Caller", to_agent="FailingDesk", message_type=kind
                )
                message.content.update(content)
                try:
                    reply = await stub.HandleMessage(
                        agent_pb2.HandleMessageRequest(message=message), timeout=10
                    )
                    said.append(
                        (
                            message_pb2.MessageType.Name(reply.response.message_type),
                            reply.response.content["error"],
                        )
                    )
                except grpc.aio.AioRpcError as error:
                    said.append((error.code().name, error.details() or ""))
        return said

    async with LocalMesh() as mesh:
        served = await mesh.add_agent(failing)
        python = await answers(served.address)
        await mesh.stop_agent("FailingDesk", 0.5)
        node = await asyncio.create_subprocess_exec(
            "node", "-e", FAILING_DESK, mesh.address, cwd=NODE_DIR,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert node.stdout is not None and node.stderr is not None
        try:
            async with asyncio.timeout(30):
                at = json.loads(await node.stdout.readline())
            nodes = await answers(at)
        finally:
            node.terminate()
            async with asyncio.timeout(15):
                _, err = await node.communicate()
    assert python == [
        ("MESSAGE_TYPE_ERROR", "the ledger at /srv/ledger is locked"),
        ("INTERNAL", "the handler failed"),
    ]
    assert nodes == python
    assert "FailingDesk failed on HANDOFF" in err.decode()  # (said where it runs)

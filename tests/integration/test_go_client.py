"""A Go agent and client (clients/go) on plain gRPC, built from the contract with protoc-gen-go
and protoc-gen-go-grpc, against a real mesh of Python agents."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from benchmarks.harness import build_meshgo, go_available
from gateway.embedded import EmbeddedMesh
from mesh import (
    AgentClient,
    BrokerConfig,
    DeliveryMode,
    Message,
    MessageType,
    MessageValidationError,
    connect,
)
from mesh.testing import LocalMesh
from tests.helpers.direct import (
    answers_to_bad_direct_calls,
    assert_said_alike,
    python_agent_answers,
)
from tests.helpers.health import NOT_SERVING, SERVING, health_of, tls_health, watching
from tests.helpers.processes import (
    BROKER_READY,
    free_port,
    gaps_between,
    instances_become,
    request_once_back,
    start,
    stop,
    tries_counted,
    wait_killed,
)
from tests.helpers.secrets import SecretVolume

pytestmark = pytest.mark.skipif(
    not go_available(),
    reason="Go, protoc-gen-go(-grpc) or the Go packages of gRPC are not installed"
    " (make test installs the Debian packages when run as root)",
)


@pytest.fixture(scope="module")
def meshgo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """clients/go/build.sh's program, built for this run."""
    return build_meshgo(tmp_path_factory.mktemp("go"))


async def run(meshgo: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(meshgo),
        *args,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


class GoAgent:
    """`meshgo agent` in a process of its own, serving until stopped."""

    def __init__(self, process: asyncio.subprocess.Process, address: str) -> None:
        self.process = process
        self.address = address

    async def stop(self) -> tuple[int, str]:
        """SIGTERM, as a service manager stops it: its exit status and what it printed."""
        assert self.process.stdout is not None
        self.process.terminate()
        async with asyncio.timeout(15):
            rest = await self.process.stdout.read()
            return await self.process.wait(), rest.decode()


@pytest.fixture
async def go_agents(meshgo: Path) -> AsyncIterator[list[GoAgent]]:
    started: list[GoAgent] = []
    yield started
    for agent in started:
        if agent.process.returncode is None:
            agent.process.kill()
            await agent.process.wait()


async def start_go_agent(
    meshgo: Path,
    started: list[GoAgent],
    broker: str,
    agent_id: str,
    *flags: str,
    env: dict[str, str] | None = None,
) -> GoAgent:
    process = await asyncio.create_subprocess_exec(
        str(meshgo),
        "agent",
        "-broker",
        broker,
        "-id",
        agent_id,
        *flags,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    agent = GoAgent(process, "")
    started.append(agent)
    async with asyncio.timeout(30):
        line = (await process.stdout.readline()).decode()
    assert f"{agent_id} serving on 127.0.0.1:" in line, line
    agent.address = line.rsplit(" ", 1)[-1].strip()
    return agent


async def test_a_go_agent_takes_part_in_a_group_chat_beside_the_python_agents(
    embedded: EmbeddedMesh, meshgo: Path, go_agents: list[GoAgent]
) -> None:
    await start_go_agent(
        meshgo,
        go_agents,
        embedded.broker.address,
        "GoExpertAgent",
        "-types",
        "stock_expert",
        "-confidence",
        "0.75",
    )
    group = "GoExpertAgent,IndustryExpertAgent,TechnicalAnalysisAgent,FundamentalAnalysisAgent"
    code, out, err = await run(
        meshgo,
        "groupchat",
        "-gateway",
        embedded.gateway.address,
        "-agents",
        group,
        "-query",
        "What stock should I buy?",
        "-label",
        "stocks",
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("GROUP_CREATED ")
    contributions = sorted(line for line in lines if line.startswith("CONTRIBUTION "))
    assert contributions == [
        "CONTRIBUTION FundamentalAnalysisAgent: Buy AAPL (confidence 0.72)",
        "CONTRIBUTION GoExpertAgent: Buy AAPL (confidence 0.75)",
        "CONTRIBUTION IndustryExpertAgent: Buy AAPL (confidence 0.8)",
        "CONTRIBUTION TechnicalAnalysisAgent: Buy AAPL (confidence 0.85)",
    ]
    assert "RESULT group chat completed: Buy AAPL (unanimous expert consensus)" in lines
    aggregate = json.loads(lines[-1].removeprefix("AGGREGATE "))
    assert aggregate["votes"] == {"Buy AAPL": 4}
    assert "go saw: What stock should I buy?" in aggregate["reasoning"]

    # The Go process dies: the next chat names it missing at once and goes on without it.
    [go_agent] = go_agents
    go_agent.process.kill()
    await go_agent.process.wait()
    async with connect(embedded.broker.address, agent_id="GoChatAdmin") as admin:
        await instances_become(admin, "GoExpertAgent", ())
        try:
            code, out, err = await run(
                meshgo, "groupchat", "-gateway", embedded.gateway.address, "-agents", group,
                "-query", "What stock should I buy?", "-label", "stocks",
            )  # fmt: skip
        finally:
            await admin.deregister("GoExpertAgent")  # (the shared mesh as it was)
    assert code == 0, err
    lines = out.splitlines()
    [missing] = [line for line in lines if line.startswith("AGENT_MISSING ")]
    assert missing.startswith(
        "AGENT_MISSING GoExpertAgent gave no answer: no instance of GoExpertAgent is serving"
    ), missing
    assert len([line for line in lines if line.startswith("CONTRIBUTION ")]) == 3
    assert "RESULT group chat partial: Buy AAPL (unanimous expert consensus)" in lines
    assert json.loads(lines[-1].removeprefix("AGGREGATE "))["votes"] == {"Buy AAPL": 3}

    # Nobody answers: the chat failed, and the command says so in its exit status.
    code, out, err = await run(
        meshgo, "groupchat", "-gateway", embedded.gateway.address, "-agents", "GoNobody",
        "-query", "What stock should I buy?",
    )  # fmt: skip
    assert code == 1
    assert "RESULT group chat failed: no agent answered" in out
    assert "the group chat failed" in err


async def test_meshgo_groupchat_starts_a_run_the_full_gateway_refused_again(
    mesh: LocalMesh, meshgo: Path
) -> None:
    """The gateway runs its limit: `meshgo groupchat` is refused before its run starts
    (TOO_MANY_RUNS), says so on stderr, and starts it again after the backoff (at least the
    refusal's RetryInfo), which completes once a place frees. Before, it failed at once."""
    from tests.helpers.gateways import SLOW_AGENT, full_gateway

    async with full_gateway(mesh) as full:
        chat = asyncio.create_task(
            run(meshgo, "groupchat", "-gateway", full.address, "-agents", SLOW_AGENT,
                "-query", "later")
        )  # fmt: skip
        await full.refused_at_least(1)
        full.release.set()
        code, out, err = await chat
    assert code == 0, err
    assert err.startswith(
        "meshgo: retry 1/3 in 500 ms after RESOURCE_EXHAUSTED: the gateway already runs its"
        " limit of patterns at once (1): this run did not start"
    ), err
    assert "RESULT group chat completed: AAPL (unanimous expert consensus)" in out.splitlines()
    assert full.asked == ["held0", "later"]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["request", "-broker", "http://127.0.0.1:50051", "-to", "Desk", "-action", "x"],
            "meshgo: http://127.0.0.1:50051 is a URL, not a gRPC target: give host:port "
            "(127.0.0.1:50051; TLS is set apart, not by http://)",
        ),
        (
            ["agent", "-broker", "127.0.0.1:99999", "-id", "Desk"],
            "meshgo: 127.0.0.1:99999: a port is from 1 to 65535",
        ),
        (
            ["groupchat", "-gateway", "GRPCS://gateway.svc:443/", "-agents", "a", "-query", "q"],
            "is a URL, not a gRPC target: give host:port (gateway.svc:443; TLS is set apart",
        ),
    ],
)
async def test_meshgo_refuses_an_address_grpc_cannot_dial_as_meant(
    meshgo: Path, flags: list[str], said: str
) -> None:
    """As the Python and Node.js clients do: at once, and saying why. Before, a URL was dialled
    as a host name, UNAVAILABLE after every retry ("too many colons in address")."""
    code, out, err = await run(meshgo, *flags)
    assert (code, out) == (1, "")
    assert said in err and "retry" not in err, err


async def test_a_go_agent_answers_python_asks_go_and_leaves_when_stopped(
    embedded: EmbeddedMesh, meshgo: Path, go_agents: list[GoAgent]
) -> None:
    broker = embedded.broker.address
    agent = await start_go_agent(meshgo, go_agents, broker, "GoDeskAgent", "-types", "desk")
    async with connect(broker, agent_id="PyCaller") as client:
        await client.register()
        # A Python request to the Go agent: answered under its correlation, and its sender
        # gets the ACK of receipt it asked for, which the broker sends for the agent.
        answer = await client.request(
            "GoDeskAgent", {"action": "book", "parameters": {"seat": "12A"}}, ack_required=True
        )
        assert answer.message_type is MessageType.RESPONSE
        assert answer.from_agent == "GoDeskAgent"
        assert answer.content["echo"] == {"action": "book", "parameters": {"seat": "12A"}}
        assert (answer.content["action"], answer.content["status"]) == ("book", "COMPLETED")
        [ack] = await client.receive()
        assert (ack.message_type, ack.from_agent) == (MessageType.ACK, "GoDeskAgent")
        assert ack.correlation_id == answer.correlation_id

        # A plain alert is not answered; a hand-off is.
        await client.broadcast_to_types(["desk"], {"alert": "maintenance at noon"})
        await client.handoff("GoDeskAgent", "Seat the passenger", context={"seat": "12A"})
        # (Answered in order: an answer to the alert would have come first.)
        async with client.subscribe() as inbox, asyncio.timeout(10):
            first = await anext(aiter(inbox))
            await first.ack()
        assert first.message.message_type is MessageType.RESPONSE
        assert first.message.content["action"] == "execute_handoff"
        assert first.message.content["echo"]["parameters"]["context"] == {"seat": "12A"}

        # Its own server: the Agent service, directly (RT-011 peer-to-peer).
        async with AgentClient(agent.address) as direct:
            card = await direct.describe()
            assert (card.agent_id, list(card.agent_types)) == ("GoDeskAgent", ["desk"])
            reply = await direct.handle(
                Message(from_agent="PyCaller", to_agent="GoDeskAgent", content={"action": "ping"})
            )
            assert reply is not None and reply.content["served_by"] == "GoDeskAgent"
            # What the broker would refuse, its server refuses too, with the same status.
            for content, to_agent, sender, field, why in (
                ({"action": "x"}, "Other", "PyCaller", "to_agent", "serves GoDeskAgent, not Other"),
                ({}, "GoDeskAgent", "PyCaller", "content.action", "content.action is required"),
                ({"action": "x"}, "GoDeskAgent", "", "from_agent", "from_agent is required"),
            ):
                refused = Message(from_agent=sender, to_agent=to_agent, content=content)
                with pytest.raises(MessageValidationError, match=why) as info:
                    await direct.handle(refused)
                assert info.value.code == "INVALID_ARGUMENT"
                assert info.value.reason == "VALIDATION_FAILED"
                assert [v.field for v in info.value.field_violations] == [field]

        # Go asks Python: a request to a Python sample agent, and one to nobody.
        code, out, err = await run(
            meshgo,
            "request",
            "-broker",
            broker,
            "-from",
            "GoCaller",
            "-to",
            "PaymentAgent",
            "-action",
            "process_refund",
            "-params",
            '{"amount": 50}',
        )
        assert code == 0, err
        response = json.loads(out)
        assert (response["fromAgent"], response["toAgent"]) == ("PaymentAgent", "GoCaller")
        assert response["messageType"] == "MESSAGE_TYPE_RESPONSE"
        assert response["content"]["action"] == "process_refund"
        code, out, err = await run(
            meshgo, "request", "-broker", broker, "-to", "Nobody", "-action", "x"
        )
        assert (code, out) == (1, "")
        assert err == "meshgo: NOT_FOUND: agent Nobody is not registered\n"

        code, said = await agent.stop()
        assert (code, said) == (0, "GoDeskAgent stopped\n")
        assert "GoDeskAgent" not in [a.agent_id for a in await client.list_agents()]


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
async def test_a_go_agent_names_the_content_fields_it_requires(
    embedded: EmbeddedMesh, meshgo: Path, go_agents: list[GoAgent], push: bool
) -> None:
    """RF-009 scenario 18 from Go: the broker refuses a request without "parameters" to its
    sender, and the agent's own server a direct call without it."""
    broker = embedded.broker.address
    flags = ("-require", "action,parameters", *(("-push",) if push else ()))
    agent = await start_go_agent(meshgo, go_agents, broker, "GoLedgerAgent", *flags)
    async with connect(broker, agent_id="PyCaller") as client:
        await client.register()
        [listed] = [a for a in await client.list_agents() if a.agent_id == "GoLedgerAgent"]
        assert listed.required_fields == ("action", "parameters")
        answer = await client.request(
            "GoLedgerAgent", {"action": "book", "parameters": {"amount": 450}}, timeout=10
        )
        assert answer.content["echo"] == {"action": "book", "parameters": {"amount": 450}}
        with pytest.raises(MessageValidationError) as refused:
            await client.request("GoLedgerAgent", {"action": "book"}, timeout=10)
        assert refused.value.message == "content.parameters is required by GoLedgerAgent"
        async with AgentClient(agent.address) as direct:
            for content in ({"action": "book"}, {"action": "book", "parameters": None}):
                with pytest.raises(MessageValidationError) as refused:
                    await direct.handle(
                        Message(from_agent="PyCaller", to_agent="GoLedgerAgent", content=content)
                    )
                assert refused.value.message == "content.parameters is required by GoLedgerAgent"
                assert [v.field for v in refused.value.field_violations] == ["content.parameters"]
            alert = Message(
                from_agent="PyCaller",
                to_agent="GoLedgerAgent",
                message_type=MessageType.BROADCAST,
                content={"alert": "maintenance at noon"},
            )
            await direct.handle(alert)  # (an alert is not held to them)
    await agent.stop()


async def test_a_go_agent_refuses_bad_direct_calls_as_the_python_agents_do(
    meshgo: Path, go_agents: list[GoAgent]
) -> None:
    """Plain gRPC to the agents' own servers, the same bad requests to a Go agent and to a
    Python one: each refused INVALID_ARGUMENT, saying the same. Before, the Go agent answered
    garbage INTERNAL (grpc-go's "error unmarshalling request"), and took and echoed an
    undefined type or priority, a ttl out of range, a timestamp out of range, NaN and
    messages past 1 MiB."""
    async with LocalMesh() as mesh:
        python = await python_agent_answers(mesh, "GoBadCallers")
        agent = await start_go_agent(meshgo, go_agents, mesh.address, "GoBadCallers")
        go = await answers_to_bad_direct_calls(agent.address, "GoBadCallers")
        assert agent.process.returncode is None  # (the Go agent still serves)
        await agent.stop()
    assert_said_alike(go, python)


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
async def test_a_deregistered_go_agent_stops_taking_messages_and_says_so(
    embedded: EmbeddedMesh, meshgo: Path, go_agents: list[GoAgent], push: bool
) -> None:
    """Told by the broker (its session's subscription ended, AGENT_DEREGISTERED; pushed to,
    the broker's NotifyDeregistered call), the Go agent goes NOT_SERVING and stays off the
    mesh until stopped, rather than registering again. Its process's readiness
    (`agentmesh.agents`, which a pod's probe asks, as of the Python agents) says the same."""
    broker = embedded.broker.address
    flags = ("-push",) if push else ()
    agent = await start_go_agent(meshgo, go_agents, broker, "GoLeavingDesk", *flags)
    async with (
        connect(broker, agent_id="PyAdmin") as admin,
        watching(agent.address, "mesh.v1.AgentService") as readiness,
        watching(agent.address, "agentmesh.agents") as pod,
    ):
        await readiness.until(SERVING)
        await pod.until(SERVING)
        answer = await admin.request("GoLeavingDesk", {"action": "book"}, timeout=10)
        assert answer.content["echo"] == {"action": "book"}
        await admin.deregister("GoLeavingDesk")
        await readiness.until(NOT_SERVING)
        await pod.until(NOT_SERVING)
        await asyncio.sleep(1.0)  # (past its first delay before registering again)
        assert "GoLeavingDesk" not in [a.agent_id for a in await admin.list_agents()]
        assert await health_of(agent.address) == SERVING  # (the process itself: alive)
    code, said = await agent.stop()
    assert code == 0
    assert said == (
        "GoLeavingDesk was deregistered: it takes no more messages (start it again to register"
        " it again)\nGoLeavingDesk stopped\n"
    )


async def test_a_go_agent_registered_for_push_is_called_by_the_broker(
    embedded: EmbeddedMesh, meshgo: Path, go_agents: list[GoAgent]
) -> None:
    broker = embedded.broker.address
    await start_go_agent(meshgo, go_agents, broker, "GoPushDesk", "-types", "desk", "-push")
    async with connect(broker, agent_id="PyPushCaller") as client:
        await client.register()
        listed = {a.agent_id: a for a in await client.list_agents()}
        assert listed["GoPushDesk"].delivery_mode is DeliveryMode.PUSH
        answer = await client.request(
            "GoPushDesk", {"action": "book", "parameters": {"seat": "3C"}}, ack_required=True
        )
        assert answer.message_type is MessageType.RESPONSE
        assert answer.from_agent == "GoPushDesk"
        assert answer.content["echo"] == {"action": "book", "parameters": {"seat": "3C"}}
        # The ACK of receipt, sent by the broker as it hands the request over.
        [ack] = await client.receive()
        assert (ack.message_type, ack.from_agent) == (MessageType.ACK, "GoPushDesk")
        stats = await client.queue_stats("GoPushDesk")
    view = stats.for_agent("GoPushDesk")
    assert view is not None and view.subscribers == 1 and view.depth == 0


@pytest.mark.parametrize(
    ("flags", "mode", "said_on_restart"),
    [
        # Pulling: its session ends with the broker; it registers and subscribes again.
        ((), DeliveryMode.PULL, "session ended"),
        # Pushed to: no session to lose; it watches the broker's health, registers again.
        (("-push",), DeliveryMode.PUSH, ""),
    ],
)
async def test_a_go_agent_is_back_in_service_after_a_broker_restart(
    meshgo: Path,
    go_agents: list[GoAgent],
    flags: tuple[str, ...],
    mode: DeliveryMode,
    said_on_restart: str,
) -> None:
    from mesh.client import NO_RETRY

    port = free_port()
    address = f"127.0.0.1:{port}"
    broker = await start("broker", "--port", str(port), ready=BROKER_READY)
    try:
        agent = await start_go_agent(meshgo, go_agents, address, "GoEchoAgent", *flags)
        async with (
            connect(address, agent_id="Caller", retry=NO_RETRY) as client,
            watching(agent.address, "mesh.v1.AgentService") as readiness,
        ):
            first = await client.request("GoEchoAgent", {"action": "echo", "n": 1}, timeout=5)
            assert first.content["echo"] == {"action": "echo", "n": 1}
            assert await readiness.until(SERVING) == [SERVING]

            # The broker dies and comes back on its port, remembering nothing (memory store):
            # the Go agent is back in service by itself. Meanwhile it is not ready, though
            # its process serves (liveness).
            await wait_killed(broker)
            assert await readiness.until(NOT_SERVING) == [NOT_SERVING]
            assert await health_of(agent.address) == SERVING
            broker = await start("broker", "--port", str(port), ready=BROKER_READY)
            assert await readiness.until(SERVING) == [SERVING]
            again = await request_once_back(client, "GoEchoAgent", {"action": "echo", "n": 2})
            assert again.content["echo"] == {"action": "echo", "n": 2}
            listed = {a.agent_id: a for a in await client.list_agents()}
            assert listed["GoEchoAgent"].delivery_mode is mode
        code, said = await agent.stop()
        assert code == 0
        assert said_on_restart in said and said.endswith("GoEchoAgent stopped\n")
    finally:
        await stop(broker)


async def test_a_go_agent_tries_to_reach_a_broker_that_went_away_at_least_every_2_s(
    meshgo: Path, go_agents: list[GoAgent]
) -> None:
    """While the broker is away, the Go agent's connection tries it again as the Python and
    Node.js clients do: at once, then backing off to once every 2 s (gRPC's default starts
    at 1 s and grows to 120 s: a long outage left the agent out of service for long after
    the broker was back). Where the broker was, a listener that closes each connection counts
    the tries; then the broker comes back and the agent with it."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    broker = await start("broker", "--port", str(port), ready=BROKER_READY)
    try:
        agent = await start_go_agent(meshgo, go_agents, address, "GoEchoAgent")
        async with watching(agent.address, "mesh.v1.AgentService") as readiness:
            assert await readiness.until(SERVING) == [SERVING]
            await wait_killed(broker)
            gone = asyncio.get_running_loop().time()
            async with tries_counted(port) as tries:
                await asyncio.sleep(8)
            gaps = gaps_between(gone, tries)
            assert len(gaps) >= 6 and max(gaps) <= 3.0, gaps

            broker = await start("broker", "--port", str(port), ready=BROKER_READY)
            assert await readiness.until(SERVING) == [NOT_SERVING, SERVING]
        async with connect(address, agent_id="Caller") as client:
            again = await request_once_back(client, "GoEchoAgent", {"action": "echo", "n": 2})
            assert again.content["echo"] == {"action": "echo", "n": 2}
    finally:
        await stop(broker)


async def test_go_retries_a_request_while_the_queue_is_full(meshgo: Path) -> None:
    """RF-009 scenarios 12 and 15 from Go: a request refused with RESOURCE_EXHAUSTED is made
    again after RT-011's backoff (100, 500, 2000 ms), each wait at least the RetryInfo the
    broker sent (0.3 s here); once the queue has room it goes through, and a queue that stays
    full fails it after the third retry, with the broker's own words."""
    config = BrokerConfig(max_messages_per_agent=1, retry_after_seconds=0.3)
    async with (
        LocalMesh(config) as mesh,
        mesh.client("GoFullDesk") as full_desk,
        mesh.client("GoRetryDesk") as desk,
    ):
        for client in (full_desk, desk):
            await client.register()
            await client.send(client.agent_id, {"action": "fill"})

        code, out, err = await run(
            meshgo, "request", "-broker", mesh.address, "-to", "GoFullDesk", "-action", "x"
        )
        full = "RESOURCE_EXHAUSTED: GoFullDesk queue full (1 of 1 messages)"
        assert (code, out) == (1, "")
        assert err.splitlines() == [
            f"meshgo: retry 1/3 in 300 ms after {full}",
            f"meshgo: retry 2/3 in 500 ms after {full}",
            f"meshgo: retry 3/3 in 2000 ms after {full}",
            f"meshgo: {full}",
        ]
        # Nothing of the refused request was kept: the queue holds the filler alone.
        [kept] = await full_desk.receive()
        assert kept.content == {"action": "fill"}

        process = await asyncio.create_subprocess_exec(
            str(meshgo), "request", "-broker", mesh.address, "-from", "GoCaller",
            "-to", "GoRetryDesk", "-action", "book",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stdout is not None and process.stderr is not None
        async with asyncio.timeout(30):
            first = (await process.stderr.readline()).decode()
            assert first == f"meshgo: retry 1/3 in 300 ms after {full.replace('Full', 'Retry')}\n"
            # The desk takes its queue now: the filler, then the request when it is retried.
            async with desk.subscribe() as inbox:
                async for delivery in inbox:
                    asked = delivery.message
                    if asked.from_agent != "GoCaller":
                        await delivery.ack()
                        continue
                    await delivery.answer(
                        Message(
                            from_agent="GoRetryDesk",
                            to_agent=asked.from_agent,
                            message_type=MessageType.RESPONSE,
                            correlation_id=asked.correlation_id,
                            content={"action": asked.action, "status": "COMPLETED"},
                        )
                    )
                    break
            out, rest = await process.communicate()
        assert process.returncode == 0, first + rest.decode()
        answer = json.loads(out)
        assert (answer["fromAgent"], answer["toAgent"]) == ("GoRetryDesk", "GoCaller")
        assert answer["content"] == {"action": "book", "status": "COMPLETED"}
        # One request, asked until it went through: the same id each time.
        assert asked.correlation_id == asked.message_id == answer["correlationId"]


async def test_go_speaks_tls_with_a_token_and_is_held_to_its_identity(
    tmp_path: Path, meshgo: Path, go_agents: list[GoAgent]
) -> None:
    from mesh import LocalMesh, SecurityConfig
    from mesh.certs import write_dev_certificates

    certs = write_dev_certificates(tmp_path / "certs")
    tokens = {"go": "go-agent-token-0123456789", "py": "py-caller-token-0123456789"}
    credentials = tmp_path / "credentials.json"
    credentials.write_text(
        json.dumps(
            {
                "principals": [
                    {"name": "go", "token": tokens["go"], "agents": ["GoSecureAgent"]},
                    {"name": "py", "token": tokens["py"], "agents": ["PyCaller"]},
                ]
            }
        )
    )
    security = SecurityConfig(
        tls_cert=str(certs["server"]),
        tls_key=str(certs["server_key"]),
        credentials_file=str(credentials),
    )
    go_env = {"AGENTMESH_TLS_CA": str(certs["ca"]), "AGENTMESH_TOKEN": tokens["go"]}
    async with LocalMesh(security=security) as mesh:
        await start_go_agent(meshgo, go_agents, mesh.address, "GoSecureAgent", env=go_env)
        as_py = SecurityConfig(tls_ca=str(certs["ca"]), token=tokens["py"])
        async with connect(mesh.address, agent_id="PyCaller", security=as_py) as client:
            answer = await client.request("GoSecureAgent", {"action": "pay"}, timeout=10)
            assert answer.content["served_by"] == "GoSecureAgent"

        def asking(sender: str) -> tuple[str, ...]:
            return ("request", "-broker", mesh.address, "-from", sender, "-to", "GoSecureAgent",
                    "-action", "pay")  # fmt: skip

        code, out, err = await run(meshgo, *asking("GoSecureAgent"), env=go_env)
        assert code == 0, err
        assert json.loads(out)["content"]["served_by"] == "GoSecureAgent"
        # Acting as an agent its token does not name; no token; plaintext to a TLS broker.
        code, _, err = await run(meshgo, *asking("PyCaller"), env=go_env)
        assert (code, err.split(":")[:2]) == (1, ["meshgo", " PERMISSION_DENIED"]), err
        code, _, err = await run(
            meshgo, *asking("GoSecureAgent"), env={**go_env, "AGENTMESH_TOKEN": ""}
        )
        assert (code, err.split(":")[:2]) == (1, ["meshgo", " UNAUTHENTICATED"]), err
        # (UNAVAILABLE is retried, as the broker away would be, then given up.)
        code, _, err = await run(meshgo, *asking("GoSecureAgent"), env={"AGENTMESH_TLS_CA": ""})
        *retries, last = err.splitlines()
        assert (code, last.split(":")[:2]) == (1, ["meshgo", " UNAVAILABLE"]), err
        assert [r.split(" after ")[0] for r in retries] == [
            "meshgo: retry 1/3 in 100 ms",
            "meshgo: retry 2/3 in 500 ms",
            "meshgo: retry 3/3 in 2000 ms",
        ], err


async def test_go_renews_its_certificates_and_its_token_without_a_restart(
    tmp_path: Path, meshgo: Path, go_agents: list[GoAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Go agent's TLS files, renewed in place (by another CA's here, so that which one a
    connection got shows), serve the connections made after: its server's certificate and the
    CA its callers' certificates must be signed by (mutual TLS, as AGENTMESH_TLS_CA is set),
    and the CA it checks the broker with, the broker's certificate renewed with it. Its token
    file, rotated (the new token beside the old, the file renewed, the old one taken out),
    keeps it in service: its session ends as the old token goes, and it subscribes again with
    the new one, while the old token is refused."""
    import mesh.security
    from mesh import SecurityConfig
    from mesh.certs import write_dev_certificates

    monkeypatch.setattr(mesh.security, "RENEWAL_LOOK_SECONDS", 0.2)
    first, second = (
        write_dev_certificates(tmp_path / name, clients=["caller"]) for name in ("first", "second")
    )

    def tls_files(certs: dict[str, Path]) -> dict[str, Path]:
        return {"ca.crt": certs["ca"], "tls.crt": certs["server"], "tls.key": certs["server_key"]}

    def caller_of(certs: dict[str, Path]) -> tuple[Path, Path, Path]:
        return certs["ca"], certs["caller"], certs["caller_key"]

    volume = SecretVolume(tmp_path / "tls", tls_files(first))
    broker_files = SecretVolume(tmp_path / "broker", tls_files(first))
    both_cas = tmp_path / "both-cas.pem"
    both_cas.write_bytes(first["ca"].read_bytes() + second["ca"].read_bytes())
    old, new, caller = (f"go-{name}-token-0123456789" for name in ("old", "new", "caller"))
    credentials = tmp_path / "credentials.json"

    def principals(*tokens: str) -> None:
        go = [{"name": "go", "token": t, "agents": ["GoRenewingAgent"]} for t in tokens]
        py = {"name": "py", "token": caller, "agents": ["PyCaller"]}
        credentials.write_text(json.dumps({"principals": [*go, py]}))

    principals(old)
    token_file = tmp_path / "go.token"
    token_file.write_text(old + "\n")
    security = SecurityConfig(
        tls_cert=broker_files["tls.crt"],
        tls_key=broker_files["tls.key"],
        credentials_file=str(credentials),
    )
    go_env = {
        "AGENTMESH_TLS_CA": volume["ca.crt"],
        "AGENTMESH_TOKEN_FILE": str(token_file),
        "AGENTMESH_TLS_CERT": volume["tls.crt"],
        "AGENTMESH_TLS_KEY": volume["tls.key"],
    }
    async with LocalMesh(security=security) as local:
        agent = await start_go_agent(
            meshgo, go_agents, local.address, "GoRenewingAgent", env=go_env
        )
        as_py = SecurityConfig(tls_ca=str(both_cas), token=caller)
        async with connect(local.address, agent_id="PyCaller", security=as_py) as client:
            answer = await client.request("GoRenewingAgent", {"action": "pay"}, timeout=10)
            assert answer.content["served_by"] == "GoRenewingAgent"

            assert await tls_health(agent.address, *caller_of(first)) == SERVING
            assert await tls_health(agent.address, first["ca"]) == "UNAVAILABLE"  # (no cert)
            volume.renew(tls_files(second))
            broker_files.renew(tls_files(second))
            await asyncio.sleep(1.5)  # (Go looks at its files at most once a second)
            assert await tls_health(agent.address, *caller_of(second)) == SERVING
            assert await tls_health(agent.address, *caller_of(first)) == "UNAVAILABLE"

            principals(old, new)
            token_file.write_text(new)
            await asyncio.sleep(2.5)
            principals(new)
            await asyncio.sleep(1.0)  # (the broker looks every 0.2 s here)
            old_env = {**go_env, "AGENTMESH_TOKEN_FILE": "", "AGENTMESH_TOKEN": old}
            code, _, err = await run(
                meshgo, "request", "-broker", local.address, "-from", "GoRenewingAgent",
                "-to", "GoRenewingAgent", "-action", "pay", env=old_env,
            )  # fmt: skip
            assert (code, err.split(":")[:2]) == (1, ["meshgo", " UNAUTHENTICATED"]), err
            answer = await client.request("GoRenewingAgent", {"action": "pay"}, timeout=15)
            assert answer.content["served_by"] == "GoRenewingAgent"
        code, printed = await agent.stop()
    assert code == 0, printed
    assert f"meshgo: the certificate {volume['tls.crt']} was renewed" in printed, printed
    assert f"meshgo: the CA {volume['ca.crt']} was renewed" in printed, printed
    assert f"meshgo: the token file {token_file} was renewed" in printed, printed


async def test_a_go_agents_server_asks_for_no_certificate_with_client_auth_none(
    tmp_path: Path, meshgo: Path, go_agents: list[GoAgent]
) -> None:
    """With AGENTMESH_TLS_CLIENT_AUTH=none the Go agent's CA is its client's alone: its server
    speaks TLS and asks its callers for no certificate (with the default it requires one).
    AGENTMESH_AGENT_HEALTH_PORT gives it a plaintext health port beside it."""
    from mesh import SecurityConfig
    from mesh.certs import write_dev_certificates

    certs = write_dev_certificates(tmp_path / "certs", clients=["caller"])
    server, key, ca = (str(certs[name]) for name in ("server", "server_key", "ca"))
    env = {"AGENTMESH_TLS_CA": ca, "AGENTMESH_TLS_CERT": server, "AGENTMESH_TLS_KEY": key}
    async with LocalMesh(security=SecurityConfig(tls_cert=server, tls_key=key)) as local:
        asks_none = await start_go_agent(
            meshgo, go_agents, local.address, "GoOpenAgent",
            env={**env, "AGENTMESH_TLS_CLIENT_AUTH": "none", "AGENTMESH_AGENT_HEALTH_PORT": "0"},
        )  # fmt: skip
        requires = await start_go_agent(meshgo, go_agents, local.address, "GoMutualAgent", env=env)
        assert await tls_health(asks_none.address, certs["ca"]) == SERVING
        # Its health port: the same statuses in plaintext, for probes that cannot speak TLS.
        assert asks_none.process.stdout is not None
        said = (await asyncio.wait_for(asks_none.process.stdout.readline(), 10)).decode()
        assert said.startswith("GoOpenAgent health on 127.0.0.1:"), said
        health_at = said.rsplit(" ", 1)[-1].strip()
        assert await health_of(health_at, "mesh.v1.AgentService") == SERVING
        assert await tls_health(requires.address, certs["ca"]) == "UNAVAILABLE"
        mutual = (certs["ca"], certs["caller"], certs["caller_key"])
        assert await tls_health(requires.address, *mutual) == SERVING
        code, _, err = await run(
            meshgo, "agent", "-broker", local.address, "-id", "GoWrongAgent",
            env={**env, "AGENTMESH_TLS_CLIENT_AUTH": "maybe"},
        )  # fmt: skip
    assert code != 0 and "AGENTMESH_TLS_CLIENT_AUTH must be require or none" in err, err
    code, _, err = await run(meshgo, "agent", "-health-port", "70000")
    assert code != 0 and "-health-port must be a port, 0 for any free one, or -1" in err, err


async def test_a_go_agents_own_server_holds_its_callers_to_the_credentials_file(
    tmp_path: Path, meshgo: Path, go_agents: list[GoAgent]
) -> None:
    """With AGENTMESH_CREDENTIALS_FILE (as the secured overlay gives each agent's pod) the Go
    agent's server takes a direct call only with a token the file names, sent as an agent its
    caller may act as, as a Python agent's does; it reads the file again when it changes."""
    from tests.helpers.guarded import check_direct_calls_are_held_to_credentials, write_credentials

    credentials = tmp_path / "credentials.json"
    write_credentials(credentials)
    async with LocalMesh() as local:
        agent = await start_go_agent(
            meshgo, go_agents, local.address, "GoGuarded",
            env={"AGENTMESH_CREDENTIALS_FILE": str(credentials)},
        )  # fmt: skip
        assert agent.process.stdout is not None
        stdout = agent.process.stdout

        async def warned() -> str:
            return (await stdout.readline()).decode()

        await check_direct_calls_are_held_to_credentials(
            agent.address, "GoGuarded", credentials, warned
        )
        code, printed = await agent.stop()
    assert code == 0, printed


async def test_a_go_agents_mutual_tls_server_holds_callers_to_their_certificates(
    tmp_path: Path, meshgo: Path, go_agents: list[GoAgent]
) -> None:
    """The Go agent's server with mutual TLS: a caller's certificate names who it is, acting
    as the agent of its name alone, as a Python agent's server holds it."""
    from mesh import SecurityConfig
    from mesh.certs import write_dev_certificates
    from tests.helpers.guarded import check_direct_calls_are_held_to_certificates, mutual_tls_env

    issued = write_dev_certificates(tmp_path / "certs", clients=["PaymentAgent"])
    server, key = str(issued["server"]), str(issued["server_key"])
    env = mutual_tls_env(issued)
    async with LocalMesh(security=SecurityConfig(tls_cert=server, tls_key=key)) as local:
        agent = await start_go_agent(meshgo, go_agents, local.address, "GoMutual", env=env)
        await check_direct_calls_are_held_to_certificates(agent.address, "GoMutual", issued)
        code, printed = await agent.stop()
    assert code == 0, printed


async def test_a_go_agent_trusts_its_renewed_ca_when_it_connects_again(
    tmp_path: Path, meshgo: Path, go_agents: list[GoAgent]
) -> None:
    """A CA rotation: the broker's certificate and the Go agent's CA file renewed in place to
    another CA's, then the broker restarted (a pod rolled). The agent's next connection checks
    the broker against the CA its file holds now, and it is back in service, the same
    process."""
    from mesh import SecurityConfig
    from mesh.certs import write_dev_certificates

    first, second = (write_dev_certificates(tmp_path / name) for name in ("first", "second"))
    broker_files = SecretVolume(
        tmp_path / "broker", {"tls.crt": first["server"], "tls.key": first["server_key"]}
    )
    agent_files = SecretVolume(tmp_path / "agent", {"ca.crt": first["ca"]})
    both_cas = tmp_path / "both-cas.pem"
    both_cas.write_bytes(first["ca"].read_bytes() + second["ca"].read_bytes())
    port = free_port()
    address = f"127.0.0.1:{port}"
    tls = ("--tls-cert", broker_files["tls.crt"], "--tls-key", broker_files["tls.key"])
    serve = ("broker", "--port", str(port), "--metrics-port", "-1", *tls)
    broker = await start(*serve, ready=BROKER_READY)
    try:
        agent = await start_go_agent(
            meshgo, go_agents, address, "GoRotatingAgent",
            env={"AGENTMESH_TLS_CA": agent_files["ca.crt"]},
        )  # fmt: skip
        as_py = SecurityConfig(tls_ca=str(both_cas))
        async with connect(address, agent_id="PyCaller", security=as_py) as client:
            answer = await client.request("GoRotatingAgent", {"action": "pay"}, timeout=10)
            assert answer.content["served_by"] == "GoRotatingAgent"
        broker_files.renew({"tls.crt": second["server"], "tls.key": second["server_key"]})
        agent_files.renew({"ca.crt": second["ca"]})
        await stop(broker)
        broker = await start(*serve, ready=BROKER_READY)
        async with connect(address, agent_id="PyCaller", security=as_py) as client:
            answer = await request_once_back(client, "GoRotatingAgent", {"action": "pay"})
            assert answer.content["served_by"] == "GoRotatingAgent"
        code, printed = await agent.stop()
        assert code == 0, printed
        assert f"meshgo: the CA {agent_files['ca.crt']} was renewed" in printed, printed
    finally:
        await stop(broker)


async def test_a_go_agent_whose_process_dies_is_taken_off_its_agents_instances(
    meshgo: Path, go_agents: list[GoAgent]
) -> None:
    """Two Go processes serve one agent; each is killed (SIGKILL: no deregistration) and
    leaves the agent's instances as its session breaks; the agent stays, with none."""
    async with LocalMesh() as mesh, mesh.client("Caller") as client:
        first, second = [
            await start_go_agent(meshgo, go_agents, mesh.address, "GoTwinAgent") for _ in range(2)
        ]
        await instances_become(client, "GoTwinAgent", (first.address, second.address))
        for gone, left in ((first, (second.address,)), (second, ())):
            gone.process.kill()
            await gone.process.wait()
            info = await instances_become(client, "GoTwinAgent", left)
            assert info.address == (left[-1] if left else "")

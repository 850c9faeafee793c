"""Every server speaks health and reflection; buf sees the contract; agents shut down cleanly."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, struct_pb2
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status

from mesh import (
    Agent,
    AgentClient,
    AgentContext,
    LocalMesh,
    MeshError,
    Message,
    Tool,
    agent,
    connect,
    on,
)
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.core.model import MessageType
from mesh.v1 import agent_pb2, agent_pb2_grpc, message_pb2
from tests.helpers.health import NOT_SERVING, SERVING, health_of, watching

ROOT = Path(__file__).resolve().parents[2]
BUF = shutil.which("buf") or str(Path(sys.executable).parent / "buf")


def buf(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BUF, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, input=stdin
    )


async def abuf(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(buf, *args)


def test_contract_is_buf_lint_clean() -> None:
    result = buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_contract_is_buf_formatted() -> None:
    result = buf("format", "--exit-code")
    assert result.returncode == 0, result.stdout + result.stderr


class Weather(Agent):
    """Answers forecast requests."""

    agent_id = "WeatherAgent"
    agent_types = ("info",)
    tools = (Tool(name="forecast_db", description="local forecast table"),)

    @on("forecast")
    async def forecast(self, message: Message, ctx: AgentContext) -> dict:
        return {"city": message.parameters["city"], "sky": "clear"}


async def test_buf_curl_lists_and_calls_every_service_through_reflection(mesh: LocalMesh) -> None:
    served = await mesh.add_agent(Weather())
    listed = await abuf(
        "curl",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
        "--list-methods",
        f"http://{mesh.address}",
    )
    assert listed.returncode == 0, listed.stderr
    for method in (
        "mesh.v1.BrokerService/SendMessage",
        "mesh.v1.BrokerService/Connect",
        "mesh.v1.BrokerService/Subscribe",
        "grpc.health.v1.Health/Check",
    ):
        assert method in listed.stdout.split()
    agent_methods = await abuf(
        "curl",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
        "--list-methods",
        f"http://{served.address}",
    )
    assert "mesh.v1.AgentService/HandleMessage" in agent_methods.stdout.split()

    called = await abuf(
        "curl",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
        "-d",
        json.dumps(
            {
                "message": {
                    "from_agent": "cli",
                    "to_agent": "WeatherAgent",
                    "content": {"action": "forecast", "parameters": {"city": "Paris"}},
                }
            }
        ),
        f"http://{mesh.address}/mesh.v1.BrokerService/SendRequest",
    )
    assert called.returncode == 0, called.stderr
    response = json.loads(called.stdout)["response"]
    assert response["messageType"] == "MESSAGE_TYPE_RESPONSE"
    assert response["content"] == {"action": "forecast", "city": "Paris", "sky": "clear"}

    card = await abuf(
        "curl",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
        f"http://{served.address}/mesh.v1.AgentService/DescribeAgent",
    )
    assert json.loads(card.stdout)["card"]["tools"] == [
        {"name": "forecast_db", "description": "local forecast table"}
    ]


@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
async def test_reflection_answers_both_protocol_versions(mesh: LocalMesh, protocol: str) -> None:
    """Current tools ask for grpc.reflection.v1 first (some only for it); older ones for
    v1alpha. Either way the services are listed and a method is called by its schema."""
    served = await mesh.add_agent(Weather())

    def curl(*args: str) -> list[str]:
        grpc_flags = ("--protocol", "grpc", "--http2-prior-knowledge")
        return ["curl", *grpc_flags, "--reflect-protocol", protocol, *args]

    listed = await abuf(*curl("--list-services", f"http://{mesh.address}"))
    assert listed.returncode == 0, listed.stderr
    assert {
        "mesh.v1.BrokerService",
        "mesh.v1.MemoryService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= set(listed.stdout.split())
    card = await abuf(*curl(f"http://{served.address}/mesh.v1.AgentService/DescribeAgent"))
    assert card.returncode == 0, card.stderr
    assert json.loads(card.stdout)["card"]["agentId"] == "WeatherAgent"


async def test_every_listed_service_is_described(mesh: LocalMesh) -> None:
    """What grpcurl's `list` then `describe` does, over the v1 protocol: every service the
    server lists has its file (and the files it imports) to give."""
    v1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        call = channel.stream_stream(
            v1,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )

        async def ask(request: reflection_pb2.ServerReflectionRequest) -> Any:
            replies = [reply async for reply in call(iter([request]), timeout=5)]
            assert len(replies) == 1
            return replies[0]

        listed = await ask(reflection_pb2.ServerReflectionRequest(list_services=""))
        names = [service.name for service in listed.list_services_response.service]
        assert "grpc.reflection.v1.ServerReflection" in names
        for name in names:
            reply = await ask(reflection_pb2.ServerReflectionRequest(file_containing_symbol=name))
            assert reply.WhichOneof("message_response") == "file_descriptor_response", name
            files = [
                descriptor_pb2.FileDescriptorProto.FromString(raw)
                for raw in reply.file_descriptor_response.file_descriptor_proto
            ]
            package, _, service = name.rpartition(".")
            assert any(
                f.package == package and service in [s.name for s in f.service] for f in files
            ), name


async def test_health_is_serving_on_broker_and_agents(mesh: LocalMesh) -> None:
    served = await mesh.add_agent(Weather())
    assert await health_of(mesh.address) == SERVING
    assert await health_of(mesh.address, "mesh.v1.BrokerService") == SERVING
    assert await health_of(served.address, "mesh.v1.AgentService") == SERVING


async def test_a_client_given_the_address_of_another_server_is_told_to_check_it(
    mesh: LocalMesh,
) -> None:
    """The SDK pointed at the gateway, the gateway client at the broker (their ports mixed
    up): gRPC's bare "Method not found!" was all either said."""
    from gateway.client import GatewayClient
    from gateway.server import serve_gateway

    gateway = await serve_gateway(mesh.address)
    try:
        async with connect(gateway.address, agent_id="Mixed", retry=NO_RETRY) as client:
            with pytest.raises(MeshError) as info:
                await client.send("PaymentAgent", {"action": "pay"})
        async with GatewayClient(mesh.address) as wrong:
            with pytest.raises(MeshError) as other:
                await wrong.collect(wrong.run("Route", {"request_type": "refund_request"}))
    finally:
        await gateway.stop(0.5)
    for error in (info.value, other.value):
        assert error.code == "UNIMPLEMENTED"
        assert error.message.startswith("Method not found!: the server at this address does not")
        assert "is it the right address?" in error.message


async def test_agent_service_describes_and_handles_directly(mesh: LocalMesh) -> None:
    served = await mesh.add_agent(Weather())
    async with AgentClient(served.address) as direct:
        card = await direct.describe()
        assert card.agent_id == "WeatherAgent"
        assert card.agent_types == ("info",)
        assert card.actions == ("forecast",)
        assert card.description == "Answers forecast requests."
        answer = await direct.handle(
            Message(
                from_agent="cli",
                to_agent="WeatherAgent",
                content={"action": "forecast", "parameters": {"city": "Lima"}},
            )
        )
        assert answer is not None and answer.message_type is MessageType.RESPONSE
        assert answer.content["city"] == "Lima"
        failed = await direct.handle(
            Message(from_agent="cli", to_agent="WeatherAgent", content={"action": "unknown"})
        )
        assert failed is not None and failed.message_type is MessageType.ERROR
        assert "does not handle action 'unknown'" in failed.content["error"]


async def test_a_direct_call_is_held_to_the_message_format_before_any_handler_runs(
    mesh: LocalMesh,
) -> None:
    """A message called to an agent's own server meets the rules the broker holds every
    message to (it was handed to the handler as it came: no content, no action, no sender, or
    meant for another agent), and is for the agent that server serves."""
    handled = []

    @agent("Ledger")
    async def ledger(message: Message, ctx: AgentContext) -> dict[str, Any]:
        handled.append(message.message_id)
        return {"booked": True}

    served = await mesh.add_agent(ledger)
    action = struct_pb2.Struct(fields={"action": struct_pb2.Value(string_value="book")})
    cases = [
        (message_pb2.Message(from_agent="cli", to_agent="Ledger"), ["content"]),
        (
            message_pb2.Message(from_agent="cli", to_agent="Ledger", content=struct_pb2.Struct()),
            ["content.action"],
        ),
        (message_pb2.Message(to_agent="Ledger", content=action), ["from_agent"]),
        (message_pb2.Message(from_agent="cli", to_agent="Other", content=action), ["to_agent"]),
        (message_pb2.Message(), ["from_agent", "to_agent", "content"]),
        (
            message_pb2.Message(
                from_agent="cli",
                to_agent="Ledger",
                message_type=message_pb2.MESSAGE_TYPE_HANDOFF,
                content=action,
            ),
            ["content.parameters.task_description"],
        ),
    ]
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        for message, fields in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.HandleMessage(agent_pb2.HandleMessageRequest(message=message))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            status = rpc_status.from_call(info.value)
            assert status is not None
            violations = [
                v.field
                for d in status.details
                if d.Is(error_details_pb2.BadRequest.DESCRIPTOR)
                for v in _unpacked_bad_request(d).field_violations
            ]
            assert violations == fields
        assert handled == []
        answered = await stub.HandleMessage(
            agent_pb2.HandleMessageRequest(
                message=message_pb2.Message(from_agent="cli", to_agent="Ledger", content=action)
            )
        )
        assert answered.response.content["booked"] is True
    assert len(handled) == 1
    async with AgentClient(served.address) as direct:
        misrouted = Message(from_agent="cli", to_agent="Other", content={"action": "book"})
        with pytest.raises(MeshError, match="this server serves Ledger, not Other") as refused:
            await direct.handle(misrouted)
        assert refused.value.code == "INVALID_ARGUMENT"


def _unpacked_bad_request(detail: Any) -> error_details_pb2.BadRequest:
    bad = error_details_pb2.BadRequest()
    detail.Unpack(bad)
    return bad


async def test_graceful_shutdown_finishes_in_flight_work_then_deregisters(mesh: LocalMesh) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    @agent("SlowAgent")
    async def slow(message: Message, ctx: AgentContext) -> dict:
        started.set()
        await release.wait()
        return {"done": True}

    served = await mesh.add_agent(slow)
    async with mesh.client("caller") as caller:
        pending = asyncio.create_task(caller.request("SlowAgent", {"action": "work"}, timeout=10))
        await started.wait()
        stopping = asyncio.create_task(mesh.stop_agent("SlowAgent", grace=5))
        async with asyncio.timeout(5):
            while await health_of(served.address) != NOT_SERVING:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        release.set()
        answer = await pending
        await stopping
        assert answer.content == {"action": "work", "done": True}
        assert [a.agent_id for a in await caller.list_agents()] == []
        stats = await caller.queue_stats()
        assert stats.totals["held"] == 0  # acked before the agent left


async def test_shutdown_past_grace_returns_unfinished_work_to_the_queue(mesh: LocalMesh) -> None:
    started = asyncio.Event()

    @agent("StuckAgent")
    async def stuck(message: Message, ctx: AgentContext) -> None:
        started.set()
        await asyncio.Event().wait()

    await mesh.add_agent(stuck)
    async with mesh.client("caller") as caller:
        sent = await caller.send("StuckAgent", {"action": "work"})
        await started.wait()
        await mesh.stop_agent("StuckAgent", grace=0.1)
        # Nothing accepted is lost: the message waits for the agent's next instance.
        [back] = await caller.receive("StuckAgent")
        assert back.message_id == sent.message_id


async def test_decorated_function_and_class_agents_are_equivalent(mesh: LocalMesh) -> None:
    @agent("Doubler", agent_types=["math"])
    async def doubler(message: Message, ctx: AgentContext) -> int:
        return int(message.parameters["x"]) * 2

    await mesh.add_agent(doubler)
    async with mesh.client("caller") as caller:
        reply = await caller.request("Doubler", {"action": "double", "parameters": {"x": 21}})
        assert reply.content == {"action": "double", "result": 42}
        [info] = await caller.list_agents("math")
        assert info.agent_id == "Doubler"
    with pytest.raises(ValueError, match="needs an agent_id"):
        Agent()


async def test_broker_shutdown_under_load_refuses_new_work_and_finishes_what_it_accepted() -> None:
    handled: list[int] = []
    asked = asyncio.Event()

    @agent("Worker")
    async def worker(message: Message, ctx: AgentContext) -> dict:
        if message.action == "answer":
            asked.set()
        await asyncio.sleep(0.005)
        if message.action == "work":
            handled.append(int(message.parameters["n"]))  # type: ignore[arg-type]
        return {"ok": True}

    local = await LocalMesh(BrokerConfig(sweep_interval=0.05)).start()
    assert local.server is not None
    server = local.server
    await local.add_agent(worker, max_in_flight=4)
    client = local.client("sender", retry=NO_RETRY)
    await client.register("sender")
    accepted: list[int] = []
    refusals: list[MeshError] = []
    enough = asyncio.Event()

    async def push(lane: int) -> None:
        for n in itertools.count(lane * 1_000_000):
            try:
                await client.send("Worker", {"action": "work", "parameters": {"n": n}})
            except MeshError as error:
                refusals.append(error)
                return
            accepted.append(n)
            if len(accepted) >= 100:
                enough.set()

    pushers = [asyncio.create_task(push(lane)) for lane in range(4)]
    await enough.wait()
    # (HIGH: handled next, not behind the work queued so far, so that the queue is not full
    # by the time the broker stops, however fast the senders are)
    asking = asyncio.create_task(
        client.request("Worker", {"action": "answer"}, timeout=10, priority="HIGH")
    )
    async with asyncio.timeout(5):
        await asked.wait()  # the request is in flight: accepted, being handled, not answered
    stopping = asyncio.create_task(server.stop(10))
    async with asyncio.timeout(5):
        while await health_of(server.address) != NOT_SERVING:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    await asyncio.gather(*pushers)
    # New work is refused with a status that tells a client to go elsewhere or come back...
    assert {(e.code, e.reason) for e in refusals} == {("UNAVAILABLE", "SHUTTING_DOWN")}
    # ...while the request in flight is answered, and every accepted message is handled.
    answer = await asking
    assert answer.content == {"action": "answer", "ok": True}
    await stopping
    assert sorted(handled) == sorted(accepted)
    local.server = None
    await local.stop()


async def test_gateway_shutdown_lets_a_running_pattern_finish_and_refuses_new_ones(
    mesh: LocalMesh,
) -> None:
    from gateway.client import GatewayClient
    from gateway.server import serve_gateway
    from mesh import SecurityConfig

    release = asyncio.Event()

    @agent("SlowExpert")
    async def slow(message: Message, ctx: AgentContext) -> dict:
        await release.wait()
        return {"recommendation": "AAPL", "confidence": 0.9}

    await mesh.add_agent(slow)
    gateway = await serve_gateway(mesh.address, security=SecurityConfig())
    async with GatewayClient(gateway.address, security=SecurityConfig()) as client:
        events: list[dict] = []

        async def chat() -> None:
            async for event in client.group_chat(agent_ids=["SlowExpert"], query="q"):
                events.append(event)

        running = asyncio.create_task(chat())
        while not events:  # noqa: ASYNC110 - waits for the first streamed event
            await asyncio.sleep(0.01)
        stopping = asyncio.create_task(gateway.stop(grace=10))
        async with asyncio.timeout(5):
            while await health_of(gateway.address) != NOT_SERVING:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        with pytest.raises(MeshError) as refused:
            await client.collect(client.group_chat(agent_ids=["SlowExpert"], query="again"))
        assert refused.value.code == "UNAVAILABLE"
        release.set()
        await running
        await stopping
    assert events[-1]["kind"] == "RESULT"
    assert events[-1]["data"]["status"] == "COMPLETED"


async def test_a_gateway_at_its_limit_of_runs_refuses_a_new_one_before_it_starts(
    mesh: LocalMesh,
) -> None:
    """A gateway already running its --max-runs patterns refuses another with
    RESOURCE_EXHAUSTED (reason TOO_MANY_RUNS, a RetryInfo): nothing of it ran (no agent was
    asked, no event streamed). The GatewayClient starts such a run again after its backoff,
    and it completes once a place frees; without retries the caller gets the refusal."""
    from gateway.client import GatewayClient
    from gateway.events import Pattern
    from gateway.server import RUNS_RETRY_AFTER_SECONDS
    from mesh import SecurityConfig
    from mesh.core.errors import LimitExceededError
    from mesh.v1 import gateway_pb2, gateway_pb2_grpc
    from tests.helpers.gateways import SLOW_AGENT, full_gateway

    async with full_gateway(mesh, max_runs=2) as full:
        metrics = full.gateway.metrics
        assert metrics.active._value.get() == 2
        async with grpc.aio.insecure_channel(full.address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            call = stub.RunGroupChat(
                gateway_pb2.RunGroupChatRequest(agent_ids=[SLOW_AGENT], query="raw")
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pytest.fail("a refused run streamed an event")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(refused.value)
        assert status is not None
        details = {d.type_url.rsplit(".", 1)[-1]: d for d in status.details}
        info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        details["ErrorInfo"].Unpack(info)
        details["RetryInfo"].Unpack(retry)
        assert info.reason == "TOO_MANY_RUNS"
        assert retry.retry_delay.ToMilliseconds() == RUNS_RETRY_AFTER_SECONDS * 1000
        assert status.message == (
            "the gateway already runs its limit of patterns at once (2): this run did not"
            " start; retry later"
        )

        async with GatewayClient(
            full.address, security=SecurityConfig(), retry=NO_RETRY
        ) as impatient:
            with pytest.raises(LimitExceededError) as told:
                await impatient.collect(impatient.group_chat(agent_ids=[SLOW_AGENT], query="now"))
        assert told.value.reason == "TOO_MANY_RUNS"
        assert told.value.retry_after == RUNS_RETRY_AFTER_SECONDS
        assert full.refused() == 2
        assert sorted(full.asked) == ["held0", "held1"]  # (the refused runs asked nobody)

        async with GatewayClient(full.address, security=SecurityConfig()) as client:
            patient = asyncio.create_task(
                client.collect(client.group_chat(agent_ids=[SLOW_AGENT], query="later"))
            )
            await full.refused_at_least(3)
            full.release.set()
            later = await asyncio.wait_for(patient, 10)
        held = await asyncio.gather(*full.held)
        assert [events[-1]["data"]["status"] for events in held] == ["COMPLETED"] * 2
        assert later[-1]["kind"] == "RESULT" and later[-1]["data"]["status"] == "COMPLETED"
        assert full.asked[2:] == ["later"]
        assert metrics.tallies[Pattern.GROUP_CHAT].runs == 3  # refusals are no runs
        assert metrics.active._value.get() == 0


async def test_the_gateway_clients_figures_wait_for_a_gateway_that_is_starting(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens at the gateway's address yet (it is restarting): GetPatternStats is
    refused (UNAVAILABLE) and asked again after the backoff, and answered once the gateway
    serves. Without retries the caller gets the refusal."""
    import logging

    from gateway.client import GatewayClient
    from gateway.server import serve_gateway
    from mesh import SecurityConfig
    from mesh.core.errors import BrokerUnavailableError
    from tests.helpers.processes import free_port

    caplog.set_level(logging.INFO, logger="gateway.client")
    port = free_port()
    address = f"127.0.0.1:{port}"
    async with GatewayClient(address, security=SecurityConfig(), retry=NO_RETRY) as once:
        with pytest.raises(BrokerUnavailableError):
            await once.pattern_stats()
    async with GatewayClient(address, security=SecurityConfig()) as client:
        asking = asyncio.create_task(client.pattern_stats())
        async with asyncio.timeout(10):
            while not any("retry 1/3" in r.message for r in caplog.records):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        gateway = await serve_gateway(mesh.address, port=port, security=SecurityConfig())
        try:
            stats = await asyncio.wait_for(asking, 10)
            assert stats["GROUP_CHAT"]["runs"] == 0
        finally:
            await gateway.stop()
    [first, *_] = [r.message for r in caplog.records if r.name == "gateway.client"]
    assert first.startswith("retry 1/3 in 100 ms after UNAVAILABLE")


async def test_the_gateway_is_ready_only_while_its_broker_serves() -> None:
    from gateway.client import GatewayClient
    from gateway.server import GATEWAY_SERVICE, serve_gateway
    from mesh import SecurityConfig
    from mesh.config import ServerConfig
    from mesh.server import serve_broker

    _, broker = await serve_broker(server_config=ServerConfig(port=0))
    gateway = await serve_gateway(broker.address, security=SecurityConfig())
    try:
        assert await health_of(gateway.address, GATEWAY_SERVICE) == SERVING
        async with (
            watching(gateway.address, GATEWAY_SERVICE) as watch,
            GatewayClient(gateway.address, security=SecurityConfig()) as client,
        ):
            assert await watch.until(SERVING) == [SERVING]
            await broker.stop(0)
            assert await watch.until(NOT_SERVING) == [NOT_SERVING]
            # The process itself still serves: a liveness probe on "" leaves it running.
            assert await health_of(gateway.address) == SERVING
            # A run is refused whole, before any event, rather than failing midway.
            events: list[dict] = []
            with pytest.raises(MeshError) as refused:
                async for event in client.group_chat(agent_ids=["Anyone"], query="q"):
                    events.append(event)
            assert refused.value.code == "UNAVAILABLE" and events == []
            assert f"the broker at {broker.address} cannot be reached" in refused.value.message
            _, broker = await serve_broker(server_config=ServerConfig(port=broker.port))
            assert await watch.until(SERVING) == [SERVING]
            ran = await client.collect(client.group_chat(agent_ids=["Anyone"], query="q"))
            assert ran[0]["kind"] == "GROUP_CREATED" and ran[-1]["kind"] == "RESULT"
    finally:
        await gateway.stop(0)
        await broker.stop(0)


async def test_a_gateway_started_before_its_broker_is_not_ready() -> None:
    from gateway.server import GATEWAY_SERVICE, serve_gateway
    from mesh import SecurityConfig
    from mesh.config import ServerConfig
    from mesh.server import serve_broker

    _, placeholder = await serve_broker(server_config=ServerConfig(port=0))
    port = placeholder.port
    await placeholder.stop(0)  # (a port nothing listens on, for now)
    gateway = await serve_gateway(f"127.0.0.1:{port}", security=SecurityConfig())
    try:
        assert await health_of(gateway.address, GATEWAY_SERVICE) == NOT_SERVING
        assert await health_of(gateway.address) == SERVING
        _, broker = await serve_broker(server_config=ServerConfig(port=port))
        try:
            async with watching(gateway.address, GATEWAY_SERVICE) as watch:
                assert (await watch.until(SERVING))[-1] == SERVING
        finally:
            await broker.stop(0)
    finally:
        await gateway.stop(0)


@pytest.mark.parametrize("delivery", ["pull", "push"])
async def test_an_agent_is_ready_only_while_it_takes_its_messages(delivery: str) -> None:
    from mesh.agent import AGENT_SERVICE, serve
    from mesh.config import ServerConfig
    from mesh.server import serve_broker

    @agent("Echo")
    async def echo(message: Message, ctx: AgentContext) -> dict:
        return {"echo": message.content["action"]}

    _, broker = await serve_broker(server_config=ServerConfig(port=0))
    served = await serve(echo, broker.address, delivery_mode=delivery)
    try:
        async with watching(served.address, AGENT_SERVICE) as watch:
            assert await watch.until(SERVING) == [SERVING]
            await broker.stop(0)
            assert await watch.until(NOT_SERVING) == [NOT_SERVING]
            assert await health_of(served.address) == SERVING  # (liveness: the process serves)
            # A broker on the memory store comes back knowing nobody: the agent registers
            # (and subscribes) again before it says SERVING.
            _, broker = await serve_broker(server_config=ServerConfig(port=broker.port))
            assert await watch.until(SERVING) == [SERVING]
        async with connect(broker.address, agent_id="caller", retry=NO_RETRY) as client:
            answer = await client.request("Echo", {"action": "again"}, timeout=10)
        assert answer.content["echo"] == "again"
    finally:
        await served.stop(0)
        await broker.stop(0)


async def test_a_tls_server_says_its_health_in_plaintext_on_its_health_port(
    tmp_path: Path,
) -> None:
    """A kubelet's gRPC probe cannot speak TLS: with a health port, the broker, the gateway
    and an agent each serve grpc.health.v1 alone (and reflection of it) in plaintext beside
    their TLS server, the same statuses as their own; nothing else is served there, and a
    stopping server says NOT_SERVING there as it drains."""
    from gateway.server import serve_gateway
    from mesh import SecurityConfig, serve
    from mesh.certs import write_dev_certificates
    from mesh.config import ServerConfig
    from mesh.server import serve_broker
    from mesh.v1 import broker_pb2, broker_pb2_grpc

    certs = write_dev_certificates(tmp_path / "certs")
    tls = SecurityConfig(tls_cert=str(certs["server"]), tls_key=str(certs["server_key"]))
    as_client = SecurityConfig(tls_ca=str(certs["ca"]))
    _, broker = await serve_broker(server_config=ServerConfig(port=0, health_port=0), security=tls)
    assert broker.health_port
    health = f"127.0.0.1:{broker.health_port}"
    gateway = agent = None
    try:
        assert await health_of(health) == SERVING
        assert await health_of(health, "mesh.v1.BrokerService") == SERVING
        async with grpc.aio.insecure_channel(health) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
                await broker_pb2_grpc.BrokerServiceStub(channel).ListAgents(
                    broker_pb2.ListAgentsRequest(), timeout=5
                )
        assert elsewhere.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            await health_of(broker.address)  # (the server itself speaks TLS alone)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        listed = await abuf(
            "curl", "--protocol", "grpc", "--http2-prior-knowledge", "--list-services",
            f"http://{health}",
        )  # fmt: skip
        assert listed.stdout.split() == [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ], listed.stderr

        served = tls.evolve(tls_ca=str(certs["ca"]))  # (its server: mutual TLS)
        agent = await serve(Weather(), broker.address, security=served, health_port=0)
        assert agent.server.health_port
        agent_health = f"127.0.0.1:{agent.server.health_port}"
        assert await health_of(agent_health, "mesh.v1.AgentService") == SERVING

        gateway = await serve_gateway(broker.address, security=as_client, health_port=0)
        assert gateway.server.health_port
        assert await health_of(f"127.0.0.1:{gateway.server.health_port}") == SERVING

        await agent.stop()
        agent = None
        async with watching(health, "mesh.v1.BrokerService") as watch:
            assert await watch.until(SERVING) == [SERVING]
            stopping = asyncio.create_task(broker.stop(1.0))
            assert await watch.until(NOT_SERVING) == [NOT_SERVING]
            await stopping
        with pytest.raises(grpc.aio.AioRpcError):
            await health_of(health)  # (gone with its server)
    finally:
        if agent is not None:
            await agent.stop()
        if gateway is not None:
            await gateway.stop()
        await broker.stop()


async def test_agentmesh_agent_counts_its_health_ports_up_as_its_ports() -> None:
    from tests.helpers.processes import BROKER_READY, free_ports_in_a_row, start, stop

    broker = await start("broker", "--port", "0", ready=BROKER_READY)
    first = free_ports_in_a_row(3)
    agents = await start(
        "agent", "agents.stocks:stock_experts", "--broker", broker.address,
        "--health-port", str(first),
        ready=r"FundamentalAnalysisAgent serving on (\S+?)[,\s]",  # (the third, the last)
    )  # fmt: skip
    try:
        said = [line for line in agents.output if "serving on" in line]
        assert len(said) == 3, agents.output
        for i, line in enumerate(said):
            assert f", health on 127.0.0.1:{first + i}, broker" in line, said
            assert await health_of(f"127.0.0.1:{first + i}", "mesh.v1.AgentService") == SERVING
    finally:
        await stop(agents)
        await stop(broker)

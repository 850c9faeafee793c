"""Push delivery: an agent that is a plain gRPC server of AgentService.HandleMessage and a
registration (DELIVERY_MODE_PUSH) gets its messages from the broker, with the broker's
guarantees: answers correlated, at-least-once with redelivery, dead letters, nothing counted
against a message while the agent's server is away."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, struct_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from agents import sample_agents
from gateway.client import GatewayClient
from gateway.server import serve_gateway
from mesh import (
    Agent,
    AgentContext,
    AgentNotFoundError,
    DeliveryMode,
    LocalMesh,
    MeshError,
    Message,
    MessageType,
    MessageValidationError,
    Priority,
    RequestTimeoutError,
    RetryLater,
    agent,
    connect,
    on,
)
from mesh._status import abort, from_rpc_error
from mesh.agent import serve
from mesh.certs import write_dev_certificates
from mesh.client import NO_RETRY, GatherResult, MeshClient
from mesh.config import BrokerConfig, SecurityConfig
from mesh.v1 import agent_pb2, agent_pb2_grpc, broker_pb2, broker_pb2_grpc, message_pb2
from tests.helpers.health import NOT_SERVING, SERVING, health_of, watching
from tests.helpers.node import start_node_example
from tests.helpers.plain_agent import PlainAgent, echo, port_kept, start_plain
from tests.helpers.processes import (
    BROKER_READY,
    free_port,
    request_once_back,
    start,
    stop,
    wait_killed,
)


async def register_push(mesh: LocalMesh, agent_id: str, address: str) -> message_pb2.AgentInfo:
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        response = await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(
                agent=message_pb2.AgentInfo(
                    agent_id=agent_id,
                    address=address,
                    delivery_mode=message_pb2.DELIVERY_MODE_PUSH,
                )
            )
        )
    return response.agent


async def test_a_scheduled_message_is_pushed_when_due(mesh: LocalMesh) -> None:
    """A request scheduled for a push agent is called to its server once due, not before,
    and answered then; the pushed message carries its deliver_at."""
    agent = PlainAgent(echo)
    server, address = await start_plain(agent)
    try:
        await register_push(mesh, "ReminderDesk", address)
        async with mesh.client("Cashier") as client:
            started = time.monotonic()
            answer = await client.request(
                "ReminderDesk", {"action": "remind", "parameters": {"n": 1}}, delay=0.5
            )
            waited = time.monotonic() - started
        assert answer.content["echo"] == {"n": 1}
        assert waited >= 0.45  # (not before its time)
        (pushed,) = agent.seen
        assert pushed.HasField("deliver_at")
    finally:
        await server.stop(None)


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
async def mesh() -> AsyncIterator[LocalMesh]:
    async with LocalMesh(config=BrokerConfig(lease_seconds=5)) as local:
        yield local


async def test_a_plain_grpc_server_answers_requests_pushed_to_it(mesh: LocalMesh) -> None:
    agent = PlainAgent(echo)
    server, address = await start_plain(agent)
    try:
        info = await register_push(mesh, "LedgerAgent", address)
        assert info.delivery_mode == message_pb2.DELIVERY_MODE_PUSH
        assert list(info.instances) == [address]
        async with mesh.client("Cashier") as client:
            answer = await client.request(
                "LedgerAgent",
                {"action": "post", "parameters": {"amount": 450, "account": "A-1"}},
                timeout=10,
                headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
            )
            await client.register("Cashier")
            listed = {a.agent_id: a for a in await client.list_agents()}
        assert answer.message_type is MessageType.RESPONSE
        assert answer.from_agent == "LedgerAgent"
        assert answer.to_agent == "Cashier"
        assert answer.content["echo"] == {"amount": 450, "account": "A-1"}
        (pushed,) = agent.seen
        assert pushed.to_agent == "LedgerAgent" and pushed.from_agent == "Cashier"
        # The request's trace context, in the message and in the call's metadata alike.
        (metadata,) = agent.metadata
        assert metadata["traceparent"] == pushed.headers["traceparent"]
        assert metadata["traceparent"].split("-")[1] == TRACE_ID
        assert answer.correlation_id == pushed.message_id
        assert listed["LedgerAgent"].delivery_mode.value == "PUSH"
        assert listed["Cashier"].delivery_mode.value == "PULL"
    finally:
        await server.stop(None)


async def test_a_push_registration_needs_an_address_and_a_defined_mode(mesh: LocalMesh) -> None:
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        for agent, field, words in (
            (
                message_pb2.AgentInfo(
                    agent_id="Nowhere", delivery_mode=message_pb2.DELIVERY_MODE_PUSH
                ),
                "agent.address",
                "push delivery needs the address",
            ),
            (
                message_pb2.AgentInfo(agent_id="Odd", address="127.0.0.1:1", delivery_mode=9),
                "agent.delivery_mode",
                "agent.delivery_mode 9 is not defined",
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RegisterAgent(broker_pb2.RegisterAgentRequest(agent=agent))
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert words in (refused.value.details() or "")
            fields = [v.field for v in from_rpc_error(refused.value).field_violations]
            assert fields == [field]
        listed = await stub.ListAgents(broker_pb2.ListAgentsRequest())
    assert [a.agent_id for a in listed.agents] == []


async def test_the_sdk_registers_an_agent_for_push(mesh: LocalMesh) -> None:
    agent = PlainAgent(echo)
    server, address = await start_plain(agent)
    try:
        async with mesh.client("Cashier") as client:
            with pytest.raises(MessageValidationError) as refused:
                await client.register("LedgerAgent", address=address, delivery_mode="sideways")
            assert refused.value.field_violations[0].field == "delivery_mode"
            info = await client.register("LedgerAgent", address=address, delivery_mode="push")
            assert info.delivery_mode is DeliveryMode.PUSH
            answer = await client.request(
                "LedgerAgent", {"action": "post", "parameters": {"n": 1}}, timeout=10
            )
            listing = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mesh.cli", "agents", "--broker", mesh.address, "--json",
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, _ = await listing.communicate()
    finally:
        await server.stop(None)
    assert answer.content["echo"] == {"n": 1}
    assert [(a["agent_id"], a["delivery_mode"]) for a in json.loads(out)] == [
        ("LedgerAgent", "PUSH")
    ]


class Quotes(Agent):
    """An SDK agent served for push: it asks another agent and answers with what it heard."""

    agent_id = "QuoteDesk"

    @on("quote")
    async def quote(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        tax = await ctx.request("TaxDesk", {"action": "rate", "item": message.content["item"]})
        return {"price": 100, "tax": tax.content["rate"]}


@agent("TaxDesk")
async def tax_desk(message: Message, ctx: AgentContext) -> dict[str, Any]:
    return {"rate": 0.2 if message.content["item"] == "book" else 0.1}


async def test_an_sdk_agent_served_for_push_takes_its_messages_from_the_brokers_calls(
    mesh: LocalMesh,
) -> None:
    with pytest.raises(MessageValidationError):
        await mesh.add_agent(Quotes(), delivery_mode="sideways")
    await mesh.add_agent(tax_desk)  # (pulls: subscribed on its stream)
    await mesh.add_agent(Quotes(), delivery_mode="push")
    async with mesh.client("Shop") as client:
        answers = [
            await client.request("QuoteDesk", {"action": "quote", "item": item}, timeout=10)
            for item in ("book", "pen")
        ]
        agents = {a.agent_id: a for a in await client.list_agents()}
        listed = {agent_id: a.delivery_mode for agent_id, a in agents.items()}
        stats = await client.queue_stats("QuoteDesk")
        await mesh.stop_agent("QuoteDesk")
        after = [a.agent_id for a in await client.list_agents()]
    assert [(a.from_agent, a.content["tax"]) for a in answers] == [
        ("QuoteDesk", 0.2),
        ("QuoteDesk", 0.1),
    ]
    assert listed == {"QuoteDesk": DeliveryMode.PUSH, "TaxDesk": DeliveryMode.PULL}
    assert agents["QuoteDesk"].max_in_flight == 16  # serve's max_in_flight, for the broker's calls
    view = stats.for_agent("QuoteDesk")
    assert view is not None and view.subscribers == 1  # the broker's push, no stream of its own
    assert after == ["TaxDesk"]  # stopping deregistered it


async def test_a_group_chat_through_the_gateway_runs_on_push_agents() -> None:
    experts = ["IndustryExpertAgent", "TechnicalAnalysisAgent", "FundamentalAnalysisAgent"]
    async with LocalMesh() as local:
        for one in sample_agents():
            if one.agent_id in experts:
                await local.add_agent(one, delivery_mode="push")
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                events = await client.collect(
                    client.group_chat(
                        agent_ids=experts, query="What stock should I buy?", option_label="stocks"
                    )
                )
            async with local.client("Shop") as shop:
                modes = {a.agent_id: a.delivery_mode for a in await shop.list_agents()}
        finally:
            await gateway.stop(0.5)
    assert modes == dict.fromkeys(experts, DeliveryMode.PUSH)
    result = events[-1]
    assert result["kind"] == "RESULT" and result["data"]["status"] == "COMPLETED"
    assert sorted(result["data"]["answered"]) == sorted(experts)


async def test_pushes_come_in_priority_order_one_at_a_time() -> None:
    release = asyncio.Event()

    async def slow_first(message: message_pb2.Message, context: Any) -> None:
        if message.content["action"] == "first":
            await release.wait()

    agent = PlainAgent(slow_first)
    server, address = await start_plain(agent)
    config = BrokerConfig(default_max_in_flight=1)
    try:
        async with LocalMesh(config=config) as mesh, mesh.client("Orders") as client:
            await register_push(mesh, "PaymentAgent", address)
            await client.register("Orders")
            await client.send("PaymentAgent", {"action": "first"})
            await agent.until_seen(1)
            for name, priority in (("low", Priority.LOW), ("high", Priority.HIGH)):
                await client.send("PaymentAgent", {"action": name}, priority=priority)
            await client.send("PaymentAgent", {"action": "medium"})
            release.set()
            await agent.until_seen(4)
            stats = await client.queue_stats("PaymentAgent")
            answers: list[Message] = []
            async with asyncio.timeout(5):
                while len(answers) < 4:  # (the last is queued as its push call returns)
                    answers += await client.receive("Orders")
                    await asyncio.sleep(0.01)
    finally:
        await server.stop(None)
    actions = [m.content["action"] for m in agent.seen]
    assert actions == ["first", "high", "medium", "low"]
    assert [m.priority for m in agent.seen[1:]] == [
        message_pb2.PRIORITY_HIGH,
        message_pb2.PRIORITY_MEDIUM,
        message_pb2.PRIORITY_LOW,
    ]
    view = stats.for_agent("PaymentAgent")
    assert view is not None and view.depth == 0 and view.subscribers == 1
    # A REQUEST is always answered: with nothing returned, an empty RESPONSE, correlated.
    assert [a.message_type for a in answers] == [MessageType.RESPONSE] * 4
    assert {a.correlation_id for a in answers} == {m.message_id for m in agent.seen}


async def test_an_agent_says_how_many_calls_its_server_takes_at_once(mesh: LocalMesh) -> None:
    release = asyncio.Event()
    running = 0
    most = 0

    async def hold(message: message_pb2.Message, context: Any) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await release.wait()
        running -= 1

    agent = PlainAgent(hold)
    server, address = await start_plain(agent)
    try:
        async with mesh.client("Cashier") as client:
            with pytest.raises(MessageValidationError):
                await client.register("LedgerAgent", address=address, max_in_flight=-1)
            with pytest.raises(MessageValidationError) as refused:
                await client.register(
                    "LedgerAgent", address=address, delivery_mode="push", max_in_flight=10**6
                )
            assert [v.field for v in refused.value.field_violations] == ["agent.max_in_flight"]
            info = await client.register(
                "LedgerAgent", address=address, delivery_mode="push", max_in_flight=2
            )
            assert info.max_in_flight == 2
            for n in range(5):
                await client.send(
                    "LedgerAgent", {"action": "note", "n": n}, message_type="BROADCAST"
                )
            await agent.until_seen(2)
            await asyncio.sleep(0.3)  # (time for a third call, were it let through)
            stats = await client.queue_stats("LedgerAgent")
            # Registered again with room for one more: the calls running go on.
            await client.register(
                "LedgerAgent", address=address, delivery_mode="push", max_in_flight=3
            )
            await agent.until_seen(3)
            await asyncio.sleep(0.3)
            during = [int(m.content["n"]) for m in agent.seen]
            release.set()
            await agent.until_seen(5)
    finally:
        await server.stop(None)
    view = stats.for_agent("LedgerAgent")
    assert view is not None and (view.in_flight, view.depth) == (2, 3)
    assert during == [0, 1, 2]  # none called again: the first two were not cancelled
    assert sorted(int(m.content["n"]) for m in agent.seen) == [0, 1, 2, 3, 4]
    assert most == 3


async def test_a_refusal_dead_letters_at_once_and_tells_the_requester(mesh: LocalMesh) -> None:
    async def refuse(message: message_pb2.Message, context: Any) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such account")

    async with push_ledger(mesh, refuse) as agent, mesh.client("Cashier") as client:
        with pytest.raises(MeshError) as failed:
            await client.request("LedgerAgent", {"action": "post"}, timeout=10)
        await client.send("LedgerAgent", {"action": "note"})
        await agent.until_seen(2)
        await asyncio.sleep(0.1)  # (the dead letter is written after the call returns)
        dead = await client.dead_letters("LedgerAgent")
    assert "no such account" in str(failed.value)
    assert len(agent.seen) == 2  # each once: a refusal is not tried again
    assert sorted(d.message.content["action"] for d in dead) == ["note", "post"]
    assert all("INVALID_ARGUMENT: no such account" in d.reason for d in dead)
    assert all(d.attempts == 1 for d in dead)


@contextlib.asynccontextmanager
async def push_ledger(mesh: LocalMesh, handle: Any) -> AsyncIterator[PlainAgent]:
    """LedgerAgent by push: a plain AgentService server whose calls ``handle`` answers;
    stopped at the end."""
    agent = PlainAgent(handle)
    server, address = await start_plain(agent)
    try:
        await register_push(mesh, "LedgerAgent", address)
        yield agent
    finally:
        await server.stop(None)


def crashing_ledger(mesh: LocalMesh) -> contextlib.AbstractAsyncContextManager[PlainAgent]:
    """LedgerAgent by push, every call of which fails ("disk full")."""

    async def crash(message: message_pb2.Message, context: Any) -> None:
        raise RuntimeError("disk full")

    return push_ledger(mesh, crash)


async def test_a_failing_agent_gets_each_message_again_then_dead_letters_it(
    mesh: LocalMesh,
) -> None:
    async with crashing_ledger(mesh) as agent, mesh.client("Cashier") as client:
        await client.send("LedgerAgent", {"action": "post"})
        await agent.until_seen(4)
        await asyncio.sleep(0.3)
        dead = await client.dead_letters("LedgerAgent")
    assert len(agent.seen) == mesh.config.max_delivery_attempts == 4
    assert len({m.message_id for m in agent.seen}) == 1
    # Tried again after RT-011's backoff: 100 ms, 500 ms, 2 s (at least).
    waits = [later - earlier for earlier, later in itertools.pairwise(agent.called_at)]
    assert [w >= least for w, least in zip(waits, (0.1, 0.5, 2.0), strict=True)] == [True] * 3
    (letter,) = dead
    assert letter.message.content["action"] == "post"
    assert letter.attempts == 4


async def test_a_busy_server_is_called_again_no_sooner_than_it_asked(mesh: LocalMesh) -> None:
    """RESOURCE_EXHAUSTED with a google.rpc.RetryInfo of 1.5 s: the broker waits that long
    before its next attempt, rather than RT-011's first backoff of 100 ms."""

    async def busy_once(message: message_pb2.Message, context: Any) -> message_pb2.Message:
        if len(ledger.seen) == 1:
            retry = error_details_pb2.RetryInfo()
            retry.retry_delay.FromMilliseconds(1500)
            detail = any_pb2.Any()
            detail.Pack(retry)
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort_with_status(
                rpc_status.to_status(
                    status_pb2.Status(code=code.value[0], message="busy", details=[detail])
                )
            )
        return await echo(message, context)

    async with push_ledger(mesh, busy_once) as ledger, mesh.client("Cashier") as client:
        answer = await client.request(
            "LedgerAgent", {"action": "post", "parameters": {"n": 1}}, timeout=15
        )
    assert answer.content["echo"] == {"n": 1}
    first, second = ledger.called_at
    assert second - first >= 1.5


async def test_a_request_that_fails_every_attempt_tells_its_requester_when_it_is_dead_lettered(
    mesh: LocalMesh,
) -> None:
    """The requester waited out its deadline for a request already dead-lettered: now it
    hears, the moment the last attempt fails, that no answer will come, and why."""

    async with crashing_ledger(mesh) as agent, mesh.client("Cashier") as client:
        started = asyncio.get_running_loop().time()
        with pytest.raises(MeshError) as failed:
            await client.request("LedgerAgent", {"action": "post"}, timeout=30)
        waited = asyncio.get_running_loop().time() - started
    assert len(agent.seen) == 4
    assert failed.value.reason == "DEAD_LETTERED"
    assert failed.value.message == (
        "LedgerAgent did not answer: the message was dead-lettered "
        "(nacked after 4 delivery attempts)"
    )
    assert waited < 20  # (the backoff's 2.6 s, not the request's 30 s)


def _nan_answer() -> message_pb2.Message:
    answer = message_pb2.Message()
    answer.content.update({"action": "post"})
    answer.content.fields["total"].number_value = float("nan")
    return answer


def _deep_answer() -> message_pb2.Message:
    value = struct_pb2.Value(string_value="bottom")
    for _ in range(40):  # (three protobuf levels each: past the 100 gRPC parses)
        outer = struct_pb2.Value()
        outer.struct_value.fields["n"].CopyFrom(value)
        value = outer
    answer = message_pb2.Message()
    answer.content.update({"action": "post"})
    answer.content.fields["deep"].CopyFrom(value)
    return answer


def _large_answer() -> message_pb2.Message:
    answer = message_pb2.Message()
    answer.content.update({"action": "post", "report": "x" * 1_100_000})
    return answer


@pytest.mark.parametrize(
    ("answer", "said", "reason"),
    [
        (
            _nan_answer,
            "LedgerAgent's answer could not be read: content.total is NaN or Infinity",
            "AGENT_ERROR",
        ),
        (
            _deep_answer,
            "LedgerAgent's answer could not be read: the answer is not a mesh.v1.",
            "AGENT_ERROR",
        ),
        (_large_answer, "LedgerAgent's answer was refused: message is 11", "MESSAGE_TOO_LARGE"),
    ],
    ids=["NaN", "too deep", "too large"],
)
async def test_an_answer_the_mesh_cannot_carry_reaches_the_requester_as_an_error(
    mesh: LocalMesh, answer: Any, said: str, reason: str
) -> None:
    """A NaN was taken and broke the requester's session as it was written out; an answer too
    deep for gRPC to parse stopped the push task; one above the message limit was delivered
    whole. Each now reaches the requester at once as an ERROR saying why, handled once."""

    async def reply(message: message_pb2.Message, context: Any) -> message_pb2.Message:
        return answer()  # type: ignore[no-any-return]

    async with push_ledger(mesh, reply) as agent, mesh.client("Cashier") as client:
        with pytest.raises(MeshError) as failed:
            await client.request("LedgerAgent", {"action": "post"}, timeout=10)
        assert failed.value.message.startswith(said), failed.value.message
        assert failed.value.reason == reason
        # (and the session goes on)
        assert await client.list_agents()
    assert len(agent.seen) == 1


async def test_a_handler_slower_than_its_lease_is_called_once() -> None:
    async def slow(message: message_pb2.Message, context: Any) -> message_pb2.Message:
        await asyncio.sleep(1.5)  # five leases of 0.3 s
        return await echo(message, context)

    agent = PlainAgent(slow)
    server, address = await start_plain(agent)
    try:
        async with (
            LocalMesh(config=BrokerConfig(lease_seconds=0.3, sweep_interval=0.05)) as mesh,
            mesh.client("Cashier") as client,
        ):
            await register_push(mesh, "LedgerAgent", address)
            answer = await client.request(
                "LedgerAgent", {"action": "post", "parameters": {"n": 5}}, timeout=10
            )
            await asyncio.sleep(0.5)
            stats = await client.queue_stats("LedgerAgent")
    finally:
        await server.stop(None)
    assert answer.content["echo"] == {"n": 5}
    assert len(agent.seen) == 1  # its lease kept while the call ran: not delivered again
    view = stats.for_agent("LedgerAgent")
    assert view is not None and view.depth == 0 and view.in_flight == 0


async def test_a_push_agent_that_asks_for_a_message_later_takes_its_next_one_meanwhile(
    mesh: LocalMesh,
) -> None:
    """An SDK agent taking its messages by push raises ``RetryLater`` in its handler: its
    server answers UNAVAILABLE (reason RETRY_LATER, the wait in a RetryInfo), and the broker
    hands the message back to come again after that wait rather than holding it: the one
    call the agent takes at once goes to its next message meanwhile. Each call says which
    delivery it is of how many (``ctx.attempt``, ``ctx.max_attempts``)."""
    seen: list[tuple[str, int]] = []
    most: set[int] = set()

    class Packing(Agent):
        agent_id = "Packing"

        @on("pack")
        async def pack(self, message: Message, ctx: AgentContext) -> None:
            order = str(message.parameters["order"])
            seen.append((order, ctx.attempt))
            most.add(ctx.max_attempts)
            if order == "o1" and ctx.attempt == 1:
                raise RetryLater(1.0, "the box is not there yet")

    await mesh.add_agent(Packing(), delivery_mode="push", max_in_flight=1)
    async with mesh.client("Store") as client:
        await client.register()  # (the sends are requests: their answers come here)
        for order in ("o1", "o2"):
            await client.send("Packing", {"action": "pack", "parameters": {"order": order}})
        async with asyncio.timeout(10):
            while ("o1", 2) not in seen:  # noqa: ASYNC110 - the agent's own progress
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # (anything more would come now)
        assert seen == [("o1", 1), ("o2", 1), ("o1", 2)]
        assert most == {4}  # (the broker's number of attempts, said with each call)
        assert await client.dead_letters("Packing") == []
        view = (await client.queue_stats("Packing")).for_agent("Packing")
        assert view is not None and (view.depth, view.in_flight) == (0, 0)


async def test_a_server_busy_with_one_message_keeps_the_others_going(mesh: LocalMesh) -> None:
    release = asyncio.Event()
    tried: list[str] = []

    async def busy_once(message: message_pb2.Message, context: Any) -> None:
        action = message.content["action"]
        if action == "slow":
            await release.wait()
        elif action == "busy" and action not in tried:
            tried.append(action)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "busy, try again")

    agent = PlainAgent(busy_once)
    server, address = await start_plain(agent)
    try:
        await register_push(mesh, "LedgerAgent", address)
        async with mesh.client("Cashier") as client:
            await client.send("LedgerAgent", {"action": "slow"}, message_type="BROADCAST")
            await agent.until_seen(1)
            await client.send("LedgerAgent", {"action": "busy"}, message_type="BROADCAST")
            await agent.until_seen(3)  # refused once, then taken again
            release.set()
            await asyncio.sleep(0.3)
            dead = await client.dead_letters("LedgerAgent")
            stats = await client.queue_stats("LedgerAgent")
    finally:
        await server.stop(None)
    # The slow call was not given up for its neighbour's refusal: called once, finished.
    assert [m.content["action"] for m in agent.seen] == ["slow", "busy", "busy"]
    assert dead == []
    view = stats.for_agent("LedgerAgent")
    assert view is not None and view.depth == 0 and view.in_flight == 0


async def test_nothing_is_lost_or_counted_while_the_agents_server_is_away(
    mesh: LocalMesh,
) -> None:
    agent = PlainAgent(echo)
    server, address = await start_plain(agent)
    await register_push(mesh, "LedgerAgent", address)
    async with mesh.client("Cashier") as client:
        first = await client.request(
            "LedgerAgent", {"action": "post", "parameters": {"n": 0}}, timeout=10
        )
        assert first.content["echo"] == {"n": 0}
        with port_kept(address) as port:
            await server.stop(None)
            for n in range(1, 4):
                await client.send("LedgerAgent", {"action": "post", "parameters": {"n": n}})
            await asyncio.sleep(3)  # the broker tries the server again, and again
            assert len(agent.seen) == 1
            server, _ = await start_plain(agent, port)
        try:
            await agent.until_seen(4)
            await asyncio.sleep(0.2)
            dead = await client.dead_letters("LedgerAgent")
            stats = await client.queue_stats("LedgerAgent")
        finally:
            await server.stop(None)
    assert sorted(m.content["parameters"]["n"] for m in agent.seen[1:]) == [1, 2, 3]
    assert dead == []
    view = stats.for_agent("LedgerAgent")
    assert view is not None and view.depth == 0 and view.in_flight == 0


async def test_a_server_that_serves_another_agent_is_left_none_of_its_messages(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """The address an instance registered with now serves another agent (the pod's address
    given to another pod, the port to another process): its server refuses the agent's
    messages as not its own. They wait in the queue for an instance of their agent, none
    dead-lettered, and the instance is out of reach until its address serves it again."""
    handled: list[Message] = []

    @agent("TaxDesk")
    async def taxes(message: Message, ctx: AgentContext) -> dict[str, Any]:
        handled.append(message)
        return {"rate": 0.2}

    stranger = (await mesh.add_agent(taxes, delivery_mode="push")).address
    await register_push(mesh, "LedgerAgent", stranger)
    async with mesh.client("Cashier") as client:
        for n in range(3):
            await client.send("LedgerAgent", {"action": "post", "parameters": {"n": n}})
        item = await left_out(client, "LedgerAgent")
        await asyncio.sleep(2.5)  # (the broker tries that server again, and again)
        waiting = await client.queue_stats("LedgerAgent")
        dead_meanwhile = await client.dead_letters("LedgerAgent")
        away = await unreachable(mesh, "LedgerAgent")
        # LedgerAgent's own server is back at that address: it gets them all, each once.
        ledger = PlainAgent(echo)
        await mesh.stop_agent("TaxDesk")
        server, _ = await start_plain(ledger, int(stranger.rpartition(":")[2]))
        try:
            await ledger.until_seen(3)
            await asyncio.sleep(0.3)
            dead = await client.dead_letters("LedgerAgent")
            back = await unreachable(mesh, "LedgerAgent")
        finally:
            await server.stop(None)
    assert item.error is not None and item.error.message.startswith(
        f"no instance of LedgerAgent can be reached: the server at {stranger} is another"
        " agent's (this server serves TaxDesk, not LedgerAgent) since "
    )
    view = waiting.for_agent("LedgerAgent")
    # (in flight while the broker tries that address again: back in the queue at once)
    assert view is not None and view.depth + view.in_flight == 3 and view.dead_letters == 0
    assert dead_meanwhile == [] and dead == []
    assert away == 1 and back == 0
    assert sorted(m.content["parameters"]["n"] for m in ledger.seen) == [0, 1, 2]
    assert len(ledger.seen) == 3
    assert handled == []
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(
        f"the server at {stranger} is another agent's (this server serves TaxDesk, not"
        " LedgerAgent)" in w
        for w in warned
    ), warned


async def test_an_agent_whose_server_is_gone_is_left_out_of_gathers_and_said_so(
    mesh: LocalMesh,
) -> None:
    agent = PlainAgent(echo)
    server, address = await start_plain(agent)
    await register_push(mesh, "LedgerAgent", address)
    async with mesh.client("Cashier") as client:
        await client.request("LedgerAgent", {"action": "post", "parameters": {}}, timeout=10)
        with port_kept(address) as port:
            await server.stop(None)  # no call in flight: the broker finds it gone by itself
            # A gather leaves it out at once, saying why, as soon as the broker knows.
            item = await left_out(client, "LedgerAgent")
            assert "no instance of LedgerAgent can be reached" in item.error.message
            assert address in item.error.message
            assert await unreachable(mesh, "LedgerAgent") == 1
            with pytest.raises(RequestTimeoutError, match="LedgerAgent can be reached"):
                await client.request("LedgerAgent", {"action": "post"}, timeout=0.3)
            # Back on its address: served again, the request sent meanwhile with it.
            server, _ = await start_plain(agent, port)
        try:
            answer = await client.request(
                "LedgerAgent", {"action": "post", "parameters": {"n": 2}}, timeout=10
            )
            again = await gathered(client, "LedgerAgent", timeout=5)
            reached_again = await unreachable(mesh, "LedgerAgent")
        finally:
            await server.stop(None)
    assert answer.content["echo"] == {"n": 2}
    assert [(item.agent_id, item.error) for item in again] == [("LedgerAgent", None)]
    assert reached_again == 0


async def unreachable(mesh: LocalMesh, agent_id: str) -> float | None:
    """The agent's ``agentmesh_push_instances_unreachable``, scraped as /metrics scrapes it
    (from another thread)."""
    assert mesh.broker is not None
    registry = mesh.broker.metrics.registry
    return await asyncio.to_thread(
        registry.get_sample_value, "agentmesh_push_instances_unreachable", {"agent": agent_id}
    )


async def left_out(client: MeshClient, agent_id: str) -> GatherResult:
    """A gather to the agent, once it leaves the agent out at once as none of its instances
    can be reached (NO_INSTANCE: the broker found out), within 15 s."""
    async with asyncio.timeout(15):
        while True:
            (item,) = await gathered(client, agent_id, timeout=0.5)
            if item.error is not None and item.error.reason == "NO_INSTANCE":
                return item


async def gathered(client: MeshClient, agent_id: str, timeout: float) -> list[GatherResult]:
    return [
        item
        async for item in client.gather(
            {"action": "quote", "parameters": {}}, agent_ids=[agent_id], timeout=timeout
        )
    ]


async def test_an_agent_that_leaves_is_pushed_nothing_more(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mesh")
    agent = PlainAgent(echo)
    server, address = await start_plain(agent)
    try:
        await register_push(mesh, "LedgerAgent", address)
        async with mesh.client("Cashier") as client:
            await client.request("LedgerAgent", {"action": "post", "parameters": {}}, timeout=10)
            await client.deregister("LedgerAgent", address=address)
            await client.register("LedgerAgent")  # (pulls now: its queue keeps what comes)
            await client.send("LedgerAgent", {"action": "later"})
            await asyncio.sleep(1.5)
            received = await client.receive("LedgerAgent")
    finally:
        await server.stop(None)
    assert len(agent.seen) == 1
    assert [m.content["action"] for m in received] == ["later"]
    # Its push ended with its subscription, quietly: nothing failed.
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_each_instance_keeps_the_delivery_it_registered_with(mesh: LocalMesh) -> None:
    """A rolling update from pulling processes to pushed ones (or back): an instance that
    registers to pull does not stop the pushes to the others, and once the pulling ones have
    left, the pushed ones still get every message."""
    agent = PlainAgent(echo)
    server, address = await start_plain(agent)
    puller = "10.0.0.9:7000"
    try:
        await register_push(mesh, "LedgerAgent", address)
        async with mesh.client("Cashier") as client:
            info = await client.register("LedgerAgent", address=puller)  # (an old process)
            assert list(info.instances) == [address, puller]
            assert info.push_instances == (address,)
            listings = []
            for json_too in (("--json",), ()):
                listing = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "mesh.cli", "agents", "--broker", mesh.address,
                    *json_too, stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
                listings.append((await listing.communicate())[0].decode())
            # Pushed to while the other instance pulls: the queue is shared.
            answer = await client.request(
                "LedgerAgent", {"action": "post", "parameters": {"n": 1}}, timeout=10
            )
            await client.deregister("LedgerAgent", address=puller)  # the old process leaves
            [after] = [a for a in await client.list_agents() if a.agent_id == "LedgerAgent"]
            again = await client.request(
                "LedgerAgent", {"action": "post", "parameters": {"n": 2}}, timeout=10
            )
    finally:
        await server.stop(None)
    [listed] = json.loads(listings[0])
    assert listed["push_instances"] == [address]
    assert f"{puller} (+1 more) (push: 1 of 2)" in listings[1]
    assert [answer.content["echo"], again.content["echo"]] == [{"n": 1}, {"n": 2}]
    assert (list(after.instances), after.push_instances) == ([address], (address,))
    assert len(agent.seen) == 2


async def start_node_push_agent(
    agent_id: str, broker: str, port: int = 0
) -> tuple[asyncio.subprocess.Process, str]:
    """clients/node/examples/push-agent.js (plain @grpc/grpc-js, no agentmesh library) in a
    process of its own; the process and its server's address once it has registered."""
    return await start_node_example("push-agent.js", agent_id, broker, str(port))


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_plain_node_server_is_an_agent_and_loses_nothing_when_killed(
    mesh: LocalMesh,
) -> None:
    node, address = await start_node_push_agent("NodeLedger", mesh.address)
    try:
        async with mesh.client("Cashier") as client:
            await client.register("Cashier")
            answer = await client.request(
                "NodeLedger", {"action": "post", "parameters": {"amount": 450}}, timeout=15
            )
            assert answer.from_agent == "NodeLedger" and answer.to_agent == "Cashier"
            assert answer.content["echo"]["parameters"] == {"amount": 450}
            assert f"pid {node.pid}" in answer.content["served_by"]

            node.kill()  # no goodbye: the broker finds its server gone
            await node.wait()
            sent = [
                await client.send("NodeLedger", {"action": "post", "parameters": {"n": n}})
                for n in range(3)
            ]
            await asyncio.sleep(1)
            port = int(address.rpartition(":")[2])
            node, again = await start_node_push_agent("NodeLedger", mesh.address, port)
            assert again == address
            # Each was a REQUEST, and each is answered: into the sender's queue.
            answers: list[Message] = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 15
            while len(answers) < 3 and loop.time() < deadline:
                answers += await client.receive("Cashier")
                await asyncio.sleep(0.05)
            dead = await client.dead_letters("NodeLedger")
    finally:
        node.terminate()
        await node.wait()
    assert sorted(a.correlation_id for a in answers) == sorted(m.message_id for m in sent)
    assert all(f"pid {node.pid}" in a.content["served_by"] for a in answers)
    assert dead == []


async def test_a_server_that_refuses_the_brokers_credentials_loses_the_agent_nothing(
    mesh: LocalMesh,
) -> None:
    """An agent's server that does not know the broker's token (set on one side of a token
    change and not yet on the other) refuses every call UNAUTHENTICATED: that is no refusal of
    the messages. They wait in the queue, none dead-lettered, until it takes the broker's
    calls again."""
    wanted: dict[str, str | None] = {"authorization": "Bearer ledger-2"}

    async def guarded(message: message_pb2.Message, context: Any) -> message_pb2.Message:
        said = dict(context.invocation_metadata() or ()).get("authorization")
        if wanted["authorization"] is not None and said != wanted["authorization"]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the token is not valid")
        return await echo(message, context)

    async with push_ledger(mesh, guarded) as ledger, mesh.client("Cashier") as client:
        await client.register("Cashier")
        asked = [
            await client.send("LedgerAgent", {"action": "post", "parameters": {"n": n}})
            for n in range(3)
        ]
        item = await left_out(client, "LedgerAgent")
        dead_meanwhile = await client.dead_letters("LedgerAgent")
        refused = len(ledger.seen)
        wanted["authorization"] = None  # the server takes any caller now
        answers: list[Message] = []
        async with asyncio.timeout(15):
            while len(answers) < 3:
                answers += await client.receive("Cashier")
                await asyncio.sleep(0.05)
        dead = await client.dead_letters("LedgerAgent")
    assert item.error is not None and (
        "refuses the broker's credentials (the token is not valid)" in item.error.message
    )
    assert refused >= 1 and dead_meanwhile == [] and dead == []
    assert sorted(a.correlation_id for a in answers) == sorted(m.message_id for m in asked)
    assert sorted(a.content["echo"]["n"] for a in answers) == [0, 1, 2]


async def test_a_push_stopped_while_its_server_refuses_gives_back_what_it_held(
    mesh: LocalMesh,
) -> None:
    """The instance registers again to pull (its process updated) just as the server at its
    address refuses the agent's messages as a whole, some calls still on their way back: the
    push ends with its subscription, and every message it held is in the queue at once, not
    after its lease."""

    async def refuse_slowly(message: message_pb2.Message, context: Any) -> None:
        if len(stranger.seen) > 1:
            await asyncio.sleep(2)
        await abort(
            context,
            MessageValidationError.for_field("to_agent", "this server serves TaxDesk"),
        )

    stranger = PlainAgent(refuse_slowly)
    server, address = await start_plain(stranger)
    try:
        await register_push(mesh, "LedgerAgent", address)
        async with mesh.client("LedgerAgent") as ledger:
            for n in range(3):
                await ledger.send("LedgerAgent", {"action": "post", "parameters": {"n": n}})
            await stranger.until_seen(3)
            await asyncio.sleep(0.2)  # (the first refused, the push ends, two calls still out)
            await ledger.register("LedgerAgent", address=address)  # to pull, from now on
            async with asyncio.timeout(3.5):  # (its lease is 5 s)
                taken: list[Message] = []
                while len(taken) < 3:
                    taken += await ledger.receive("LedgerAgent")
                    await asyncio.sleep(0.05)
            stats = await ledger.queue_stats("LedgerAgent")
    finally:
        await server.stop(None)
    assert sorted(m.content["parameters"]["n"] for m in taken) == [0, 1, 2]
    view = stats.for_agent("LedgerAgent")
    assert view is not None and view.subscribers == 0


async def test_a_plain_node_server_says_a_message_is_not_for_the_agent_it_serves(
    mesh: LocalMesh,
) -> None:
    """The plain Node.js example refuses another agent's message the way the SDKs' servers
    do (a field violation on ``to_agent`` in gRPC's rich status), so that its address, given
    to an instance of another agent, loses that agent nothing."""
    node, address = await start_node_push_agent("NodeTax", mesh.address)
    try:
        await register_push(mesh, "LedgerAgent", address)
        async with mesh.client("Cashier") as client:
            for n in range(2):
                await client.send("LedgerAgent", {"action": "post", "parameters": {"n": n}})
            item = await left_out(client, "LedgerAgent")
            dead = await client.dead_letters("LedgerAgent")
            stats = await client.queue_stats("LedgerAgent")
    finally:
        node.terminate()
        await node.wait()
    assert item.error is not None and (
        f"the server at {address} is another agent's (this server serves NodeTax, not"
        " LedgerAgent)" in item.error.message
    )
    assert dead == []
    view = stats.for_agent("LedgerAgent")
    assert view is not None and view.depth + view.in_flight == 2


async def test_the_broker_pushes_over_mutual_tls_with_its_client_certificate(
    tmp_path: Path,
) -> None:
    certs = write_dev_certificates(tmp_path, clients=["broker", "LedgerAgent"])
    broker_security = SecurityConfig(
        tls_cert=str(certs["server"]),
        tls_key=str(certs["server_key"]),
        tls_ca=str(certs["ca"]),
        tls_client_cert=str(certs["broker"]),
        tls_client_key=str(certs["broker_key"]),
    )
    agent = PlainAgent(echo)
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(agent, server)
    port = server.add_secure_port(
        "127.0.0.1:0",
        grpc.ssl_server_credentials(
            [(certs["server_key"].read_bytes(), certs["server"].read_bytes())],
            root_certificates=certs["ca"].read_bytes(),
            require_client_auth=True,  # only a caller with a certificate of the mesh's CA
        ),
    )
    await server.start()
    ledger = SecurityConfig(
        tls_ca=str(certs["ca"]),
        tls_client_cert=str(certs["LedgerAgent"]),
        tls_client_key=str(certs["LedgerAgent_key"]),
    )
    try:
        async with (
            LocalMesh(security=broker_security) as mesh,
            mesh.client("LedgerAgent", security=ledger) as client,
        ):
            await client.register("LedgerAgent", address=f"127.0.0.1:{port}", delivery_mode="push")
            answer = await client.request(
                "LedgerAgent", {"action": "post", "parameters": {"n": 7}}, timeout=10
            )
    finally:
        await server.stop(None)
    assert answer.content["echo"] == {"n": 7}
    assert len(agent.seen) == 1


@pytest.mark.processes
async def test_an_sdk_push_agent_registers_again_when_the_broker_comes_back() -> None:
    """A push agent keeps no stream to the broker; a broker restarted on the memory store
    forgets it. It watches the broker's health and registers again once it serves."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    broker = await start("broker", "--port", str(port), ready=BROKER_READY)
    try:
        served = await serve(tax_desk, address, delivery_mode="push")
        try:
            async with (
                connect(address, agent_id="Shop", retry=NO_RETRY) as client,
                watching(served.address, "mesh.v1.AgentService") as readiness,
            ):
                first = await client.request("TaxDesk", {"action": "rate", "item": "book"})
                assert first.content["rate"] == 0.2
                assert await readiness.until(SERVING) == [SERVING]
                await wait_killed(broker)
                # Not ready while the broker is away; ready once registered again.
                assert await readiness.until(NOT_SERVING) == [NOT_SERVING]
                broker = await start("broker", "--port", str(port), ready=BROKER_READY)
                assert await readiness.until(SERVING) == [SERVING]
                again = await request_once_back(
                    client, "TaxDesk", {"action": "rate", "item": "pen"}
                )
                listed = {a.agent_id: a for a in await client.list_agents()}
        finally:
            await served.stop()
    finally:
        await stop(broker)
    assert again.content["rate"] == 0.1 and again.from_agent == "TaxDesk"
    assert listed["TaxDesk"].delivery_mode is DeliveryMode.PUSH


@pytest.mark.processes
async def test_an_sdk_push_agent_deregistered_on_purpose_is_told_and_stays_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pulling agent learns of its deregistration as its subscription ends; a pushed one
    holds no stream, and went on saying it was ready and registered again when the broker
    came back. The broker now tells each pushed instance (NotifyDeregistered): both stop
    being ready, and neither registers again after a restart of the broker on its durable
    store."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    args = ("broker", "--port", str(port), "--store", f"sqlite:///{tmp_path / 'q.db'}")
    broker = await start(*args, ready=BROKER_READY)
    try:
        instances = [await serve(tax_desk, address, delivery_mode="push") for _ in range(2)]
        try:
            async with connect(address, agent_id="Shop", retry=NO_RETRY) as client:
                answer = await client.request("TaxDesk", {"action": "rate", "item": "book"})
                assert answer.content["rate"] == 0.2
                with caplog.at_level(logging.WARNING, logger="mesh.agent"):
                    async with contextlib.AsyncExitStack() as stack:
                        readiness = [
                            await stack.enter_async_context(
                                watching(served.address, "mesh.v1.AgentService")
                            )
                            for served in instances
                        ]
                        for ready in readiness:
                            assert await ready.until(SERVING) == [SERVING]
                        await client.deregister("TaxDesk")
                        for ready in readiness:
                            assert await ready.until(NOT_SERVING) == [NOT_SERVING]
                said = [r.getMessage() for r in caplog.records if r.name == "mesh.agent"]
                gone = "TaxDesk was deregistered: it takes no more messages"
                assert [line[: len(gone)] for line in said] == [gone, gone]

                await wait_killed(broker)
                broker = await start(*args, ready=BROKER_READY)
                # Back, on the store that remembers the deregistration: neither instance
                # registers again (each would within a second of the broker serving).
                await asyncio.sleep(2)
                assert "TaxDesk" not in [a.agent_id for a in await client.list_agents()]
                for served in instances:
                    assert await health_of(served.address, "mesh.v1.AgentService") == NOT_SERVING
        finally:
            for served in instances:
                await served.stop()
    finally:
        await stop(broker)


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
@pytest.mark.parametrize("example", ["echo-agent.js", "push-agent.js"])
async def test_a_node_push_agent_deregistered_on_purpose_is_told_and_stays_off(
    tmp_path: Path, example: str
) -> None:
    """The Node.js library's agent, and the plain @grpc/grpc-js one (which serves no health
    of its own): each says it was deregistered and does not register again."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    args = ("broker", "--port", str(port), "--store", f"sqlite:///{tmp_path / 'q.db'}")
    broker = await start(*args, ready=BROKER_READY)
    sdk = example == "echo-agent.js"
    try:
        node, node_at = await start_node_example(example, "NodePushEcho", address, *(
            ("push",) if sdk else ()))  # fmt: skip
        try:
            async with contextlib.AsyncExitStack() as stack:
                client = await stack.enter_async_context(
                    connect(address, agent_id="Shop", retry=NO_RETRY)
                )
                answer = await client.request("NodePushEcho", {"action": "echo", "n": 1})
                assert answer.content["echo"] == {"action": "echo", "n": 1}
                if sdk:
                    readiness = await stack.enter_async_context(
                        watching(node_at, "mesh.v1.AgentService")
                    )
                    assert await readiness.until(SERVING) == [SERVING]
                await client.deregister("NodePushEcho")
                assert node.stdout is not None
                async with asyncio.timeout(10):
                    said = (await node.stdout.readline()).decode()
                assert said.startswith("NodePushEcho was deregistered: it takes no more messages")
                if sdk:
                    assert await readiness.until(NOT_SERVING) == [NOT_SERVING]
                await wait_killed(broker)
                broker = await start(*args, ready=BROKER_READY)
                await asyncio.sleep(2.5)  # (it would register again within a second or so)
                assert "NodePushEcho" not in [a.agent_id for a in await client.list_agents()]
                if sdk:
                    assert await health_of(node_at, "mesh.v1.AgentService") == NOT_SERVING
        finally:
            if node.returncode is None:
                node.terminate()
            await node.wait()
    finally:
        await stop(broker)


class BusyAtFirst(PlainAgent):
    """A plain server whose first NotifyDeregistered is refused for now (UNAVAILABLE), as a
    server busy or restarting would; it takes the next."""

    def __init__(self) -> None:
        super().__init__(echo)
        self.notices: list[str] = []
        self.noticed = asyncio.Event()

    async def NotifyDeregistered(
        self, request: agent_pb2.NotifyDeregisteredRequest, context: Any
    ) -> agent_pb2.NotifyDeregisteredResponse:
        self.notices.append(request.agent_id)
        self.noticed.set()
        if len(self.notices) == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "busy for a moment")
        return agent_pb2.NotifyDeregisteredResponse()


async def test_a_notice_the_agents_server_did_not_take_for_now_is_given_again(
    mesh: LocalMesh,
) -> None:
    """The server refused the deregistration notice for now: the broker gives it again
    (after 0.5 s), and the server hears it. Before, it was given once, and the agent went on
    serving, and registered again when the broker came back. An agent registered again
    before the next try is not told: it is no longer off."""
    for registered_again in (False, True):
        plain = BusyAtFirst()
        server, address = await start_plain(plain)
        try:
            await register_push(mesh, "Kiosk", address)
            async with mesh.client("admin") as admin:
                await admin.deregister("Kiosk")
                async with asyncio.timeout(10):
                    await plain.noticed.wait()
                if registered_again:
                    await register_push(mesh, "Kiosk", address)
                    await asyncio.sleep(1.0)  # (past the first retry's 0.5 s)
                    assert plain.notices == ["Kiosk"]
                    await admin.deregister("Kiosk")
                else:
                    async with asyncio.timeout(10):
                        while len(plain.notices) < 2:
                            plain.noticed.clear()
                            await plain.noticed.wait()
                    assert plain.notices == ["Kiosk", "Kiosk"]
        finally:
            await server.stop(0)


async def test_an_sdk_agents_server_takes_only_the_notices_meant_for_it(mesh: LocalMesh) -> None:
    """NotifyDeregistered called directly, as any client can: one for another agent is
    refused as HandleMessage refuses its messages; one to an instance that pulls (its
    subscription's end is what tells it) changes nothing."""
    pushed = await mesh.add_agent(tax_desk, delivery_mode="push")
    pulling = await mesh.add_agent(Quotes())
    for served in (pushed, pulling):
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.NotifyDeregistered(
                    agent_pb2.NotifyDeregisteredRequest(agent_id="Nobody")
                )
            error = from_rpc_error(refused.value)
            assert (error.code, error.message) == (
                "INVALID_ARGUMENT",
                f"this server serves {served.agent.agent_id}, not Nobody",
            )
            assert [v.field for v in error.field_violations] == ["agent_id"]
        assert await health_of(served.address, "mesh.v1.AgentService") == SERVING
    async with grpc.aio.insecure_channel(pulling.address) as channel:
        await agent_pb2_grpc.AgentServiceStub(channel).NotifyDeregistered(
            agent_pb2.NotifyDeregisteredRequest(agent_id=pulling.agent.agent_id)
        )
    assert await health_of(pulling.address, "mesh.v1.AgentService") == SERVING
    async with mesh.client("Shop") as client:
        quote = await client.request(pulling.agent.agent_id, {"action": "quote", "item": "book"})
    assert (quote.content["price"], quote.content["tax"]) == (100, 0.2)


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_a_node_push_agent_registers_again_when_the_broker_comes_back() -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    broker = await start("broker", "--port", str(port), ready=BROKER_READY)
    try:
        node, node_at = await start_node_example("echo-agent.js", "NodePushEcho", address, "push")
        try:
            async with (
                connect(address, agent_id="Shop", retry=NO_RETRY) as client,
                watching(node_at, "mesh.v1.AgentService") as readiness,
            ):
                first = await client.request("NodePushEcho", {"action": "echo", "n": 1})
                assert first.content["echo"] == {"action": "echo", "n": 1}
                assert await readiness.until(SERVING) == [SERVING]
                await wait_killed(broker)
                # Not ready while the broker is away; ready once registered again.
                assert await readiness.until(NOT_SERVING) == [NOT_SERVING]
                broker = await start("broker", "--port", str(port), ready=BROKER_READY)
                assert await readiness.until(SERVING) == [SERVING]
                again = await request_once_back(client, "NodePushEcho", {"action": "echo", "n": 2})
                listed = {a.agent_id: a for a in await client.list_agents()}
        finally:
            if node.returncode is None:
                node.terminate()
            await node.wait()
    finally:
        await stop(broker)
    assert again.content["echo"] == {"action": "echo", "n": 2}
    assert listed["NodePushEcho"].delivery_mode is DeliveryMode.PUSH


async def test_the_brokers_log_stays_json_lines_when_a_push_server_goes_away_mid_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC's core wrote its own line to the broker's stderr ("Got goaway ...") when an
    agent's server stopped during a call: not JSON, in a log read as JSON lines. The mesh
    keeps gRPC's core to errors unless GRPC_VERBOSITY says otherwise. (The line came about
    one time in two: three servers stop here.)"""
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)  # (as a shell would start it)
    broker = await start("broker", "--port", "0", ready=BROKER_READY)
    try:
        for attempt in range(3):
            busy = asyncio.Event()

            async def slow(message: message_pb2.Message, context: Any) -> message_pb2.Message:
                busy.set()  # noqa: B023 - (each server's own, used while it runs)
                await asyncio.sleep(5)
                return await echo(message, context)

            server, address = await start_plain(PlainAgent(slow))
            try:
                async with grpc.aio.insecure_channel(broker.address) as channel:
                    await broker_pb2_grpc.BrokerServiceStub(channel).RegisterAgent(
                        broker_pb2.RegisterAgentRequest(
                            agent=message_pb2.AgentInfo(
                                agent_id=f"SlowAgent{attempt}",
                                address=address,
                                delivery_mode=message_pb2.DELIVERY_MODE_PUSH,
                            )
                        )
                    )
                async with connect(broker.address, agent_id="Asker") as client:
                    await client.send(f"SlowAgent{attempt}", {"action": "work", "parameters": {}})
                    async with asyncio.timeout(10):
                        await busy.wait()
                    await server.stop(0)  # (the broker's call to it is cut)
                    await asyncio.sleep(0.3)
            finally:
                await server.stop(None)
    finally:
        assert await stop(broker) == 0
    stray = [
        line
        for line in broker.output
        if not line.startswith("{") and not line.startswith("agentmesh broker")
    ]
    assert stray == []


async def test_a_pushed_server_gone_for_long_is_taken_off_and_its_agent_forgotten() -> None:
    """``forget_lost_after``: a push instance whose server has not answered for that long
    (a pod gone, its agent named after it) is taken off as lost as of when it stopped
    answering, its agent then forgotten, and the broker stops dialling it; the queue keeps
    what was sent meanwhile for a server that registers again. (It was dialled, and listed,
    for good.)"""
    config = BrokerConfig(lease_seconds=5, forget_lost_after=2, sweep_interval=0.05)
    agent = PlainAgent(echo)
    server, address = await start_plain(agent)
    async with LocalMesh(config=config) as mesh, mesh.client("Cashier") as client:
        await register_push(mesh, "Ledger-7f3a", address)
        await client.request("Ledger-7f3a", {"action": "post", "parameters": {}}, timeout=10)
        with port_kept(address) as port:
            await server.stop(None)
            async with asyncio.timeout(15):
                while await unreachable(mesh, "Ledger-7f3a") != 1:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            await client.send("Ledger-7f3a", {"action": "later"}, ttl=600)
            async with asyncio.timeout(15):
                while "Ledger-7f3a" in [a.agent_id for a in await client.list_agents()]:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert mesh.broker is not None
            samples = mesh.broker.metrics.registry.get_sample_value
            assert await asyncio.to_thread(samples, "agentmesh_agents_forgotten_total") == 1
            assert await unreachable(mesh, "Ledger-7f3a") is None  # pushed to no more
            with pytest.raises(AgentNotFoundError):
                await client.send("Ledger-7f3a", {"action": "post"})
            # Its server back, registered again: what was sent meanwhile reaches it.
            server, _ = await start_plain(agent, port)
        try:
            await register_push(mesh, "Ledger-7f3a", address)
            async with asyncio.timeout(15):
                while [m.content["action"] for m in agent.seen][-1:] != ["later"]:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        finally:
            await server.stop(None)

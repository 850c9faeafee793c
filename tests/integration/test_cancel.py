"""Giving up: a caller that stops waiting for a request or a gather (a cancelled task, a
gateway client that stops reading a pattern's events) makes the broker stop waiting too, at
once rather than at the deadline, over the SDK, the gateway and the raw Connect protocol; the
agent working on it is told (its runtime cancels the handler). An answer that comes anyway
(a handler that finishes what it started) is late: taken in quietly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc
import pytest

from gateway.client import GatewayClient
from gateway.embedded import EmbeddedMesh
from gateway.server import serve_gateway
from mesh import AgentContext, Message, MessageType, RequestTimeoutError, agent, connect
from mesh.client import NO_RETRY, MeshClient, Received
from mesh.config import BrokerConfig
from mesh.core.broker import Broker
from mesh.core.model import new_message_id
from mesh.server import serve_broker
from mesh.testing import LocalMesh
from mesh.v1 import broker_pb2, broker_pb2_grpc


class SlowMesh(NamedTuple):
    mesh: LocalMesh
    release: asyncio.Event  # set: the Slow agent answers
    started: asyncio.Event  # set by the Slow agent's handler as it starts


@pytest.fixture
async def slow_mesh() -> AsyncIterator[SlowMesh]:
    """A mesh with an agent that answers only once released (even when told that its
    requester gave up: it finishes what it started), and one that answers at once."""
    release, started = asyncio.Event(), asyncio.Event()

    @agent("Slow", agent_types=["panel"])
    async def slow(message: Message, ctx: AgentContext) -> dict[str, Any]:
        started.set()
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()
        return {"recommendation": "Hold", "confidence": 0.5}

    @agent("Fast", agent_types=["panel"])
    async def fast(message: Message, ctx: AgentContext) -> dict[str, Any]:
        return {"recommendation": "Buy", "confidence": 0.9}

    async with LocalMesh() as mesh:
        await mesh.add_agent(slow)
        await mesh.add_agent(fast)
        try:
            yield SlowMesh(mesh, release, started)
        finally:
            release.set()


async def settled(mesh: LocalMesh) -> int:
    """The broker's pending requests, once what a give-up set off has run."""
    assert mesh.broker is not None
    async with asyncio.timeout(2):
        while mesh.broker.pending_requests:  # noqa: ASYNC110 (a broker figure, no event)
            await asyncio.sleep(0.02)
    return mesh.broker.pending_requests


async def told(mesh: LocalMesh, agent_id: str = "Slow") -> int:
    """How many times the agent's runtime was told that a requester gave up, once told."""
    runtime = mesh.agents[agent_id].runtime
    async with asyncio.timeout(3):
        while not runtime.withdrawn:  # noqa: ASYNC110 (a runtime figure, no event)
            await asyncio.sleep(0.02)
    return runtime.withdrawn


async def ask_slow_past_its_deadline(client: MeshClient, slow: SlowMesh) -> None:
    """Asks the Slow agent with a 1 s deadline, until its handler was running when the
    deadline passed. (On a busy machine a request can reach it so late that it is withdrawn
    before its handler starts, and then no answer comes, late or not.)"""
    for _ in range(5):
        slow.started.clear()
        with pytest.raises(RequestTimeoutError):
            await client.request("Slow", {"action": "quote"}, timeout=1.0)
        if slow.started.is_set():
            return
    pytest.fail("5 requests with a 1 s deadline each ended before the Slow agent's handler ran")


async def late_answer_counted(broker: Broker) -> None:
    """Returns once the broker has counted a late answer."""
    async with asyncio.timeout(5):
        while not broker.metrics.totals.late_answers:  # noqa: ASYNC110 (a broker figure)
            await asyncio.sleep(0.02)


async def test_a_cancelled_request_is_given_up_at_the_broker(
    slow_mesh: SlowMesh,
) -> None:
    mesh, _, _ = slow_mesh
    assert mesh.broker is not None
    async with mesh.client("caller") as client:
        asking = asyncio.create_task(client.request("Slow", {"action": "quote"}, timeout=30))
        async with asyncio.timeout(5):
            while not mesh.broker.pending_requests:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        assert await settled(mesh) == 0  # not 30 s from now
        assert await told(mesh) == 1
        # The session goes on.
        answer = await client.request("Fast", {"action": "quote"}, timeout=5)
        assert answer.content["recommendation"] == "Buy"


async def test_a_gather_left_early_is_given_up_at_the_broker(
    slow_mesh: SlowMesh,
) -> None:
    mesh, _, _ = slow_mesh
    async with mesh.client("caller") as client:
        items = client.gather({"query": "q"}, agent_types=["panel"], timeout=30)
        first = await anext(items)
        assert first.agent_id == "Fast"
        await items.aclose()  # not waiting for Slow
        assert await settled(mesh) == 0
        assert await told(mesh) == 1


async def test_a_pattern_whose_client_stops_reading_stops_at_the_broker(
    slow_mesh: SlowMesh,
) -> None:
    mesh, release, _ = slow_mesh
    gateway = await serve_gateway(mesh.address)
    try:
        async with GatewayClient(gateway.address) as client:
            events = client.group_chat(agent_ids=["Fast", "Slow"], query="q", agent_timeout="30s")
            async for event in events:
                if event["kind"] == "CONTRIBUTION":
                    break
            await events.aclose()  # type: ignore[attr-defined]
            assert await settled(mesh) == 0
            assert await told(mesh) == 1
            release.set()
            done = await client.collect(client.group_chat(agent_ids=["Fast", "Slow"], query="q"))
            assert done[-1]["data"]["status"] == "COMPLETED"
    finally:
        await gateway.stop(0.5)


async def test_a_cancel_frame_gives_up_a_gather_of_the_session(
    slow_mesh: SlowMesh,
) -> None:
    mesh, _, _ = slow_mesh
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        call = broker_pb2_grpc.BrokerServiceStub(channel).Connect()
        gather = broker_pb2.ConnectRequest(seq=7)
        gather.gather.agent_types.append("panel")
        gather.gather.message.from_agent = "raw"
        gather.gather.message.content.update({"query": "q"})
        gather.gather.timeout.seconds = 30
        await call.write(gather)
        frame = await asyncio.wait_for(call.read(), 5)
        assert (frame.seq, frame.gathered.agent_id) == (7, "Fast")
        cancel = broker_pb2.ConnectRequest()
        cancel.cancel.seq = 7
        await call.write(cancel)
        assert await settled(mesh) == 0
        # Nothing more comes for seq 7 (no `accepted`): the stream just ends when closed.
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF


async def test_answers_after_a_give_up_are_taken_in_quietly(
    slow_mesh: SlowMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent answers a request its caller gave up (here, its deadline passed): the broker
    counts the late answer and drops it; the agent is not told it did something wrong. (The
    deadline leaves a busy machine time to deliver the request: one still queued when it
    passes is withdrawn unhandled, and no answer comes, late or not.)"""
    caplog.set_level(logging.INFO)
    mesh, release, _ = slow_mesh
    assert mesh.broker is not None
    async with mesh.client("caller") as client:
        await ask_slow_past_its_deadline(client, slow_mesh)
        await told(mesh)  # (told later, as it answered, the handler would be cancelled then)
        release.set()
        await late_answer_counted(mesh.broker)
    assert mesh.broker.metrics.totals.late_answers == 1
    [late] = [r for r in caplog.records if "late answer" in r.getMessage()]
    assert late.event["category"] == "late_answer"  # type: ignore[attr-defined]
    assert late.event["from_agent"] == "Slow"  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if "refused a frame" in r.getMessage()]


async def test_a_late_answer_to_an_agent_is_not_queued_to_it(
    slow_mesh: SlowMesh,
) -> None:
    """The requester is an agent with a queue of its own: an answer that comes after its
    request ended is dropped as late, not queued to it as if it were a message for it."""
    mesh, release, _ = slow_mesh
    assert mesh.broker is not None
    async with mesh.client("Desk") as desk:
        await desk.register("Desk")
        await ask_slow_past_its_deadline(desk, slow_mesh)
        await told(mesh)  # (told later, as it answered, the handler would be cancelled then)
        release.set()
        await late_answer_counted(mesh.broker)
        [queue] = (await desk.queue_stats("Desk")).agents
        assert (queue.depth, queue.in_flight) == (0, 0)


async def test_a_late_answer_is_known_on_every_replica(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The request waited on broker A and was given up there; the agent, subscribed through
    broker B, answers late: B knows it from the request's route in Redis. (The agent answers
    from its own subscription: an SDK handler would be cancelled by the withdrawal that
    follows the give-up, whenever that reaches it first.)"""
    caplog.set_level(logging.INFO)
    config = BrokerConfig(store=redis_url)
    broker_a, server_a = await serve_broker(broker_config=config)
    broker_b, server_b = await serve_broker(broker_config=config)
    try:
        async with (
            connect(server_a.address, agent_id="caller", retry=NO_RETRY) as client,
            connect(server_b.address, agent_id="Slow", retry=NO_RETRY) as slow,
        ):
            await slow.register("Slow")
            async with slow.subscribe("Slow") as inbox:
                asked = asyncio.create_task(
                    client.request("Slow", {"action": "quote"}, timeout=0.5)
                )
                delivery = await anext(inbox)
                with pytest.raises(RequestTimeoutError):
                    await asked
                await slow.send_message(
                    Message(
                        from_agent="Slow",
                        to_agent=delivery.message.reply_target,
                        message_type=MessageType.RESPONSE,
                        content={"action": "quote", "quote": 1},
                        correlation_id=delivery.message.message_id,
                    )
                )
                await late_answer_counted(broker_b)
    finally:
        await server_a.stop(0.5)
        await server_b.stop(0.5)
    assert broker_a.metrics.totals.late_answers == 0
    assert not [r for r in caplog.records if "refused a frame" in r.getMessage()]


async def test_a_second_answer_to_an_ended_gather_is_taken_in_quietly(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent answers twice (as one does when its request is redelivered after a lease
    lapsed although it had been handled): the gatherer gets the first answer, and the second
    is counted as late rather than refused with NOT_FOUND (the gatherer is not an agent)."""
    caplog.set_level(logging.INFO)
    assert mesh.broker is not None
    async with mesh.client("caller") as caller, mesh.client("Twice") as twice:
        await twice.register("Twice")
        async with twice.subscribe("Twice") as inbox:
            answers = asyncio.create_task(
                caller.gather({"action": "quote"}, agent_ids=["Twice"], timeout=5).__anext__()
            )
            delivery = await anext(inbox)
            answer = Message(
                from_agent="Twice",
                to_agent=delivery.message.reply_target,
                message_type=MessageType.RESPONSE,
                content={"action": "quote", "price": 7},
                correlation_id=delivery.message.message_id,
            )
            await twice.send_message(answer)
            first = await answers
            assert first.response is not None and first.response.content["price"] == 7
            await settled(mesh)
            again = await twice.send_message(answer.evolve(message_id=new_message_id()))
        assert again.message_type is MessageType.RESPONSE  # accepted, not NOT_FOUND
    assert mesh.broker.metrics.totals.late_answers == 1
    assert [r for r in caplog.records if "late answer" in r.getMessage()]


async def test_patterns_left_early_leave_the_others_whole(embedded: EmbeddedMesh) -> None:
    """Many patterns at once through the gateway, a good part of them left after a few
    events: each one left gives its gathers up, which cancels tasks in the middle of writes
    on the gateway's one stream to the broker. The others must not notice: no frame written
    twice (a duplicate gather was refused as 'already waiting'), none lost."""
    rng = random.Random(7)
    kinds = ("stock_recommendation", "refund_request", "hotel_recommendation")
    finished: list[str] = []

    async with GatewayClient(embedded.gateway.address) as client:

        async def run(leave_after: int | None) -> None:
            events = client.route(rng.choice(kinds))
            seen = 0
            try:
                async for event in events:
                    seen += 1
                    if leave_after is not None and seen >= leave_after:
                        return
                    if event["kind"] == "RESULT":
                        finished.append(event["summary"])
            finally:
                await events.aclose()  # type: ignore[attr-defined]

        for _ in range(10):
            plan = [rng.choice([1, 2, 3, None]) for _ in range(12)]
            await asyncio.gather(*(run(leave_after) for leave_after in plan))
            assert len(finished) == sum(1 for p in plan if p is None)
            finished.clear()


async def test_a_withdrawal_that_comes_as_the_answer_is_written_stops_nothing(
    slow_mesh: SlowMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler is over and its answer on its way when the requester's deadline passes:
    the withdrawal cancels nothing (it would have cut the answer's write, or the session's
    stream under it), and the answer reaches the broker, late."""
    mesh, release, _ = slow_mesh
    assert mesh.broker is not None
    write = Received.answer

    async def written_once_withdrawn(self: Received, answer: Message) -> None:
        while not self.withdrawn:  # noqa: ASYNC110 (set by the session's reader)
            await asyncio.sleep(0.01)
        await write(self, answer)

    monkeypatch.setattr(Received, "answer", written_once_withdrawn)
    release.set()  # (answers at once)
    async with mesh.client("caller") as client:
        with pytest.raises(RequestTimeoutError):
            await client.request("Slow", {"action": "quote"}, timeout=1.0)
        await late_answer_counted(mesh.broker)
    assert mesh.agents["Slow"].runtime.withdrawn == 0  # (nothing was left to stop)

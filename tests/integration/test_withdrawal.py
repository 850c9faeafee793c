"""A request whose requester gives up is withdrawn: not delivered if it still waits, and the
agent working on it is told, so that its handler stops instead of running on for nobody.

The requester gives up by its deadline (the request's timeout, a gRPC deadline) or by
cancelling (a cancelled call or session request); a gather withdraws its copies from the
agents that did not answer in time. Subscribers hear of it when they ask to
(``withdrawals`` on the subscription): a `withdrawn` frame on a session, a `withdrawn`
response on the Subscribe stream; the Python runtime cancels the handler.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from mesh import Agent, AgentContext, LocalMesh, MeshError, Message, RequestTimeoutError, on
from mesh.agent import AgentRuntime
from mesh.client import NO_RETRY, AgentClient, connect
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2
from tests.helpers.processes import BROKER_READY, Proc, start, stop
from tests.integration.test_delivery import nothing_within


class Thinker(Agent):
    """Answers ``think`` after ``seconds``; records each run's start and how it ended."""

    def __init__(self, agent_id: str = "Thinker", seconds: float = 5.0) -> None:
        super().__init__(agent_id)
        self.seconds = seconds
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.cancelled_event = asyncio.Event()

    @on("think")
    async def think(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        self.started.append(message.message_id)
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled.append(message.message_id)
            self.cancelled_event.set()
            raise
        self.finished.append(message.message_id)
        return {"thought": self.agent_id}


def withdrawn_count(mesh: LocalMesh, state: str) -> float:
    assert mesh.broker is not None
    value = mesh.broker.metrics.registry.get_sample_value(
        "agentmesh_messages_withdrawn_total", {"state": state}
    )
    return value or 0.0


async def test_a_handler_stops_when_its_requester_times_out(mesh: LocalMesh) -> None:
    """The request's deadline passes: the handler is cancelled at once, never runs again
    (not at its lease's end either), and the broker holds nothing of it."""
    thinker = Thinker()
    served = await mesh.add_agent(thinker, lease_seconds=1.0)
    async with mesh.client("asker") as client:
        with pytest.raises(RequestTimeoutError):
            await client.request("Thinker", {"action": "think"}, timeout=0.4)
        await asyncio.wait_for(thinker.cancelled_event.wait(), 3)
        await asyncio.sleep(1.5)  # past the lease it had: not delivered again
        assert len(thinker.started) == 1 and thinker.cancelled == thinker.started
        assert thinker.finished == []
        stats = await client.queue_stats("Thinker")
        view = stats.for_agent("Thinker")
        assert view is not None and (view.depth, view.in_flight) == (0, 0)
        assert stats.totals["redelivered_count"] == 0
        assert stats.totals["withdrawn_count"] == 1
        assert await client.dead_letters("Thinker") == []
    assert served.runtime.withdrawn == 1
    assert withdrawn_count(mesh, "in_flight") == 1


async def test_a_handler_stops_when_its_requester_cancels(mesh: LocalMesh) -> None:
    thinker = Thinker()
    await mesh.add_agent(thinker)
    async with mesh.client("asker") as client:
        asking = asyncio.create_task(client.request("Thinker", {"action": "think"}, timeout=30))
        async with asyncio.timeout(5):
            while not thinker.started:  # noqa: ASYNC110 - the handler's own record
                await asyncio.sleep(0.02)
        asking.cancel()
        await asyncio.wait_for(thinker.cancelled_event.wait(), 3)
        # The agent goes on with the next request as ever.
        thinker.seconds = 0.0
        answer = await client.request("Thinker", {"action": "think"}, timeout=5)
        assert answer.content["thought"] == "Thinker"
    assert len(thinker.cancelled) == 1 and len(thinker.finished) == 1


async def test_a_plain_function_handler_can_see_that_its_requester_gave_up(
    mesh: LocalMesh,
) -> None:
    """A plain function runs in a worker thread, where no cancellation reaches: it looks at
    ``ctx.withdrawn`` and stops early."""
    seen: list[str] = []

    class Crunch(Agent):
        @on("crunch")
        def crunch(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
            for _ in range(500):  # up to 5 s of work, in slices
                if ctx.withdrawn:
                    seen.append("stopped")
                    return {}
                time.sleep(0.01)
            seen.append("finished")
            return {"done": True}

    await mesh.add_agent(Crunch("Cruncher"))
    async with mesh.client("asker") as client:
        with pytest.raises(RequestTimeoutError):
            await client.request("Cruncher", {"action": "crunch"}, timeout=0.3)
        async with asyncio.timeout(3):
            while not seen:  # noqa: ASYNC110 - the handler's own record, from its thread
                await asyncio.sleep(0.02)
        assert seen == ["stopped"]  # (not "finished": its work was 5 s)


async def test_a_request_given_up_before_its_delivery_is_never_delivered(
    mesh: LocalMesh,
) -> None:
    """Nobody consumes the agent's queue while the request waits: it leaves the queue when
    its requester gives up, before its ttl, and is not delivered to whoever comes later."""
    async with mesh.client("asker") as client:
        await client.register("Sleeper")
        with pytest.raises(RequestTimeoutError):
            await client.request("Sleeper", {"action": "think"}, ttl=3600, timeout=0.3)
        view = (await client.queue_stats("Sleeper")).for_agent("Sleeper")
        assert view is not None and view.depth == 0
        kept = await client.send("Sleeper", {"action": "note"})
        async with client.subscribe("Sleeper") as inbox:
            first = await asyncio.wait_for(anext(aiter(inbox)), 5)
            assert first.message.message_id == kept.message_id
            await first.ack()
    assert withdrawn_count(mesh, "waiting") == 1


async def test_a_gather_withdraws_its_copies_from_the_agents_that_did_not_answer(
    mesh: LocalMesh,
) -> None:
    quick, slow = Thinker("Quick", 0.0), Thinker("Slow", 5.0)
    await mesh.add_agent(quick)
    await mesh.add_agent(slow)
    async with mesh.client("asker") as client:
        outcomes = [
            (item.agent_id, item.error.code if item.error else "answered")
            async for item in client.gather(
                {"action": "think"}, agent_ids=["Quick", "Slow"], timeout=0.5
            )
        ]
        assert outcomes == [("Quick", "answered"), ("Slow", "DEADLINE_EXCEEDED")]
        await asyncio.wait_for(slow.cancelled_event.wait(), 3)
    assert quick.cancelled == [] and len(slow.cancelled) == 1
    assert withdrawn_count(mesh, "in_flight") == 1


class Delegator(Agent):
    """Answers ``think`` by asking the next agent of a chain and waiting for it."""

    def __init__(self, agent_id: str, next_agent: str) -> None:
        super().__init__(agent_id)
        self.next_agent = next_agent
        self.cancelled = asyncio.Event()

    @on("think")
    async def think(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        try:
            answer = await ctx.request(self.next_agent, {"action": "think"}, timeout=30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return dict(answer.content)


async def test_a_give_up_reaches_down_a_chain_of_agents(mesh: LocalMesh) -> None:
    """Front asks Middle, which asks Back (slow): when Front's requester gives up, Front's
    handler is cancelled, which gives up its own request to Middle, and so on down: no agent
    of the chain works on for nobody."""
    back = Thinker("Back")
    middle, front = Delegator("Middle", "Back"), Delegator("Front", "Middle")
    for one in (back, middle, front):
        await mesh.add_agent(one)
    async with mesh.client("asker") as client:
        with pytest.raises(RequestTimeoutError):
            await client.request("Front", {"action": "think"}, timeout=0.5)
        async with asyncio.timeout(5):
            await front.cancelled.wait()
            await middle.cancelled.wait()
            await back.cancelled_event.wait()
        assert back.finished == []
        for agent_id in ("Front", "Middle", "Back"):
            view = (await client.queue_stats(agent_id)).for_agent(agent_id)
            assert view is not None and (view.depth, view.in_flight) == (0, 0), agent_id
    assert withdrawn_count(mesh, "in_flight") == 3


def _request(to: str) -> broker_pb2.SendRequestRequest:
    request = broker_pb2.SendRequestRequest(
        message=message_pb2.Message(from_agent="caller", to_agent=to)
    )
    request.message.content.update({"action": "think"})
    return request


async def test_plain_grpc_subscribers_hear_of_withdrawals_when_they_ask(
    mesh: LocalMesh,
) -> None:
    """A session subscribed with ``withdrawals`` gets a `withdrawn` frame naming the
    delivery once its requester's deadline passed (after the delivery), and its ack counts
    nothing; the Subscribe stream gets a response with `withdrawn` set and no delivery; a
    subscription that did not ask hears nothing."""
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        for agent_id in ("Desk", "Stream", "Quiet"):
            await stub.RegisterAgent(
                broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id=agent_id))
            )

        session = stub.Connect()
        subscribe = broker_pb2.ConnectRequest(seq=1)
        subscribe.subscribe.agent_id = "Desk"
        subscribe.subscribe.withdrawals = True
        await session.write(subscribe)
        assert (await asyncio.wait_for(session.read(), 5)).WhichOneof("frame") == "accepted"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SendRequest(_request("Desk"), timeout=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        delivered = await asyncio.wait_for(session.read(), 5)
        message_id = delivered.delivery.message.message_id
        withdrawn = await asyncio.wait_for(session.read(), 5)
        assert withdrawn.WhichOneof("frame") == "withdrawn"
        assert (withdrawn.withdrawn.agent_id, list(withdrawn.withdrawn.message_ids)) == (
            "Desk",
            [message_id],
        )
        ack = await stub.Ack(broker_pb2.AckRequest(agent_id="Desk", message_ids=[message_id]))
        assert ack.acknowledged == 0
        session.cancel()

        stream = stub.Subscribe(broker_pb2.SubscribeRequest(agent_id="Stream", withdrawals=True))
        asking = asyncio.ensure_future(stub.SendRequest(_request("Stream"), timeout=0.5))
        first = await asyncio.wait_for(stream.read(), 5)
        assert first.HasField("delivery") and not first.HasField("withdrawn")
        second = await asyncio.wait_for(stream.read(), 5)
        assert not second.HasField("delivery")
        assert list(second.withdrawn.message_ids) == [first.delivery.message.message_id]
        with pytest.raises(grpc.aio.AioRpcError):
            await asking
        stream.cancel()

        quiet = stub.Subscribe(broker_pb2.SubscribeRequest(agent_id="Quiet"))
        asking = asyncio.ensure_future(stub.SendRequest(_request("Quiet"), timeout=0.3))
        only = await asyncio.wait_for(quiet.read(), 5)
        assert only.HasField("delivery")
        with pytest.raises(grpc.aio.AioRpcError):
            await asking
        await nothing_within(quiet.read(), 1.0)
        quiet.cancel()
        stats = await stub.GetQueueStats(broker_pb2.GetQueueStatsRequest())
        assert stats.totals.withdrawn_count == 3
    assert withdrawn_count(mesh, "in_flight") == 3


@pytest.mark.processes
async def test_a_withdrawal_reaches_the_subscriber_through_another_replica(
    redis_url: str,
) -> None:
    """The requester waits on one broker replica, the agent is subscribed through another
    (one Redis): its handler still hears that the requester gave up."""
    a: Proc = await start("broker", "--port", "0", "--store", redis_url, ready=BROKER_READY)
    b: Proc = await start("broker", "--port", "0", "--store", redis_url, ready=BROKER_READY)
    try:
        thinker = Thinker()
        async with connect(a.address, agent_id="Thinker", retry=NO_RETRY) as via_a:
            runtime = AgentRuntime(thinker, via_a, lease_seconds=2.0)
            await runtime.start()
            try:
                await asyncio.wait_for(runtime.subscribed.wait(), 10)
                async with connect(b.address, agent_id="asker", retry=NO_RETRY) as via_b:
                    with pytest.raises(RequestTimeoutError):
                        await via_b.request("Thinker", {"action": "think"}, timeout=1.0)
                await asyncio.wait_for(thinker.cancelled_event.wait(), 5)
                assert thinker.finished == [] and runtime.withdrawn == 1
            finally:
                await runtime.stop(grace=0.5)
    finally:
        await stop(a)
        await stop(b)


async def test_a_subscriber_hears_of_a_withdrawal_and_its_stream_goes_on(
    mesh: LocalMesh,
) -> None:
    """A hand-written consumer: the delivery it holds turns ``withdrawn`` and reaches
    ``on_withdrawn`` (here one that fails: the subscription goes on all the same)."""
    heard: list[str] = []

    def on_withdrawn(received: Any) -> None:
        heard.append(received.message.message_id)
        raise RuntimeError("a careless callback")

    async with mesh.client("asker") as client:
        await client.register("Desk")
        async with client.subscribe("Desk", on_withdrawn=on_withdrawn) as inbox:
            deliveries = aiter(inbox)
            asking = asyncio.ensure_future(client.request("Desk", {"action": "think"}, timeout=0.4))
            first = await asyncio.wait_for(anext(deliveries), 5)
            with pytest.raises(RequestTimeoutError):
                await asking
            async with asyncio.timeout(3):
                while not first.withdrawn:  # noqa: ASYNC110 - set by the session's reader
                    await asyncio.sleep(0.02)
            assert heard == [first.message.message_id]
            kept = await client.send("Desk", {"action": "note"})
            second = await asyncio.wait_for(anext(deliveries), 5)
            assert second.message.message_id == kept.message_id and not second.withdrawn
            await second.ack()


async def test_a_direct_call_whose_caller_gives_up_cancels_the_handler(mesh: LocalMesh) -> None:
    """Without the broker: a call to the agent's own server past its gRPC deadline cancels
    the handler there, as a withdrawal does."""
    thinker = Thinker("Direct")
    served = await mesh.add_agent(thinker)
    async with AgentClient(served.address) as direct:
        with pytest.raises(MeshError) as info:
            await direct.handle(
                Message(from_agent="caller", to_agent="Direct", content={"action": "think"}),
                timeout=0.3,
            )
        assert info.value.code == "DEADLINE_EXCEEDED"
    await asyncio.wait_for(thinker.cancelled_event.wait(), 3)
    assert thinker.finished == []

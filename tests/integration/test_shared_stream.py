"""Several agents' subscriptions on one Connect stream: the broker delivers each agent's
messages (message.to_agent names it), refuses what is ambiguous, ends one subscription
without the others; the SDK puts the subscriptions of one client, and the agents served
together by serve_all, on one stream."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from mesh import Agent, AgentContext, Message, serve_all
from mesh.config import BrokerConfig
from mesh.core.errors import MessageQueueFullError
from mesh.testing import LocalMesh
from mesh.v1 import broker_pb2, broker_pb2_grpc


async def _read(call: Any) -> list[broker_pb2.ConnectResponse]:
    """One read of the stream, `batch` frames unpacked."""
    frame = await asyncio.wait_for(call.read(), 10)
    return list(frame.batch.frames) if frame.WhichOneof("frame") == "batch" else [frame]


async def _call(call: Any, request: broker_pb2.ConnectRequest) -> broker_pb2.ConnectResponse:
    """Writes a frame and reads until its answer (deliveries read meanwhile are dropped:
    tests using this have none pending)."""
    await call.write(request)
    while True:
        for frame in await _read(call):
            if frame.seq == request.seq:
                return frame


def _delivered(frames: list[broker_pb2.ConnectResponse]) -> list[tuple[str, str]]:
    out = []
    for frame in frames:
        kind = frame.WhichOneof("frame")
        if kind == "delivery":
            out.append((frame.delivery.message.to_agent, frame.delivery.message.message_id))
        elif kind == "deliveries":
            out += [(d.message.to_agent, d.message.message_id) for d in frame.deliveries.deliveries]
    return out


def _subscribe(seq: int, agent_id: str) -> broker_pb2.ConnectRequest:
    request = broker_pb2.ConnectRequest(seq=seq)
    request.subscribe.agent_id = agent_id
    request.subscribe.max_batch = 16
    return request


async def test_one_stream_carries_the_deliveries_of_several_agents(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as client, grpc.aio.insecure_channel(mesh.address) as channel:
        for name in ("Billing", "Shipping"):
            await client.register(name, agent_types=("store",))
        call = broker_pb2_grpc.BrokerServiceStub(channel).Connect()
        for seq, name in ((1, "Billing"), (2, "Shipping")):
            answer = await _call(call, _subscribe(seq, name))
            assert answer.WhichOneof("frame") == "accepted"

        # Subscribing an agent twice on one stream is refused; the first one goes on.
        twice = await _call(call, _subscribe(3, "Billing"))
        assert twice.WhichOneof("frame") == "error"
        assert twice.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]

        to_billing = await client.send("Billing", {"action": "charge"})
        to_shipping = await client.send("Shipping", {"action": "ship"})
        broadcast = await client.broadcast({"action": "count"}, agent_types=["store"])
        got: list[tuple[str, str]] = []
        while len(got) < 4:
            got += _delivered(await _read(call))
        assert sorted(got) == sorted(
            [
                ("Billing", to_billing.message_id),
                ("Shipping", to_shipping.message_id),
                ("Billing", broadcast.message_id),
                ("Shipping", broadcast.message_id),
            ]
        )

        # An ack must name its agent when the stream carries two.
        ack = broker_pb2.ConnectRequest(seq=4)
        ack.ack.message_ids.append(to_billing.message_id)
        refused = await _call(call, ack)
        assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "agent_id" in refused.error.message

        ack = broker_pb2.ConnectRequest()
        ack.ack.agent_id = "Billing"
        ack.ack.message_ids.extend([to_billing.message_id, broadcast.message_id])
        await call.write(ack)

        # Ending Shipping's subscription puts its two unacknowledged messages back in its
        # queue; Billing's goes on.
        unsubscribe = broker_pb2.ConnectRequest(seq=5)
        unsubscribe.unsubscribe.agent_id = "Shipping"
        assert (await _call(call, unsubscribe)).WhichOneof("frame") == "accepted"
        back = await client.receive("Shipping")
        assert sorted(m.message_id for m in back) == sorted(
            [to_shipping.message_id, broadcast.message_id]
        )
        later = await client.send("Billing", {"action": "refund"})
        assert _delivered(await _read(call)) == [("Billing", later.message_id)]
        report = await client.queue_stats()
        billing = report.for_agent("Billing")
        assert billing is not None and billing.depth == 0

        # Ending a subscription the stream does not carry is refused.
        again = broker_pb2.ConnectRequest(seq=6)
        again.unsubscribe.agent_id = "Shipping"
        assert (await _call(call, again)).WhichOneof("frame") == "error"
        call.cancel()


async def test_the_subscriptions_of_one_client_share_its_stream(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as sender, mesh.client() as client:
        for name in ("A", "B"):
            await client.register(name)
        sub_a = await client.subscribe("A").start()
        sub_b = await client.subscribe("B").start()
        assert sub_a._session is sub_b._session is client._session

        sent_a = await sender.send("A", {"action": "x"})
        sent_b = await sender.send("B", {"action": "y"})
        got_a = await asyncio.wait_for(anext(aiter(sub_a)), 5)
        got_b = await asyncio.wait_for(anext(aiter(sub_b)), 5)
        assert got_a.message.message_id == sent_a.message_id
        assert got_b.message.message_id == sent_b.message_id
        await got_a.ack()

        # Closing B (its message unacknowledged) returns that message; A goes on.
        await sub_b.close()
        with pytest.raises(StopAsyncIteration):
            await anext(aiter(sub_b))
        assert [m.message_id for m in await sender.receive("B")] == [sent_b.message_id]
        more = await sender.send("A", {"action": "z"})
        got = await asyncio.wait_for(anext(aiter(sub_a)), 5)
        assert got.message.message_id == more.message_id
        await got.ack()

        # A second subscription of the same agent from this client has a stream of its own,
        # and the two share the agent's messages.
        second = await client.subscribe("A").start()
        assert second._session is not sub_a._session
        first_ids = {(await sender.send("A", {"action": "n", "i": i})).message_id for i in range(6)}
        await sub_a.close()
        seen = set()
        while len(seen) < 6:
            received = await asyncio.wait_for(anext(aiter(second)), 5)
            seen.add(received.message.message_id)
            await received.ack()
        assert seen == first_ids
        await second.close()


class Counter(Agent):
    agent_types = ("counter",)

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        return {"agent": self.agent_id}


async def test_agents_served_together_share_one_client_and_all_answer(mesh: LocalMesh) -> None:
    agents = [Counter(f"counter-{i}") for i in range(3)]
    group = await serve_all(agents, mesh.address, max_in_flight=4)
    try:
        assert len(group) == 3
        assert {server.client for server in group} == {group.client}
        async with mesh.client("asker") as asker:
            answered = []
            async for item in asker.gather({"action": "count"}, agent_types=["counter"]):
                assert item.response is not None
                answered.append(item.response.content["agent"])
            assert sorted(answered) == ["counter-0", "counter-1", "counter-2"]
            answer = await asker.request("counter-1", {"action": "count"})
            assert answer.content["agent"] == "counter-1"
    finally:
        await group.stop(1.0)
    async with mesh.client("asker") as asker:
        assert not [a for a in await asker.list_agents() if a.agent_id.startswith("counter-")]


async def test_unsubscribe_while_a_delivery_is_being_written_is_answered(mesh: LocalMesh) -> None:
    """The subscriber reads nothing for a while, so the broker's write of a large deliveries
    frame waits on flow control; an `unsubscribe` then stops the subscription in the middle of
    that write. grpc.aio takes one write at a time and cannot take one back: the `accepted`
    must wait for that write to end, not start beside it (which failed the stream with
    TOO_MANY_OPERATIONS and left the client waiting for ever, without a status)."""
    async with mesh.client("sender") as client, grpc.aio.insecure_channel(mesh.address) as channel:
        await client.register("Archive")
        bulky = {"action": "store", "blob": "x" * 250_000}
        sent = [await client.send("Archive", bulky) for _ in range(60)]
        call = broker_pb2_grpc.BrokerServiceStub(channel).Connect()
        subscribe = _subscribe(1, "Archive")
        subscribe.subscribe.max_in_flight = 60
        subscribe.subscribe.max_batch = 60
        assert (await _call(call, subscribe)).WhichOneof("frame") == "accepted"
        await asyncio.sleep(0.3)  # deliveries are written and wait for the reader
        unsubscribe = broker_pb2.ConnectRequest(seq=2)
        unsubscribe.unsubscribe.agent_id = "Archive"
        await call.write(unsubscribe)
        await asyncio.sleep(0.3)
        seen: list[broker_pb2.ConnectResponse] = []
        while not any(frame.seq == 2 for frame in seen):
            seen += await _read(call)
        assert [f.WhichOneof("frame") for f in seen if f.seq == 2] == ["accepted"]
        assert len(_delivered(seen)) <= 60
        await call.done_writing()
        assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.OK
        # Whatever the stream did not finish delivering is back in the queue, nothing lost.
        stats = (await client.queue_stats("Archive")).agents[0]
        assert (stats.depth, stats.in_flight) == (len(sent), 0)


async def test_a_broadcast_travels_on_the_stream_and_says_who_could_not_take_it() -> None:
    """A `broadcast` frame is answered with `broadcasted`: the copies' id, who got one, and
    who could not (a full queue), as the unary Broadcast answers; with seq 0 it is not
    answered at all; without a message it is refused by seq. The SDK broadcasts this way."""
    async with (
        LocalMesh(BrokerConfig(max_messages_per_agent=2, sweep_interval=0.05)) as mesh,
        mesh.client("sender") as client,
        grpc.aio.insecure_channel(mesh.address) as channel,
    ):
        for name, kind in (("Billing", "store"), ("Shipping", "store"), ("Audit", "audit")):
            await client.register(name, agent_types=(kind,))
        for _ in range(2):
            await client.send("Billing", {"action": "charge"})  # Billing's queue is full
        call = broker_pb2_grpc.BrokerServiceStub(channel).Connect()

        to_stores = broker_pb2.ConnectRequest(seq=1)
        to_stores.broadcast.agent_types.append("store")
        to_stores.broadcast.message.from_agent = "sender"
        to_stores.broadcast.message.content.update({"action": "stocktake"})
        answer = await _call(call, to_stores)
        assert answer.WhichOneof("frame") == "broadcasted"
        outcome = answer.broadcasted
        assert list(outcome.recipients) == ["Shipping"]
        assert [f.agent_id for f in outcome.failures] == ["Billing"]
        assert outcome.failures[0].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "Billing queue full" in outcome.failures[0].error.message

        to_all = broker_pb2.ConnectRequest(seq=0)  # fire-and-forget
        to_all.broadcast.message.from_agent = "sender"
        to_all.broadcast.message.content.update({"alert": "closing early"})
        empty = broker_pb2.ConnectRequest(seq=2)
        empty.broadcast.agent_types.append("store")
        await call.write(to_all)
        await call.write(empty)
        # Frames are handled in order: had the seq-0 broadcast been answered, that answer
        # would come first.
        [refusal] = await _read(call)
        assert (refusal.seq, refusal.WhichOneof("frame")) == (2, "error")
        assert refusal.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        # A message the broker refuses is refused by seq, and the session goes on.
        no_content = broker_pb2.ConnectRequest(seq=3)
        no_content.broadcast.message.from_agent = "sender"
        refused = await _call(call, no_content)
        assert refused.WhichOneof("frame") == "error"
        assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert refused.error.message == "content is required"
        await call.done_writing()

        shipping = await client.receive("Shipping")
        assert [m.content for m in shipping] == [
            {"action": "stocktake"},
            {"alert": "closing early"},
        ]
        assert shipping[0].message_id == outcome.message_id
        assert [m.content for m in await client.receive("Audit")] == [{"alert": "closing early"}]

        # The SDK's broadcast reports the same, with the typed error.
        result = await client.broadcast({"action": "stocktake"}, agent_types=["store"])
        assert result.recipients == ("Shipping",)
        [(agent_id, error)] = result.failures
        assert agent_id == "Billing" and isinstance(error, MessageQueueFullError)

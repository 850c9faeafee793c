"""At-least-once delivery, request deadlines, concurrency and error statuses over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from types import MappingProxyType
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2

from mesh import (
    Agent,
    AgentClient,
    AgentContext,
    AgentError,
    BrokerConfig,
    DeadLetter,
    LocalMesh,
    MeshClient,
    MeshError,
    Message,
    MessageTooLargeError,
    MessageType,
    MessageValidationError,
    Priority,
    RequestTimeoutError,
    RetryLater,
    agent,
    on,
    serve_all,
)
from mesh.core.broker import Broker
from mesh.core.errors import AgentNotFoundError
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2
from tests.helpers.stores import CountingStore


async def test_request_to_an_agent_that_does_not_answer_ends_at_the_deadline(
    mesh: LocalMesh,
) -> None:
    async with mesh.client("Orchestrator") as client:
        await client.register("SilentAgent")  # registered, but nobody consumes its queue
        with pytest.raises(RequestTimeoutError, match="no response from SilentAgent"):
            await client.request("SilentAgent", {"action": "ping"}, timeout=0.3)
        assert mesh.broker is not None and mesh.broker.pending_requests == 0


async def test_unary_send_request_honours_the_grpc_deadline(mesh: LocalMesh) -> None:
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id="SilentAgent"))
        )
        request = broker_pb2.SendRequestRequest(
            message=message_pb2.Message(from_agent="caller", to_agent="SilentAgent")
        )
        request.message.content.update({"action": "ping"})
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SendRequest(request, timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_two_concurrent_requesters_each_get_their_own_answers(mesh: LocalMesh) -> None:
    @agent("EchoAgent")
    async def echo(message: Message, ctx: AgentContext) -> dict:
        await asyncio.sleep(0)  # interleave handlers
        return {"requester": message.from_agent, "n": message.parameters["n"]}

    await mesh.add_agent(echo, max_in_flight=64)

    async def requester(name: str) -> list[tuple[str, int, str]]:
        async with mesh.client(name) as client:

            async def one(n: int) -> tuple[str, int, str]:
                reply = await client.request(
                    "EchoAgent", {"action": "echo", "parameters": {"n": n}}
                )
                return reply.content["requester"], reply.content["n"], reply.to_agent

            return list(await asyncio.gather(*(one(n) for n in range(500))))

    a, b = await asyncio.gather(requester("RequesterA"), requester("RequesterB"))
    assert a == [("RequesterA", n, "RequesterA") for n in range(500)]
    assert b == [("RequesterB", n, "RequesterB") for n in range(500)]


async def test_unacked_delivery_is_redelivered_after_its_lease_then_dead_lettered() -> None:
    config = BrokerConfig(sweep_interval=0.02, max_delivery_attempts=2)
    async with LocalMesh(config) as local, local.client("sender") as client:
        await client.register("Worker")
        sent = await client.send("Worker", {"action": "work"})
        attempts = []
        async with client.subscribe("Worker", lease_seconds=0.1) as sub:
            async for received in sub:
                attempts.append(received.attempt)  # never acked
                if len(attempts) == 2:
                    break
        assert attempts == [1, 2]
        dead = await only_dead_letter(client, "Worker")
        assert dead.message.message_id == sent.message_id
        assert dead.attempts == 2
        stats = await client.queue_stats("Worker")
        assert stats.agents[0].dead_letters == 1
        assert stats.totals["redelivered_count"] == 1


async def test_nack_redelivers_with_attempt_count(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as client:
        await client.register("Worker")
        await client.send("Worker", {"action": "work"})
        seen = []
        async with client.subscribe("Worker") as sub:
            async for received in sub:
                seen.append(received.attempt)
                if received.attempt == 1:
                    await received.nack()
                else:
                    await received.ack()
                    break
        assert seen == [1, 2]
        assert (await client.queue_stats("Worker")).agents[0].in_flight == 0


async def test_a_one_way_message_whose_handler_fails_comes_back_after_rt011_backoff(
    mesh: LocalMesh,
) -> None:
    """An agent's handler fails on a hand-off nobody waits for (a lock held a moment): the
    runtime hands it back after RT-011's backoff, 100 ms after the first attempt and 500 ms
    after the second, not at once; the third attempt succeeds, and nothing is dead-lettered.
    One that always fails goes to the dead-letter queue after its four attempts, 2 s after
    the third."""
    tries: dict[str, list[float]] = {"post": [], "wreck": []}

    class Ledger(Agent):
        agent_id = "Ledger"

        async def handle(self, message: Message, ctx: AgentContext) -> None:
            assert message.handoff is not None
            task = message.handoff.task_description
            tries[task].append(time.monotonic())
            if task == "wreck" or len(tries["post"]) < 3:
                raise RuntimeError("the ledger is locked")

    def gaps(action: str) -> list[float]:
        return [later - sooner for sooner, later in itertools.pairwise(tries[action])]

    await mesh.add_agent(Ledger())
    async with mesh.client("Bookkeeper") as client:
        await client.handoff("Ledger", "post")
        async with asyncio.timeout(20):
            while len(tries["post"]) < 3:  # noqa: ASYNC110 - the agent's own progress
                await asyncio.sleep(0.05)
        [first, second] = gaps("post")
        assert first >= 0.1 and second >= 0.5
        wrecked = await client.handoff("Ledger", "wreck")
        dead = await only_dead_letter(client, "Ledger")
        assert dead.message.message_id == wrecked.message_id
        assert dead.reason == "nacked after 4 delivery attempts"
        waited = gaps("wreck")
        assert len(waited) == 3
        assert waited[0] >= 0.1 and waited[1] >= 0.5 and waited[2] >= 2.0, waited
        [queue] = (await client.queue_stats("Ledger")).agents
        assert (queue.depth, queue.in_flight, queue.dead_letters) == (0, 0, 1)


async def test_a_handler_that_raises_retry_later_has_its_message_again_then(
    mesh: LocalMesh,
) -> None:
    """A handler that cannot handle a message yet raises ``RetryLater(seconds)``: the message
    goes back to the broker and comes again after that wait, its attempt counted, while the
    agent's place in flight (one, here) takes its next message at once. A request is not
    answered meanwhile: its requester gets the answer of the attempt that succeeds. Called
    directly, the agent's server answers UNAVAILABLE with the wait in a RetryInfo. Once the
    broker's attempts are used up, the message is dead-lettered."""
    seen: list[tuple[str, int]] = []
    most: dict[str, int] = {}

    class Shipping(Agent):
        agent_id = "Shipping"

        @on("ship")
        async def ship(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
            order = str(message.parameters["order"])
            seen.append((order, ctx.attempt))
            most[order] = ctx.max_attempts
            if order == "never":
                raise RetryLater(0.05, "the carrier is not taking parcels")
            if order in ("o1", "asked", "direct") and ctx.attempt == 1:
                raise RetryLater(1.0, f"{order} is not packed yet")
            return {"shipped": order}

    served = await mesh.add_agent(Shipping(), max_in_flight=1)
    with pytest.raises(ValueError, match="more than 0"):
        RetryLater(0)
    async with mesh.client("Store") as client:
        await client.register()  # (the sends are requests too: their answers come here)
        await client.send("Shipping", {"action": "ship", "parameters": {"order": "o1"}})
        await client.send("Shipping", {"action": "ship", "parameters": {"order": "o2"}})
        answer = await client.request(
            "Shipping", {"action": "ship", "parameters": {"order": "asked"}}, timeout=10
        )
        assert answer.content["shipped"] == "asked"
        async with asyncio.timeout(10):
            while ("o1", 2) not in seen:  # noqa: ASYNC110 - the agent's own progress
                await asyncio.sleep(0.02)
        # o2 was handled while o1 waited; each came back once, with its attempt counted.
        assert seen.index(("o2", 1)) < seen.index(("o1", 2))
        assert sorted(seen) == [("asked", 1), ("asked", 2), ("o1", 1), ("o1", 2), ("o2", 1)]
        assert served.runtime.postponed == 2 and served.runtime.failed == 0
        direct = Message(
            from_agent="Store",
            to_agent="Shipping",
            content={"action": "ship", "parameters": {"order": "direct"}},
        )
        async with AgentClient(served.address) as agent:
            with pytest.raises(MeshError) as info:
                await agent.handle(direct)
        assert (info.value.code, info.value.reason) == ("UNAVAILABLE", "RETRY_LATER")
        assert info.value.retry_after == pytest.approx(1.0)
        assert "direct is not packed yet" in info.value.message
        # (each delivery says the broker's number of attempts; a direct call is none)
        assert most == {"o1": 4, "o2": 4, "asked": 4, "direct": 0}
        never = await client.send("Shipping", {"action": "ship", "parameters": {"order": "never"}})
        dead = await only_dead_letter(client, "Shipping")
        assert dead.message.message_id == never.message_id
        assert dead.reason == "nacked after 4 delivery attempts"
        assert [attempt for order, attempt in seen if order == "never"] == [1, 2, 3, 4]


async def only_dead_letter(client: MeshClient, agent_id: str) -> DeadLetter:
    """The dead letter the agent's queue comes to hold, waited for: there must be one only."""
    async with asyncio.timeout(30):
        while not (dead := await client.dead_letters(agent_id)):  # noqa: ASYNC110 - broker state
            await asyncio.sleep(0.02)
    [only] = dead
    return only


def failing_ledger(tries: list[float]) -> Agent:
    """Agent "Ledger", whose handler notes when it ran into ``tries``, then fails."""

    class Ledger(Agent):
        agent_id = "Ledger"

        async def handle(self, message: Message, ctx: AgentContext) -> None:
            tries.append(time.monotonic())
            raise RuntimeError("the ledger is locked")

    return Ledger()


async def test_an_agent_stopping_hands_back_at_once_a_failed_delivery_waiting_out_its_backoff(
    mesh: LocalMesh,
) -> None:
    """Stopped while a failed hand-off waits out its 2 s backoff (after the third attempt),
    the agent hands it back then: the stop (given 30 s to finish its work) does not wait for
    the backoff, and the message is back in the queue for whoever serves the agent next."""
    tries: list[float] = []

    await mesh.add_agent(failing_ledger(tries))
    async with mesh.client("Bookkeeper") as client:
        sent = await client.handoff("Ledger", "post")
        async with asyncio.timeout(20):
            while len(tries) < 3:  # noqa: ASYNC110 - the agent's own progress
                await asyncio.sleep(0.02)
        stopping = time.monotonic()
        await mesh.stop_agent("Ledger", grace=30)
        assert time.monotonic() - stopping < 1.5  # (the backoff alone was 2 s)
        assert len(tries) == 3
        [queue] = (await client.queue_stats("Ledger")).agents
        assert (queue.depth, queue.in_flight, queue.dead_letters) == (1, 0, 0)
        [back] = await client.receive("Ledger")
        assert back.message_id == sent.message_id


async def test_the_runtime_backs_off_until_the_last_attempt_of_the_broker_it_is_served_by() -> None:
    """A broker set to five delivery attempts says so with each delivery (a subscriber reads
    it), and an agent whose handler keeps failing waits out RT-011's backoff before each of
    the five (2 s before the fifth too) rather than stopping at RT-011's default of four,
    after which the fifth came at once."""
    tries: list[float] = []

    config = BrokerConfig(sweep_interval=0.05, max_delivery_attempts=5)
    async with LocalMesh(config) as local, local.client("Bookkeeper") as client:
        await client.register("Reader")
        await client.send("Reader", {"action": "look"})
        async with client.subscribe("Reader") as sub:
            received = await anext(aiter(sub))
            assert (received.attempt, received.max_attempts) == (1, 5)
            await received.ack()
        await local.add_agent(failing_ledger(tries))
        wrecked = await client.handoff("Ledger", "wreck")
        dead = await only_dead_letter(client, "Ledger")
        assert dead.message.message_id == wrecked.message_id
        assert dead.reason == "nacked after 5 delivery attempts"
        waited = [later - sooner for sooner, later in itertools.pairwise(tries)]
        assert len(waited) == 4
        assert waited[0] >= 0.1 and waited[1] >= 0.5 and waited[2] >= 2.0, waited
        assert waited[3] >= 2.0, waited  # (before: at once, the runtime's fourth its last)


async def test_a_request_and_a_gather_hear_when_their_message_is_dead_lettered() -> None:
    """An agent that takes a request and hands it back every time: after the last attempt
    the request is dead-lettered, and its requester (a gather too, for that agent) hears so
    at once instead of at its deadline; so does one whose agent rejects it."""
    config = BrokerConfig(max_delivery_attempts=2)
    async with LocalMesh(config) as local, local.client("Asker") as asker:
        await asker.register("Worker", agent_types=["worker"])

        async def hand_back() -> None:
            async with local.client("Worker") as worker, worker.subscribe("Worker") as sub:
                async for received in sub:
                    if received.message.content.get("action") == "refuse":
                        await received.reject("not mine")
                    else:
                        await received.nack()

        handing = asyncio.create_task(hand_back())
        try:
            with pytest.raises(MeshError) as failed:
                await asker.request("Worker", {"action": "work"}, timeout=30)
            assert failed.value.reason == "DEAD_LETTERED"
            assert failed.value.message == (
                "Worker did not answer: the message was dead-lettered "
                "(nacked after 2 delivery attempts)"
            )
            [result] = [
                r async for r in asker.gather({"action": "work"}, agent_ids=["Worker"], timeout=30)
            ]
            assert result.response is not None  # (an agent's ERROR, as a gather gives it)
            assert result.response.message_type is MessageType.ERROR
            assert result.response.content["reason"] == "DEAD_LETTERED"
            with pytest.raises(MeshError) as refused:
                await asker.request("Worker", {"action": "refuse"}, timeout=30)
            assert refused.value.reason == "DEAD_LETTERED"
            assert refused.value.message.endswith("dead-lettered (not mine)")
        finally:
            handing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handing
        assert len(await asker.dead_letters("Worker")) == 3


async def test_at_most_once_never_delivers_a_message_twice() -> None:
    config = BrokerConfig(sweep_interval=0.02, delivery_guarantee="at_most_once")
    async with LocalMesh(config) as local, local.client("sender") as client:
        await client.register("Worker")
        nacked = await client.send("Worker", {"action": "work", "n": 1})
        lapsed = await client.send("Worker", {"action": "work", "n": 2})
        kept = await client.send("Worker", {"action": "work", "n": 3})
        seen = []
        async with client.subscribe("Worker", lease_seconds=0.1) as sub:
            async for received in sub:
                seen.append((received.message.content["n"], received.attempt))
                if received.message.message_id == nacked.message_id:
                    await received.nack()  # not handed back: there is no second delivery
                elif received.message.message_id == kept.message_id:
                    await received.ack()
                    break  # (the second one is never acked: its lease lapses)
        async with asyncio.timeout(5):
            while len(await client.dead_letters("Worker")) < 2:  # noqa: ASYNC110 - broker state
                await asyncio.sleep(0.02)
        assert seen == [(1, 1), (2, 1), (3, 1)]
        dead = {d.message.message_id: d for d in await client.dead_letters("Worker")}
        assert set(dead) == {nacked.message_id, lapsed.message_id}
        assert all(d.attempts == 1 for d in dead.values())
        assert await client.receive("Worker") == []
        assert (await client.queue_stats("Worker")).totals["redelivered_count"] == 0


async def test_a_fifo_broker_delivers_in_arrival_order_whatever_the_priority() -> None:
    async with LocalMesh(BrokerConfig(queue_type="fifo")) as local, local.client("s") as client:
        await client.register("Worker")
        for n, priority in enumerate((Priority.LOW, Priority.HIGH, Priority.MEDIUM, Priority.HIGH)):
            await client.send("Worker", {"action": "work", "n": n}, priority=priority)
        assert [m.content["n"] for m in await client.receive("Worker")] == [0, 1, 2, 3]
        [queue] = (await client.queue_stats("Worker")).agents
        assert queue.depth == 0


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        (
            "queue_type",
            "topic",
            "queue_type must be priority_queue or fifo (for a topic, broadcast to agent types)",
        ),
        ("queue_type", "lifo", "queue_type must be priority_queue or fifo"),
        (
            "delivery_guarantee",
            "exactly_once",
            "delivery_guarantee must be at_least_once or "
            "at_most_once (exactly once is at_least_once with idempotent handlers: a re-sent "
            "message id is accepted once, and a redelivery says its attempt)",
        ),
    ],
)
def test_queue_types_and_guarantees_the_broker_does_not_offer_are_refused(
    field: str, value: str, error: str
) -> None:
    with pytest.raises(ValueError) as refused:
        BrokerConfig(**{field: value})
    assert str(refused.value) == error
    assert BrokerConfig(delivery_guarantee="at_most_once").delivery_attempts == 1
    assert BrokerConfig(max_delivery_attempts=6).delivery_attempts == 6


async def test_closed_subscription_returns_unacked_messages_to_the_next_instance(
    mesh: LocalMesh,
) -> None:
    async with mesh.client("sender") as client:
        await client.register("Worker")
        sent = [await client.send("Worker", {"action": "work", "i": i}) for i in range(3)]
        first = client.subscribe("Worker")
        got = []
        async for received in first:
            got.append(received.message.message_id)
            if len(got) == 3:
                break
        await first.close()  # died holding three leased messages
        again = []
        async with client.subscribe("Worker") as second:
            async for received in second:
                again.append((received.message.message_id, received.attempt))
                await received.ack()
                if len(again) == 3:
                    break
        assert again == [(m.message_id, 2) for m in sent]


async def test_a_consumer_taking_one_message_per_subscription_uses_no_attempt_of_the_rest(
    mesh: LocalMesh,
) -> None:
    """A subscription is sent up to max_in_flight deliveries at once; those its application
    never took go back uncounted when it closes, so none runs out of attempts unseen."""
    async with mesh.client("sender") as client:
        await client.register("Worker")
        for i in range(6):
            await client.send("Worker", {"action": "work", "i": i})
        taken = []
        for _ in range(6):
            async with asyncio.timeout(5), client.subscribe("Worker", max_in_flight=64) as sub:
                async for received in sub:
                    taken.append((received.message.content["i"], received.attempt))
                    await received.ack()
                    break
        assert taken == [(i, 1) for i in range(6)]
        assert await client.dead_letters("Worker") == []
        assert (await client.queue_stats("Worker")).agents[0].depth == 0


async def test_max_in_flight_bounds_unacked_deliveries(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as client:
        await client.register("Worker")
        for i in range(5):
            await client.send("Worker", {"action": "work", "i": i})
        async with client.subscribe("Worker", max_in_flight=2) as sub:
            iterator = sub.__aiter__()
            first = await iterator.__anext__()
            await iterator.__anext__()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await iterator.__anext__()
            await first.ack()
            third = await iterator.__anext__()
            assert third.message.content["i"] == 2


async def test_unary_subscribe_streams_deliveries_for_plain_grpc_clients(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as client, grpc.aio.insecure_channel(mesh.address) as channel:
        await client.register("Worker")
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        call = stub.Subscribe(
            broker_pb2.SubscribeRequest(agent_id="Worker", lease=duration_pb2.Duration(seconds=30))
        )
        sent = await client.send("Worker", {"action": "work"})
        first = await call.read()
        assert first.delivery.message.message_id == sent.message_id
        assert first.delivery.delivery_attempt == 1
        ack = await stub.Ack(
            broker_pb2.AckRequest(agent_id="Worker", message_ids=[sent.message_id])
        )
        assert ack.acknowledged == 1
        call.cancel()


async def test_unknown_agent_is_not_found(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as client:
        with pytest.raises(AgentNotFoundError, match="agent Ghost is not registered"):
            await client.send("Ghost", {"action": "x"})
        with pytest.raises(AgentNotFoundError):
            await client.request("Ghost", {"action": "x"}, timeout=1)


async def test_receiving_for_an_agent_that_is_not_registered_is_not_found(
    mesh: LocalMesh,
) -> None:
    """A misspelt agent id is NOT_FOUND, not an empty queue, through the SDK, the unary RPC
    and a session's ``receive`` frame (the session going on); a registered agent's empty
    queue is an empty list; a deregistered agent is NOT_FOUND once its queue is empty."""
    async with mesh.client("Desk") as client:
        await client.register("Worker")
        assert await client.receive("Worker") == []
        with pytest.raises(AgentNotFoundError, match="agent Wroker is not registered"):
            await client.receive("Wroker")
        sent = await client.send("Worker", {"action": "pay"})
        async with grpc.aio.insecure_channel(mesh.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="Wroker"))
            assert unary.value.code() is grpc.StatusCode.NOT_FOUND
            assert unary.value.details() == "agent Wroker is not registered"
            session = stub.Connect()
            ask = broker_pb2.ConnectRequest(seq=1)
            ask.receive.agent_id = "Wroker"
            await session.write(ask)
            refused = await session.read()
            assert (refused.seq, refused.WhichOneof("frame")) == (1, "error")
            assert refused.error.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert refused.error.reason == "AGENT_NOT_FOUND"
            ask = broker_pb2.ConnectRequest(seq=2)
            ask.receive.agent_id = "Worker"
            await session.write(ask)
            taken = await session.read()
            assert (taken.seq, taken.WhichOneof("frame")) == (2, "received")
            assert [m.message_id for m in taken.received.messages] == [sent.message_id]
            await session.done_writing()
        await client.deregister("Worker")
        with pytest.raises(AgentNotFoundError):
            await client.receive("Worker")


async def test_oversize_message_gets_a_clear_error_and_nothing_is_enqueued() -> None:
    limit = BrokerConfig(max_message_bytes=64 * 1024)
    async with LocalMesh(limit) as local, local.client("sender") as client:
        await client.register("Worker")
        with pytest.raises(MessageTooLargeError, match="the limit is 65536 bytes") as info:
            await client.send("Worker", {"action": "x", "blob": "y" * 70_000})
        assert info.value.code == "INVALID_ARGUMENT"
        assert await client.receive("Worker") == []


async def test_validation_errors_carry_field_violations_in_the_grpc_status(mesh: LocalMesh) -> None:
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SendMessage(
                broker_pb2.SendMessageRequest(message=message_pb2.Message(to_agent="PaymentAgent"))
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "from_agent is required; content is required"
        status = rpc_status.from_call(info.value)
        bad = error_details_pb2.BadRequest()
        assert any(d.Unpack(bad) for d in status.details if d.Is(bad.DESCRIPTOR))
        assert [v.field for v in bad.field_violations] == ["from_agent", "content"]


async def test_a_scheduled_message_is_delivered_when_due_and_not_before(
    mesh: LocalMesh,
) -> None:
    """``deliver_at`` (the SDK's ``delay``): the broker holds the message (ListMessages says
    DEFERRED, until when) and delivers it to a subscriber once due, after a message sent
    later. Over plain gRPC a deliver_at past the broker's max_ttl, after the message's ttl
    ends, after a request's deadline, or on a RESPONSE is INVALID_ARGUMENT, and nothing is
    queued."""
    async with mesh.client("Desk") as client:
        await client.register("Worker")
        later = await client.send("Worker", {"action": "remind"}, delay=0.6)
        sent = time.monotonic()
        await client.send("Worker", {"action": "pay"})
        listed = await client.list_messages("Worker")
        assert [(q.message.content["action"], q.state.value, q.attempts) for q in listed] == [
            ("pay", "WAITING", 0),
            ("remind", "DEFERRED", 0),
        ]
        assert later.deliver_at is not None and listed[1].until is not None
        assert abs((listed[1].until - later.deliver_at).total_seconds()) < 0.01
        [queue] = (await client.queue_stats("Worker")).agents
        assert (queue.depth, queue.in_flight, queue.deferred) == (1, 0, 1)
        got = []
        async with client.subscribe("Worker") as sub:
            async for delivery in sub:
                got.append((delivery.message.content["action"], delivery.attempt))
                await delivery.ack()
                if len(got) == 2:
                    due = time.monotonic() - sent
                    assert delivery.message.deliver_at == later.deliver_at  # (it travels)
                    break
        assert got == [("pay", 1), ("remind", 1)]
        assert due >= 0.5  # (not before its time)

        async with grpc.aio.insecure_channel(mesh.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)

            def scheduled(ahead: float, **fields: Any) -> message_pb2.Message:
                message = message_pb2.Message(from_agent="Desk", to_agent="Worker", **fields)
                message.content.update({"action": "remind"})
                message.deliver_at.FromSeconds(int(time.time() + ahead))
                return message

            refusals = [
                stub.SendMessage(broker_pb2.SendMessageRequest(message=scheduled(2 * 86400))),
                stub.SendMessage(broker_pb2.SendMessageRequest(message=scheduled(30, ttl=10))),
                stub.SendMessage(
                    broker_pb2.SendMessageRequest(
                        message=scheduled(
                            30, message_type=message_pb2.MESSAGE_TYPE_RESPONSE, correlation_id="x"
                        )
                    )
                ),
                stub.SendRequest(broker_pb2.SendRequestRequest(message=scheduled(30)), timeout=2),
            ]
            details = []
            for call in refusals:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                details.append(refused.value.details())
            assert details == [
                "deliver_at must be at most 86400 seconds ahead",
                "deliver_at must come before the message's ttl of 10 s ends"
                " (10.0 s from now, counted from its timestamp)",
                "deliver_at is not for a RESPONSE: it goes at once",
                details[3],
            ]
            assert details[3].startswith("deliver_at must come before the deadline of the REQUEST")
        # Nothing queued: only the ERROR that tells Worker the answer it waits for was refused.
        left = await client.list_messages("Worker")
        assert [q.message.message_type for q in left] == [MessageType.ERROR]


async def test_a_sender_takes_back_what_it_sent_before_it_is_delivered(
    mesh: LocalMesh,
) -> None:
    """``CancelMessages`` (the SDK's ``cancel_messages``): a sender's messages still waiting,
    or scheduled, leave the queue; one in flight, another sender's, or one unknown stays.
    No message ids, or no sender, is INVALID_ARGUMENT."""
    async with mesh.client("Desk") as client, mesh.client("Audit") as other:
        await client.register("Worker")
        reminder = await client.send("Worker", {"action": "remind"}, delay=60)
        pay = await client.send("Worker", {"action": "pay"})
        audit = await other.send("Worker", {"action": "audit"})
        refund = await client.send("Worker", {"action": "refund"})
        async with client.subscribe("Worker", max_in_flight=1) as sub:
            held = await anext(aiter(sub))
            assert held.message.message_id == pay.message_id
            taken = await client.cancel_messages(
                "Worker", [reminder, pay, audit.message_id, refund, "nope"]
            )
            assert taken == [reminder.message_id, refund.message_id]
            listed = await client.list_messages("Worker")
            assert [(q.message.content["action"], q.state.value) for q in listed] == [
                ("audit", "WAITING"),
                ("pay", "IN_FLIGHT"),
            ]
            await held.ack()
        with pytest.raises(MessageValidationError, match="a list of message ids or messages"):
            await client.cancel_messages("Worker", audit.message_id)  # type: ignore[arg-type]
        async with grpc.aio.insecure_channel(mesh.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            for request, said in (
                (
                    broker_pb2.CancelMessagesRequest(from_agent="Desk", to_agent="Worker"),
                    "message_ids must name at least one message",
                ),
                (
                    broker_pb2.CancelMessagesRequest(to_agent="Worker", message_ids=["x"]),
                    "from_agent is required",
                ),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.CancelMessages(request)
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert refused.value.details() == said
            answer = await stub.CancelMessages(
                broker_pb2.CancelMessagesRequest(
                    from_agent="Audit", to_agent="Worker", message_ids=[audit.message_id]
                )
            )
            assert (answer.cancelled, list(answer.message_ids)) == (1, [audit.message_id])
        assert await client.list_messages("Worker") == []


async def test_batch_results_are_per_message(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as client:
        await client.register("Worker")
        good = client.build("Worker", {"action": "x"})
        bad = client.build("Worker", None)
        ghost = client.build("Ghost", {"action": "x"})
        results = await client.send_batch([good, bad, ghost])
        assert results[0] == good
        assert results[1].code == "INVALID_ARGUMENT"
        assert results[2].code == "NOT_FOUND"
        assert [m.message_id for m in await client.receive("Worker")] == [good.message_id]


async def test_the_sdk_takes_names_in_any_case_and_names_what_it_cannot_take(
    mesh: LocalMesh,
) -> None:
    """A type or priority by name in any case ("high", as often written) is taken; an
    unknown one, or a ttl that is not a whole number of seconds the wire can carry, raises
    MessageValidationError naming the field (not protobuf's TypeError or ValueError), and
    nothing is sent."""

    async with mesh.client("sender") as client:
        await client.register("Worker")
        await client.send("Worker", {"action": "x"}, priority="high", message_type="request")
        wrong: list[tuple[dict[str, Any], str]] = [
            ({"priority": "URGENT"}, "priority"),
            ({"message_type": "PING"}, "message_type"),
            ({"ttl": 1.5}, "ttl"),
            ({"ttl": "60"}, "ttl"),
            ({"ttl": True}, "ttl"),
            ({"ttl": 2**40}, "ttl"),
        ]
        for options, field in wrong:
            with pytest.raises(MessageValidationError) as info:
                await client.send("Worker", {"action": "y"}, **options)
            assert [v.field for v in info.value.field_violations] == [field], options
        [taken] = await client.receive("Worker")
        assert (taken.priority, taken.message_type) == (Priority.HIGH, MessageType.REQUEST)


async def test_agent_handler_error_answers_with_error_message(mesh: LocalMesh) -> None:
    from mesh import AgentError

    class Failing(Agent):
        agent_id = "PaymentAgent"

        async def handle(self, message: Message, ctx: AgentContext) -> dict:
            raise ValueError("Payment failed")

    await mesh.add_agent(Failing())
    async with mesh.client("caller") as client:
        with pytest.raises(AgentError, match="Payment failed"):
            await client.request("PaymentAgent", {"action": "pay"})


async def test_broadcast_via_to_agent_broadcast(mesh: LocalMesh) -> None:
    async with mesh.client("Orchestrator") as client:
        for name in ("A", "B"):
            await client.register(name)
        sent = await client.send("broadcast", {"alert": "hi"}, message_type=MessageType.BROADCAST)
        for name in ("A", "B"):
            [got] = await client.receive(name)
            assert got.message_id == sent.message_id and got.to_agent == name
        # Sent to "broadcast", a message is a BROADCAST unless it says otherwise (an alert
        # has no action); an empty list of types is the caller's mistake.
        plain = await client.send("broadcast", {"alert": "maintenance at noon"})
        for name in ("A", "B"):
            [got] = await client.receive(name)
            assert (got.message_id, got.message_type) == (plain.message_id, MessageType.BROADCAST)
        with pytest.raises(MessageValidationError, match="at least one agent type"):
            await client.broadcast_to_types([], {"alert": "x"})


async def test_gather_streams_answers_and_names_the_silent(mesh: LocalMesh) -> None:
    for name, delay in (("Fast", 0.0), ("Slow", 0.05)):

        def make(name: str, delay: float) -> Agent:
            async def handler(message: Message, ctx: AgentContext) -> dict:
                await asyncio.sleep(delay)
                return {"from": name, "query": message.content["query"]}

            return agent(name, agent_types=["expert"])(handler)

        await mesh.add_agent(make(name, delay))
    async with mesh.client("user") as user:
        await user.register("Silent", agent_types=["expert"])
        seen = []
        async for item in user.gather({"query": "q?"}, agent_types=["expert"], timeout=0.5):
            seen.append(item)
        assert [i.agent_id for i in seen] == ["Fast", "Slow", "Silent"]
        assert seen[0].response.message_type is MessageType.RESPONSE
        assert seen[0].response.content == {"action": "response", "from": "Fast", "query": "q?"}
        assert isinstance(seen[2].error, RequestTimeoutError)
        # Every copy was a BROADCAST with the same id, answered under that id.
        assert seen[0].response.correlation_id == seen[1].response.correlation_id
        assert mesh.broker is not None and mesh.broker.pending_requests == 0
        # A gather's time (here its 0.5 s deadline) is its own figure, not a roundtrip's.
        totals = (await user.queue_stats()).totals
        assert totals["roundtrip_latency_p99_ms"] == 0
        registry = mesh.broker.metrics.registry
        assert registry.get_sample_value("agentmesh_gather_latency_seconds_count") == 1
        assert registry.get_sample_value("agentmesh_gather_latency_seconds_sum") >= 0.5
        assert registry.get_sample_value("agentmesh_roundtrip_latency_seconds_count") == 0
        assert registry.get_sample_value("agentmesh_requests_total", {"outcome": "gather"}) == 1


async def _connect_subscribed(
    stub: broker_pb2_grpc.BrokerServiceStub, agent_id: str, **subscribe: int
) -> grpc.aio.StreamStreamCall:
    call = stub.Connect()
    request = broker_pb2.ConnectRequest(seq=1)
    request.subscribe.agent_id = agent_id
    for name, value in subscribe.items():
        setattr(request.subscribe, name, value)
    await call.write(request)
    accepted = await call.read()
    assert accepted.seq == 1 and accepted.WhichOneof("frame") == "accepted"
    return call


async def test_a_session_that_asks_for_batches_gets_what_is_ready_in_one_frame(
    mesh: LocalMesh,
) -> None:
    async with mesh.client("sender") as client, grpc.aio.insecure_channel(mesh.address) as channel:
        await client.register("Worker")
        sent = [await client.send("Worker", {"action": "work", "i": i}) for i in range(5)]
        urgent = await client.send("Worker", {"action": "urgent"}, priority="HIGH")
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        # Five of the six fit the subscriber's max_in_flight: one frame, in queue order.
        call = await _connect_subscribed(stub, "Worker", max_in_flight=5, max_batch=64)
        frame = await call.read()
        assert frame.WhichOneof("frame") == "deliveries"
        got = [d.message.message_id for d in frame.deliveries.deliveries]
        assert got == [urgent.message_id] + [m.message_id for m in sent[:4]]
        assert all(d.delivery_attempt == 1 for d in frame.deliveries.deliveries)
        # Acking one frees one place: the last message comes alone, as a plain delivery.
        ack = broker_pb2.ConnectRequest()
        ack.ack.agent_id = "Worker"
        ack.ack.message_ids.append(urgent.message_id)
        await call.write(ack)
        frame = await call.read()
        assert frame.WhichOneof("frame") == "delivery"
        assert frame.delivery.message.message_id == sent[4].message_id
        call.cancel()


async def test_a_session_that_does_not_ask_for_batches_gets_one_delivery_per_frame(
    mesh: LocalMesh,
) -> None:
    async with mesh.client("sender") as client, grpc.aio.insecure_channel(mesh.address) as channel:
        await client.register("Worker")
        sent = [await client.send("Worker", {"action": "work", "i": i}) for i in range(3)]
        call = await _connect_subscribed(broker_pb2_grpc.BrokerServiceStub(channel), "Worker")
        frames = [await call.read() for _ in range(3)]
        assert [f.WhichOneof("frame") for f in frames] == ["delivery"] * 3
        assert [f.delivery.message.message_id for f in frames] == [m.message_id for m in sent]
        call.cancel()


async def test_a_subscriber_of_one_message_a_frame_costs_the_store_one_look_a_message() -> None:
    """Subscribe, and a session that does not ask for batches, still get one delivery a
    frame, in queue order; but what is ready is leased at once, so the store is asked once
    for the lot, and once for each message that comes alone, never again for nothing."""
    store = CountingStore()
    async with (
        LocalMesh(broker=Broker(BrokerConfig(), store=store)) as mesh,
        mesh.client("sender") as client,
        grpc.aio.insecure_channel(mesh.address) as channel,
    ):
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await client.register("Worker")
        ready = [
            await client.send("Worker", {"action": "work"}, priority=priority)
            for priority in ("LOW", "MEDIUM", "HIGH")
        ]
        session = await _connect_subscribed(stub, "Worker")
        frames = [await session.read() for _ in ready]
        assert [f.WhichOneof("frame") for f in frames] == ["delivery"] * 3
        got = [f.delivery.message.message_id for f in frames]
        assert got == [m.message_id for m in reversed(ready)]  # HIGH, MEDIUM, LOW
        await asyncio.sleep(0.05)
        assert store.leases == 1
        session.cancel()

        await client.register("Plain")
        unary = stub.Subscribe(broker_pb2.SubscribeRequest(agent_id="Plain"))
        for i in range(6):
            sent = await client.send("Plain", {"action": "work", "i": i})
            delivered = await unary.read()
            assert delivered.delivery.message.message_id == sent.message_id
            await stub.Ack(broker_pb2.AckRequest(agent_id="Plain", message_ids=[sent.message_id]))
            if i == 0:
                await asyncio.sleep(0.05)  # (the subscription's first look found nothing)
                before = store.leases
        await asyncio.sleep(0.05)
        assert store.leases - before == 5
        unary.cancel()


async def test_batches_are_split_before_they_grow_past_a_mebibyte(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as client, grpc.aio.insecure_channel(mesh.address) as channel:
        await client.register("Worker")
        blob = "x" * 300_000
        sent = [await client.send("Worker", {"action": "work", "blob": blob}) for _ in range(7)]
        call = await _connect_subscribed(
            broker_pb2_grpc.BrokerServiceStub(channel), "Worker", max_in_flight=64, max_batch=64
        )
        got: list[str] = []
        sizes = []
        while len(got) < len(sent):
            frame = await call.read()
            sizes.append(frame.ByteSize())
            batch = (
                frame.deliveries.deliveries
                if frame.WhichOneof("frame") == "deliveries"
                else [frame.delivery]
            )
            got.extend(d.message.message_id for d in batch)
        assert got == [m.message_id for m in sent]
        assert len(sizes) >= 3 and all(size <= 1024 * 1024 + 1024 for size in sizes)
        call.cancel()


async def test_acks_sent_together_release_every_message_and_closing_sends_the_last_ones(
    mesh: LocalMesh,
) -> None:
    async with mesh.client("sender") as client, mesh.client("Worker") as worker:
        await client.register("Worker")
        batch = await client.send_batch(
            [client.build("Worker", {"action": "w"}) for _ in range(50)]
        )
        sub = worker.subscribe("Worker", max_in_flight=64)
        received = []
        async for delivery in sub:
            received.append(delivery.message.message_id)
            await delivery.ack()
            if len(received) == 50:
                break
        await sub.close()  # the acks still queued go out before the session ends
        assert received == [m.message_id for m in batch]
        [queue] = (await client.queue_stats("Worker")).agents
        assert (queue.depth, queue.in_flight) == (0, 0)
        assert await client.receive("Worker") == []  # nothing came back for redelivery


async def test_acks_of_a_steady_trickle_wait_for_company_and_closing_sends_them_at_once(
    mesh: LocalMesh,
) -> None:
    async with mesh.client("sender") as client, mesh.client("Worker", ack_linger=30) as worker:
        await client.register("Worker")
        sub = worker.subscribe("Worker", max_in_flight=64)
        acked = []
        for i in range(5):  # one at a time: each is acked before the next is sent
            await client.send("Worker", {"action": "w", "i": i})
            delivery = await sub.__anext__()
            await delivery.ack()
            acked.append(delivery.message.content["i"])
        assert acked == [0, 1, 2, 3, 4]
        # The first ack went at once (nothing came before it); the next four linger together.
        [queue] = (await client.queue_stats("Worker")).agents
        assert (queue.depth, queue.in_flight) == (0, 4)
        assert worker.stats.settle_frames == 1
        async with asyncio.timeout(5):
            await sub.close()  # no lingering: the four go in one frame before it ends
        assert worker.stats.settle_frames == 2
        [queue] = (await client.queue_stats("Worker")).agents
        assert (queue.depth, queue.in_flight) == (0, 0)
        assert await client.receive("Worker") == []  # nothing came back for redelivery


async def test_a_clients_next_call_writes_the_acks_it_holds_back_first(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as client, mesh.client("Worker", ack_linger=30) as worker:
        await client.register("Worker")
        async with worker.subscribe("Worker", max_in_flight=64) as sub:
            for i in range(3):
                await client.send("Worker", {"action": "w", "i": i})
                await (await sub.__anext__()).ack()
            assert worker.stats.settle_frames == 1  # the first; the other two linger
            await worker.queue_stats("Worker")  # what the worker asks next sees its acks
            assert worker.stats.settle_frames == 2
            async with asyncio.timeout(5):
                while (await client.queue_stats("Worker")).agents[0].in_flight:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)  # (their frame and the call are two streams)
            # A receive (it travels on the session, not as a call of its own) does the same.
            for i in range(3, 5):
                await client.send("Worker", {"action": "w", "i": i})
                await (await sub.__anext__()).ack()
            assert worker.stats.settle_frames == 2  # both linger (a steady flow)
            assert await worker.receive("Worker") == []
            assert worker.stats.settle_frames == 3


async def test_acks_go_at_once_when_half_the_window_is_outstanding(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as client, mesh.client("Worker", ack_linger=30) as worker:
        await client.register("Worker")
        await client.send_batch([client.build("Worker", {"action": "w", "i": i}) for i in range(6)])
        got = []
        async with asyncio.timeout(10):  # a lingering ack would hold the window for 30 s
            async with worker.subscribe("Worker", max_in_flight=2) as sub:
                async for delivery in sub:
                    got.append(delivery.message.content["i"])
                    await delivery.ack()
                    if len(got) == 6:
                        break
        assert got == [0, 1, 2, 3, 4, 5]
        [queue] = (await client.queue_stats("Worker")).agents
        assert (queue.depth, queue.in_flight) == (0, 0)


async def test_frames_sent_in_a_batch_are_handled_one_by_one_and_a_nested_batch_is_refused(
    mesh: LocalMesh,
) -> None:
    async with mesh.client("sender") as client, grpc.aio.insecure_channel(mesh.address) as channel:
        await client.register("Worker")
        call = broker_pb2_grpc.BrokerServiceStub(channel).Connect()
        frame = broker_pb2.ConnectRequest()
        for seq in (1, 2):
            inner = frame.batch.frames.add(seq=seq)
            inner.send.from_agent = "sender"
            inner.send.to_agent = "Worker"
            inner.send.content.update({"action": "work", "n": seq})
        frame.batch.frames.add(seq=3).batch.frames.add(seq=4)
        await call.write(frame)
        answers = [await call.read() for _ in range(3)]
        assert [(a.seq, a.WhichOneof("frame")) for a in answers] == [
            (1, "accepted"),
            (2, "accepted"),
            (3, "error"),
        ]
        assert answers[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert answers[2].error.message == "a batch cannot hold a batch"
        queued = await client.receive("Worker")
        assert [m.content["n"] for m in queued] == [1, 2]
        call.cancel()


async def test_a_session_that_takes_batches_gets_answers_together_under_load(
    mesh: LocalMesh,
) -> None:
    @agent("EchoAgent")
    async def echo(message: Message, ctx: AgentContext) -> dict:
        return {"n": message.parameters["n"]}

    await mesh.add_agent(echo, max_in_flight=64)
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        call = broker_pb2_grpc.BrokerServiceStub(channel).Connect(
            metadata=(("agentmesh-batch", "1"),)
        )
        frame = broker_pb2.ConnectRequest()
        for seq in range(1, 101):
            request = frame.batch.frames.add(seq=seq).request
            request.message.from_agent = "caller"
            request.message.to_agent = "EchoAgent"
            request.message.message_id = f"req-{seq}"
            request.message.message_type = message_pb2.MessageType.MESSAGE_TYPE_REQUEST
            request.message.content.update({"action": "echo", "parameters": {"n": seq}})
        await call.write(frame)
        frames, reads = await _read_answers(call, 100)
        for one in frames:
            assert one.WhichOneof("frame") == "response"
            assert one.response.correlation_id == f"req-{one.seq}"
        answered = {one.seq: int(one.response.content["n"]) for one in frames}
        assert answered == {seq: seq for seq in range(1, 101)}
        assert reads < 100  # some answers shared a frame
        call.cancel()


async def test_the_answers_to_a_batch_of_sends_come_back_in_order_sharing_frames(
    mesh: LocalMesh,
) -> None:
    async with mesh.client("sender") as client, grpc.aio.insecure_channel(mesh.address) as channel:
        await client.register("Worker")
        call = broker_pb2_grpc.BrokerServiceStub(channel).Connect(
            metadata=(("agentmesh-batch", "1"),)
        )
        frame = broker_pb2.ConnectRequest()
        for seq in range(1, 51):
            send = frame.batch.frames.add(seq=seq).send
            send.from_agent = "sender"
            send.to_agent = "Worker" if seq != 25 else "Nobody"
            send.content.update({"action": "work", "n": seq})
        await call.write(frame)
        frames, reads = await _read_answers(call, 50)
        answers = [(one.seq, one.WhichOneof("frame")) for one in frames]
        assert answers == [(seq, "error" if seq == 25 else "accepted") for seq in range(1, 51)]
        assert reads < 50  # answers shared frames
        queued = await client.receive("Worker", max_messages=100)
        assert [m.content["n"] for m in queued] == [n for n in range(1, 51) if n != 25]
        call.cancel()


async def _read_answers(call: Any, count: int) -> tuple[list[broker_pb2.ConnectResponse], int]:
    """The first ``count`` answer frames of a Connect stream, unpacking `batch` frames, and how
    many frames they came in."""
    answers: list[broker_pb2.ConnectResponse] = []
    reads = 0
    while len(answers) < count:
        got = await asyncio.wait_for(call.read(), 10)
        reads += 1
        answers += got.batch.frames if got.WhichOneof("frame") == "batch" else [got]
    return answers, reads


class Payments(Agent):
    """Handles payments, and nothing else."""

    agent_id = "PaymentAgent"

    @on("process_payment")
    async def pay(self, message: Message, ctx: AgentContext) -> dict:
        return {"status": "PAID"}


async def test_a_message_no_handler_takes_is_not_tried_again(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """A hand-off (or any one-way message) for an action the agent has no handler for goes
    to the dead-letter queue at its first delivery, with the reason; a request for one is
    answered with an ERROR of reason UNHANDLED_ACTION; a broadcast it does not handle is
    left aside. Each is logged once, without a traceback."""
    await mesh.add_agent(Payments())
    async with mesh.client("SellerAgent") as client:
        handoff = await client.handoff("PaymentAgent", "Refund $50", workflow_id="wf_1")
        with pytest.raises(AgentError, match="does not handle action 'refund'") as info:
            await client.request("PaymentAgent", {"action": "refund"}, timeout=5)
        assert info.value.reason == "UNHANDLED_ACTION"
        await client.broadcast({"alert": "System maintenance in 10 minutes"})
        paid = await client.request("PaymentAgent", {"action": "process_payment"}, timeout=5)
        assert paid.content["status"] == "PAID"  # and it goes on serving

        async with asyncio.timeout(5):
            while not await client.dead_letters("PaymentAgent"):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            while (await client.queue_stats("PaymentAgent")).totals["held"]:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        [dead] = await client.dead_letters("PaymentAgent")
        assert dead.message.message_id == handoff.message_id
        assert dead.reason == "PaymentAgent does not handle action 'execute_handoff'"
        assert dead.attempts == 1
        stats = await client.queue_stats("PaymentAgent")
        assert stats.totals["redelivered_count"] == 0
    assert not [r for r in caplog.records if r.exc_info]
    warnings = [r.getMessage() for r in caplog.records if r.name == "mesh.agent"]
    assert any("execute_handoff" in w and "dead-letter queue" in w for w in warnings)
    assert any("'refund'" in w and "answered REQUEST" in w for w in warnings)
    assert not any("maintenance" in w or "BROADCAST" in w for w in warnings)


async def test_a_nack_with_a_delay_frees_the_place_in_flight_until_the_message_comes_back(
    mesh: LocalMesh,
) -> None:
    """``redeliver_after`` on a nack (the SDK's ``nack(redeliver_after=)``, a frame on its
    session; the unary ``Nack``): the subscriber's one place in flight takes its next message
    at once, and the nacked one comes back after the delay with its attempt counted. A bad
    delay, or one beside a dead_letter_reason, is INVALID_ARGUMENT and the delivery stays
    held; the SDK refuses a negative one before anything is sent."""
    async with mesh.client("sender") as client:
        await client.register("Worker")
        first = (await client.send("Worker", {"action": "work", "i": 1})).message_id
        second = (await client.send("Worker", {"action": "work", "i": 2})).message_id
        seen = []
        async with client.subscribe("Worker", max_in_flight=1) as sub:
            async for received in sub:
                seen.append((received.message.message_id, received.attempt))
                if len(seen) == 1:
                    with pytest.raises(MessageValidationError, match="redeliver_after"):
                        await received.nack(redeliver_after=-1)
                    await received.nack(redeliver_after=0.3)
                elif len(seen) == 2:
                    await received.ack()
                else:
                    break  # (closing hands it back: attempt 2 counted)
        # A plain nack would have had the first back first, in its place ahead of the second.
        assert seen == [(first, 1), (second, 1), (first, 2)]
        async with (
            grpc.aio.insecure_channel(mesh.address) as channel,
            client.subscribe("Worker", max_in_flight=1) as again,
        ):
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            leased = await anext(again)
            assert (leased.message.message_id, leased.attempt) == (first, 3)

            def nack(seconds: float, reason: str = "") -> broker_pb2.NackRequest:
                request = broker_pb2.NackRequest(
                    agent_id="Worker", message_ids=[first], dead_letter_reason=reason
                )
                request.redeliver_after.FromNanoseconds(int(seconds * 1e9))
                return request

            for bad, said in [
                (nack(-1), "redeliver_after must be within 0..86400 seconds"),
                (nack(86401), "redeliver_after must be within 0..86400 seconds"),
                (nack(1, reason="broken"), "give one or the other"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Nack(bad)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert said in (info.value.details() or "")
            assert await client.dead_letters("Worker") == []
            # (the SDK's unary nack: its value checked before anything is sent)
            with pytest.raises(MessageValidationError, match="redeliver_after"):
                await client.nack([first], "Worker", redeliver_after=float("nan"))
            assert await client.nack([first], "Worker", redeliver_after=0.2) == (1, 0)
            assert await client.nack([first], "Worker", redeliver_after=0.2) == (0, 0)  # (held)
            deferred = "agentmesh_messages_deferred_total"
            assert mesh.broker.metrics.registry.get_sample_value(deferred) == 2
            back = await asyncio.wait_for(anext(again), 5)
            assert (back.message.message_id, back.attempt) == (first, 4)
            await back.ack()


async def test_nack_with_a_reason_dead_letters_through_every_way_in(mesh: LocalMesh) -> None:
    async with mesh.client("sender") as client:
        await client.register("Worker")
        first = await client.send("Worker", {"action": "work", "i": 1})
        second = await client.send("Worker", {"action": "work", "i": 2})
        async with client.subscribe("Worker") as sub:
            async for received in sub:
                # On the session; a reason longer than the broker takes is cut to fit.
                await received.reject("cannot read the attachment " + "x" * 2000)
                break
        async with (
            grpc.aio.insecure_channel(mesh.address) as channel,
            client.subscribe("Worker") as again,
        ):
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            leased = await anext(again)  # (the first subscription may have held it too)
            assert leased.message.message_id == second.message_id
            too_long = broker_pb2.NackRequest(
                agent_id="Worker", message_ids=[second.message_id], dead_letter_reason="x" * 1025
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Nack(too_long)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 1024 characters" in (info.value.details() or "")
            assert (await client.queue_stats("Worker")).agents[0].in_flight == 1  # still held
            reply = await stub.Nack(
                broker_pb2.NackRequest(
                    agent_id="Worker", message_ids=[second.message_id], dead_letter_reason="no"
                )
            )
            assert (reply.requeued, reply.dead_lettered) == (0, 1)
        dead = await client.dead_letters("Worker")
        cut = ("cannot read the attachment " + "x" * 2000)[:1024]
        assert [(d.message.message_id, d.reason, d.attempts) for d in dead] == [
            (first.message_id, cut, 1),
            (second.message_id, "no", leased.attempt),
        ]


async def test_dead_letters_are_listed_a_page_at_a_time(mesh: LocalMesh) -> None:
    """Ten dead letters of 800 KB (8 MB, over what one gRPC answer takes): pages of at most
    3 MiB, or of page_size, that together list every one, oldest first."""
    blob = "x" * 800_000
    async with mesh.client("sender") as client:
        await client.register("Worker")
        sent = [
            await client.send("Worker", {"action": "work", "parameters": {"blob": blob}})
            for _ in range(10)
        ]
        async with client.subscribe("Worker", max_in_flight=4) as sub:
            rejected = 0
            async for received in sub:
                await received.reject("cannot do it")
                rejected += 1
                if rejected == 10:
                    break
        expected = [m.message_id for m in sent]
        async with asyncio.timeout(10):
            while len(await client.dead_letters("Worker")) < 10:  # noqa: ASYNC110 - broker state
                await asyncio.sleep(0.05)

        async with grpc.aio.insecure_channel(mesh.address) as channel:  # gRPC's 4 MiB default
            stub = broker_pb2_grpc.BrokerServiceStub(channel)

            async def pages(page_size: int = 0) -> list[list[str]]:
                request = broker_pb2.ListDeadLettersRequest(agent_id="Worker", page_size=page_size)
                found = []
                while True:
                    page = await stub.ListDeadLetters(request)
                    found.append([d.message.message_id for d in page.dead_letters])
                    if not page.next_page_token:
                        return found
                    request.page_token = page.next_page_token

            by_size = await pages()
            assert [len(page) for page in by_size] == [3, 3, 3, 1]
            assert [mid for page in by_size for mid in page] == expected
            by_count = await pages(page_size=4)
            assert [len(page) for page in by_count] == [3, 3, 3, 1]  # (4 do not fit in 3 MiB)
            assert [len(page) for page in await pages(page_size=2)] == [2, 2, 2, 2, 2]
            for wrong in (
                broker_pb2.ListDeadLettersRequest(page_token="abc"),
                broker_pb2.ListDeadLettersRequest(page_size=-1),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ListDeadLetters(wrong)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The SDK reads every page.
        assert [d.message.message_id for d in await client.dead_letters("Worker")] == expected


async def test_a_queue_is_listed_in_delivery_order_without_taking_anything(
    mesh: LocalMesh,
) -> None:
    """``ListMessages`` (the SDK's ``list_messages``, ``agentmesh queue``): what an agent's
    queue holds, left there: what waits, in the order it will be delivered, then what is in
    flight, with its attempts and times, a page at a time. An agent that is not registered
    and has nothing is NOT_FOUND; no agent, a bad page token or size INVALID_ARGUMENT."""
    async with mesh.client("Desk") as client:
        await client.register("Worker")
        low = await client.send("Worker", {"action": "archive"}, priority=Priority.LOW)
        taken = await client.send("Worker", {"action": "pay"}, priority=Priority.HIGH)
        medium = [await client.send("Worker", {"action": f"job{i}"}) for i in range(3)]
        urgent = await client.send("Worker", {"action": "refund"}, priority=Priority.HIGH)
        async with client.subscribe("Worker", max_in_flight=1) as sub:
            held = await anext(aiter(sub))  # (kept unacked while the queue is listed)
            assert held.message.message_id == taken.message_id
            expected = [urgent, *medium, low, taken]
            listed = await client.list_messages("Worker")
            assert [q.message.message_id for q in listed] == [m.message_id for m in expected]
            assert [(q.message.content["action"], q.state.value, q.attempts) for q in listed] == [
                ("refund", "WAITING", 0),
                ("job0", "WAITING", 0),
                ("job1", "WAITING", 0),
                ("job2", "WAITING", 0),
                ("archive", "WAITING", 0),
                ("pay", "IN_FLIGHT", 1),
            ]
            for q in listed:
                assert round((q.expires_at - q.accepted_at).total_seconds()) == 3600
            assert [q.until is None for q in listed] == [True] * 5 + [False]
            until = listed[-1].until
            assert until is not None  # (in flight: when its lease ends, as its delivery said)
            assert abs((until - held.lease_expires_at).total_seconds()) < 0.01
            async with grpc.aio.insecure_channel(mesh.address) as channel:
                stub = broker_pb2_grpc.BrokerServiceStub(channel)
                request = broker_pb2.ListMessagesRequest(agent_id="Worker", page_size=2)
                pages = []
                while True:
                    page = await stub.ListMessages(request)
                    pages.append([q.message.message_id for q in page.messages])
                    if not page.next_page_token:
                        break
                    request.page_token = page.next_page_token
                assert [len(p) for p in pages] == [2, 2, 2]
                assert [mid for p in pages for mid in p] == [m.message_id for m in expected]
                for wrong, code in (
                    (broker_pb2.ListMessagesRequest(agent_id="Nobody"), "NOT_FOUND"),
                    (broker_pb2.ListMessagesRequest(), "INVALID_ARGUMENT"),
                    (
                        broker_pb2.ListMessagesRequest(agent_id="Worker", page_token="x"),
                        "INVALID_ARGUMENT",
                    ),
                    (
                        broker_pb2.ListMessagesRequest(agent_id="Worker", page_size=-1),
                        "INVALID_ARGUMENT",
                    ),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.ListMessages(wrong)
                    assert info.value.code().name == code
            await held.nack(redeliver_after=3600)
            async with asyncio.timeout(5):
                while (await client.list_messages("Worker"))[-1].state.value != "DEFERRED":  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
        # Deferred for an hour, it is listed last; nothing was taken.
        listed = await client.list_messages("Worker")
        assert [(q.message.message_id, q.state.value) for q in listed][-2:] == [
            (low.message_id, "WAITING"),
            (taken.message_id, "DEFERRED"),
        ]
        assert round((listed[-1].until - listed[-1].accepted_at).total_seconds() / 60) == 60
        assert (await client.queue_stats("Worker")).agents[0].depth == 5
        assert [m.message_id for m in await client.receive("Worker")] == [
            q.message.message_id for q in listed[:5]
        ]
        assert [q.state.value for q in await client.list_messages("Worker")] == ["DEFERRED"]


class Slow(Agent):
    """Takes ``seconds`` over each message, counting the runs of each."""

    agent_id = "SlowAgent"

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.runs: dict[str, int] = {}

    @on("work")
    async def work(self, message: Message, ctx: AgentContext) -> dict[str, int]:
        self.runs[message.message_id] = self.runs.get(message.message_id, 0) + 1
        await asyncio.sleep(self.seconds)
        return {"runs": self.runs[message.message_id]}


async def test_a_handler_slower_than_its_lease_runs_once(mesh: LocalMesh) -> None:
    """The runtime extends the lease of a delivery while its handler works on it: a handler
    taking three leases is not run again meanwhile, answers once, and nothing is
    redelivered or dead-lettered."""
    slow = Slow(3.0)
    await mesh.add_agent(slow, lease_seconds=1.0)
    async with mesh.client("boss") as client:
        await client.register("boss")
        sent = await client.send("SlowAgent", {"action": "work"})  # its answer is queued
        answer = await client.request("SlowAgent", {"action": "work"}, timeout=10)
        assert answer.content["runs"] == 1
        await asyncio.sleep(0.5)  # the first, started with the request, is done too
        assert slow.runs == {sent.message_id: 1, answer.correlation_id: 1}
        [queued] = await client.receive("boss")
        assert (queued.correlation_id, queued.content["runs"]) == (sent.message_id, 1)
        stats = await client.queue_stats()
        assert stats.totals["redelivered_count"] == 0
        assert await client.dead_letters("SlowAgent") == []


async def test_a_lease_is_extended_no_longer_than_the_runtime_allows(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """Past ``max_lease_extension`` the broker delivers the message again (a handler stuck
    for good must not hold it forever), and the runtime says so."""
    slow = Slow(3.0)
    await mesh.add_agent(slow, lease_seconds=0.6, max_lease_extension=1.0)
    async with mesh.client("boss") as client:
        await client.register("boss")
        sent = await client.send("SlowAgent", {"action": "work"})
        async with asyncio.timeout(10):
            while slow.runs.get(sent.message_id, 0) < 2:  # noqa: ASYNC110 - a handler's count
                await asyncio.sleep(0.05)
        assert any("is no longer extended" in r.getMessage() for r in caplog.records)


async def test_extend_lease_over_plain_grpc_keeps_a_delivery_from_coming_again(
    mesh: LocalMesh,
) -> None:
    """`ExtendLease` (a unary call, or a frame on a session): the delivery is not redelivered
    at its first lease's end; a bad lease is INVALID_ARGUMENT; what is not leased counts 0."""
    async with mesh.client("sender") as client:
        await client.register("Desk")
        sent = await client.send("Desk", {"action": "x"})
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        stream = stub.Subscribe(
            broker_pb2.SubscribeRequest(
                agent_id="Desk", lease=duration_pb2.Duration(nanos=600_000_000)
            )
        )
        first = await asyncio.wait_for(stream.read(), 5)
        assert first.delivery.message.message_id == sent.message_id

        def extend(seconds: int, *ids: str) -> broker_pb2.ExtendLeaseRequest:
            return broker_pb2.ExtendLeaseRequest(
                agent_id="Desk", message_ids=ids, lease=duration_pb2.Duration(seconds=seconds)
            )

        reply = await stub.ExtendLease(extend(3, sent.message_id, "ghost"))
        assert reply.extended == 1
        await nothing_within(stream.read(), 1.5)  # not delivered again at 0.6 s
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ExtendLease(extend(-1, sent.message_id))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ack = await stub.Ack(broker_pb2.AckRequest(agent_id="Desk", message_ids=[sent.message_id]))
        assert ack.acknowledged == 1
        assert (await stub.ExtendLease(extend(3, sent.message_id))).extended == 0
        stream.cancel()

        # On a session, the frame is not answered; a bad one is, with an error under its seq.
        session = stub.Connect()
        subscribe = broker_pb2.ConnectRequest(seq=1)
        subscribe.subscribe.agent_id = "Desk"
        subscribe.subscribe.lease.FromNanoseconds(600_000_000)
        await session.write(subscribe)
        assert (await asyncio.wait_for(session.read(), 5)).WhichOneof("frame") == "accepted"
        async with mesh.client("sender") as client:
            again = await client.send("Desk", {"action": "y"})
        delivered = await asyncio.wait_for(session.read(), 5)
        assert delivered.delivery.message.message_id == again.message_id
        await session.write(broker_pb2.ConnectRequest(extend_lease=extend(3, again.message_id)))
        await session.write(broker_pb2.ConnectRequest(seq=7, extend_lease=extend(-1, "x")))
        refused = await asyncio.wait_for(session.read(), 5)
        assert (refused.seq, refused.error.code) == (7, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        next_frame = asyncio.ensure_future(session.read())
        await nothing_within(next_frame, 1.5)  # not delivered again at 0.6 s
        session.cancel()
    assert mesh.broker is not None
    assert mesh.broker.metrics.registry.get_sample_value("agentmesh_leases_extended_total") == 2


async def nothing_within(read: Any, seconds: float) -> None:
    """Nothing comes of ``read`` within ``seconds`` (the read itself is left running: a read
    cancelled cancels its call)."""
    pending = asyncio.ensure_future(read)
    done, _ = await asyncio.wait({pending}, timeout=seconds)
    assert not done, pending.result()


async def reject_all(client: Any, agent_id: str, count: int) -> None:
    """Takes ``count`` deliveries of ``agent_id`` and rejects each (dead letters at once)."""
    async with client.subscribe(agent_id) as inbox:
        for _ in range(count):
            delivery = await asyncio.wait_for(anext(aiter(inbox)), 5)
            await delivery.reject("the handler was broken")


async def test_dead_letters_are_requeued_once_the_cause_is_fixed() -> None:
    """RequeueDeadLetters puts them back, oldest first, as first deliveries; a full queue
    takes what fits and the rest stay dead letters, to be requeued later."""
    async with LocalMesh(BrokerConfig(max_messages_per_agent=2)) as local:
        async with local.client("sender") as client:
            await client.register("Worker")
            sent = []
            for n in range(3):  # (two places: each is dead before the next comes)
                sent.append(await client.send("Worker", {"action": "x", "n": n}))
                await reject_all(client, "Worker", 1)
            dead = await client.dead_letters("Worker")
            assert [d.message.message_id for d in dead] == [m.message_id for m in sent]
            await client.send("Worker", {"action": "x", "n": 9})  # one of two places taken

            first = await client.requeue_dead_letters("Worker")
            assert (first.requeued, first.left) == (1, 2)
            left = await client.dead_letters("Worker")
            assert [d.message.message_id for d in left] == [m.message_id for m in sent[1:]]
            got = await client.receive("Worker")
            assert [m.content["n"] for m in got] == [0, 9]  # the oldest timestamp first

            named = await client.requeue_dead_letters("Worker", [sent[2].message_id, "ghost"])
            assert (named.requeued, named.left) == (1, 0)
            async with client.subscribe("Worker") as inbox:
                again = await asyncio.wait_for(anext(aiter(inbox)), 5)
                assert (again.message.message_id, again.attempt) == (sent[2].message_id, 1)
                assert again.message.content == {"action": "x", "n": 2}
                await again.ack()
            assert [d.message.message_id for d in await client.dead_letters("Worker")] == [
                sent[1].message_id
            ]
            stats = (await client.queue_stats()).for_agent("Worker")
            assert stats is not None and stats.dead_letters == 1

        async with grpc.aio.insecure_channel(local.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.RequeueDeadLetters(broker_pb2.RequeueDeadLettersRequest())
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            done = await stub.RequeueDeadLetters(
                broker_pb2.RequeueDeadLettersRequest(agent_id="Worker")
            )
            assert (done.requeued, done.left) == (1, 0)
            page = await stub.ListDeadLetters(broker_pb2.ListDeadLettersRequest(agent_id="Worker"))
            assert list(page.dead_letters) == []
        assert local.broker is not None  # (its /metrics count them)
        registry = local.broker.metrics.registry
        assert registry.get_sample_value("agentmesh_dead_letters_requeued_total") == 3


async def test_a_dead_letter_whose_id_another_senders_message_took_stays_dead() -> None:
    """Requeued while the queue holds another sender's message with the same id, a dead letter
    was taken for a retry of it: counted as requeued and dropped from the dead letters, in
    the queue nowhere. It stays a dead letter, counted as left, and the others go back."""
    async with (
        LocalMesh() as local,
        local.client("sender") as client,
        local.client("other") as other,
    ):
        await client.register("Worker")
        first = await client.send("Worker", {"action": "x", "n": 1})
        second = await client.send("Worker", {"action": "x", "n": 2})
        await reject_all(client, "Worker", 2)
        await other.send(
            Message(
                message_id=first.message_id,
                from_agent="other",
                to_agent="Worker",
                content={"action": "y"},
            )
        )
        done = await client.requeue_dead_letters("Worker")
        assert (done.requeued, done.left) == (1, 1)
        dead = await client.dead_letters("Worker")
        assert [d.message.message_id for d in dead] == [first.message_id]
        got = await client.receive("Worker")
        assert sorted((m.message_id, m.from_agent) for m in got) == sorted(
            [(first.message_id, "other"), (second.message_id, "sender")]
        )


async def test_an_agent_on_the_brokers_default_lease_keeps_it_without_spinning(
    mesh: LocalMesh,
) -> None:
    """lease_seconds=0 is the default lease (30 s, asked for by name, so that the runtime
    extends by a length it knows): every 10 s, not in a loop that would burn the process's
    CPU; the agent works as any other."""
    import time

    slow = Slow(0.01)
    await mesh.add_agent(slow, lease_seconds=0)
    started = time.process_time()
    await asyncio.sleep(0.5)
    assert time.process_time() - started < 0.25
    async with mesh.client("boss") as client:
        answer = await client.request("SlowAgent", {"action": "work"}, timeout=5)
        assert answer.content["runs"] == 1


@pytest.mark.parametrize(
    "options",
    [{"lease_seconds": -1}, {"lease_seconds": float("nan")}, {"max_lease_extension": -5}],
)
async def test_an_agent_with_a_lease_that_is_no_time_is_refused_at_once(
    mesh: LocalMesh, options: dict[str, float]
) -> None:
    """Refused before it registers (it retried subscribing until serve timed out)."""

    with pytest.raises(MessageValidationError, match=next(iter(options))):
        await mesh.add_agent(Slow(0.01), **options)
    async with mesh.client("boss") as client:
        assert "SlowAgent" not in [a.agent_id for a in await client.list_agents()]


async def test_a_plain_function_handler_runs_off_the_event_loop(mesh: LocalMesh) -> None:
    """A handler written without async (a blocking library call) works, for an @on method and
    for an @agent function, and runs in a worker thread: while one blocks, the event loop
    (other agents, the client's stream) goes on and answers."""
    import threading

    loop_thread = threading.get_ident()
    release = threading.Event()

    class Blocking(Agent):
        agent_id = "Blocking"

        @on("lookup")
        def lookup(self, message: Message, ctx: AgentContext) -> dict[str, object]:
            release.wait(10)  # a blocking call, until the other answer came
            return {"off_loop": threading.get_ident() != loop_thread}

    @agent("Plain")
    def plain(message: Message, ctx: AgentContext) -> str:
        return "plain answer"

    class Overridden(Agent):
        agent_id = "Overridden"

        def handle(self, message: Message, ctx: AgentContext) -> dict[str, bool]:  # type: ignore[override]
            return {"overridden": True}

    await mesh.add_agent(Blocking())
    await mesh.add_agent(plain)

    class Forgetful(Agent):  # `return` of a coroutine without its await: said, at once
        agent_id = "Forgetful"

        @on("forget")
        async def forget(self, message: Message, ctx: AgentContext) -> Any:
            return asyncio.sleep(0, {"never": "sent"})

        @on("spawn")  # a task made and not awaited: its text would have been the answer
        async def spawn(self, message: Message, ctx: AgentContext) -> Any:
            return asyncio.ensure_future(asyncio.sleep(0, {"never": "sent"}))

    await mesh.add_agent(Overridden())
    await mesh.add_agent(Forgetful())
    async with mesh.client("asker") as client:
        slow = asyncio.create_task(client.request("Blocking", {"action": "lookup"}, timeout=15))
        await asyncio.sleep(0.1)
        quick = await client.request("Plain", {"action": "any"}, timeout=3)
        assert quick.content == {"action": "any", "result": "plain answer"}
        assert not slow.done()
        with pytest.raises(AgentError, match="returned a coroutine, not its result"):
            await client.request("Forgetful", {"action": "forget"}, timeout=3)
        with pytest.raises(AgentError, match="returned a Task, not its result: an await is"):
            await client.request("Forgetful", {"action": "spawn"}, timeout=3)
        other = await client.request("Overridden", {"action": "any"}, timeout=3)
        assert other.content == {"action": "any", "overridden": True}
        release.set()
        assert (await slow).content == {"action": "lookup", "off_loop": True}


async def test_a_handler_that_cannot_be_called_is_refused_as_its_agent_is_made(
    mesh: LocalMesh,
) -> None:
    """A handler missing ``ctx`` failed on every message, one by one, as an ERROR answer; a
    bare ``@on`` (no action named) made the method no handler at all, without a word."""
    with pytest.raises(
        TypeError, match=r'@on takes the name of the action it handles, as in @on\("book"\)'
    ):

        class Bare(Agent):
            @on  # type: ignore[arg-type]
            async def book(self, message: Message, ctx: AgentContext) -> None: ...

    class NoContext(Agent):
        agent_id = "NoContext"

        @on("book")
        async def book(self, message: Message) -> None: ...

    with pytest.raises(TypeError, match=r"the handler NoContext\.book must take \(message, ctx\)"):
        NoContext()

    class Handles(Agent):
        agent_id = "Handles"

        async def handle(self, message: Message) -> None:  # type: ignore[override]
            ...

    with pytest.raises(TypeError, match=r"the handler Handles\.handle must take"):
        Handles()
    with pytest.raises(TypeError, match=r"must take \(message, ctx\)"):

        @agent("Lone")
        async def lone(message: Message) -> None: ...

    with pytest.raises(
        TypeError, match=r'@agent takes the agent\'s id, as in @agent\("PaymentAgent"\)'
    ):

        @agent  # type: ignore[arg-type]
        async def nameless(message: Message, ctx: AgentContext) -> None: ...

    class Lenient(Agent):  # what can be called with a message and its context is taken
        agent_id = "Lenient"

        @on("book")
        async def book(self, message: Message, ctx: AgentContext | None = None) -> Any:
            return {"booked": message.parameters["room"]}

        @on("any")
        def anything(self, *args: Any) -> Any:
            return {"args": len(args)}

    # What is served as an agent and is none: said before any server starts.
    with pytest.raises(
        TypeError,
        match=r"an agent to serve is an Agent object, not <class .*: make one, Lenient\(\)",
    ):
        await serve_all([Lenient], mesh.address)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="an agent to serve is an Agent object, not 'Lenient'"):
        await mesh.add_agent("Lenient")  # type: ignore[arg-type]

    with pytest.raises(
        TypeError, match=r"Twice\.price and Twice\.price_v2 both handle 'price': an action has one"
    ):

        class Twice(Agent):
            agent_id = "Twice"

            @on("price")
            async def price(self, message: Message, ctx: AgentContext) -> None: ...

            @on("price")  # (copied, and the name alone changed)
            async def price_v2(self, message: Message, ctx: AgentContext) -> None: ...

        Twice()

    class Forgetful(Lenient):
        def __init__(self, rate: int) -> None:
            self.rate = rate  # (super().__init__() forgotten: no handler was found)

    with pytest.raises(
        TypeError,
        match=r"Forgetful\.__init__ does not call super\(\)\.__init__\(\), where an Agent finds",
    ):
        await mesh.add_agent(Forgetful(3))
    await mesh.add_agent(Lenient())
    async with mesh.client("asker") as client:
        booked = await client.request(
            "Lenient", {"action": "book", "parameters": {"room": 12}}, timeout=5
        )
        assert booked.content == {"action": "book", "booked": 12}
        assert (await client.request("Lenient", {"action": "any"}, timeout=5)).content == {
            "action": "any",
            "args": 2,
        }


async def test_a_mapping_a_handler_returns_is_its_answer_s_content(mesh: LocalMesh) -> None:
    """Any mapping is content, as a dict is: returned by a handler (it was sent as
    {"result": "<its Python text>"}), or held within what it returns (sent as that text)."""

    class Viewer(Agent):
        agent_id = "Viewer"

        @on("view")
        async def view(self, message: Message, ctx: AgentContext) -> Any:
            return MappingProxyType({"status": "ok", "limits": MappingProxyType({"max": 3})})

    await mesh.add_agent(Viewer())
    async with mesh.client("asker") as client:
        answer = await client.request("Viewer", {"action": "view"}, timeout=5)
        assert answer.content == {"action": "view", "status": "ok", "limits": {"max": 3}}


async def test_a_subscriber_answers_with_content_as_a_handler_does(mesh: LocalMesh) -> None:
    """``delivery.answer({...})``, outside the agent runtime: the RESPONSE is made as a
    handler's return value makes it (it was an AttributeError: only a Message was taken)."""
    async with mesh.client("Desk") as desk, mesh.client("asker") as asker:
        await desk.register("Desk")
        async with desk.subscribe("Desk") as inbox:
            asking = asyncio.create_task(
                asker.request("Desk", {"action": "quote"}, priority="HIGH", timeout=5)
            )
            delivery = await asyncio.wait_for(anext(aiter(inbox)), 5)
            with pytest.raises(TypeError, match=r"answer takes a Message or the answer's content"):
                await delivery.answer("450")  # type: ignore[arg-type]
            await delivery.answer({"price": 450})
            answer = await asking
        assert answer.content == {"action": "quote", "price": 450}
        assert (answer.message_type, answer.from_agent, answer.priority) == (
            MessageType.RESPONSE,
            "Desk",
            Priority.HIGH,
        )
        assert answer.correlation_id == delivery.message.message_id and delivery.done
        [queue] = (await asker.queue_stats("Desk")).agents
        assert (queue.depth, queue.in_flight, queue.dead_letters) == (0, 0, 0)


async def test_a_subscriber_keeps_a_delivery_by_hand(mesh: LocalMesh) -> None:
    """`Received.extend_lease()` outside the agent runtime: the delivery is not redelivered at
    its first lease's end, and acked after it, it is gone."""
    async with mesh.client("worker") as client:
        await client.register("Desk")
        sent = await client.send("Desk", {"action": "long"})
        async with client.subscribe("Desk", lease_seconds=0.6) as inbox:
            stream = aiter(inbox)
            first = await asyncio.wait_for(anext(stream), 5)
            assert first.message.message_id == sent.message_id
            await first.extend_lease(3)
            await nothing_within(anext(stream), 1.5)  # not delivered again at 0.6 s
            await first.ack()
        stats = (await client.queue_stats()).for_agent("Desk")
        assert stats is not None and (stats.depth, stats.in_flight) == (0, 0)
        assert (await client.queue_stats()).totals["redelivered_count"] == 0


async def test_a_delivery_the_broker_fails_to_write_comes_again_on_a_new_subscription(
    mesh: LocalMesh, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fault of the broker's own as it writes a delivery on a session (a bug: here, its
    encoding raising) ends that subscription, and says so with the traceback: what it held
    goes back to the queue with the attempt counted, the agent is told UNAVAILABLE and
    subscribes again, and takes the message. Before, the session's delivering task died
    without a word: the subscription stayed open, and the agent's messages waited in its
    queue. A message that can never be written ends in the dead-letter queue."""
    from mesh import codec, serve

    caplog.set_level(logging.WARNING)
    encode = codec.delivery_to_pb
    written: list[tuple[str, int]] = []

    def faulty(delivery: Any, out: Any, *args: Any) -> Any:
        action = delivery.message.content["action"]
        written.append((action, delivery.attempt))
        if action == "never" or delivery.attempt == 1:
            raise RuntimeError("a bug in the broker's encoding")
        return encode(delivery, out, *args)

    monkeypatch.setattr(codec, "delivery_to_pb", faulty)
    handled: list[str] = []

    @agent("Ledger")
    async def ledger(message: Message, ctx: AgentContext) -> dict[str, str]:
        handled.append(message.content["action"])
        return {"posted": "yes"}

    async with mesh.client("Caller") as caller:
        served = await serve(ledger, mesh.address)
        try:
            answer = await caller.request("Ledger", {"action": "post"}, timeout=10)
            assert answer.content["posted"] == "yes"
            assert written == [("post", 1), ("post", 2)] and handled == ["post"]
            await caller.send("Ledger", {"action": "never"})
            dead = await only_dead_letter(caller, "Ledger")
            assert dead.message.content == {"action": "never"} and dead.attempts == 4
            assert written[2:] == [("never", n) for n in (1, 2, 3, 4)]
            answer = await caller.request("Ledger", {"action": "post"}, timeout=10)
            assert answer.content["posted"] == "yes"  # (the agent serves on)
            assert handled == ["post", "post"]
        finally:
            await served.stop(1.0)
    faults = [r for r in caplog.records if r.name == "mesh.server"]
    assert {r.getMessage() for r in faults} == {"the session's deliveries to Ledger failed"}
    assert all(r.levelname == "ERROR" and r.exc_info for r in faults)
    assert len(faults) == 1 + 4 + 1


async def test_a_fault_as_the_broker_writes_on_a_plain_subscribe_stream_ends_it_unavailable(
    mesh: LocalMesh, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same fault on the unary-stream ``Subscribe`` of a plain gRPC client: the stream
    ends UNAVAILABLE ("subscribe again"), as a session's subscription ends, not INTERNAL;
    the fault is logged with its traceback, and the message is back in the queue at once
    with its attempt counted, for the next subscription."""
    from mesh import codec

    caplog.set_level(logging.WARNING)
    encode = codec.delivery_to_pb

    def faulty(delivery: Any, out: Any, *args: Any) -> Any:
        if delivery.attempt == 1:
            raise RuntimeError("a bug in the broker's encoding")
        return encode(delivery, out, *args)

    monkeypatch.setattr(codec, "delivery_to_pb", faulty)
    async with mesh.client("Caller") as caller:
        await caller.register("Ledger")
        sent = await caller.send("Ledger", {"action": "post"})
        async with grpc.aio.insecure_channel(mesh.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            stream = stub.Subscribe(broker_pb2.SubscribeRequest(agent_id="Ledger"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(stream.read(), 5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.details() == (
                "the broker failed to deliver Ledger's messages: subscribe again"
            )
            again = stub.Subscribe(broker_pb2.SubscribeRequest(agent_id="Ledger"))
            second = await asyncio.wait_for(again.read(), 5)
            assert second.delivery.message.message_id == sent.message_id
            assert second.delivery.delivery_attempt == 2
            again.cancel()
    faults = [r for r in caplog.records if r.name == "mesh.server"]
    assert [r.getMessage() for r in faults] == ["the deliveries to Ledger failed"]
    assert faults[0].levelname == "ERROR" and faults[0].exc_info


async def test_a_delivery_the_broker_refuses_to_write_goes_back_to_the_queue_at_once(
    mesh: LocalMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with an error the broker names (here, its encoding refusing the message
    once): the subscription ends saying that error, and what it held is back in the queue at
    once, not when its lease (30 s) runs out. Before, it stayed leased to a subscription
    nobody wrote for."""
    from mesh import codec, serve

    encode = codec.delivery_to_pb
    written: list[int] = []

    def refusing(delivery: Any, out: Any, *args: Any) -> Any:
        written.append(delivery.attempt)
        if delivery.attempt == 1:
            raise MessageValidationError.for_field("message.content", "cannot be written")
        return encode(delivery, out, *args)

    monkeypatch.setattr(codec, "delivery_to_pb", refusing)

    @agent("Ledger")
    async def ledger(message: Message, ctx: AgentContext) -> dict[str, str]:
        return {"posted": "yes"}

    async with mesh.client("Caller") as caller:
        served = await serve(ledger, mesh.address)
        try:
            answer = await caller.request("Ledger", {"action": "post"}, timeout=10)
            assert answer.content["posted"] == "yes" and written == [1, 2]
        finally:
            await served.stop(1.0)

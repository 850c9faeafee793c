"""The queue stores: order, TTL, capacity, leases, redelivery, dead letters.

Every test runs against every store (in memory, journalled to SQLite, on a Redis server and on
a three-node Redis Cluster); the durable and Redis stores' own tests are at the end.
"""

from __future__ import annotations

import asyncio
import gc
import json
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mesh.codec import message_size
from mesh.core.durable import SqliteQueueStore, open_store
from mesh.core.errors import MessageIdTakenError, MessageQueueFullError
from mesh.core.model import AgentInfo, DeadLetter, Message, Priority
from mesh.core.queue import InMemoryQueueStore, QueueStore, Released


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    def __init__(self) -> None:
        self.expired: list[Message] = []
        self.dead: list[DeadLetter] = []
        self.redelivered: list[tuple[str, int]] = []
        self.due: list[str] = []
        self.released: list[Released] = []

    def on_expired(self, message: Message) -> None:
        self.expired.append(message)

    def on_dead_letter(self, dead: DeadLetter) -> None:
        self.dead.append(dead)

    def on_redelivery(self, message: Message, attempt: int) -> None:
        self.redelivered.append((message.message_id, attempt))

    def on_due(self, message: Message) -> None:
        self.due.append(message.message_id)

    def on_released(self, released: Released) -> None:
        self.released.append(released)


BASE = datetime(2025, 11, 16, 10, 0, 0, tzinfo=UTC)


def msg(
    mid: str, *, to: str = "PaymentAgent", priority: Priority = Priority.MEDIUM, at: float = 0.0
) -> Message:
    return Message(
        message_id=mid,
        from_agent="FlightAgent",
        to_agent=to,
        content={"action": "process_payment"},
        priority=priority,
        timestamp=BASE + timedelta(seconds=at),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


OPTIONS = {"max_messages_per_agent": 5, "max_total_messages": 8, "max_delivery_attempts": 3}


STORES = ["memory", "sqlite", "redis", "redis-cluster"]


def open_kind(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    clock: FakeClock,
    recorder: Recorder,
    **options: object,
) -> QueueStore:
    """A store of the kind the test is parametrized with (``request.param``)."""
    options = {**OPTIONS, **options}
    made: QueueStore
    if request.param == "memory":
        made = InMemoryQueueStore(**options, clock=clock, listener=recorder)
    elif request.param == "sqlite":
        made = SqliteQueueStore(tmp_path / "q.db", **options, clock=clock, listener=recorder)
    else:
        from mesh.redis_store import RedisQueueStore

        url = request.getfixturevalue(
            "redis_url" if request.param == "redis" else "redis_cluster_url"
        )
        # Redis keeps time by the wall clock: the fake clock drives a fake wall clock.
        made = RedisQueueStore(
            url,
            **options,
            wall_clock=lambda: BASE + timedelta(seconds=clock.now),
        )
        made.listener = recorder
    return made


@pytest.fixture(params=STORES)
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock, recorder: Recorder
) -> AsyncIterator[QueueStore]:
    made = open_kind(request, tmp_path, clock, recorder)
    yield made
    await made.close()


@pytest.fixture(params=STORES)
async def fifo_store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock, recorder: Recorder
) -> AsyncIterator[QueueStore]:
    made = open_kind(request, tmp_path, clock, recorder, fifo=True)
    yield made
    await made.close()


async def ids(store: QueueStore, agent: str = "PaymentAgent") -> list[str]:
    return [p.message.message_id for p in await store.pop(agent)]


async def test_priority_then_timestamp_order(store: QueueStore) -> None:
    # RF-009 scenario 5's table: LOW at :00, HIGH at :05, MEDIUM at :02.
    await store.put(msg("msg_001", priority=Priority.LOW, at=0), 3600)
    await store.put(msg("msg_002", priority=Priority.HIGH, at=5), 3600)
    await store.put(msg("msg_003", priority=Priority.MEDIUM, at=2), 3600)
    assert await ids(store) == ["msg_002", "msg_003", "msg_001"]


async def test_same_priority_is_oldest_first_and_then_arrival(store: QueueStore) -> None:
    await store.put(msg("late", at=9), 3600)
    await store.put(msg("early", at=1), 3600)
    await store.put(msg("tie-a", at=5), 3600)
    await store.put(msg("tie-b", at=5), 3600)
    assert await ids(store) == ["early", "tie-a", "tie-b", "late"]


async def test_a_fifo_queue_keeps_arrival_order_whatever_the_priority_and_timestamp(
    fifo_store: QueueStore,
) -> None:
    # RT-011 queue type "fifo": the table of RF-009 scenario 5 comes out as it went in.
    await fifo_store.put(msg("msg_001", priority=Priority.LOW, at=0), 3600)
    await fifo_store.put(msg("msg_002", priority=Priority.HIGH, at=5), 3600)
    await fifo_store.put(msg("msg_003", priority=Priority.MEDIUM, at=2), 3600)
    lease = await fifo_store.lease("PaymentAgent", "sub-1", 30)
    assert lease is not None and lease.message.message_id == "msg_001"
    await fifo_store.nack("PaymentAgent", ["msg_001"])  # back in its place: first again
    assert await ids(fifo_store) == ["msg_001", "msg_002", "msg_003"]


async def test_pop_takes_what_fits_in_max_bytes_and_leaves_the_rest_in_place(
    store: QueueStore,
) -> None:
    # Three messages of about 1.1 KB (1.3 KB as Redis keeps them), then a larger one.
    for mid, at, size in (("m0", 0, 1000), ("m1", 1, 1000), ("m2", 2, 1000), ("big", 9, 5000)):
        await store.put(replace(msg(mid, at=at), content={"action": "a", "blob": "x" * size}), 60)

    async def pop(max_bytes: int) -> list[str]:
        popped = await store.pop("PaymentAgent", 0, max_bytes, message_size)
        return [p.message.message_id for p in popped]

    assert await pop(2700) == ["m0", "m1"]
    assert await pop(2700) == ["m2"]  # the next one does not fit beside it
    assert await pop(2700) == ["big"]  # larger than max_bytes alone: it comes all the same
    assert await pop(2700) == []
    assert await store.held() == 0


async def test_pop_removes_and_respects_max(store: QueueStore) -> None:
    for i in range(4):
        await store.put(msg(f"m{i}", at=i), 3600)
    assert [p.message.message_id for p in await store.pop("PaymentAgent", 3)] == ["m0", "m1", "m2"]
    assert await ids(store) == ["m3"]
    assert await ids(store) == []
    assert await store.held() == 0


async def test_expired_message_is_never_popped_and_is_reported(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    await store.put(msg("old"), 60)
    await store.put(msg("fresh", at=1), 3600)
    clock.advance(65)
    assert await ids(store) == ["fresh"]
    assert [m.message_id for m in recorder.expired] == ["old"]


async def test_expired_message_is_never_leased(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    await store.put(msg("old"), 60)
    clock.advance(61)
    assert await store.lease("PaymentAgent", "sub", 30) is None
    assert len(recorder.expired) == 1


async def test_sweep_expires_without_a_reader(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    await store.put(msg("old"), 60)
    clock.advance(60)
    await store.sweep()
    assert [m.message_id for m in recorder.expired] == ["old"]
    assert await store.held() == 0
    [stats] = await store.stats("PaymentAgent")
    assert stats.depth == 0


async def test_a_fifo_queue_still_counts_its_messages_by_priority(
    fifo_store: QueueStore,
) -> None:
    await fifo_store.put(msg("msg_001", priority=Priority.LOW), 3600)
    await fifo_store.put(msg("msg_002", priority=Priority.HIGH), 3600)
    await fifo_store.put(msg("msg_003", priority=Priority.MEDIUM), 3600)
    await fifo_store.put(msg("msg_004", priority=Priority.MEDIUM), 3600)
    await fifo_store.lease("PaymentAgent", "sub-1", 30)  # msg_001, the first in
    [stats] = await fifo_store.stats("PaymentAgent")
    assert (stats.high, stats.medium, stats.low, stats.in_flight) == (1, 2, 0, 1)


async def test_capacity_per_agent(store: QueueStore) -> None:
    for i in range(5):
        await store.put(msg(f"m{i}"), 3600)
    with pytest.raises(MessageQueueFullError, match="PaymentAgent queue full") as info:
        await store.put(msg("m5"), 3600)
    assert info.value.retry_after and info.value.retry_after > 0
    # Another agent still has room.
    assert await store.put(msg("other", to="HotelAgent"), 3600)
    # Nothing accepted was lost.
    assert await ids(store) == [f"m{i}" for i in range(5)]


async def test_capacity_in_total(store: QueueStore) -> None:
    for i in range(4):
        await store.put(msg(f"a{i}", to="A"), 3600)
        await store.put(msg(f"b{i}", to="B"), 3600)
    with pytest.raises(MessageQueueFullError, match="C queue full"):
        await store.put(msg("c0", to="C"), 3600)
    assert await store.held() == 8


async def test_expired_messages_do_not_hold_capacity(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    for i in range(5):
        await store.put(msg(f"m{i}"), 10)
    clock.advance(11)
    assert await store.put(msg("new"), 3600)
    assert len(recorder.expired) == 5
    assert await ids(store) == ["new"]


async def test_duplicate_message_id_is_accepted_once(store: QueueStore) -> None:
    assert await store.put(msg("same"), 3600)
    assert not await store.put(msg("same"), 3600)
    assert await ids(store) == ["same"]


async def test_a_retried_send_of_a_held_message_is_a_duplicate_even_when_full(
    store: QueueStore,
) -> None:
    """A sender whose answer was lost sends again: the message is held, so the retry is
    the harmless duplicate it is, however full the queues are (not a refusal the sender
    would take for a lost message)."""
    for i in range(5):
        await store.put(msg(f"p{i}"), 3600)  # PaymentAgent full
    for i in range(3):
        await store.put(msg(f"a{i}", to="AuditAgent"), 3600)  # the broker full
    assert await store.put(msg("p0"), 3600) is False
    assert await store.put(msg("a0", to="AuditAgent"), 3600) is False
    assert await store.put(msg("a1", to="AuditAgent", priority=Priority.LOW), 3600) is False
    with pytest.raises(MessageQueueFullError):
        await store.put(msg("a3", to="AuditAgent"), 3600)
    assert await store.held() == 8


async def test_another_senders_message_under_a_held_id_is_refused_even_when_full(
    store: QueueStore,
) -> None:
    """The broker full, a message from another sender under an id the queue holds is refused
    for its id, as it is when there is room: not taken for a retry and dropped unsaid."""
    for i in range(5):
        await store.put(msg(f"p{i}"), 3600)
    for i in range(3):
        await store.put(msg(f"a{i}", to="AuditAgent"), 3600)  # the broker full
    for full, to in (("PaymentAgent", "PaymentAgent"), ("the broker", "AuditAgent")):
        other = replace(msg("p0" if to == "PaymentAgent" else "a0", to=to), from_agent="Other")
        with pytest.raises(MessageIdTakenError, match="from FlightAgent: a message id must"):
            await store.put(other, 3600)
        assert await store.put(replace(other, from_agent="FlightAgent"), 3600) is False, full
    assert await store.held() == 8
    popped = [p.message for p in await store.pop("AuditAgent")]
    assert [(m.message_id, m.from_agent) for m in popped] == [
        (f"a{i}", "FlightAgent") for i in range(3)
    ]


async def test_retried_sends_near_the_limit_take_no_place_from_new_ones(
    store: QueueStore,
) -> None:
    """Senders retrying a held message while others send new ones, three places left: the
    retries add nothing and take no place, so the three new messages fit."""
    for i in range(4):
        await store.put(msg(f"a{i}", to="AuditAgent"), 3600)
    await store.put(msg("p0"), 3600)
    together = [msg("p0"), msg("p0"), msg("p0"), msg("p1"), msg("p2"), msg("p3")]
    results = await asyncio.gather(*(store.put(m, 3600) for m in together))
    assert results == [False, False, False, True, True, True]
    assert await store.held() == 8
    with pytest.raises(MessageQueueFullError):
        await store.put(msg("p4"), 3600)


async def test_lease_ack_releases_capacity(store: QueueStore, recorder: Recorder) -> None:
    await store.put(msg("m1"), 3600)
    lease = await store.lease("PaymentAgent", "sub-1", 30)
    assert lease is not None and lease.attempt == 1 and lease.subscriber == "sub-1"
    assert await store.held() == 1  # in flight still holds capacity
    [stats] = await store.stats("PaymentAgent")
    assert (stats.depth, stats.in_flight) == (0, 1)
    assert await store.ack("PaymentAgent", ["m1"]) == 1
    assert await store.held() == 0
    assert await store.ack("PaymentAgent", ["m1"]) == 0
    assert [r.message_id for r in recorder.released] == ["m1"]


async def test_still_leased_names_the_leases_a_subscriber_holds(store: QueueStore) -> None:
    for i in range(4):
        await store.put(msg(f"m{i}", at=i), 3600)
    await store.lease_many("PaymentAgent", "sub-1", 30, 2)  # m0, m1
    await store.lease("PaymentAgent", "sub-2", 30)  # m2
    await store.ack("PaymentAgent", ["m0"])
    asked = {"m0", "m1", "m2", "m3", "never"}
    assert await store.still_leased("PaymentAgent", "sub-1", asked) == {"m1"}
    assert await store.still_leased("PaymentAgent", "sub-2", asked) == {"m2"}
    await store.nack("PaymentAgent", ["m2"])  # back in the queue: leased to nobody
    assert await store.still_leased("PaymentAgent", "sub-2", asked) == set()
    assert await store.still_leased("Nobody", "sub-1", asked) == set()


async def test_nack_redelivers_in_place_with_attempt_count(
    store: QueueStore, recorder: Recorder
) -> None:
    await store.put(msg("first", at=0), 3600)
    await store.put(msg("second", at=1), 3600)
    lease = await store.lease("PaymentAgent", "s", 30)
    assert lease is not None and lease.message.message_id == "first"
    assert await store.nack("PaymentAgent", ["first"]) == (1, 0)
    again = await store.lease("PaymentAgent", "s", 30)
    assert again is not None
    assert (again.message.message_id, again.attempt) == ("first", 2)
    assert recorder.redelivered == [("first", 2)]


async def test_pop_says_how_often_each_message_was_delivered_before(store: QueueStore) -> None:
    await store.put(msg("handed back", at=0), 3600)
    await store.put(msg("never leased", at=1), 3600)
    await store.lease("PaymentAgent", "s", 30)
    assert await store.nack("PaymentAgent", ["handed back"]) == (1, 0)
    popped = await store.pop("PaymentAgent")
    assert [(p.message.message_id, p.attempts) for p in popped] == [
        ("handed back", 1),
        ("never leased", 0),
    ]


async def test_lease_expiry_redelivers(store: QueueStore, clock: FakeClock) -> None:
    await store.put(msg("m1"), 3600)
    await store.lease("PaymentAgent", "s", 5)
    clock.advance(4)
    await store.sweep()
    assert await store.lease("PaymentAgent", "s", 5) is None
    clock.advance(2)
    await store.sweep()
    lease = await store.lease("PaymentAgent", "s", 5)
    assert lease is not None and lease.attempt == 2


async def test_an_extended_lease_ends_that_much_later(store: QueueStore, clock: FakeClock) -> None:
    """A handler still at work keeps its message: the lease ends ``lease_seconds`` after the
    extension, not after the delivery; a message no longer leased is not extended."""
    await store.put(msg("m1"), 3600)
    await store.put(msg("m2"), 3600)
    assert len(await store.lease_many("PaymentAgent", "s", 5, 2)) == 2
    clock.advance(4)
    assert await store.extend_lease("PaymentAgent", ["m1", "ghost"], 5) == 1
    clock.advance(2)  # 6 s: m2's lease ended, m1's ends at 9 s
    assert await store.extend_lease("PaymentAgent", ["m2"], 5) == 0  # too late, unswept
    await store.sweep()
    again = await store.lease("PaymentAgent", "s", 5)
    assert again is not None and (again.message.message_id, again.attempt) == ("m2", 2)
    assert await store.lease("PaymentAgent", "s", 5) is None
    clock.advance(4)  # 10 s
    await store.sweep()
    back = await store.lease("PaymentAgent", "s", 5)
    assert back is not None and (back.message.message_id, back.attempt) == ("m1", 2)
    assert await store.ack("PaymentAgent", ["m1"]) == 1
    assert await store.extend_lease("PaymentAgent", ["m1"], 5) == 0
    assert await store.extend_lease("Nobody", ["m1"], 5) == 0


async def test_withdrawn_messages_leave_whether_waiting_or_leased(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    """A request its requester gave up: one still waiting is never delivered, a leased one
    is gone for good (its release says withdrawn, for its subscriber), their places free;
    what is not held (acked, unknown) counts nothing."""
    for i in range(4):
        await store.put(msg(f"m{i}", at=i), 3600)
    assert len(await store.lease_many("PaymentAgent", "sub-1", 5, 2)) == 2  # m0, m1
    assert await store.ack("PaymentAgent", ["m0"]) == 1
    recorder.released.clear()
    assert await store.withdraw("PaymentAgent", ["m0", "m1", "m2", "ghost"]) == (1, 1)
    assert recorder.released == [Released("m1", "PaymentAgent", "sub-1", withdrawn=True)]
    assert await store.held() == 1
    [stats] = await store.stats("PaymentAgent")
    assert (stats.depth, stats.in_flight) == (1, 0)
    assert await store.ack("PaymentAgent", ["m1"]) == 0  # its subscriber's late ack
    clock.advance(6)  # past m1's lease: nothing comes back
    await store.sweep()
    got = await store.lease("PaymentAgent", "sub-1", 5)
    assert got is not None and (got.message.message_id, got.attempt) == ("m3", 1)
    assert await store.lease("PaymentAgent", "sub-1", 5) is None
    assert await store.withdraw("Nobody", ["m3"]) == (0, 0)
    assert recorder.expired == [] and recorder.dead == []


async def test_withdrawn_messages_free_their_places(store: QueueStore) -> None:
    for i in range(5):
        await store.put(msg(f"m{i}", at=i), 3600)
    with pytest.raises(MessageQueueFullError):
        await store.put(msg("more", at=9), 3600)
    await store.lease("PaymentAgent", "s", 30)
    assert await store.withdraw("PaymentAgent", ["m0", "m4"]) == (1, 1)
    await store.put(msg("more", at=9), 3600)
    assert await ids(store) == ["m1", "m2", "m3", "more"]


async def test_dead_letters_taken_out_by_id_leave_the_others(store: QueueStore) -> None:
    """What a requeue does to the dead letters: the named ones go (every entry of an id),
    the others and other agents' stay, and the counts follow."""
    for mid, to in (("a", "PaymentAgent"), ("b", "PaymentAgent"), ("c", "HotelAgent")):
        await store.put(msg(mid, to=to), 3600)
        assert await store.lease(to, "s", 30) is not None
        assert await store.nack(to, [mid], dead_letter_reason="broken") == (0, 1)
    assert await store.remove_dead_letters("PaymentAgent", ["a", "c", "ghost"]) == 1
    assert [d.message.message_id for d in await store.dead_letters("PaymentAgent")] == ["b"]
    assert [d.message.message_id for d in await store.dead_letters("HotelAgent")] == ["c"]
    assert (await store.stats("PaymentAgent"))[0].dead_letters == 1
    assert await store.remove_dead_letters("PaymentAgent", []) == 0


async def test_dead_letter_after_max_attempts(store: QueueStore, recorder: Recorder) -> None:
    await store.put(msg("poison"), 3600)
    for attempt in (1, 2):
        lease = await store.lease("PaymentAgent", "s", 30)
        assert lease is not None and lease.attempt == attempt
        assert await store.nack("PaymentAgent", ["poison"]) == (1, 0)
    lease = await store.lease("PaymentAgent", "s", 30)
    assert lease is not None and lease.attempt == 3
    assert await store.nack("PaymentAgent", ["poison"]) == (0, 1)
    assert await store.lease("PaymentAgent", "s", 30) is None
    [dead] = await store.dead_letters("PaymentAgent")
    assert dead.message.message_id == "poison" and dead.attempts == 3
    assert "nacked after 3 delivery attempts" in dead.reason
    assert recorder.dead == [dead]
    assert await store.held() == 0
    [stats] = await store.stats("PaymentAgent")
    assert stats.dead_letters == 1


async def test_nack_with_a_reason_dead_letters_at_once(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    await store.put(msg("unreadable", at=0), 3600)
    await store.put(msg("next", at=1), 3600)
    await store.put(msg("late", at=2), 10)
    leases = await store.lease_many("PaymentAgent", "s", 30, 3)
    assert [lease.attempt for lease in leases] == [1, 1, 1]
    reason = "PaymentAgent does not handle action 'execute_handoff'"
    assert await store.nack("PaymentAgent", ["unreadable"], dead_letter_reason=reason) == (0, 1)
    assert await store.nack("PaymentAgent", ["unreadable"], dead_letter_reason=reason) == (0, 0)
    [dead] = await store.dead_letters("PaymentAgent")
    assert (dead.message.message_id, dead.reason, dead.attempts) == ("unreadable", reason, 1)
    assert recorder.dead == [dead]
    # Past its TTL it expires rather than joining the dead letters; a plain nack still requeues.
    clock.advance(11)
    assert await store.nack("PaymentAgent", ["late"], dead_letter_reason=reason) == (0, 0)
    assert [m.message_id for m in recorder.expired] == ["late"]
    assert await store.nack("PaymentAgent", ["next"]) == (1, 0)
    lease = await store.lease("PaymentAgent", "s", 30)
    assert lease is not None and (lease.message.message_id, lease.attempt) == ("next", 2)
    assert len(await store.dead_letters("PaymentAgent")) == 1


async def test_a_nack_with_a_delay_brings_the_message_back_only_then(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    """Nacked with ``delay``, a delivery is held by nobody until the delay ends (its
    subscriber's place in flight free at once, the others' messages going first, closing
    its subscription bringing it no sooner), then comes back in its place for its next
    attempt."""
    await store.put(msg("m1", at=0), 3600)
    await store.put(msg("m2", at=1), 3600)
    first = await store.lease("PaymentAgent", "s", 30)
    assert first is not None and first.message.message_id == "m1"
    assert await store.nack("PaymentAgent", ["m1"], delay=5) == (1, 0)
    assert recorder.released == [Released("m1", "PaymentAgent", "s")]
    assert recorder.redelivered == []
    assert await store.still_leased("PaymentAgent", "s", {"m1"}) == set()
    # Deferred, it is neither nacked again nor extended (its delay stands).
    assert await store.nack("PaymentAgent", ["m1"]) == (0, 0)
    assert await store.extend_lease("PaymentAgent", ["m1"], 60) == 0
    second = await store.lease("PaymentAgent", "s", 30)
    assert second is not None and second.message.message_id == "m2"
    [stats] = await store.stats("PaymentAgent")
    assert (stats.depth, stats.in_flight, stats.deferred) == (0, 1, 1)  # (m2 in flight)
    clock.advance(4)
    await store.sweep()
    assert await store.lease("PaymentAgent", "s", 30) is None
    assert await store.release_subscriber("PaymentAgent", "s") == 1  # m2 alone
    clock.advance(2)  # 6 s: the delay has ended
    await store.sweep()
    back = await store.lease_many("PaymentAgent", "s2", 30, 2)
    assert [(lease.message.message_id, lease.attempt) for lease in back] == [("m1", 2), ("m2", 2)]
    assert ("m1", 2) in recorder.redelivered


async def test_a_scheduled_message_waits_for_its_time_then_in_its_place(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    """Put with a ``delay``, a message is held (it takes its place in the queue's capacity,
    and a listing shows it DEFERRED) but neither leased nor received until the delay ends;
    then it waits in its place (by priority and timestamp) for its first delivery: due,
    not redelivered. One whose ttl ends first expires; a re-sent one is taken once."""
    await store.put(msg("later", at=0), 3600, None, 5)
    await store.put(msg("now", at=1), 3600)
    await store.put(msg("never", at=2), 3, None, 5)
    assert await store.put(msg("later", at=0), 3600, None, 5) is False  # (a retry)
    assert await store.held() == 3
    leases = await store.lease_many("PaymentAgent", "s", 30, 5)
    assert [lease.message.message_id for lease in leases] == ["now"]
    assert await store.ack("PaymentAgent", ["now"]) == 1
    assert await store.ack("PaymentAgent", ["later"]) == 0  # (never delivered)
    assert await store.nack("PaymentAgent", ["later"]) == (0, 0)
    assert await store.extend_lease("PaymentAgent", ["later"], 60) == 0
    assert await store.pop("PaymentAgent") == []
    listed = await store.listing("PaymentAgent")
    assert [(h.message.message_id, h.attempts, h.state.value) for h in listed] == [
        ("later", 0, "DEFERRED"),
        ("never", 0, "DEFERRED"),
    ]
    [stats] = await store.stats("PaymentAgent")
    assert (stats.depth, stats.in_flight, stats.deferred, stats.held) == (0, 0, 2, 2)
    assert recorder.released == [Released("now", "PaymentAgent", "s")]  # (its ack alone)
    clock.advance(4)
    await store.sweep()
    assert await store.lease("PaymentAgent", "s", 30) is None
    assert [m.message_id for m in recorder.expired] == []
    await store.put(msg("newer", at=3), 3600)
    clock.advance(2)  # 6 s: due (and "never" is past its ttl of 3 s)
    await store.sweep()
    assert recorder.due == ["later"]
    assert recorder.redelivered == []
    assert [m.message_id for m in recorder.expired] == ["never"]
    back = await store.lease_many("PaymentAgent", "s", 30, 5)
    assert [(lease.message.message_id, lease.attempt) for lease in back] == [
        ("later", 1),
        ("newer", 1),
    ]
    assert await store.held() == 2


async def test_a_sender_takes_back_what_is_not_delivered_yet(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    """``cancel``: a sender's messages waiting or held until a time (scheduled, or nacked
    with a delay) leave the queue for good; one in flight, another sender's, or one no
    longer held stays as it is."""
    await store.put(msg("nacked", at=0), 3600)
    await store.put(msg("leased", at=1), 3600)
    await store.put(msg("waiting", at=2), 3600)
    await store.put(msg("later", at=3), 3600, None, 60)
    other = Message(
        message_id="other",
        from_agent="HotelAgent",
        to_agent="PaymentAgent",
        content={"action": "x"},
        timestamp=BASE + timedelta(seconds=4),
    )
    await store.put(other, 3600)
    leases = await store.lease_many("PaymentAgent", "s", 30, 2)
    assert [lease.message.message_id for lease in leases] == ["nacked", "leased"]
    assert await store.nack("PaymentAgent", ["nacked"], delay=60) == (1, 0)
    asked = ["nacked", "leased", "later", "other", "gone", "waiting", "later"]
    assert await store.cancel("PaymentAgent", "FlightAgent", asked) == [
        "nacked",
        "later",
        "waiting",
    ]
    assert await store.cancel("PaymentAgent", "FlightAgent", ["later"]) == []
    assert await store.cancel("Nobody", "FlightAgent", ["later"]) == []
    listed = await store.listing("PaymentAgent")
    assert [(h.message.message_id, h.state.value) for h in listed] == [
        ("other", "WAITING"),
        ("leased", "IN_FLIGHT"),
    ]
    assert await store.held() == 2
    [stats] = await store.stats("PaymentAgent")
    assert (stats.depth, stats.in_flight, stats.deferred) == (1, 1, 0)
    clock.advance(61)
    await store.sweep()
    assert (recorder.due, recorder.redelivered) == ([], [("leased", 2)])


async def test_a_nack_with_a_delay_leaves_at_once_what_cannot_come_back(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    """A delivery whose attempts are used up goes to the dead-letter queue at once, one past
    its ttl expires at once, and a deferred one is still acked (its handler got there
    after all)."""
    await store.put(msg("tired", at=0), 3600)
    await store.put(msg("late", at=1), 10)
    await store.put(msg("done", at=2), 3600)
    for _ in range(2):  # OPTIONS: 3 attempts
        await store.lease("PaymentAgent", "s", 30)
        assert await store.nack("PaymentAgent", ["tired"]) == (1, 0)
    leases = await store.lease_many("PaymentAgent", "s", 30, 3)
    assert [(lease.message.message_id, lease.attempt) for lease in leases] == [
        ("tired", 3),
        ("late", 1),
        ("done", 1),
    ]
    assert await store.nack("PaymentAgent", ["tired"], delay=60) == (0, 1)
    [dead] = await store.dead_letters("PaymentAgent")
    assert (dead.message.message_id, dead.attempts) == ("tired", 3)
    assert await store.nack("PaymentAgent", ["done"], delay=60) == (1, 0)
    assert await store.ack("PaymentAgent", ["done"]) == 1
    clock.advance(11)
    assert await store.nack("PaymentAgent", ["late"], delay=60) == (0, 0)
    assert [m.message_id for m in recorder.expired] == ["late"]
    clock.advance(60)
    await store.sweep()
    assert await store.lease("PaymentAgent", "s", 30) is None
    [stats] = await store.stats("PaymentAgent")
    assert (stats.depth, stats.in_flight, stats.dead_letters) == (0, 0, 1)


async def test_a_listing_shows_what_the_queue_holds_and_leaves_it(
    store: QueueStore, clock: FakeClock
) -> None:
    """What is waiting, in the order it will be delivered (HIGH first, then by timestamp; one
    handed back in its place, with its attempt), then what is in flight or deferred, by when
    its lease or delay ends; each with when it was accepted and when its ttl ends. What is
    past its ttl leaves; nothing is taken."""
    await store.put(msg("low", priority=Priority.LOW, at=0), 3600)
    await store.put(msg("late", at=3), 10)
    await store.put(msg("medium", at=1), 3600)
    await store.put(msg("high", priority=Priority.HIGH, at=2), 3600)
    await store.put(msg("later", at=0.7), 3600)
    leases = await store.lease_many("PaymentAgent", "s", 30, 2)
    assert [lease.message.message_id for lease in leases] == ["high", "later"]
    assert await store.nack("PaymentAgent", ["high"]) == (1, 0)
    assert await store.nack("PaymentAgent", ["later"], delay=60) == (1, 0)
    leased = await store.lease("PaymentAgent", "s", 100)
    assert leased is not None and leased.message.message_id == "high"
    clock.advance(5)
    listed = await store.listing("PaymentAgent")
    assert [(h.message.message_id, h.attempts, h.state.value) for h in listed] == [
        ("medium", 0, "WAITING"),
        ("late", 0, "WAITING"),
        ("low", 0, "WAITING"),
        ("later", 1, "DEFERRED"),
        ("high", 2, "IN_FLIGHT"),
    ]
    accepted = listed[0].accepted_at  # (all came at the same moment)
    assert [round(h.accepted_at - accepted, 2) for h in listed] == [0.0] * 5
    assert [round(h.expires_at - accepted, 2) for h in listed] == [3600, 10, 3600, 3600, 3600]
    # (waiting: no end; the delay of 60 s and the lease of 100 s from when they began)
    assert [h.until is None for h in listed] == [True, True, True, False, False]
    assert [round((h.until or 0) - accepted, 2) for h in listed[3:]] == [60.0, 100.0]
    clock.advance(6)  # past late's ttl
    assert [h.message.message_id for h in await store.listing("PaymentAgent")] == [
        "medium",
        "low",
        "later",
        "high",
    ]
    assert await store.listing("Nobody") == []
    assert [p.message.message_id for p in await store.pop("PaymentAgent")] == ["medium", "low"]


async def test_a_listing_of_a_fifo_queue_is_in_arrival_order(fifo_store: QueueStore) -> None:
    await fifo_store.put(msg("first", priority=Priority.LOW, at=5), 3600)
    await fifo_store.put(msg("second", priority=Priority.HIGH, at=0), 3600)
    await fifo_store.put(msg("third", at=1), 3600)
    assert [h.message.message_id for h in await fifo_store.listing("PaymentAgent")] == [
        "first",
        "second",
        "third",
    ]


async def test_lease_many_takes_what_is_ready_in_queue_order(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    await store.put(msg("low", priority=Priority.LOW, at=0), 3600)
    await store.put(msg("old", at=1), 10)
    await store.put(msg("m1", at=2), 3600)
    await store.put(msg("high", priority=Priority.HIGH, at=3), 3600)
    await store.put(msg("m2", at=4), 3600)
    clock.advance(11)  # "old" expired: skipped and reported, never leased
    leases = await store.lease_many("PaymentAgent", "sub-1", 30, 3)
    assert [lease.message.message_id for lease in leases] == ["high", "m1", "m2"]
    assert all(lease.attempt == 1 and lease.subscriber == "sub-1" for lease in leases)
    assert [m.message_id for m in recorder.expired] == ["old"]
    rest = await store.lease_many("PaymentAgent", "sub-1", 30, 10)
    assert [lease.message.message_id for lease in rest] == ["low"]
    assert await store.lease_many("PaymentAgent", "sub-1", 30, 10) == []
    [stats] = await store.stats("PaymentAgent")
    assert (stats.depth, stats.in_flight) == (0, 4)


async def test_departed_subscriber_returns_its_leases(store: QueueStore) -> None:
    await store.put(msg("a", at=0), 3600)
    await store.put(msg("b", at=1), 3600)
    await store.lease("PaymentAgent", "gone", 30)
    await store.lease("PaymentAgent", "stays", 30)
    assert await store.release_subscriber("PaymentAgent", "gone") == 1
    lease = await store.lease("PaymentAgent", "next", 30)
    assert lease is not None and (lease.message.message_id, lease.attempt) == ("a", 2)


async def test_a_subscriber_leaving_counts_attempts_only_for_what_it_had_seen(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    for i, mid in enumerate("abcd"):
        await store.put(msg(mid, at=i), 3600)
    leases = await store.lease_many("PaymentAgent", "gone", 30, 4)
    assert [lease.attempt for lease in leases] == [1, 1, 1, 1]
    # "a" was handed to the application; "b", "c", "d" were still buffered by its client.
    assert await store.release_subscriber("PaymentAgent", "gone", seen={"a", "elsewhere"}) == 4
    leases = await store.lease_many("PaymentAgent", "next", 30, 4)
    assert [(lease.message.message_id, lease.attempt) for lease in leases] == [
        ("a", 2),
        ("b", 1),
        ("c", 1),
        ("d", 1),
    ]
    # A subscriber that comes and goes, never looking at "d", never uses its attempts up.
    for _ in range(5):
        await store.release_subscriber("PaymentAgent", "next", seen=set())
        leases = await store.lease_many("PaymentAgent", "next", 30, 4)
        assert {lease.message.message_id: lease.attempt for lease in leases}["d"] == 1
    assert await store.dead_letters("PaymentAgent") == [] and recorder.dead == []
    # Without the list, every delivery counts (a client that does not say).
    await store.release_subscriber("PaymentAgent", "next")
    leases = await store.lease_many("PaymentAgent", "next", 30, 4)
    assert {lease.message.message_id: lease.attempt for lease in leases}["d"] == 2


async def test_expired_while_leased_is_not_redelivered(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    await store.put(msg("m"), 10)
    await store.lease("PaymentAgent", "s", 30)
    clock.advance(11)
    assert await store.nack("PaymentAgent", ["m"]) == (0, 0)
    assert [m.message_id for m in recorder.expired] == ["m"]
    assert await store.held() == 0


async def test_low_priority_flood_leaves_room_for_high(store: QueueStore) -> None:
    # 5 places: LOW may take 4 (80%); the last is kept for HIGH and MEDIUM.
    for i in range(4):
        await store.put(msg(f"low{i}", priority=Priority.LOW, at=i), 3600)
    with pytest.raises(MessageQueueFullError, match=r"PaymentAgent queue full .*LOW"):
        await store.put(msg("low4", priority=Priority.LOW), 3600)
    assert await store.put(msg("urgent", priority=Priority.HIGH, at=10), 3600)
    with pytest.raises(MessageQueueFullError, match="PaymentAgent queue full"):
        await store.put(msg("more", priority=Priority.HIGH), 3600)
    lease = await store.lease("PaymentAgent", "s", 30)
    assert lease is not None and lease.message.message_id == "urgent"


async def test_an_agent_that_left_with_an_empty_queue_is_no_longer_listed(
    store: QueueStore, clock: FakeClock, recorder: Recorder
) -> None:
    """Agents that come and go under new ids do not pile up in the store: one forgotten with
    an empty queue is no longer listed (nor swept); one with a message waiting stays. A
    message for it later lists it again, and sweeps go through it again."""
    await store.put(msg("a", to="Worker"), 60)
    assert await ids(store, "Worker") == ["a"]
    await store.put(msg("b", to="Keeper"), 60)
    await store.forget_agent("Worker")
    await store.forget_agent("Keeper")
    assert [s.agent_id for s in await store.stats()] == ["Keeper"]
    await store.put(msg("c", to="Worker"), 1)
    assert [s.agent_id for s in await store.stats()] == ["Keeper", "Worker"]
    clock.advance(2)
    await store.sweep()
    assert [m.message_id for m in recorder.expired] == ["c"]


def messages_alive() -> int:
    gc.collect()
    return sum(isinstance(o, Message) for o in gc.get_objects())


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_what_was_acked_or_expired_is_not_kept(
    kind: str, tmp_path: Path, clock: FakeClock
) -> None:
    """A store in this process keeps what it holds, not what it held: 5,000 messages acked
    with an hour of TTL left, and 5,000 that expired in a queue nobody reads, leave at most a
    bounded remainder alive (the expiry and lease heaps used to keep every acked message
    until its TTL ended: 36 million at 10,000 a second)."""
    options = {"max_messages_per_agent": 10, "max_total_messages": 100, "clock": clock}
    store: QueueStore = (
        InMemoryQueueStore(**options)
        if kind == "memory"
        else SqliteQueueStore(tmp_path / "q.db", **options)
    )
    before = messages_alive()
    for i in range(5000):
        await store.put(msg(f"acked{i}"), 3600)
        lease = await store.lease("PaymentAgent", "s", 30)
        assert lease is not None
        assert await store.ack("PaymentAgent", [lease.message.message_id]) == 1
    del lease
    await store.sync()  # the durable store's journal holds its changes until they are written
    assert messages_alive() - before < 1100
    for i in range(5000):
        await store.put(msg(f"unread{i}", to="AuditAgent"), 1)
        clock.advance(2)
        if i % 100 == 0:
            await store.sweep()
    await store.sweep()
    await store.sync()  # the durable store's journal holds its changes until they are written
    assert await store.held() == 0
    assert messages_alive() - before < 1100
    await store.close()


# -- the durable store ---------------------------------------------------------------------


@pytest.fixture(params=["redis", "redis-cluster"])
def redis_store_url(request: pytest.FixtureRequest) -> str:
    return str(
        request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
    )


async def test_redis_cluster_shards_the_queues_by_agent(redis_cluster_url: str) -> None:
    import redis.asyncio as aioredis

    from mesh.redis_store import RedisQueueStore

    store = RedisQueueStore(redis_cluster_url, max_messages_per_agent=100)
    agents = [f"Agent{n}" for n in range(12)]
    try:
        for agent in agents:
            for i in range(3):
                await store.put(msg(f"{agent}-{i}", to=agent, at=i), 3600)
        assert store.cluster
        # Each agent's queue lives whole on one node, and the agents spread over the nodes.
        owners: dict[str, set[str]] = {}
        client = await store._client()
        for node in client.get_primaries():
            plain = aioredis.Redis(host=node.host, port=node.port)
            for key in await plain.keys("mesh:{*}:msg"):
                owners.setdefault(key.decode(), set()).add(node.name)
            await plain.aclose()
        assert sorted(owners) == sorted(f"mesh:{{{agent}}}:msg" for agent in agents)
        assert all(len(nodes) == 1 for nodes in owners.values())
        assert len(set().union(*owners.values())) >= 2
        for agent in agents:
            assert await ids(store, agent) == [f"{agent}-{i}" for i in range(3)]
        assert await store.held() == 0
    finally:
        await store.close()


async def test_redis_a_queue_forgotten_through_one_replica_is_named_again_by_another(
    redis_store_url: str,
) -> None:
    """Replica B forgets an agent whose queue replica A already knows: A's next message to
    it must name the queue again (A would not, by what it knew), or no sweep would go
    through it."""
    from mesh.redis_store import RedisQueueStore

    a = RedisQueueStore(redis_store_url, **OPTIONS)
    b = RedisQueueStore(redis_store_url, **OPTIONS)
    try:
        await a.put(msg("first", to="Worker"), 3600)
        assert await ids(a, "Worker") == ["first"]
        await b.forget_agent("Worker")
        assert await b.stats() == []
        await a.put(msg("again", to="Worker"), 3600)
        assert [(s.agent_id, s.depth) for s in await b.stats()] == [("Worker", 1)]
    finally:
        await a.close()
        await b.close()


async def test_redis_sweeps_go_through_the_queues_that_hold_messages_only(
    redis_url: str, clock: FakeClock
) -> None:
    """200 agents whose queues were used and are empty again: after the sweep that finds
    them so, a sweep runs no script for them (on the old design, one per queue five times a
    second on every replica); a queue that gets a message again is swept again, and what
    falls due in it is expired."""
    import redis.asyncio as aioredis

    from mesh.redis_store import BUSY, RedisQueueStore

    store = RedisQueueStore(
        redis_url, max_messages_per_agent=10, wall_clock=lambda: BASE + timedelta(seconds=clock())
    )
    recorder = Recorder()
    store.listener = recorder
    raw = aioredis.Redis.from_url(redis_url)

    async def scripts_run() -> int:
        stats = await raw.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

    try:
        agents = [f"agent-{i}" for i in range(200)]
        for agent_id in agents:
            await store.put(msg(f"m-{agent_id}", to=agent_id), 3600)
        for agent_id in agents:
            assert len(await store.pop(agent_id)) == 1
        await store.sweep()  # finds every queue empty
        assert await raw.smembers(BUSY) == set()
        before = await scripts_run()
        await store.sweep()
        assert await scripts_run() == before
        assert [s.agent_id for s in await store.stats()] == sorted(agents)  # still known

        await store.put(msg("late", to="agent-7"), 10)
        assert await raw.smembers(BUSY) == {b"agent-7"}
        clock.advance(11)
        before = await scripts_run()
        await store.sweep()
        assert await scripts_run() == before + 1
        assert [m.message_id for m in recorder.expired] == ["late"]
    finally:
        await raw.aclose()
        await store.close()


async def test_redis_a_queue_one_replica_found_idle_is_swept_again_after_anothers_put(
    redis_store_url: str, clock: FakeClock
) -> None:
    """Replica A's sweep finds a queue empty and takes it out of the swept queues; replica
    B, which already knew the queue, then puts a message in it with a TTL of 10 s. A's next
    sweep must go through it again and expire the message once its TTL is over."""
    from mesh.redis_store import RedisQueueStore

    def replica() -> RedisQueueStore:
        return RedisQueueStore(
            redis_store_url, **OPTIONS, wall_clock=lambda: BASE + timedelta(seconds=clock())
        )

    a, b = replica(), replica()
    recorder = Recorder()
    a.listener = recorder
    try:
        assert await b.put(msg("first", to="Worker"), 3600)
        assert await ids(b, "Worker") == ["first"]
        await a.sweep()
        assert await b.put(msg("late", to="Worker"), 10)
        clock.advance(11)
        await a.sweep()
        assert [m.message_id for m in recorder.expired] == ["late"]
    finally:
        await a.close()
        await b.close()


async def test_redis_a_put_while_a_sweep_takes_its_queue_out_keeps_the_queue_swept(
    redis_store_url: str,
) -> None:
    """The race of taking an idle queue out: the sweep's script has found it empty (and
    deleted its counter) when another replica's put comes in, before the sweep takes the
    queue out of mesh:busy. The sweep must see the put and name the queue again."""
    from mesh.redis_store import BUSY, RedisQueueStore, connect

    a = RedisQueueStore(redis_store_url, **OPTIONS)
    b = RedisQueueStore(redis_store_url, **OPTIONS)
    raw = await connect(redis_store_url)
    try:
        assert await b.put(msg("first", to="Worker"), 3600)
        assert await ids(b, "Worker") == ["first"]
        _, [(_, idle)] = await a._run_many("sweep", [("Worker", a._return_args())])
        assert int(idle) == 1
        assert await b.put(msg("between", to="Worker"), 3600)  # names it in mesh:busy
        await a._mark_idle(["Worker"], [])  # takes it out, then looks again: named again
        assert await raw.smembers(BUSY) == {b"Worker"}
    finally:
        await raw.aclose()
        await a.close()
        await b.close()


async def test_redis_a_sweep_through_every_queue_finds_one_left_out(
    redis_store_url: str, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue holding a message but missing from mesh:busy (its naming lost in a failover)
    is swept by the next sweep through every queue, and named again."""
    from mesh.redis_store import BUSY, RedisQueueStore, connect

    store = RedisQueueStore(
        redis_store_url, **OPTIONS, wall_clock=lambda: BASE + timedelta(seconds=clock())
    )
    recorder = Recorder()
    store.listener = recorder
    raw = await connect(redis_store_url)
    try:
        await store.sweep()
        assert await store.put(msg("kept", to="Worker"), 3600)
        assert await store.put(msg("due", to="Worker"), 10)
        await raw.srem(BUSY, "Worker")
        clock.advance(11)
        await store.sweep()  # through mesh:busy: the queue is not there
        assert recorder.expired == []
        monkeypatch.setattr("mesh.redis_store.FULL_SWEEP_SECONDS", 0.0)
        await store.sweep()
        assert [m.message_id for m in recorder.expired] == ["due"]
        assert await raw.smembers(BUSY) == {b"Worker"}
        assert await ids(store, "Worker") == ["kept"]
    finally:
        await raw.aclose()
        await store.close()


async def test_redis_replicas_keep_time_by_the_server_not_by_their_hosts(
    redis_store_url: str,
) -> None:
    """A replica on a host whose clock runs 30 s behind: what it sets (a lease end, a TTL
    end), judged by another replica's sweep, lasts its full time. By that host's own clock
    the lease would have ended 25 s before it began, and the message expired at once."""
    from mesh.redis_store import RedisQueueStore

    behind = RedisQueueStore(redis_store_url, **OPTIONS, local_clock=lambda: time.time() - 30)
    other = RedisQueueStore(redis_store_url, **OPTIONS)
    recorder = Recorder()
    other.listener = recorder
    try:
        await behind.put(msg("leased"), 3600)
        lease = await behind.lease("PaymentAgent", "s", 5)
        assert lease is not None
        assert lease.lease_expires_at.timestamp() == pytest.approx(time.time() + 5, abs=1)
        await behind.put(msg("waiting", to="AuditAgent"), 10)
        await other.sweep()
        assert recorder.redelivered == [] and recorder.expired == []
        [payment] = await other.stats("PaymentAgent")
        assert payment.in_flight == 1
        assert await ids(other, "AuditAgent") == ["waiting"]
    finally:
        await behind.close()
        await other.close()


async def test_redis_total_count_left_too_high_is_corrected(
    redis_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mesh.redis_store import TOTAL, RedisQueueStore, connect

    store = RedisQueueStore(redis_store_url, **OPTIONS)
    try:
        for i in range(3):
            await store.put(msg(f"m{i}"), 3600)
        # A replica killed between removing messages and giving their places back.
        raw = await connect(redis_store_url)
        await raw.incrby(TOTAL, 5)
        with pytest.raises(MessageQueueFullError, match="hold 8 of their 8"):
            await store.put(msg("x", to="HotelAgent"), 3600)
        monkeypatch.setattr("mesh.redis_store.RECONCILE_EVERY", 0.0)
        for _ in range(3):  # the same difference three samples running: corrected
            await store.sweep()
        assert int(await raw.get(TOTAL)) == 3
        await raw.aclose()
        for i in range(5):
            assert await store.put(msg(f"h{i}", to="HotelAgent"), 3600)
        assert await store.held() == 8
    finally:
        await store.close()


async def test_redis_total_limit_holds_across_replicas_with_a_stale_count(
    redis_store_url: str,
) -> None:
    from mesh.redis_store import TOTAL, RedisQueueStore, connect

    a = RedisQueueStore(redis_store_url, **OPTIONS)
    b = RedisQueueStore(redis_store_url, **OPTIONS)
    raw = await connect(redis_store_url)
    try:
        assert await a.put(msg("a0", to="A"), 3600)  # replica A last saw 1 message held
        for i in range(7):  # replica B fills the broker-wide limit of 8 meanwhile
            assert await b.put(msg(f"b{i}", to=f"B{i % 2}"), 3600)
        # A's put goes out with its reservation in one round trip, finds the limit passed,
        # takes its message back and refuses it: the limit holds.
        with pytest.raises(MessageQueueFullError, match="of their 8 messages"):
            await a.put(msg("a1", to="A"), 3600)
        assert [p.message.message_id for p in await b.pop("A")] == ["a0"]
        assert await a.held() == 7
        await a.sweep()  # every place given back is on the count
        assert int(await raw.get(TOTAL)) == 7
    finally:
        await raw.aclose()
        await a.close()
        await b.close()


async def test_redis_a_retry_sent_with_a_put_taken_back_is_refused_with_it(
    redis_store_url: str,
) -> None:
    """Replica A, its count stale, sends a message and its retry together past the limit:
    the message is taken back, and the retry, which had found it held, is refused too
    (it was answered accepted for a message no longer there)."""
    from mesh.redis_store import RedisQueueStore

    a = RedisQueueStore(redis_store_url, **OPTIONS)
    b = RedisQueueStore(redis_store_url, **OPTIONS)
    try:
        assert await a.put(msg("a0", to="A"), 3600)  # replica A last saw 1 message held
        for i in range(7):  # replica B fills the broker-wide limit of 8 meanwhile
            assert await b.put(msg(f"b{i}", to=f"B{i % 2}"), 3600)
        results = await asyncio.gather(
            a.put(msg("a1", to="A"), 3600),
            a.put(msg("a1", to="A"), 3600),
            return_exceptions=True,
        )
        assert all(isinstance(r, MessageQueueFullError) for r in results), results
        assert [p.message.message_id for p in await b.pop("A")] == ["a0"]
    finally:
        await a.close()
        await b.close()


async def test_reopened_store_has_every_accepted_message_in_order_with_its_state(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = tmp_path / "queues.db"
    first = SqliteQueueStore(path, **OPTIONS, clock=clock)
    await first.put(msg("low", priority=Priority.LOW, at=0), 3600)
    await first.put(msg("high", priority=Priority.HIGH, at=5), 3600)
    await first.put(msg("medium", priority=Priority.MEDIUM, at=1), 100)
    await first.put(msg("acked", at=2), 3600)
    await first.put(msg("popped", to="HotelAgent"), 3600)
    await first.sync()
    leased = await first.lease("PaymentAgent", "s1", 30)
    assert leased is not None and leased.message.message_id == "high"
    await first.lease("PaymentAgent", "s1", 30)  # medium
    await first.nack("PaymentAgent", ["medium"])  # back, attempt 1 recorded
    await first.lease("PaymentAgent", "s1", 30)  # medium again, attempt 2
    await first.lease("PaymentAgent", "s1", 30)  # acked
    await first.ack("PaymentAgent", ["acked"])
    await first.pop("HotelAgent")
    await first.close()

    second = SqliteQueueStore(path, **OPTIONS, clock=FakeClock())
    assert second.restored == 3
    stats = {s.agent_id: s for s in await second.stats()}
    assert (stats["PaymentAgent"].high, stats["PaymentAgent"].medium) == (1, 1)
    assert (stats["PaymentAgent"].low, stats["PaymentAgent"].in_flight) == (1, 0)
    got = []
    while (lease := await second.lease("PaymentAgent", "s2", 30)) is not None:
        got.append((lease.message.message_id, lease.attempt))
    # Leased when the first store closed: queued again, with the next attempt number.
    assert got == [("high", 2), ("medium", 3), ("low", 1)]
    assert await second.pop("HotelAgent") == []
    await second.close()


async def test_withdrawn_messages_stay_gone_after_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "queues.db"
    first = SqliteQueueStore(path, **OPTIONS)
    for mid in ("waiting", "leased", "kept"):
        await first.put(msg(mid), 3600)
    await first.lease("PaymentAgent", "s", 30)  # waiting (the oldest by arrival)
    await first.lease("PaymentAgent", "s", 30)  # leased
    await first.nack("PaymentAgent", ["waiting"])
    assert await first.withdraw("PaymentAgent", ["waiting", "leased"]) == (1, 1)
    await first.close()
    second = SqliteQueueStore(path, **OPTIONS)
    assert second.restored == 1
    assert await ids(second) == ["kept"]
    await second.close()


async def test_reopened_store_keeps_what_remains_of_the_ttl(tmp_path: Path) -> None:
    path = tmp_path / "queues.db"
    wall = [BASE]
    first = SqliteQueueStore(path, **OPTIONS, wall_clock=lambda: wall[0])
    await first.put(msg("short"), 10)
    await first.put(msg("long"), 3600)
    await first.close()
    wall[0] = BASE + timedelta(seconds=11)  # the broker was down for 11 s
    recorder = Recorder()
    second = SqliteQueueStore(path, **OPTIONS, wall_clock=lambda: wall[0], listener=recorder)
    assert await ids(second) == ["long"]
    assert [m.message_id for m in recorder.expired] == ["short"]
    await second.close()


async def test_a_delay_asked_by_a_nack_survives_a_reopen(tmp_path: Path) -> None:
    """A message nacked with a delay waits out what remains of it after a restart, where a
    lease ends with the process; once it has come back, a restart leaves it in its place."""
    path = tmp_path / "queues.db"
    wall = [BASE]
    clock = FakeClock()
    first = SqliteQueueStore(path, **OPTIONS, clock=clock, wall_clock=lambda: wall[0])
    for mid in ("later", "leased", "kept"):
        await first.put(msg(mid, at={"later": 0, "leased": 1, "kept": 2}[mid]), 3600)
    assert len(await first.lease_many("PaymentAgent", "s", 30, 2)) == 2
    assert await first.nack("PaymentAgent", ["later"], delay=60) == (1, 0)
    await first.close()
    wall[0] = BASE + timedelta(seconds=20)  # down for 20 s: 40 s of the delay remain
    second = SqliteQueueStore(path, **OPTIONS, clock=clock, wall_clock=lambda: wall[0])
    [stats] = await second.stats("PaymentAgent")
    assert (stats.depth, stats.in_flight, stats.deferred) == (2, 0, 1)
    assert [(p.message.message_id, p.attempts) for p in await second.pop("PaymentAgent")] == [
        ("leased", 1),
        ("kept", 0),
    ]
    clock.advance(39)
    await second.sweep()
    assert await second.lease("PaymentAgent", "s", 30) is None
    clock.advance(2)
    await second.sweep()
    back = await second.lease("PaymentAgent", "s", 30)
    assert back is not None and (back.message.message_id, back.attempt) == ("later", 2)
    assert await second.nack("PaymentAgent", ["later"]) == (1, 0)  # (back at once)
    await second.close()
    third = SqliteQueueStore(path, **OPTIONS, clock=clock, wall_clock=lambda: wall[0])
    assert [(p.message.message_id, p.attempts) for p in await third.pop("PaymentAgent")] == [
        ("later", 2)
    ]
    await third.close()


async def test_a_scheduled_message_keeps_its_time_through_a_reopen(tmp_path: Path) -> None:
    """A scheduled message waits out what remains of its delay after a restart, and is then
    delivered for the first time."""
    path = tmp_path / "queues.db"
    wall = [BASE]
    clock = FakeClock()
    first = SqliteQueueStore(path, **OPTIONS, clock=clock, wall_clock=lambda: wall[0])
    await first.put(msg("later", at=0), 3600, None, 60)
    await first.put(msg("now", at=1), 3600)
    await first.close()
    wall[0] = BASE + timedelta(seconds=20)  # down for 20 s: 40 s of the delay remain
    second = SqliteQueueStore(path, **OPTIONS, clock=clock, wall_clock=lambda: wall[0])
    assert [p.message.message_id for p in await second.pop("PaymentAgent")] == ["now"]
    [listed] = await second.listing("PaymentAgent")
    assert (listed.message.message_id, listed.state.value, listed.attempts) == (
        "later",
        "DEFERRED",
        0,
    )
    clock.advance(39)
    await second.sweep()
    assert await second.lease("PaymentAgent", "s", 30) is None
    clock.advance(2)
    await second.sweep()
    back = await second.lease("PaymentAgent", "s", 30)
    assert back is not None and (back.message.message_id, back.attempt) == ("later", 1)
    await second.close()


async def test_a_database_of_an_earlier_version_is_read_and_written(tmp_path: Path) -> None:
    """A database written before messages could be nacked with a delay (no ``not_before``
    column) opens: its messages are restored, and a delay asked now is kept."""
    path = tmp_path / "queues.db"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE messages (agent_id TEXT NOT NULL, message_id TEXT NOT NULL,"
        " accepted_at REAL NOT NULL, expires_at REAL NOT NULL,"
        " attempts INTEGER NOT NULL DEFAULT 0, body TEXT NOT NULL,"
        " PRIMARY KEY (agent_id, message_id))"
    )
    now = datetime.now(UTC).timestamp()
    body = json.dumps(msg("old").to_dict())
    old.execute(
        "INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?)",
        ("PaymentAgent", "old", now, now + 3600, 1, body),
    )
    old.commit()
    old.close()
    first = SqliteQueueStore(path, **OPTIONS)
    assert first.restored == 1
    await first.put(msg("new", at=1), 3600)
    leased = await first.lease_many("PaymentAgent", "s", 30, 2)
    assert [(lease.message.message_id, lease.attempt) for lease in leased] == [
        ("old", 2),
        ("new", 1),
    ]
    assert await first.nack("PaymentAgent", ["old"], delay=3600) == (1, 0)
    await first.close()
    second = SqliteQueueStore(path, **OPTIONS)
    assert [p.message.message_id for p in await second.pop("PaymentAgent")] == ["new"]
    [stats] = await second.stats("PaymentAgent")
    assert (stats.depth, stats.in_flight, stats.deferred) == (0, 0, 1)  # (old: an hour to wait)
    await second.close()


async def test_dead_letters_survive_a_reopen(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "queues.db"
    first = SqliteQueueStore(path, **OPTIONS, clock=clock)
    await first.put(msg("poison"), 3600)
    for _ in range(3):
        await first.lease("PaymentAgent", "s", 30)
        await first.nack("PaymentAgent", ["poison"])
    await first.close()
    second = SqliteQueueStore(path, **OPTIONS, clock=clock)
    dead = await second.dead_letters("PaymentAgent")
    assert [(d.message.message_id, d.attempts) for d in dead] == [("poison", 3)]
    assert (await second.stats("PaymentAgent"))[0].dead_letters == 1
    assert await second.held() == 0
    assert await second.remove_dead_letters("PaymentAgent", ["poison"]) == 1
    await second.close()
    third = SqliteQueueStore(path, **OPTIONS, clock=clock)  # taken out for good
    assert await third.dead_letters("PaymentAgent") == []
    await third.close()


async def test_concurrent_senders_share_commits(tmp_path: Path) -> None:
    store = SqliteQueueStore(tmp_path / "q.db", max_messages_per_agent=1000)

    async def send(i: int) -> None:
        await store.put(msg(f"m{i}"), 3600)
        await store.sync()

    await asyncio.gather(*(send(i) for i in range(200)))
    assert store.journal.commits < 200
    await store.close()
    reopened = SqliteQueueStore(tmp_path / "q.db", max_messages_per_agent=1000)
    assert reopened.restored == 200
    await reopened.close()


async def test_store_urls(tmp_path: Path) -> None:
    assert type(open_store("memory://")) is InMemoryQueueStore
    bare = open_store(str(tmp_path / "queues.db"))
    assert type(bare) is SqliteQueueStore
    await bare.close()
    with pytest.raises(ValueError, match="unknown queue store"):
        open_store("postgres://x")
    with pytest.raises(ValueError, match="needs a file path"):
        open_store("sqlite://")


async def test_a_registration_changed_by_many_at_once_keeps_every_change(
    store: QueueStore,
) -> None:
    """Ten changes to one registration at once, each adding an instance to what it reads: a
    store shared by replicas keeps all ten (a change that read before another's write reads
    again), and a store of one process keeps what each change returns (it keeps nothing to
    read: the broker's own registry is the registration)."""
    agent_id = f"Crowd-{secrets.token_hex(4)}"  # (a Redis is shared by the tests)

    def adding(address: str) -> Callable[[AgentInfo | None], AgentInfo | None]:
        def change(saved: AgentInfo | None) -> AgentInfo:
            earlier = saved.instances if saved else ()
            return AgentInfo(agent_id=agent_id, address=address, instances=(*earlier, address))

        return change

    addresses = [f"10.2.0.{n}:7000" for n in range(10)]
    kept = await asyncio.gather(*(store.update_agent(agent_id, adding(a)) for a in addresses))
    saved = await store.saved_agent(agent_id)
    if store.shared:
        assert saved is not None and sorted(saved.instances) == sorted(addresses)
        assert max(len(k.instances) for k in kept if k) == 10
    else:
        assert [k.instances for k in kept if k] == [(a,) for a in addresses]
    assert await store.update_agent(agent_id, lambda saved: None) is None
    assert await store.saved_agent(agent_id) is None

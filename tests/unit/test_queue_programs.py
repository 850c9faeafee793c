"""Random programs of queue operations, run on every store side by side.

Hypothesis writes programs of puts (two agents, reused ids, every priority, timestamps out
of order, short and long TTLs), leases, acks, nacks (at once or after a delay),
dead-lettering, withdrawals, departures, pops, listings and the passing of time. The
in-memory store runs each program next to the Redis store (one server, two replicas sharing
one, and a three-node cluster), and every answer and every queue's state after each step
must be the same in both: the stores are one contract. Each store's answers are also held to
rules of their own: what one lease or pop hands out comes in priority order (in arrival
order for a FIFO queue), no attempt is counted past the limit, and every message accepted is
accounted for (taken, expired, dead-lettered or still held). The SQLite store, closed and
opened again after a program, must give back every message it held, in order, with its
attempts.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mesh.core.durable import SqliteQueueStore
from mesh.core.errors import MessageIdTakenError, MessageQueueFullError
from mesh.core.model import DeadLetter, Message, Priority
from mesh.core.queue import InMemoryQueueStore, QueueStore, Released
from tests.helpers.programs import flush_mesh_keys, programs_settings

BASE = datetime(2025, 11, 16, 10, 0, 0, tzinfo=UTC)
AGENTS = ("a", "b")
IDS = tuple(f"m{i}" for i in range(6))
SUBSCRIBERS = ("s1", "s2")
OPTIONS: dict[str, Any] = {
    "max_messages_per_agent": 4,
    "max_total_messages": 6,
    "max_delivery_attempts": 2,
}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return BASE + timedelta(seconds=self.now)


@dataclass
class Events:
    """What a store told its listener."""

    expired: list[str] = field(default_factory=list)
    dead: list[tuple[str, str, int]] = field(default_factory=list)

    def on_expired(self, message: Message) -> None:
        self.expired.append(message.message_id)

    def on_dead_letter(self, dead: DeadLetter) -> None:
        self.dead.append((dead.message.message_id, dead.reason, dead.attempts))

    def on_redelivery(self, message: Message, attempt: int) -> None:
        pass

    def on_due(self, message: Message) -> None:
        pass

    def on_released(self, released: Released) -> None:
        pass


# -- programs ----------------------------------------------------------------------------------

agents = st.sampled_from(("a", "a", "a", "b"))  # (most to one: its queue fills)
some_ids = st.one_of(
    st.just("last"),  # the ids of the agent's last lease: what a subscriber acks or nacks
    st.lists(st.sampled_from(IDS), min_size=1, max_size=3, unique=True),
)
puts = st.tuples(
    st.just("put"),
    agents,
    st.sampled_from(IDS),
    st.sampled_from(list(Priority)),
    st.sampled_from([0.0, 1.0, 2.0]),  # the message's timestamp, seconds after BASE
    st.sampled_from([1.0, 5.0, 1000.0]),  # ttl
    st.sampled_from(("Sender", "Sender", "Other")),  # (an id reused by another: refused)
    st.sampled_from([0.0, 0.0, 0.0, 2.0]),  # a delay (a scheduled message)
)
leases = st.tuples(
    st.just("lease"),
    agents,
    st.sampled_from(SUBSCRIBERS),
    st.sampled_from([2.0, 100.0]),
    st.integers(1, 3),
)
operations = st.one_of(  # (puts and leases more often than the rest)
    puts,
    puts,
    puts,
    leases,
    leases,
    st.tuples(st.just("ack"), agents, some_ids),
    st.tuples(st.just("nack"), agents, some_ids, st.sampled_from(["", "poison"])),
    st.tuples(st.just("nack_later"), agents, some_ids, st.sampled_from([1.0, 5.0])),
    st.tuples(st.just("withdraw"), agents, some_ids),
    st.tuples(st.just("cancel"), agents, st.sampled_from(("Sender", "Other")), some_ids),
    st.tuples(st.just("release"), agents, st.sampled_from(SUBSCRIBERS)),
    st.tuples(st.just("release_seen"), agents, st.sampled_from(SUBSCRIBERS), some_ids),
    st.tuples(st.just("still_leased"), agents, st.sampled_from(SUBSCRIBERS), some_ids),
    st.tuples(st.just("undead"), agents, some_ids),
    st.tuples(st.just("extend"), agents, some_ids, st.sampled_from([2.0, 100.0])),
    st.tuples(st.just("pop"), agents, st.integers(0, 2)),
    st.tuples(st.just("listing"), agents),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 1.5, 3.0, 200.0])),
)
programs = st.lists(operations, min_size=10, max_size=40)


def message(mid: str, to: str, priority: Priority, at: float, sender: str = "Sender") -> Message:
    return Message(
        message_id=mid,
        from_agent=sender,
        to_agent=to,
        content={"action": "work", "parameters": {"id": mid}},
        priority=priority,
        timestamp=BASE + timedelta(seconds=at),
    )


async def step(store: QueueStore, op: tuple[Any, ...], last: dict[str, list[str]]) -> Any:
    """Runs one operation (``last``: each agent's last leased ids); returns what a caller of
    the store sees."""
    kind, *args = op
    args = [last.get(args[0], []) if arg == "last" else arg for arg in args]
    if kind == "put":
        agent_id, mid, priority, at, ttl, sender, delay = args
        try:
            return await store.put(message(mid, agent_id, priority, at, sender), ttl, None, delay)
        except MessageQueueFullError:
            return "full"
        except MessageIdTakenError as error:
            return ("taken", error.message)
    if kind == "lease":
        agent_id, subscriber, seconds, most = args
        leases = await store.lease_many(agent_id, subscriber, seconds, most)
        return [(lease.message.message_id, lease.attempt) for lease in leases]
    if kind == "ack":
        return await store.ack(args[0], args[1])
    if kind == "nack":
        return await store.nack(args[0], args[1], dead_letter_reason=args[2])
    if kind == "nack_later":
        return await store.nack(args[0], args[1], delay=args[2])
    if kind == "withdraw":
        return await store.withdraw(args[0], args[1])
    if kind == "cancel":
        return await store.cancel(args[0], args[1], args[2])
    if kind == "release":
        return await store.release_subscriber(args[0], args[1])
    if kind == "release_seen":
        return await store.release_subscriber(args[0], args[1], seen=args[2])
    if kind == "still_leased":
        return sorted(await store.still_leased(args[0], args[1], args[2]))
    if kind == "undead":
        return await store.remove_dead_letters(args[0], args[1])
    if kind == "extend":
        return await store.extend_lease(args[0], args[1], args[2])
    if kind == "listing":
        held = await store.listing(args[0])
        return [(h.message.message_id, h.attempts, h.state.value) for h in held]
    if kind == "pop":
        popped = await store.pop(args[0], args[1])
        return [(p.message.message_id, p.attempts) for p in popped]
    assert kind == "advance"
    return None


async def state(store: QueueStore) -> dict[str, Any]:
    """Every queue's counts and dead letters, and what the store holds in all."""
    stats = {
        s.agent_id: (s.high, s.medium, s.low, s.in_flight, s.deferred, s.dead_letters)
        for s in await store.stats()
        if s.held or s.dead_letters
    }
    dead = sorted(
        (d.message.to_agent, d.message.message_id, d.reason, d.attempts)
        for d in await store.dead_letters()
    )
    return {"stats": stats, "dead": dead, "held": await store.held()}


@dataclass
class Ledger:
    """Every message a store accepted is in one place: taken (acked, popped, withdrawn),
    expired, dead-lettered, or still held."""

    accepted: int = 0
    taken: int = 0

    def count(self, op: tuple[Any, ...], answer: Any) -> None:
        kind = op[0]
        if kind == "put" and answer is True:
            self.accepted += 1
        elif kind == "ack":
            self.taken += answer
        elif kind == "withdraw":
            self.taken += sum(answer)
        elif kind in ("cancel", "pop"):
            self.taken += len(answer)

    async def check(self, store: QueueStore, events: Events, where: str) -> None:
        held = await store.held()
        accounted = self.taken + len(events.expired) + len(events.dead) + held
        assert accounted == self.accepted, (
            f"{where}: {self.accepted} accepted, {self.taken} taken, {len(events.expired)} "
            f"expired, {len(events.dead)} dead-lettered, {held} held"
        )


def check_handed_out(
    op: tuple[Any, ...], answer: Any, sent: dict[tuple[str, str], Any], options: dict[str, Any]
) -> None:
    """What a lease or pop hands out comes in queue order, none past its last attempt."""
    if op[0] not in ("lease", "pop"):
        return
    assert all(0 <= attempts <= options["max_delivery_attempts"] for _, attempts in answer)
    if not options.get("fifo"):
        places = [sent[(op[1], mid)] for mid, _ in answer]
        assert places == sorted(places), f"{op}: {answer} out of priority order"


# -- running -----------------------------------------------------------------------------------


Opener = Callable[[Clock, Events, dict[str, Any]], Awaitable[QueueStore]]


async def run_side_by_side(
    program: list[tuple[Any, ...]], open_other: Opener, **options: Any
) -> tuple[InMemoryQueueStore, QueueStore, Clock]:
    """Runs the program on the in-memory store and on the other, comparing them after each
    step; returns both stores, open, and their clock."""
    options = {**OPTIONS, **options}
    clock, reference_events, other_events = Clock(), Events(), Events()
    ledger = Ledger()
    last: dict[str, list[str]] = {}
    sent: dict[tuple[str, str], tuple[int, float]] = {}  # (agent, id): (rank, timestamp)
    reference = InMemoryQueueStore(
        **options, clock=clock, wall_clock=clock.wall, listener=reference_events
    )
    other = await open_other(clock, other_events, options)
    try:
        for number, op in enumerate(program):
            if op[0] == "advance":
                clock.now += op[1]
                await reference.sweep()
                await other.sweep()
            expected, got = await step(reference, op, last), await step(other, op, last)
            if op[0] == "lease" and expected:
                last[op[1]] = [mid for mid, _ in expected]
            where = f"step {number} {op} of {program}"
            assert got == expected, f"{where}: {got} != {expected}"
            assert await state(other) == await state(reference), where
            ledger.count(op, expected)
            if op[0] == "put" and expected is True:
                sent[(op[1], op[2])] = (op[3].rank, op[4])
            check_handed_out(op, expected, sent, options)
            check_handed_out(op, got, sent, options)
            await ledger.check(reference, reference_events, where)
            await ledger.check(other, other_events, where)
            if op[0] == "advance":
                assert sorted(other_events.expired) == sorted(reference_events.expired), where
                assert sorted(other_events.dead) == sorted(reference_events.dead), where
    except BaseException:
        await other.close()
        raise
    return reference, other, clock


async def compare(program: list[tuple[Any, ...]], open_other: Opener, **options: Any) -> None:
    reference, other, _ = await run_side_by_side(program, open_other, **options)
    await other.close()
    await reference.close()


def redis_opener(urls: list[str]) -> Opener:
    async def open_redis(clock: Clock, events: Events, options: dict[str, Any]) -> QueueStore:
        from mesh.redis_store import RedisQueueStore

        flush_mesh_keys(*urls)
        made = RedisQueueStore(urls[0], **options, wall_clock=clock.wall)
        made.listener = events
        return made

    return open_redis


class Replicas:
    """Two Redis stores on one Redis, as two broker replicas share it: each call goes to one
    of them, as ``turns`` says; both sweep."""

    def __init__(self, first: QueueStore, second: QueueStore, turns: random.Random) -> None:
        self.stores, self.turns = (first, second), turns

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stores[self.turns.randrange(2)], name)

    async def sweep(self) -> None:
        for store in self.stores:  # every replica sweeps (and so beats), time passing
            await store.sweep()

    async def close(self) -> None:
        for store in self.stores:
            await store.close()


def replicas_opener(url: str, seed: int) -> Opener:
    async def open_replicas(clock: Clock, events: Events, options: dict[str, Any]) -> QueueStore:
        from mesh.redis_store import RedisQueueStore

        flush_mesh_keys(url)
        made = [RedisQueueStore(url, **options, wall_clock=clock.wall) for _ in range(2)]
        for store in made:
            store.listener = events
        return Replicas(made[0], made[1], random.Random(seed))  # type: ignore[return-value]

    return open_replicas


def sqlite_opener(path: Path) -> Opener:
    async def open_sqlite(clock: Clock, events: Events, options: dict[str, Any]) -> QueueStore:
        return SqliteQueueStore(
            path, **options, clock=clock, wall_clock=clock.wall, listener=events
        )

    return open_sqlite


async def drain(store: QueueStore) -> dict[str, list[tuple[str, int]]]:
    """Every queue's messages in delivery order, with their attempts, taken out."""
    return {
        agent_id: [(p.message.message_id, p.attempts) for p in await store.pop(agent_id)]
        for agent_id in AGENTS
    }


def beating(program: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [("advance", 1.5) if op[0] == "advance" and op[1] >= 3 else op for op in program]


@programs_settings(300)
@given(program=programs, fifo=st.booleans())
def test_the_redis_store_answers_as_the_memory_store_does(
    program: list[tuple[Any, ...]], fifo: bool, redis_server: str
) -> None:
    asyncio.run(compare(program, redis_opener([redis_server]), fifo=fifo))


@programs_settings(150)
@given(program=programs.map(beating), seed=st.integers(0, 2**32))
def test_two_replicas_on_one_redis_answer_as_the_memory_store_does(
    program: list[tuple[Any, ...]], seed: int, redis_server: str
) -> None:
    """Each operation goes through one of two stores sharing the Redis, as a client's calls
    reach one broker replica or the other; time passes in steps shorter than a replica may
    go without beating (longer, one would take the other for gone, as it should)."""
    asyncio.run(compare(program, replicas_opener(redis_server, seed)))


@programs_settings(40)
@given(program=programs)
def test_a_redis_cluster_answers_as_the_memory_store_does(
    program: list[tuple[Any, ...]], local_redis_cluster: Any
) -> None:
    asyncio.run(compare(program, redis_opener(local_redis_cluster.urls)))


@programs_settings(150)
@given(program=programs)
def test_the_sqlite_store_gives_back_after_a_restart_what_it_held(
    program: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    """After any program, the SQLite store closed and opened again holds what it held:
    waiting and leased messages queued in their places with their attempts (a lease ends
    with the process: as when its subscriber leaves), those nacked with a delay waiting it
    out still, the dead letters kept."""

    async def run() -> None:
        path = tmp_path / f"queues-{secrets.token_hex(6)}.db"  # (one a program)
        # (attempts enough that handing the leases back dead-letters none)
        options = {"max_delivery_attempts": 100}
        reference, store, clock = await run_side_by_side(program, sqlite_opener(path), **options)
        await store.sync()
        await store.close()
        for subscriber in SUBSCRIBERS:  # what a restart does to the leases
            for agent_id in AGENTS:
                await reference.release_subscriber(agent_id, subscriber)
        reopened = SqliteQueueStore(
            path, **{**OPTIONS, **options}, clock=clock, wall_clock=clock.wall
        )
        try:
            assert await state(reopened) == await state(reference)
            # The messages nacked with a delay wait it out still, then come back alike.
            clock.now += 5.0
            await reference.sweep()
            await reopened.sweep()
            assert await drain(reopened) == await drain(reference)
        finally:
            await reopened.close()
            await reference.close()

    asyncio.run(run())

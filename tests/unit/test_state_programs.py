"""Random programs on the shared state and the shared memory pool, the broker's own beside
the ones in Redis.

Hypothesis writes programs of writes (blind, at an expected version, under a lock, with a
wrong or a stale token), deletes, reads, paged listings, locks taken and given back; the
shared state of one broker and the Redis one that replicas share run each program side by
side, and every answer (the entry, or the error's class and reason) must be the same in both,
as must every page of every listing after each step. The limits are small so that programs
meet them: three entries, two writers holding locks at once. The same for the memory pool:
writes, filtered reads (tags, segment, importance, writer, limit) and deletes, its
statistics, four insights at most.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mesh.core.errors import MultiAgentCommunicationError
from mesh.core.memory import Insight, MemoryPool, SharedMemoryPool
from mesh.core.state import SharedState, StateEntry, StateStore
from tests.helpers.programs import flush_mesh_keys, programs_settings

KEYS = ("k1", "k2", "p/a", "p/b")
AGENTS = ("A", "B", "C")
LIMITS: dict[str, Any] = {"capacity": 3, "max_writers": 2}

keys = st.sampled_from(KEYS)
agents = st.sampled_from(AGENTS)
tokens = st.sampled_from(["", "held", "wrong"])  # none, the key's last lock's, a made-up one
versions = st.sampled_from([None, 0, 1, 2])
values = st.sampled_from([1, "text", {"nested": [1, 2.5, None, True]}, [], None])
lifetimes = st.sampled_from([False, False, True])  # a ttl of its own per key, or none
operations = st.one_of(
    st.tuples(st.just("put"), keys, values, agents, versions, tokens, lifetimes),
    st.tuples(st.just("put"), keys, values, agents, versions, tokens, lifetimes),
    st.tuples(st.just("delete"), keys, agents, versions, tokens),
    st.tuples(st.just("get"), keys),
    st.tuples(st.just("lock"), keys, agents),
    st.tuples(st.just("unlock"), keys, tokens),
)
programs = st.lists(operations, min_size=5, max_size=30)


def seen(entry: StateEntry) -> tuple[Any, ...]:
    """(Whether it lapses, not when: each store reads its own clock.)"""
    lapses = entry.expires_at is not None
    return (entry.key, entry.value, entry.version, entry.updated_by, lapses)


async def step(state: StateStore, op: tuple[Any, ...], locks: dict[str, str]) -> Any:
    """Runs one operation (``locks``: the token of each key's last lock, per store); returns
    what a caller sees: the entry, the lock's holder, or the error's class and reason."""
    kind, key, *args = op
    token = {"": "", "held": locks.get(key, "none taken"), "wrong": "not-a-token"}
    try:
        if kind == "put":
            # A key's ttl is its own and minutes apart from the others': which one lapses
            # first (and so goes first from a full state) is the same in both stores.
            value, agent_id, version, lock, lapses = args
            ttl = 100.0 * (KEYS.index(key) + 1) if lapses else None
            return seen(
                await state.put(
                    key, value, agent_id, expected_version=version, lock_token=token[lock], ttl=ttl
                )
            )
        if kind == "delete":
            agent_id, version, lock = args
            return seen(
                await state.delete(key, agent_id, expected_version=version, lock_token=token[lock])
            )
        if kind == "get":
            return seen(await state.get(key))
        if kind == "lock":
            taken = await state.lock(key, args[0], wait=0, lease=60)
            locks[key] = taken.token
            return (taken.key, taken.holder)
        assert kind == "unlock"
        await state.unlock(key, token[args[0]])
        return "unlocked"
    except MultiAgentCommunicationError as error:
        return (type(error).__name__, error.reason)


async def listings(state: StateStore) -> dict[tuple[str, int], list[list[str]]]:
    """Every listing's pages (the keys on each), by prefix and page size."""
    out: dict[tuple[str, int], list[list[str]]] = {}
    for prefix in ("", "p/", "k"):
        for size in (0, 1, 2):
            pages, page_token = [], ""
            while True:
                page = await state.entries(prefix, page_size=size, page_token=page_token)
                pages.append([entry.key for entry in page.entries])
                if not (page_token := page.next_page_token):
                    break
                assert len(pages) <= len(KEYS) + 1, "a listing that does not end"
            out[(prefix, size)] = pages
    return out


async def compare(program: list[tuple[Any, ...]], url: str) -> None:
    from mesh.redis_shared import RedisSharedState
    from mesh.redis_store import RedisQueueStore

    store = RedisQueueStore(url)
    reference, other = SharedState(**LIMITS), RedisSharedState(store, **LIMITS)
    reference_locks: dict[str, str] = {}
    other_locks: dict[str, str] = {}
    try:
        for number, op in enumerate(program):
            expected = await step(reference, op, reference_locks)
            got = await step(other, op, other_locks)
            where = f"step {number} {op} of {program}"
            assert got == expected, f"{where}: {got} != {expected}"
            assert await listings(other) == await listings(reference), where
    finally:
        await other.close()
        await reference.close()
        await store.close()


FUZZ = programs_settings(200)


@FUZZ
@given(program=programs)
def test_the_shared_state_in_redis_answers_as_the_brokers_own_does(
    program: list[tuple[Any, ...]], redis_server: str
) -> None:
    flush_mesh_keys(redis_server)
    asyncio.run(compare(program, redis_server))


# -- the shared memory pool --------------------------------------------------------------------

TAGS = ("t1", "t2", "t3")
SEGMENTS = ("", "s1", "s2")
some_tags = st.lists(st.sampled_from(TAGS), max_size=2, unique=True)
written = st.lists(st.integers(0, 7), max_size=2, unique=True)  # the nth insights written
pool_operations = st.one_of(
    st.tuples(
        st.just("write"),
        agents,
        some_tags,
        st.sampled_from([0.1, 0.5, 0.9]),
        st.sampled_from(SEGMENTS),
        st.integers(0, 3),  # content
    ),
    st.tuples(
        st.just("read"),
        st.lists(st.sampled_from(TAGS), max_size=1),
        st.sampled_from(("", "", *SEGMENTS)),  # (most reads across segments)
        st.sampled_from([0.0, 0.5]),
        st.integers(0, 2),  # limit
        st.sampled_from(["", "A"]),
    ),
    st.tuples(
        st.just("delete"),
        written,
        some_tags,
        st.sampled_from(SEGMENTS),
        st.sampled_from(["", "A"]),
    ),
    st.tuples(st.just("stats")),
)
pool_programs = st.lists(pool_operations, min_size=5, max_size=30)


async def pool_step(pool: MemoryPool, op: tuple[Any, ...], ids: list[str]) -> Any:
    """Runs one operation (``ids``: the ids of the insights this pool wrote, in order);
    returns what a caller sees, each insight named by the order it was written in (ids are
    the pool's own: a pool in Redis may skip numbers)."""
    kind, *args = op
    try:
        if kind == "write":
            agent_id, tags, importance, segment, content = args
            stored = await pool.write(
                Insight(
                    agent_id=agent_id,
                    content={"n": content},
                    tags=tuple(tags),
                    importance=importance,
                    segment=segment,
                )
            )
            ids.append(stored.insight_id)
            return len(ids) - 1
        if kind == "read":
            tags, segment, least, limit, agent_id = args
            found = await pool.read(
                tags=tags, segment=segment, min_importance=least, limit=limit, agent_id=agent_id
            )
            return [
                (ids.index(i.insight_id), i.agent_id, i.content, i.tags, i.importance, i.segment)
                for i in found
            ]
        if kind == "delete":
            nth, tags, segment, agent_id = args
            named = [ids[n] if n < len(ids) else f"never-{n}" for n in nth]
            return await pool.delete(
                insight_ids=named, tags=tags, segment=segment, agent_id=agent_id
            )
        assert kind == "stats"
        stats = await pool.stats()
        return (
            stats.total_insights,
            stats.agents_involved,
            {tag: n for tag, n in stats.tag_distribution.items() if n},
            {segment: n for segment, n in stats.segment_distribution.items() if n},
            stats.capacity,
        )
    except MultiAgentCommunicationError as error:
        return (type(error).__name__, error.reason)


async def compare_pools(program: list[tuple[Any, ...]], url: str) -> None:
    from mesh.redis_shared import RedisMemoryPool
    from mesh.redis_store import RedisQueueStore

    store = RedisQueueStore(url)
    reference, other = SharedMemoryPool(capacity=4), RedisMemoryPool(store, capacity=4)
    reference_ids: list[str] = []
    other_ids: list[str] = []
    try:
        for number, op in enumerate([*program, ("stats",)]):
            expected = await pool_step(reference, op, reference_ids)
            got = await pool_step(other, op, other_ids)
            assert got == expected, f"step {number} {op} of {program}: {got} != {expected}"
    finally:
        await store.close()


@FUZZ
@given(program=pool_programs)
def test_the_memory_pool_in_redis_answers_as_the_brokers_own_does(
    program: list[tuple[Any, ...]], redis_server: str
) -> None:
    flush_mesh_keys(redis_server)
    asyncio.run(compare_pools(program, redis_server))

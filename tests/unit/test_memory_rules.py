"""The shared memory pool's rules: insights kept for their ttl, deleted by what they are, and
a full pool making room by the ttl nearest its end, else taking writes again once insights
leave."""

from __future__ import annotations

import random
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from mesh.core.errors import LimitExceededError, MessageValidationError
from mesh.core.memory import Insight, SharedMemoryPool


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def vote(reviewer: str, proposal: str, *, ttl: float = 0.0) -> Insight:
    return Insight(
        agent_id=reviewer,
        content={"vote": "approve"},
        tags=("vote", reviewer, proposal),
        importance=0.8,
        segment="votes",
        ttl=ttl,
    )


async def test_an_insight_with_a_ttl_leaves_the_pool_when_it_ends() -> None:
    clock = Clock()
    pool = SharedMemoryPool(clock=clock)
    short = await pool.write(vote("reviewer_1", "p1", ttl=60))
    await pool.write(vote("reviewer_2", "p1"))
    written_at = datetime.fromtimestamp(clock.now, UTC)
    assert short.created_at == written_at
    assert short.expires_at == written_at + timedelta(seconds=60)

    clock.now += 59.9
    assert len(await pool.read(tags=["p1"])) == 2
    clock.now += 0.2
    [kept] = await pool.read(tags=["p1"])
    assert kept.agent_id == "reviewer_2" and kept.expires_at is None
    stats = await pool.stats()
    assert stats.total_insights == 1 and stats.agents_involved == 1
    assert "reviewer_1" not in stats.tag_distribution
    assert stats.tag_distribution["p1"] == 1


async def test_a_full_pool_makes_room_by_the_ttl_nearest_its_end_else_refuses() -> None:
    """Full, a pool takes out the insight with a ttl nearest its end to take a write (what
    its writer said may go, and would go first anyway: a consensus run's proposal and votes
    of a day ago, so that a gateway running rounds all day keeps running them); without any
    ttl left, a write is refused until insights leave."""
    clock = Clock()
    pool = SharedMemoryPool(capacity=3, clock=clock)
    later = await pool.write(vote("reviewer_1", "p1", ttl=600))
    await pool.write(vote("reviewer_2", "p1"))
    sooner = await pool.write(vote("reviewer_3", "p2", ttl=300))
    await pool.write(vote("reviewer_4", "p2"))  # sooner's place
    assert [i.agent_id for i in await pool.read(tags=["vote"])] == [
        "reviewer_4",
        "reviewer_2",
        "reviewer_1",
    ]
    await pool.write(vote("reviewer_5", "p3"))  # later's
    assert {sooner.insight_id, later.insight_id}.isdisjoint(
        i.insight_id for i in await pool.read(tags=["vote"])
    )
    with pytest.raises(LimitExceededError, match="limit of 3 insights") as info:
        await pool.write(vote("reviewer_6", "p3", ttl=60))  # none left with a ttl
    assert info.value.code == "RESOURCE_EXHAUSTED"
    stats = await pool.stats()
    assert (stats.total_insights, stats.tag_distribution["p1"], stats.agents_involved) == (3, 1, 3)

    assert await pool.delete(tags=["vote", "p1"]) == 1  # reviewer_2's
    await pool.write(vote("reviewer_6", "p3", ttl=60))
    assert sorted(i.agent_id for i in await pool.read(tags=["vote"])) == [
        "reviewer_4",
        "reviewer_5",
        "reviewer_6",
    ]


async def test_deletes_take_the_insights_matching_every_filter_given() -> None:
    pool = SharedMemoryPool()
    first = await pool.write(vote("reviewer_1", "p1"))
    await pool.write(vote("reviewer_2", "p1"))
    await pool.write(vote("reviewer_1", "p2"))
    await pool.write(
        Insight(agent_id="proposer", content="x", tags=("proposal", "p1"), segment="proposals")
    )
    assert await pool.delete(insight_ids=[first.insight_id, "insight_999"]) == 1
    assert await pool.delete(insight_ids=[first.insight_id]) == 0
    assert await pool.delete(tags=["p1"], segment="votes") == 1  # reviewer_2's vote on p1
    assert await pool.delete(agent_id="reviewer_1", tags=["p1"]) == 0
    assert await pool.delete(segment="proposals") == 1
    assert [(i.agent_id, i.tags[-1]) for i in await pool.read()] == [("reviewer_1", "p2")]
    with pytest.raises(MessageValidationError, match="name the insights to delete"):
        await pool.delete()
    assert (await pool.stats()).total_insights == 1


async def test_a_negative_ttl_is_refused() -> None:
    pool = SharedMemoryPool()
    with pytest.raises(MessageValidationError, match="ttl must not be negative"):
        await pool.write(vote("reviewer_1", "p1", ttl=-1))
    assert (await pool.stats()).total_insights == 0


async def test_every_part_of_an_insight_is_bounded() -> None:
    """Content and metadata 64 KiB of JSON each; the writer, each tag and the segment 256
    characters. (Metadata and names had no limit: one write could hold the pool's memory
    with megabytes, and every read of it then passed what a client takes.)"""
    pool = SharedMemoryPool()
    long = "x" * 257
    for insight, field in (
        (Insight(agent_id=long, content="c"), "insight.agent_id"),
        (Insight(agent_id="a", content="c", tags=("vote", long)), "insight.tags"),
        (Insight(agent_id="a", content="c", segment=long), "insight.segment"),
        (Insight(agent_id="a", content="c", metadata={"notes": "n" * 65_536}), "insight.metadata"),
        (Insight(agent_id="a", content={"text": "t" * 65_536}), "insight.content"),
    ):
        with pytest.raises(MessageValidationError) as info:
            await pool.write(insight)
        assert [v.field for v in info.value.field_violations] == [field]
    assert (await pool.stats()).total_insights == 0
    edge = "y" * 256
    kept = await pool.write(
        Insight(
            agent_id=edge, content="c", tags=(edge,), segment=edge, metadata={"n": "m" * 60_000}
        )
    )
    assert [i.insight_id for i in await pool.read(tags=[edge])] == [kept.insight_id]


async def test_what_was_deleted_is_not_kept_for_its_ttl() -> None:
    """Insights written with a day's ttl and deleted at once, 5,000 times over: the pool
    keeps no trace of them (their expiry entries are dropped, not held for a day)."""
    pool = SharedMemoryPool(capacity=10)
    for i in range(5_000):
        written = await pool.write(vote("reviewer_1", f"p{i}", ttl=86_400))
        assert await pool.delete(insight_ids=[written.insight_id]) == 1
    assert (await pool.stats()).total_insights == 0
    assert len(pool._expiry) <= 1_024 + 1


async def test_reads_and_statistics_agree_with_the_pool_through_writes_deletes_and_expiry() -> None:
    """2,000 random writes, deletes and passing time against a plain list of what the pool
    should hold: every read (by tags, segment, writer, importance, limit) and the statistics
    agree."""
    rng = random.Random(7)
    clock = Clock()
    pool = SharedMemoryPool(clock=clock)
    held: list[Insight] = []  # what the pool should hold, oldest first
    tags = [f"t{n}" for n in range(6)]

    def alive() -> list[Insight]:
        return [i for i in held if i.expires_at is None or i.expires_at.timestamp() > clock.now]

    for _ in range(2_000):
        roll = rng.random()
        if roll < 0.6:
            held.append(
                await pool.write(
                    Insight(
                        agent_id=rng.choice(["a", "b", "c"]),
                        content=rng.random(),
                        tags=tuple(rng.sample(tags, rng.randint(0, 3))),
                        importance=rng.choice([0.2, 0.5, 0.9]),
                        segment=rng.choice(["votes", "proposals"]),
                        ttl=rng.choice([0.0, 5.0, 50.0]),
                    )
                )
            )
        elif roll < 0.7:
            tag = rng.choice(tags)
            gone = [i for i in alive() if tag in i.tags and i.segment == "votes"]
            assert await pool.delete(tags=[tag], segment="votes") == len(gone)
            held = [i for i in held if i not in gone]
        else:
            clock.now += rng.random() * 3
        wanted = rng.sample(tags, rng.randint(0, 2))
        segment = rng.choice(["", "votes"])
        writer = rng.choice(["", "a"])
        floor, limit = rng.choice([0.0, 0.5]), rng.choice([3, 1000])
        expected = [
            i
            for i in reversed(alive())
            if set(wanted) <= set(i.tags)
            and (not segment or i.segment == segment)
            and (not writer or i.agent_id == writer)
            and i.importance >= floor
        ]
        expected.sort(key=lambda i: -i.importance)  # most important, then newest, first
        read = await pool.read(
            tags=wanted, segment=segment, agent_id=writer, min_importance=floor, limit=limit
        )
        assert [i.insight_id for i in read] == [i.insight_id for i in expected[:limit]]
    stats = await pool.stats()
    now = alive()
    assert stats.total_insights == len(now)
    assert stats.agents_involved == len({i.agent_id for i in now})
    assert stats.tag_distribution == dict(Counter(t for i in now for t in i.tags))
    assert stats.segment_distribution == dict(Counter(i.segment for i in now))

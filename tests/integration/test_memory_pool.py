"""The shared memory pool through gRPC, on the broker's own pool and on Redis (a single server
and a cluster): insights kept for their ttl, deleted by id, tags, segment or writer, and the
statistics following both."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from mesh import MeshError, connect
from mesh.client import NO_RETRY
from mesh.testing import LocalMesh
from mesh.v1 import memory_pb2, memory_pb2_grpc
from tests.helpers.processes import BROKER_READY, start, stop
from tests.helpers.stores import BROKER_STORES, store_url


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    if request.param == "memory":
        async with LocalMesh() as mesh:
            yield mesh.address
        return
    url = request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
    process = await start("broker", "--port", "0", "--store", url, ready=BROKER_READY)
    try:
        yield process.address
    finally:
        await stop(process)


async def test_an_insight_with_a_ttl_is_read_until_it_ends(broker: str) -> None:
    async with connect(broker, agent_id="reviewer_1", retry=NO_RETRY) as client:
        short = await client.write_insight(
            {"vote": "approve"}, tags=["vote", "p1"], segment="votes", ttl=0.5
        )
        kept = await client.write_insight({"vote": "modify"}, tags=["vote", "p1"], segment="votes")
        assert short.created_at is not None
        assert short.expires_at == short.created_at + timedelta(seconds=0.5)
        assert kept.expires_at is None
        [read] = [i for i in await client.read_insights(tags=["p1"]) if i.ttl]
        assert (read.insight_id, read.ttl, read.expires_at) == (
            short.insight_id,
            0.5,
            short.expires_at,
        )

        async with asyncio.timeout(10):
            while len(await client.read_insights(tags=["p1"])) == 2:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert [i.insight_id for i in await client.read_insights(tags=["p1"])] == [kept.insight_id]
        stats = await client.memory_stats()
        assert stats.total_insights == 1
        assert stats.tag_distribution == {"vote": 1, "p1": 1}
        assert stats.segment_distribution == {"votes": 1}


async def test_insights_are_deleted_by_what_they_are(broker: str) -> None:
    async with (
        connect(broker, agent_id="reviewer_1", retry=NO_RETRY) as one,
        connect(broker, agent_id="reviewer_2", retry=NO_RETRY) as two,
    ):
        first = await one.write_insight("approve", tags=["vote", "p1"], segment="votes")
        await two.write_insight("reject", tags=["vote", "p1"], segment="votes")
        await one.write_insight("modify", tags=["vote", "p2"], segment="votes")
        await one.write_insight("the plan", tags=["proposal", "p2"], segment="proposals")

        assert await one.delete_insights(insight_ids=[first.insight_id, "insight_0"]) == 1
        assert await one.delete_insights(tags=["p1"], agent_id="reviewer_1") == 0
        assert await one.delete_insights(tags=["vote", "p2"], segment="votes") == 1
        assert await two.delete_insights(agent_id="reviewer_2") == 1
        with pytest.raises(MeshError, match="name the insights to delete") as info:
            await one.delete_insights()
        assert info.value.code == "INVALID_ARGUMENT"

        [left] = await one.read_insights()
        assert (left.content, left.segment) == ("the plan", "proposals")
        stats = await one.memory_stats()
        assert (stats.total_insights, stats.agents_involved) == (1, 1)
        assert stats.tag_distribution == {"proposal": 1, "p2": 1}
        assert stats.segment_distribution == {"proposals": 1}
        # Its tags are free again: written anew, the pool counts them from zero.
        await two.write_insight("approve", tags=["vote", "p1"], segment="votes")
        assert (await one.memory_stats()).tag_distribution["p1"] == 1


async def test_a_read_with_a_filter_that_is_not_a_number_is_refused(broker: str) -> None:
    """NaN matched nothing on one pool and was no filter at all on another: refused on
    every pool, as a negative limit is, with the field named."""
    async with connect(broker, agent_id="reviewer_1", retry=NO_RETRY) as one:
        await one.write_insight("approve", tags=["vote"], importance=0.9)
        for kwargs, field in (
            ({"min_importance": float("nan")}, "min_importance"),
            ({"limit": -1}, "limit"),
        ):
            with pytest.raises(MeshError, match=field) as info:
                await one.read_insights(**kwargs)  # type: ignore[arg-type]
            assert info.value.code == "INVALID_ARGUMENT"
        assert [i.content for i in await one.read_insights(min_importance=0.5, limit=1)] == [
            "approve"
        ]


async def test_a_read_past_one_answer_comes_in_pages(broker: str) -> None:
    """75 insights of 60 kB (their content's limit is 64 KiB), about 4.5 MB: in one answer,
    within the default limit of 100, more than a gRPC client reads by default (4 MiB). An
    answer holds 3 MiB at most, the rest of the limit on the next page, most important first
    throughout."""
    async with connect(broker, agent_id="archivist", retry=NO_RETRY) as client:
        written = [
            await client.write_insight(
                {"n": i, "text": "x" * 60_000}, tags=["big"], importance=i / 100
            )
            for i in range(75)
        ]
        expected = [w.insight_id for w in reversed(written)]
        async with grpc.aio.insecure_channel(broker) as channel:  # gRPC's 4 MiB default
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            request = memory_pb2.ReadInsightsRequest(tags=["big"])
            pages = []
            while True:
                page = await stub.ReadInsights(request)
                pages.append([i.insight_id for i in page.insights])
                if not page.next_page_token:
                    break
                request.page_token = page.next_page_token
            assert len(pages) == 2
            assert [i for page in pages for i in page] == expected
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ReadInsights(memory_pb2.ReadInsightsRequest(page_token="next"))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The SDK reads every page, up to the limit.
        assert [i.insight_id for i in await client.read_insights(tags=["big"])] == expected
        most = await client.read_insights(tags=["big"], limit=55)
        assert [i.insight_id for i in most] == expected[:55]
        assert most[0].content == {"n": 74, "text": "x" * 60_000}


async def test_an_insight_over_its_limits_is_refused_whole(broker: str) -> None:
    """A tag past 256 characters or metadata past 64 KiB: INVALID_ARGUMENT naming the field,
    on every pool, and nothing kept."""
    async with connect(broker, agent_id="archivist", retry=NO_RETRY) as client:
        for kwargs, field in (
            ({"tags": ["vote", "t" * 300]}, "insight.tags"),
            ({"metadata": {"notes": "n" * 70_000}}, "insight.metadata"),
            ({"segment": "s" * 300}, "insight.segment"),
        ):
            with pytest.raises(MeshError) as info:
                await client.write_insight("approve", **kwargs)  # type: ignore[arg-type]
            assert info.value.code == "INVALID_ARGUMENT"
            assert [v.field for v in info.value.field_violations] == [field]
        assert (await client.memory_stats()).total_insights == 0


@pytest.mark.parametrize("store", BROKER_STORES)
async def test_a_full_pool_makes_room_by_the_ttl_nearest_its_end_on_every_store(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """``--max-insights 3``: a write to a full pool takes out the insight with a ttl nearest
    its end (a consensus run's proposal and votes, kept a day, leave before the pool refuses
    the next run), and one with no such insight left is refused RESOURCE_EXHAUSTED; on SQLite
    what was taken out stays out after a restart."""
    url = store_url(store, request, tmp_path)
    args = ("broker", "--port", "0", "--store", url, "--max-insights", "3")
    process = await start(*args, ready=BROKER_READY)
    try:
        async with connect(process.address, agent_id="reviewer", retry=NO_RETRY) as client:
            later = await client.write_insight("approve", tags=["vote", "p1"], ttl=600)
            kept = await client.write_insight("modify", tags=["vote", "p1"])
            sooner = await client.write_insight("reject", tags=["vote", "p2"], ttl=300)
            fourth = await client.write_insight("approve", tags=["vote", "p3"])
            fifth = await client.write_insight("approve", tags=["vote", "p4"])
            left = [i.insight_id for i in await client.read_insights(tags=["vote"])]
            assert sorted(left) == sorted([kept.insight_id, fourth.insight_id, fifth.insight_id])
            assert {later.insight_id, sooner.insight_id}.isdisjoint(left)
            with pytest.raises(MeshError, match="limit of 3 insights") as info:
                await client.write_insight("approve", tags=["vote", "p5"], ttl=60)
            assert info.value.code == "RESOURCE_EXHAUSTED"
            stats = await client.memory_stats()
            assert (stats.total_insights, stats.capacity) == (3, 3)
            assert stats.tag_distribution == {"vote": 3, "p1": 1, "p3": 1, "p4": 1}
        if store == "sqlite":
            await stop(process)
            process = await start(*args, ready=BROKER_READY)
            async with connect(process.address, agent_id="reviewer", retry=NO_RETRY) as client:
                again = [i.insight_id for i in await client.read_insights(tags=["vote"])]
                assert sorted(again) == sorted(left)
    finally:
        await stop(process)

"""The Memory gRPC service: a thin translation onto the shared memory pool and the shared
state."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from mesh import codec
from mesh._status import abort
from mesh.core.errors import MeshError
from mesh.core.memory import Insight, MemoryPool
from mesh.core.state import ChangeKind, StateEntry, StateStore
from mesh.serving import offset_page, page_offset
from mesh.v1 import memory_pb2, memory_pb2_grpc

MEMORY_SERVICE = memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].full_name


def insight_from_pb(pb: memory_pb2.Insight) -> Insight:
    return Insight(
        agent_id=pb.agent_id,
        content=codec.value_to_python(pb.content) if pb.HasField("content") else None,
        tags=tuple(pb.tags),
        importance=pb.importance,
        segment=pb.segment,
        metadata=codec.struct_to_dict(pb.metadata),
        insight_id=pb.insight_id,
        created_at=codec.timestamp_to_datetime(pb.created_at, "insight.created_at")
        if pb.HasField("created_at")
        else None,
        ttl=codec.duration_seconds(pb.ttl) if pb.HasField("ttl") else 0.0,
        expires_at=codec.timestamp_to_datetime(pb.expires_at, "insight.expires_at")
        if pb.HasField("expires_at")
        else None,
    )


def insight_to_pb(insight: Insight, out: memory_pb2.Insight) -> memory_pb2.Insight:
    out.insight_id = insight.insight_id
    out.agent_id = insight.agent_id
    codec.encode_value(insight.content, out.content, "content")
    out.tags.extend(insight.tags)
    out.importance = insight.importance
    out.segment = insight.segment
    codec.encode_struct(insight.metadata, out.metadata, "metadata")
    if insight.created_at is not None:
        codec.datetime_to_timestamp(insight.created_at, out.created_at)
    if insight.ttl:
        codec.seconds_to_duration(insight.ttl, out.ttl)
    if insight.expires_at is not None:
        codec.datetime_to_timestamp(insight.expires_at, out.expires_at)
    return out


def entry_to_pb(entry: StateEntry, out: memory_pb2.StateEntry) -> memory_pb2.StateEntry:
    out.key = entry.key
    codec.python_to_value(entry.value, out.value)
    out.version = entry.version
    out.updated_by = entry.updated_by
    codec.datetime_to_timestamp(entry.updated_at, out.updated_at)
    if entry.expires_at is not None:
        codec.datetime_to_timestamp(entry.expires_at, out.expires_at)
    return out


CHANGE_KINDS = {
    kind: memory_pb2.StateChangeKind.Value(f"STATE_CHANGE_KIND_{kind.name}") for kind in ChangeKind
}
KINDS_OF_CHANGES = {number: kind for kind, number in CHANGE_KINDS.items()}


def entry_from_pb(pb: memory_pb2.StateEntry) -> StateEntry:
    return StateEntry(
        key=pb.key,
        value=codec.value_to_python(pb.value),
        version=pb.version,
        updated_by=pb.updated_by,
        updated_at=codec.timestamp_to_datetime(pb.updated_at),
        expires_at=(
            codec.timestamp_to_datetime(pb.expires_at) if pb.HasField("expires_at") else None
        ),
    )


def _seconds(pb: Any, name: str) -> float | None:
    return codec.duration_seconds(getattr(pb, name)) if pb.HasField(name) else None


def _expected_version(pb: Any) -> int | None:
    return int(pb.expected_version) if pb.HasField("expected_version") else None


class MemoryServicer(memory_pb2_grpc.MemoryServiceServicer):
    def __init__(self, pool: MemoryPool, state: StateStore) -> None:
        self.pool = pool
        self.state = state

    async def WriteInsight(
        self, request: memory_pb2.WriteInsightRequest, context: Any
    ) -> memory_pb2.WriteInsightResponse:
        stored = await self.pool.write(insight_from_pb(request.insight))
        response = memory_pb2.WriteInsightResponse()
        insight_to_pb(stored, response.insight)
        return response

    async def ReadInsights(
        self, request: memory_pb2.ReadInsightsRequest, context: Any
    ) -> memory_pb2.ReadInsightsResponse:
        start = page_offset(request.page_token)
        insights = await self.pool.read(
            tags=request.tags,
            segment=request.segment,
            min_importance=request.min_importance,
            limit=request.limit,
            agent_id=request.agent_id,
        )
        response = memory_pb2.ReadInsightsResponse()
        response.next_page_token = offset_page(response.insights, insights, start, 0, insight_to_pb)
        return response

    async def GetMemoryStats(
        self, request: memory_pb2.GetMemoryStatsRequest, context: Any
    ) -> memory_pb2.GetMemoryStatsResponse:
        stats = await self.pool.stats()
        return memory_pb2.GetMemoryStatsResponse(
            total_insights=stats.total_insights,
            agents_involved=stats.agents_involved,
            tag_distribution=stats.tag_distribution,
            segment_distribution=stats.segment_distribution,
            capacity=stats.capacity,
        )

    async def DeleteInsights(
        self, request: memory_pb2.DeleteInsightsRequest, context: Any
    ) -> memory_pb2.DeleteInsightsResponse:
        deleted = await self.pool.delete(
            insight_ids=request.insight_ids,
            tags=request.tags,
            segment=request.segment,
            agent_id=request.agent_id,
        )
        return memory_pb2.DeleteInsightsResponse(deleted=deleted)

    # -- shared state --------------------------------------------------------------------------

    async def GetState(
        self, request: memory_pb2.GetStateRequest, context: Any
    ) -> memory_pb2.GetStateResponse:
        response = memory_pb2.GetStateResponse()
        entry_to_pb(await self.state.get(request.key), response.entry)
        return response

    async def ListState(
        self, request: memory_pb2.ListStateRequest, context: Any
    ) -> memory_pb2.ListStateResponse:
        page = await self.state.entries(
            request.prefix, page_size=request.page_size, page_token=request.page_token
        )
        response = memory_pb2.ListStateResponse(next_page_token=page.next_page_token)
        for entry in page.entries:
            entry_to_pb(entry, response.entries.add())
        return response

    async def WatchState(
        self, request: memory_pb2.WatchStateRequest, context: Any
    ) -> AsyncIterator[memory_pb2.WatchStateResponse]:
        try:
            watch = await self.state.watch(request.prefix, send_initial=request.send_initial)
        except MeshError as error:
            await abort(context, error)
        try:
            async for change in watch:
                response = memory_pb2.WatchStateResponse(kind=CHANGE_KINDS[change.kind])
                if change.entry is not None:
                    entry_to_pb(change.entry, response.entry)
                yield response
        except MeshError as error:
            await abort(context, error)
        finally:
            watch.close()

    async def PutState(
        self, request: memory_pb2.PutStateRequest, context: Any
    ) -> memory_pb2.PutStateResponse:
        entry = await self.state.put(
            request.key,
            codec.value_to_python(request.value) if request.HasField("value") else None,
            request.agent_id,
            expected_version=_expected_version(request),
            lock_token=request.lock_token,
            ttl=_seconds(request, "ttl"),
        )
        response = memory_pb2.PutStateResponse()
        entry_to_pb(entry, response.entry)
        return response

    async def DeleteState(
        self, request: memory_pb2.DeleteStateRequest, context: Any
    ) -> memory_pb2.DeleteStateResponse:
        entry = await self.state.delete(
            request.key,
            request.agent_id,
            expected_version=_expected_version(request),
            lock_token=request.lock_token,
        )
        response = memory_pb2.DeleteStateResponse()
        entry_to_pb(entry, response.entry)
        return response

    async def LockState(
        self, request: memory_pb2.LockStateRequest, context: Any
    ) -> memory_pb2.LockStateResponse:
        lock = await self.state.lock(
            request.key,
            request.agent_id,
            wait=_seconds(request, "wait"),
            lease=_seconds(request, "lease"),
        )
        response = memory_pb2.LockStateResponse(lock_token=lock.token)
        codec.datetime_to_timestamp(lock.expires_at, response.expires_at)
        return response

    async def UnlockState(
        self, request: memory_pb2.UnlockStateRequest, context: Any
    ) -> memory_pb2.UnlockStateResponse:
        await self.state.unlock(request.key, request.lock_token)
        return memory_pb2.UnlockStateResponse()

"""The Memory gRPC service: a thin translation onto the shared memory pool."""

from __future__ import annotations

from typing import Any

from mesh import codec
from mesh.core.memory import Insight, SharedMemoryPool
from mesh.server import translating
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
        created_at=codec.timestamp_to_datetime(pb.created_at)
        if pb.HasField("created_at")
        else None,
    )


def insight_to_pb(insight: Insight, out: memory_pb2.Insight) -> memory_pb2.Insight:
    out.insight_id = insight.insight_id
    out.agent_id = insight.agent_id
    codec.python_to_value(insight.content, out.content)
    out.tags.extend(insight.tags)
    out.importance = insight.importance
    out.segment = insight.segment
    codec.dict_to_struct(insight.metadata, out.metadata)
    if insight.created_at is not None:
        codec.datetime_to_timestamp(insight.created_at, out.created_at)
    return out


class MemoryServicer(memory_pb2_grpc.MemoryServiceServicer):
    def __init__(self, pool: SharedMemoryPool) -> None:
        self.pool = pool

    @translating
    async def WriteInsight(
        self, request: memory_pb2.WriteInsightRequest, context: Any
    ) -> memory_pb2.WriteInsightResponse:
        stored = self.pool.write(insight_from_pb(request.insight))
        response = memory_pb2.WriteInsightResponse()
        insight_to_pb(stored, response.insight)
        return response

    @translating
    async def ReadInsights(
        self, request: memory_pb2.ReadInsightsRequest, context: Any
    ) -> memory_pb2.ReadInsightsResponse:
        response = memory_pb2.ReadInsightsResponse()
        for insight in self.pool.read(
            tags=request.tags,
            segment=request.segment,
            min_importance=request.min_importance,
            limit=request.limit,
            agent_id=request.agent_id,
        ):
            insight_to_pb(insight, response.insights.add())
        return response

    @translating
    async def GetMemoryStats(
        self, request: memory_pb2.GetMemoryStatsRequest, context: Any
    ) -> memory_pb2.GetMemoryStatsResponse:
        stats = self.pool.stats()
        return memory_pb2.GetMemoryStatsResponse(
            total_insights=stats.total_insights,
            agents_involved=stats.agents_involved,
            tag_distribution=stats.tag_distribution,
            segment_distribution=stats.segment_distribution,
            capacity=stats.capacity,
        )

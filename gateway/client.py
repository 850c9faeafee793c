"""A Python client of the Gateway service: run patterns and read their events as dicts."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format

from mesh._status import from_rpc_error
from mesh.client import ChannelOnFirstUse, RetryPolicy, with_retries
from mesh.codec import struct_to_dict
from mesh.config import SecurityConfig, retry_wait
from mesh.core.errors import TOO_MANY_RUNS, MessageValidationError
from mesh.tracing import inject
from mesh.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger("gateway.client")


def event_dict(pb: gateway_pb2.PatternEvent) -> dict[str, Any]:
    """A PatternEvent as a plain dict: kind and pattern by name, data as JSON."""
    return {
        "run_id": pb.run_id,
        "pattern": gateway_pb2.Pattern.Name(pb.pattern).removeprefix("PATTERN_"),
        "kind": gateway_pb2.EventKind.Name(pb.kind).removeprefix("EVENT_KIND_"),
        "timestamp": pb.timestamp.ToDatetime().isoformat() + "Z",
        "elapsed_ms": pb.elapsed_ms,
        "agent_id": pb.agent_id,
        "step": pb.step,
        "round": pb.round,
        "summary": pb.summary,
        "data": struct_to_dict(pb.data),
    }


class GatewayClient(ChannelOnFirstUse):
    """``async with GatewayClient(address) as gw: async for event in gw.route(...)``.

    A run the gateway refuses before it starts, because it already runs its limit
    (RESOURCE_EXHAUSTED, reason TOO_MANY_RUNS), is started again after each of ``retry``'s
    delays (RT-011's 100, 500 and 2000 ms, or the longer wait the refusal asks for);
    ``NO_RETRY`` for none. Nothing else of a run is tried again: a run that failed may have
    done part of its work (sent hand-offs, asked agents). ``pattern_stats`` and ``feedback``
    are made again after the same delays while refused for now (RESOURCE_EXHAUSTED,
    UNAVAILABLE).
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 60.0,
        security: SecurityConfig | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(target, security)
        self.timeout = timeout
        self.retry = retry if retry is not None else RetryPolicy()

    @functools.cached_property
    def stub(self) -> gateway_pb2_grpc.GatewayServiceAsyncStub:
        return gateway_pb2_grpc.GatewayServiceStub(self._channel)

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close_channel()

    async def _stream(self, start: Callable[[], Any]) -> AsyncGenerator[dict[str, Any], None]:
        self._check_loop()
        delays = self.retry.delays
        for attempt in itertools.count():
            call, started = start(), False
            try:
                async for response in call:
                    started = True
                    yield event_dict(response.event)
                return
            except grpc.RpcError as error:
                failure = from_rpc_error(error)
                if started or failure.reason != TOO_MANY_RUNS or attempt >= len(delays):
                    raise failure from None
            finally:
                # Closed before the end (the caller stopped reading): the gateway stops the run.
                call.cancel()
            wait = retry_wait(delays[attempt], failure.retry_after)
            logger.info(
                "run refused (%s); starting it again in %.0f ms (%d/%d)",
                failure.message,
                wait * 1000,
                attempt + 1,
                len(delays),
            )
            await asyncio.sleep(wait)

    def run(self, rpc: str, request: dict[str, Any] | Any) -> AsyncIterator[dict[str, Any]]:
        """Calls a pattern RPC by name ("RunGroupChat", "Route", ...) with a dict or message."""
        method = getattr(self.stub, rpc)
        if isinstance(request, dict):
            request_type = {
                "RunGroupChat": gateway_pb2.RunGroupChatRequest,
                "RunHandoffWorkflow": gateway_pb2.RunHandoffWorkflowRequest,
                "RunCollaborativeFiltering": gateway_pb2.RunCollaborativeFilteringRequest,
                "Route": gateway_pb2.RouteRequest,
                "RunParallel": gateway_pb2.RunParallelRequest,
                "RunConsensus": gateway_pb2.RunConsensusRequest,
                "RunResearch": gateway_pb2.RunResearchRequest,
            }[rpc]
            fields, request = request, request_type()
            try:
                json_format.ParseDict(fields, request)
            except json_format.ParseError as error:  # e.g. {"query": 5}: the caller's mistake
                raise MessageValidationError.for_field(
                    "request",
                    f"the request is not a valid {request.DESCRIPTOR.full_name}: {error}",
                ) from None
        metadata = tuple(inject().items())  # continue the caller's trace in the gateway
        return self._stream(
            lambda: method(request, timeout=self.timeout, metadata=metadata or None)
        )

    def group_chat(self, **request: Any) -> AsyncIterator[dict[str, Any]]:
        return self.run("RunGroupChat", request)

    def handoff_workflow(self, **request: Any) -> AsyncIterator[dict[str, Any]]:
        return self.run("RunHandoffWorkflow", request)

    def collaborative_filtering(self, **request: Any) -> AsyncIterator[dict[str, Any]]:
        return self.run("RunCollaborativeFiltering", request)

    def consensus(self, **request: Any) -> AsyncIterator[dict[str, Any]]:
        return self.run("RunConsensus", request)

    def research(self, **request: Any) -> AsyncIterator[dict[str, Any]]:
        return self.run("RunResearch", request)

    def route(
        self, request_type: str, query: str = "", **parameters: Any
    ) -> AsyncIterator[dict[str, Any]]:
        return self.run(
            "Route", {"request_type": request_type, "query": query, "parameters": parameters}
        )

    def parallel(self, patterns: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        return self.run("RunParallel", {"patterns": patterns})

    async def collect(self, events: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
        return [event async for event in events]

    async def pattern_stats(self) -> dict[str, dict[str, Any]]:
        """Each pattern's figures by name: runs, completion, consensus rate, accuracy, ..."""
        reply = await self._unary(
            lambda: self.stub.GetPatternStats(
                gateway_pb2.GetPatternStatsRequest(), timeout=self.timeout
            )
        )
        return {_pattern_name(p.pattern): _stats_dict(p) for p in reply.patterns}

    async def feedback(self, run_id: str, satisfied: bool) -> dict[str, Any]:
        """Tells the gateway whether a finished run's outcome satisfied the user; returns the
        pattern's figures with it counted (``accuracy``: satisfied / rated)."""
        request = gateway_pb2.RecordFeedbackRequest(run_id=run_id, satisfied=satisfied)
        reply = await self._unary(lambda: self.stub.RecordFeedback(request, timeout=self.timeout))
        return {"pattern": _pattern_name(reply.pattern), **_stats_dict(reply.stats)}

    async def _unary(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """A call that may be made again (reading the figures; a rating replaces the last):
        made again after each of ``retry``'s delays while it is refused for now
        (RESOURCE_EXHAUSTED, UNAVAILABLE: the gateway restarting, say)."""
        self._check_loop()
        return await with_retries(call, self.retry, log=logger)


def _pattern_name(value: gateway_pb2.Pattern.ValueType) -> str:
    return gateway_pb2.Pattern.Name(value).removeprefix("PATTERN_")


def _stats_dict(pb: gateway_pb2.PatternStats) -> dict[str, Any]:
    return {f.name: getattr(pb, f.name) for f in pb.DESCRIPTOR.fields if f.name != "pattern"}

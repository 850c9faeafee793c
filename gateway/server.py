"""The Gateway gRPC service: pattern RPCs that stream their events; a thin translation layer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from google.protobuf import json_format
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from gateway import codec
from gateway.dispatch import Dispatcher, MeshDispatcher
from gateway.events import Emit, EventKind, Pattern, PatternEvent
from gateway.feedback import RunLedger
from gateway.metrics import PatternMetrics
from gateway.patterns._common import CANCELLED_WHY, invalid, new_id
from gateway.patterns.consensus import run_consensus
from gateway.patterns.group_chat import GroupChatSpec
from gateway.patterns.handoff import WorkflowSpec
from gateway.patterns.orchestrator import (
    Route,
    Router,
    Spec,
    pattern_of,
    routed,
    run_parallel,
    run_spec,
)
from gateway.patterns.research import run_research
from mesh._status import abort
from mesh.client import MeshClient
from mesh.codec import struct_to_dict
from mesh.config import SecurityConfig
from mesh.core.errors import TOO_MANY_RUNS, BrokerUnavailableError, LimitExceededError, MeshError
from mesh.core.model import JSON
from mesh.core.tasks import cancel_and_wait
from mesh.serving import MeshServer, start_server
from mesh.tracing import extract, tracer
from mesh.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger("gateway.server")
GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
EVENT_BUFFER = 256
Run = Callable[[Emit], Awaitable[dict[str, JSON]]]
FIRST_BROKER_ANSWER_SECONDS = 2.0
"""How long a starting gateway waits for the broker's health to answer before it says
NOT_SERVING for its service (and goes on following it)."""
MAX_RUNS = 1000
"""Pattern runs one gateway holds at once (``--max-runs``). Each holds tasks, an event buffer
and requests pending at the broker; past it a new run is refused before it starts
(RESOURCE_EXHAUSTED, reason TOO_MANY_RUNS) rather than slowing every run down."""
RUNS_RETRY_AFTER_SECONDS = 0.5
"""The wait a run refused for TOO_MANY_RUNS is told to take (its RetryInfo)."""
SETTLE_SECONDS = 2.0
"""How long a stopping gateway waits, past its grace, for the runs it cancelled to record how
they ended before it closes its broker client."""


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    """Translates pattern RPCs; the patterns themselves live in gateway.patterns."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        router: Router,
        metrics: PatternMetrics,
        *,
        max_runs: int = MAX_RUNS,
    ) -> None:
        if max_runs < 1:
            raise ValueError("max_runs must be at least 1")
        self.max_runs = max_runs
        self.dispatcher = dispatcher
        self.router = router
        self.metrics = metrics
        self.observers: list[Callable[[PatternEvent], None]] = []
        """Told of every event of every run (the dashboard follows runs this way)."""
        self.ledger = RunLedger()
        """The recent runs, which users may rate (RecordFeedback)."""
        self.draining = False
        self.broker_away: str | None = None
        """Why new runs are refused while the broker does not serve (None: it serves)."""
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def drain(self, grace: float) -> None:
        """Graceful shutdown, first half: new runs are refused with UNAVAILABLE while the
        runs in flight finish, for up to ``grace`` seconds."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self._idle.wait()

    async def settle(self, most: float) -> None:
        """Waits, ``most`` seconds at most, for the runs still winding up to end."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(most):
                await self._idle.wait()

    # -- plumbing ----------------------------------------------------------------------------

    def _observed(self, emit: Emit, open_runs: dict[str, PatternEvent]) -> Emit:
        """``emit``, the metrics, the ledger and the observers told of each event first;
        ``open_runs``: each run begun and not ended by its RESULT, by run id (its first
        event)."""

        async def observe(event: PatternEvent) -> None:
            data = event.data
            if event.kind is EventKind.AGGREGATION:
                conflict = bool(data.get("tie")) or data.get("unanimous") is False
                self.metrics.aggregation(float(data.get("aggregation_ms", 0.0)) / 1000, conflict)
            elif event.kind is EventKind.ROUTED:
                self.metrics.routed(float(data["routing_latency_ms"]) / 1000)
            begun = open_runs.setdefault(event.run_id, event)
            if event.kind is EventKind.RESULT and event.pattern is begun.pattern:
                del open_runs[event.run_id]
            self._tell(event)
            await emit(event)

        return observe

    def _tell(self, event: PatternEvent) -> None:
        self.ledger.observe(event)
        for observer in self.observers:
            observer(event)

    def _ended_without_result(
        self, open_runs: dict[str, PatternEvent], status: str, why: str
    ) -> None:
        """Runs that ended with an error, at the deadline or with their caller gone have no
        RESULT: the ledger and the observers (the dashboard, which showed them running) are
        told how they ended. (Their caller has its status.)"""
        for run_id, first in open_runs.items():
            self._tell(
                PatternEvent(
                    run_id=run_id,
                    pattern=first.pattern,
                    kind=EventKind.RESULT,
                    summary=f"{first.pattern.value.lower()} run ended without a result: {why}",
                    data={"status": status, "error": why},
                )
            )

    async def _events(
        self, pattern: Pattern, run: Run, context: Any
    ) -> AsyncIterator[gateway_pb2.PatternEvent]:
        """Runs a pattern and yields its events as they happen, within the caller's deadline."""
        if self.draining:
            await abort(
                context,
                MeshError(
                    "the gateway is shutting down: try another replica or retry later",
                    code="UNAVAILABLE",
                    reason="SHUTTING_DOWN",
                ),
            )
        if self.broker_away is not None:  # (refused whole, rather than failing mid-run)
            await abort(context, BrokerUnavailableError(self.broker_away))
        if self._active >= self.max_runs:
            self.metrics.refused(pattern, TOO_MANY_RUNS)
            await abort(
                context,
                LimitExceededError(
                    f"the gateway already runs its limit of patterns at once ({self.max_runs}):"
                    " this run did not start; retry later",
                    reason=TOO_MANY_RUNS,
                    retry_after=RUNS_RETRY_AFTER_SECONDS,
                ),
            )
        self._active += 1
        self.metrics.active.set(self._active)
        self._idle.clear()
        try:
            async for event in self._run_events(pattern, run, context):
                yield event
        finally:
            self._active -= 1
            self.metrics.active.set(self._active)
            if not self._active:
                self._idle.set()

    async def _run_events(
        self, pattern: Pattern, run: Run, context: Any
    ) -> AsyncIterator[gateway_pb2.PatternEvent]:
        queue: asyncio.Queue[PatternEvent | None] = asyncio.Queue(EVENT_BUFFER)
        open_runs: dict[str, PatternEvent] = {}
        emit = self._observed(queue.put, open_runs)
        outcome: dict[str, Any] = {}

        carrier = {
            k: v
            for k, v in (context.invocation_metadata() or ())
            if k in ("traceparent", "tracestate") and isinstance(v, str)
        }
        parent = extract(carrier)

        async def runner() -> None:
            started = time.perf_counter()
            token = otel_context.attach(parent) if parent is not None else None
            try:
                remaining = context.time_remaining()
                with tracer().start_as_current_span(
                    f"gateway.{pattern.value.lower()}", kind=SpanKind.SERVER
                ):
                    async with asyncio.timeout(remaining):
                        result = await run(emit)
                self.metrics.observe(pattern, result, time.perf_counter() - started)
            except TimeoutError:
                outcome["error"] = MeshError(
                    "the pattern did not finish before the deadline",
                    code="DEADLINE_EXCEEDED",
                    reason="DEADLINE_EXCEEDED",
                )
                self.metrics.observe(pattern, {"status": "FAILED"}, time.perf_counter() - started)
            except MeshError as error:
                outcome["error"] = error
            except Exception:
                logger.exception("%s run failed", pattern.value)
                outcome["error"] = MeshError("the pattern failed", code="INTERNAL")
                self.metrics.observe(pattern, {"status": "FAILED"}, time.perf_counter() - started)
            finally:
                if token is not None:
                    otel_context.detach(token)
                await queue.put(None)

        task = asyncio.create_task(runner())
        try:
            while (event := await queue.get()) is not None:
                yield codec.event_to_pb(event, gateway_pb2.PatternEvent())
        finally:
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if open_runs:
                error = outcome.get("error")
                if error is None:  # (the runner was cancelled)
                    self._ended_without_result(
                        open_runs, "CANCELLED", f"cancelled: {CANCELLED_WHY}"
                    )
                else:
                    self._ended_without_result(open_runs, "FAILED", error.message)
        if "error" in outcome:
            await abort(context, outcome["error"])

    async def _spec_of_route(self, request: gateway_pb2.RouteRequest) -> tuple[Any, Spec]:
        route = self.router.determine_pattern(request.request_type)
        return route, route_spec(route, request.query, struct_to_dict(request.parameters))

    # -- RPCs --------------------------------------------------------------------------------

    def _informed(self, spec: Any) -> Any:
        """The spec with its group chats' members' track records (for expertise_weighted)."""
        self.ledger.inform(spec)
        return spec

    async def _serve(
        self, spec: Any, pattern: Pattern, run: Any, wrap: Any, context: Any
    ) -> AsyncIterator[Any]:
        """Validates a pattern's spec (INVALID_ARGUMENT before any event), then streams it."""
        try:
            spec.validate()
        except MeshError as error:
            await abort(context, error)
        self._informed(spec)
        async for event in self._events(
            pattern, lambda emit: run(spec, self.dispatcher, emit), context
        ):
            yield wrap(event=event)

    async def RunGroupChat(
        self, request: gateway_pb2.RunGroupChatRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.RunGroupChatResponse]:
        # grpc.aio recognises streaming handlers by being async generators.
        async for response in self._serve(
            codec.group_chat_spec(request),
            Pattern.GROUP_CHAT,
            run_spec,
            gateway_pb2.RunGroupChatResponse,
            context,
        ):
            yield response

    async def RunHandoffWorkflow(
        self, request: gateway_pb2.RunHandoffWorkflowRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.RunHandoffWorkflowResponse]:
        # grpc.aio recognises streaming handlers by being async generators.
        async for response in self._serve(
            codec.workflow_spec(request),
            Pattern.HAND_OFF,
            run_spec,
            gateway_pb2.RunHandoffWorkflowResponse,
            context,
        ):
            yield response

    async def RunCollaborativeFiltering(
        self, request: gateway_pb2.RunCollaborativeFilteringRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.RunCollaborativeFilteringResponse]:
        # grpc.aio recognises streaming handlers by being async generators.
        async for response in self._serve(
            codec.filtering_spec(request),
            Pattern.COLLABORATIVE_FILTERING,
            run_spec,
            gateway_pb2.RunCollaborativeFilteringResponse,
            context,
        ):
            yield response

    async def Route(
        self, request: gateway_pb2.RouteRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.RouteResponse]:
        started = time.perf_counter()
        try:
            route, spec = await self._spec_of_route(request)
        except MeshError as error:
            await abort(context, error)

        self._informed(spec)

        async def run(emit: Emit) -> dict[str, JSON]:
            await routed(route, started, emit, run_id=run_id_of(spec))
            return await run_spec(spec, self.dispatcher, emit)

        async for event in self._events(route.pattern, run, context):
            yield gateway_pb2.RouteResponse(event=event)

    async def RunParallel(
        self, request: gateway_pb2.RunParallelRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.RunParallelResponse]:
        specs: list[tuple[str, Spec]] = []
        try:
            if not request.patterns:
                raise invalid("patterns", "at least one pattern is required")
            for i, item in enumerate(request.patterns):
                name = item.name or f"pattern_{i + 1}"
                kind = item.WhichOneof("spec")
                if kind == "group_chat":
                    spec: Spec = codec.group_chat_spec(item.group_chat)
                elif kind == "hand_off":
                    spec = codec.workflow_spec(item.hand_off)
                elif kind == "collaborative_filtering":
                    spec = codec.filtering_spec(item.collaborative_filtering)
                elif kind == "route":
                    _, spec = await self._spec_of_route(item.route)
                else:
                    raise invalid(f"patterns[{i}]", "each pattern needs a spec")
                spec.validate()
                specs.append((name, self._informed(spec)))
        except MeshError as error:
            await abort(context, error)

        async def run(emit: Emit) -> dict[str, JSON]:
            result = await run_parallel(specs, self.dispatcher, emit)
            results = result["results"]
            assert isinstance(results, dict)
            for name, spec in specs:
                sub = results[name]
                self.metrics.observe(pattern_of(spec), sub, float(sub["duration_ms"]) / 1000)
            return result

        async for event in self._events(Pattern.PARALLEL, run, context):
            yield gateway_pb2.RunParallelResponse(event=event)

    async def RunConsensus(
        self, request: gateway_pb2.RunConsensusRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.RunConsensusResponse]:
        # grpc.aio recognises streaming handlers by being async generators.
        async for response in self._serve(
            codec.consensus_spec(request),
            Pattern.CONSENSUS,
            run_consensus,
            gateway_pb2.RunConsensusResponse,
            context,
        ):
            yield response

    async def RunResearch(
        self, request: gateway_pb2.RunResearchRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.RunResearchResponse]:
        # grpc.aio recognises streaming handlers by being async generators.
        async for response in self._serve(
            codec.research_spec(request),
            Pattern.RESEARCH,
            run_research,
            gateway_pb2.RunResearchResponse,
            context,
        ):
            yield response

    async def GetPatternStats(
        self, request: gateway_pb2.GetPatternStatsRequest, context: Any
    ) -> gateway_pb2.GetPatternStatsResponse:
        response = gateway_pb2.GetPatternStatsResponse()
        for pattern, tally in self.metrics.tallies.items():
            codec.stats_to_pb(pattern, tally, response.patterns.add())
        return response

    async def RecordFeedback(
        self, request: gateway_pb2.RecordFeedbackRequest, context: Any
    ) -> gateway_pb2.RecordFeedbackResponse:
        try:
            rating = self.ledger.rate(request.run_id, request.satisfied)
        except MeshError as error:
            await abort(context, error)
        tally = self.metrics.feedback(rating, request.satisfied)
        response = gateway_pb2.RecordFeedbackResponse(pattern=codec.PATTERN_TO_PB[rating.pattern])
        codec.stats_to_pb(rating.pattern, tally, response.stats)
        return response


def run_id_of(spec: Spec) -> str:
    if isinstance(spec, GroupChatSpec):
        return spec.group_id
    if isinstance(spec, WorkflowSpec):
        return spec.workflow_id
    return spec.run_id


class GatewayServer:
    """A running gateway: its gRPC server and its broker client.

    Its health for ``mesh.v1.GatewayService`` follows the broker's: NOT_SERVING while the
    broker cannot be reached or does not serve (every pattern needs it), so a readiness probe
    takes the gateway out of rotation meanwhile, and new runs are refused with UNAVAILABLE;
    the server's overall health ("") says only that the process serves (liveness)."""

    def __init__(
        self,
        server: MeshServer,
        client: MeshClient,
        metrics: PatternMetrics,
        servicer: GatewayServicer | None = None,
    ) -> None:
        self.server = server
        self.client = client
        self.metrics = metrics
        self.servicer = servicer
        self.broker_serving: bool | None = None
        """What the broker's health said last (None: not heard yet)."""
        self._following: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return self.server.address

    async def follow_broker(self, first_answer: float = FIRST_BROKER_ANSWER_SECONDS) -> None:
        """Starts following the broker's health; returns once it answered (or could not be
        reached), or after ``first_answer`` seconds, NOT_SERVING until it does."""
        heard = asyncio.Event()

        async def follow() -> None:
            async for serving in self.client.broker_serving():
                await self._broker_said(serving)
                heard.set()

        self._following = asyncio.create_task(follow(), name="gateway-follows-broker")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(first_answer):
                await heard.wait()
        if not heard.is_set():
            await self._broker_said(False)

    async def _broker_said(self, serving: bool) -> None:
        if serving is self.broker_serving:
            return
        if serving:
            if self.broker_serving is not None:
                logger.info("the broker at %s serves again: the gateway too", self.client.target)
        else:
            logger.warning(
                "the broker at %s cannot be reached or is not serving (stopping, or its store"
                " away): %s NOT_SERVING, and new runs refused, until it serves",
                self.client.target,
                GATEWAY_SERVICE,
            )
        self.broker_serving = serving
        if self.servicer is not None:
            self.servicer.broker_away = (
                None
                if serving
                else f"the broker at {self.client.target} cannot be reached or is not serving"
                " (stopping, or its store away): retry later"
            )
        await self.server.set_service_serving(GATEWAY_SERVICE, serving)

    async def stop(self, grace: float = 5.0) -> None:
        await cancel_and_wait(self._following)
        await self.server.stop(grace)
        if self.servicer is not None:
            # Runs the stop cancelled still record how they ended (a workflow's status)
            # through the broker client: it closes once they have.
            await self.servicer.settle(SETTLE_SECONDS)
        await self.client.close()


def route_spec(route: Route, query: str, parameters: dict[str, Any]) -> Spec:
    """The pattern a route runs, from its preset, the caller's query (when one is given) and
    parameters, validated; a preset that is not its pattern's request: FAILED_PRECONDITION."""
    preset = dict(route.preset)
    spec: Spec
    try:
        if route.pattern is Pattern.GROUP_CHAT:
            pb = codec.preset_request(preset, gateway_pb2.RunGroupChatRequest)
            spec = codec.group_chat_spec(pb)  # type: ignore[arg-type]
            spec.query = query or spec.query
            spec.context.update(parameters)
        elif route.pattern is Pattern.HAND_OFF:
            pb = codec.preset_request(preset, gateway_pb2.RunHandoffWorkflowRequest)
            spec = codec.workflow_spec(pb)  # type: ignore[arg-type]
            spec.task = query or spec.task
            spec.context.update(parameters)
        else:
            pb = codec.preset_request(preset, gateway_pb2.RunCollaborativeFilteringRequest)
            spec = codec.filtering_spec(pb)  # type: ignore[arg-type]
            spec.query = query or spec.query
            spec.parameters.update(parameters)
    except json_format.ParseError as error:
        raise MeshError(
            f"the preset of {route.request_type} is invalid: {error}",
            code="FAILED_PRECONDITION",
            reason="BAD_PRESET",
        ) from None
    if isinstance(spec, GroupChatSpec):
        spec.group_id = spec.group_id or new_id("group")
    elif isinstance(spec, WorkflowSpec):
        spec.workflow_id = spec.workflow_id or new_id("wf")
    else:
        spec.run_id = spec.run_id or new_id("cf")
    spec.validate()
    return spec


class RoutesError(ValueError):
    """A route whose preset its pattern would refuse (:func:`check_routes`)."""


def check_routes(router: Router) -> None:
    """Each route's preset run as a request that brings a query would run it: RoutesError
    naming the route and what is wrong, as the gateway starts rather than at a caller's
    request (which could not mend it)."""
    for route in router.routes.values():
        try:
            route_spec(route, "a caller's query", {})
        except MeshError as error:
            raise RoutesError(f"route {route.request_type!r}: {error}") from None


async def serve_gateway(
    broker: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    router: Router | None = None,
    registry: CollectorRegistry | None = None,
    metrics_port: int = -1,
    health_port: int = -1,
    security: SecurityConfig | None = None,
    max_runs: int = MAX_RUNS,
) -> GatewayServer:
    """Starts the gateway on host:port (0 picks one), talking to the broker at ``broker``;
    RoutesError, before anything starts, for a route no request could run.

    Pass the broker's registry to export pattern metrics beside the broker's on one /metrics.
    ``max_runs``: the pattern runs it holds at once (more are refused with TOO_MANY_RUNS).
    ``health_port`` (-1: none, 0: any free one) serves its health alone in plaintext beside a
    TLS server, for probes that cannot speak TLS.
    """
    router = router or Router.from_file()
    check_routes(router)
    client = MeshClient(broker, agent_id="gateway", security=security)
    metrics = PatternMetrics(registry)
    servicer = GatewayServicer(MeshDispatcher(client), router, metrics, max_runs=max_runs)
    server = await start_server(
        lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
        [GATEWAY_SERVICE],
        host=host,
        port=port,
        metrics_registry=metrics.registry if registry is None else None,
        metrics_port=metrics_port,
        health_port=health_port,
        security=security,
        on_refused=metrics.refused_call,
    )
    server._on_drain.append(servicer.drain)
    gateway = GatewayServer(server, client, metrics, servicer)
    await gateway.follow_broker()
    return gateway

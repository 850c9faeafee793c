"""The orchestrator (RF-010 scenarios 16 to 18): routes a request type to a pattern with a
reason, runs any pattern, and runs several patterns at once."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.dispatch import Dispatcher
from gateway.events import Emit, EventKind, Pattern, PatternEvent
from gateway.patterns._common import MAX_PARALLEL, Stopwatch, invalid, new_id
from gateway.patterns.collaborative import FilteringSpec, run_filtering
from gateway.patterns.group_chat import GroupChatSpec, run_group_chat
from gateway.patterns.handoff import WorkflowSpec, run_workflow
from gateway.tracing import tracer
from mesh.core.errors import RoutingError
from mesh.core.model import JSON

Spec = GroupChatSpec | WorkflowSpec | FilteringSpec
ROUTES_FILE = Path(__file__).resolve().parents[1] / "data" / "routes.json"


class UnknownRequestTypeError(RoutingError):
    """No pattern is configured for a request type."""

    code = "INVALID_ARGUMENT"
    reason = "UNKNOWN_REQUEST_TYPE"


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """Where a request type goes: the pattern, why, and the preset that runs it."""

    request_type: str
    pattern: Pattern
    reason: str
    preset: dict[str, JSON] = field(default_factory=dict)


class Router:
    """Maps request types to patterns (RT-011 orchestrator routing)."""

    def __init__(self, routes: Mapping[str, Route]) -> None:
        self.routes = dict(routes)

    @classmethod
    def from_file(cls, path: Path = ROUTES_FILE) -> Router:
        """Reads {"request_type": {"pattern": ..., "reason": ..., "preset": {...}}, ...};
        a file that is not such a table raises ValueError saying where and what is wrong."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from None
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read {path}: {error}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object of routes by request type")
        return cls({name: _route(path, name, entry) for name, entry in data.items()})

    def determine_pattern(self, request_type: str) -> Route:
        route = self.routes.get(request_type)
        if route is None:
            known = ", ".join(sorted(self.routes))
            raise UnknownRequestTypeError(
                f"no pattern for request type {request_type!r}; known types: {known}"
            )
        return route


ROUTABLE = (Pattern.GROUP_CHAT, Pattern.HAND_OFF, Pattern.COLLABORATIVE_FILTERING)
"""The patterns a route may run (from a preset of its request)."""


def _route(path: Path, name: str, entry: Any) -> Route:
    def wrong(what: str) -> ValueError:
        return ValueError(f"{path}: route {name!r}: {what}")

    if not isinstance(entry, dict):
        raise wrong('must be an object: {"pattern": ..., "reason": ..., "preset": {...}}')
    names = ", ".join(p.value for p in ROUTABLE)
    if entry.get("pattern") not in names.split(", "):
        raise wrong(f"pattern must be one of {names}, got {entry.get('pattern')!r}")
    if not isinstance(entry.get("reason"), str) or not entry["reason"]:
        raise wrong("reason must be a non-empty string")
    preset = entry.get("preset", {})
    if not isinstance(preset, dict):
        raise wrong("preset must be an object (the fields of the pattern's request)")
    return Route(
        request_type=name, pattern=Pattern(entry["pattern"]), reason=entry["reason"], preset=preset
    )


async def routed(route: Route, started: float, emit: Emit, run_id: str) -> None:
    """Reports the routing decision and how long it took."""
    latency_ms = round((time.perf_counter() - started) * 1000, 3)
    await emit(
        PatternEvent(
            run_id=run_id,
            pattern=route.pattern,
            kind=EventKind.ROUTED,
            summary=f"{route.request_type} -> {route.pattern.value}: {route.reason}",
            data={
                "request_type": route.request_type,
                "pattern": route.pattern.value,
                "reason": route.reason,
                "routing_latency_ms": latency_ms,
            },
        )
    )


def pattern_of(spec: Spec) -> Pattern:
    if isinstance(spec, GroupChatSpec):
        return Pattern.GROUP_CHAT
    if isinstance(spec, WorkflowSpec):
        return Pattern.HAND_OFF
    return Pattern.COLLABORATIVE_FILTERING


async def run_spec(spec: Spec, dispatcher: Dispatcher, emit: Emit) -> dict[str, JSON]:
    if isinstance(spec, GroupChatSpec):
        return await run_group_chat(spec, dispatcher, emit)  # opens its own root span
    if isinstance(spec, WorkflowSpec):
        spec.workflow_id = spec.workflow_id or new_id("wf")
        with tracer().start_as_current_span(
            "hand_off", attributes={"workflow_id": spec.workflow_id}
        ):
            return await run_workflow(spec, dispatcher, emit)
    spec.run_id = spec.run_id or new_id("cf")
    with tracer().start_as_current_span(
        "collaborative_filtering", attributes={"workflow_id": spec.run_id}
    ):
        return await run_filtering(spec, dispatcher, emit)


def validate(spec: Spec) -> None:
    spec.validate()


async def run_parallel(
    specs: Sequence[tuple[str, Spec]],
    dispatcher: Dispatcher,
    emit: Emit,
    run_id: str = "",
) -> dict[str, JSON]:
    """Runs patterns concurrently; the total is about the slowest, not the sum."""
    run_id = run_id or new_id("parallel")
    if not specs:
        raise invalid("patterns", "at least one pattern is required")
    if len(specs) > MAX_PARALLEL:
        raise invalid("patterns", f"at most {MAX_PARALLEL} patterns run in parallel")
    for _, spec in specs:
        spec.validate()
    clock = Stopwatch()

    async def one(name: str, spec: Spec) -> tuple[str, dict[str, JSON], float]:
        watch = Stopwatch()
        result = await run_spec(spec, dispatcher, emit)
        return name, result, watch.ms

    outcomes = await asyncio.gather(*(one(name, spec) for name, spec in specs))
    results: dict[str, JSON] = {name: result for name, result, _ in outcomes}
    durations: dict[str, JSON] = {name: ms for name, _, ms in outcomes}
    statuses = {str(r["status"]) for _, r, _ in outcomes}
    final: dict[str, Any] = {
        "run_id": run_id,
        "status": "COMPLETED"
        if statuses == {"COMPLETED"}
        else ("FAILED" if statuses == {"FAILED"} else "PARTIAL"),
        "results": results,
        "recommendations": {
            name: r.get("recommendation", r.get("aggregate")) for name, r, _ in outcomes
        },
        "durations_ms": durations,
        "duration_ms": clock.ms,
        "sum_of_durations_ms": round(sum(ms for _, _, ms in outcomes), 3),
    }
    await emit(
        PatternEvent(
            run_id=run_id,
            pattern=Pattern.PARALLEL,
            kind=EventKind.RESULT,
            summary=f"{len(specs)} patterns in {final['duration_ms']:.0f} ms",
            data=final,
            elapsed_ms=clock.ms,
        )
    )
    return final

"""Pattern spans (RF-010 scenario 19): the gateway's side of the mesh-wide tracing."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import Span

from mesh.tracing import span_name, tracer

__all__ = ["now_ns", "record_span", "span_name", "tracer"]


def now_ns() -> int:
    return time.time_ns()


def record_span(
    name: str,
    start_ns: int,
    end_ns: int,
    parent: Span | None = None,
    **attributes: str | int | float | bool,
) -> None:
    """A span for something measured from outside (an agent's answer time)."""
    context = trace.set_span_in_context(parent) if parent is not None else None
    span = tracer().start_span(name, context=context, start_time=start_ns, attributes=attributes)
    span.end(end_time=end_ns)

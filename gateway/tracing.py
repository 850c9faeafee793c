"""Pattern spans (RF-010 scenario 19) with the OpenTelemetry API: a no-op until a tracer
provider is installed (the observability setup does that)."""

from __future__ import annotations

import re
import time

from opentelemetry import trace
from opentelemetry.trace import Span

TRACER_NAME = "agentmesh.gateway"


def tracer() -> trace.Tracer:
    # Looked up on every use so that a provider installed after import takes effect.
    return trace.get_tracer(TRACER_NAME)


def span_name(agent_id: str, operation: str) -> str:
    """ "TechnicalAnalyst" -> "technical_analyst.analyze" (a trailing "Agent" is dropped)."""
    base = agent_id[:-5] if agent_id.endswith("Agent") and len(agent_id) > 5 else agent_id
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).replace("-", "_").lower()
    return f"{snake}.{operation}"


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

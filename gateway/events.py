"""What patterns report as they run: typed events with a JSON payload."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime

from mesh.core.model import JSON, utc_now


class Pattern(enum.StrEnum):
    GROUP_CHAT = "GROUP_CHAT"
    HAND_OFF = "HAND_OFF"
    COLLABORATIVE_FILTERING = "COLLABORATIVE_FILTERING"
    PARALLEL = "PARALLEL"
    CONSENSUS = "CONSENSUS"
    RESEARCH = "RESEARCH"


class EventKind(enum.StrEnum):
    GROUP_CREATED = "GROUP_CREATED"
    BROADCAST_SENT = "BROADCAST_SENT"
    CONTRIBUTION = "CONTRIBUTION"
    AGENT_MISSING = "AGENT_MISSING"
    WORKFLOW_CREATED = "WORKFLOW_CREATED"
    HANDOFF = "HANDOFF"
    STEP_RESULT = "STEP_RESULT"
    PATTERN_SWITCH = "PATTERN_SWITCH"
    SCORES = "SCORES"
    AGGREGATION = "AGGREGATION"
    ROUTED = "ROUTED"
    RESULT = "RESULT"
    FAILURE = "FAILURE"
    PROPOSAL = "PROPOSAL"
    VOTE = "VOTE"
    DECISION = "DECISION"
    PLAN = "PLAN"
    FINDINGS = "FINDINGS"
    CONFLICT = "CONFLICT"
    ESCALATION = "ESCALATION"
    ITERATION = "ITERATION"
    REPORT = "REPORT"


@dataclass(frozen=True, slots=True, kw_only=True)
class PatternEvent:
    """One thing that happened in a pattern run."""

    run_id: str
    pattern: Pattern
    kind: EventKind
    summary: str
    data: dict[str, JSON] = field(default_factory=dict)
    agent_id: str = ""
    step: int = 0
    round: int = 0
    elapsed_ms: float = 0.0
    timestamp: datetime = field(default_factory=utc_now)


Emit = Callable[[PatternEvent], Awaitable[None]]


async def discard(event: PatternEvent) -> None:
    """An Emit that drops events (for callers that only want the result)."""

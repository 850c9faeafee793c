"""Shared pieces of the pattern core: ids, clocks, number handling, spec errors."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping

from mesh.core.errors import MessageValidationError, shown
from mesh.core.model import JSON

Clock = Callable[[], float]
GATEWAY_ID = "gateway"
"""The reply_to of every message the gateway sends: answers come back to the gateway."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


invalid = MessageValidationError.for_field

MAX_AGENTS = 50
"""RT-011 orchestrator max_agents: the most agents one pattern run may involve."""
MAX_PARALLEL = 16
"""The most patterns one RunParallel call may run at once."""
MAX_WAIT_SECONDS = 30.0
"""RT-011 orchestrator aggregation_timeout ("30s max to aggregate results"): the longest a
pattern waits for its agents' answers (a round's, a step's, a subagent's)."""
CANCELLED_WHY = "its caller stopped waiting, or the gateway stopped"
"""Why a run the gateway did not finish ended (its workflow status, its observers say so)."""


def check_group(field: str, agent_ids: list[str], what: str) -> None:
    """A pattern's agents: at least one, at most MAX_AGENTS, none repeated."""
    if not agent_ids:
        raise invalid(field, f"{what} needs at least one agent")
    if len(agent_ids) > MAX_AGENTS:
        raise invalid(field, f"{what} takes at most {MAX_AGENTS} agents")
    if len(set(agent_ids)) != len(agent_ids):
        raise invalid(field, f"{field} must not repeat")


def check_wait(field: str, seconds: float) -> None:
    """How long a pattern waits for an agent's answer: more than nothing, at most
    :data:`MAX_WAIT_SECONDS`."""
    if not 0 < seconds <= MAX_WAIT_SECONDS:
        raise invalid(
            field,
            f"{field} must be more than 0 and at most {MAX_WAIT_SECONDS:g} s (RT-011's "
            f"aggregation timeout), got {seconds:g} s",
        )


def nobody_answered(missing: Mapping[str, str]) -> str:
    """What a run's summary says when no agent answered: each agent and why."""
    reasons = "; ".join(f"{agent_id}: {reason}" for agent_id, reason in sorted(missing.items()))
    return f"no agent answered ({reasons})"


def as_float(value: JSON, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


def unit_value(value: JSON, default: float, field: str) -> float:
    """A confidence or score from an agent's answer: a number from 0 to 1, ``default`` when
    the answer gives none. Anything else (a string, NaN, 85 for 85%) makes the answer
    unusable: MessageValidationError on ``field``, which a pattern reports as the agent's
    reason for missing rather than let it win or sink a vote."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise invalid(field, f"{field} must be a number from 0 to 1, got {shown(value)}")
    return float(value)


def pick(value: JSON, field: str) -> str:
    """An agent's pick (a recommendation): a string that names something. None, "" or a
    list, object, number or boolean in its place makes the answer unusable:
    MessageValidationError on ``field`` (the agent is reported missing, with that reason),
    rather than an empty or made-up option taking part in the vote."""
    if not isinstance(value, str) or not value.strip():
        raise invalid(field, f"{field} must be a non-empty string, got {shown(value)}")
    return value


def clean(value: float) -> float:
    """Rounds away binary noise (0.7600000000000001 -> 0.76) for reporting."""
    return round(value, 9)


class Stopwatch:
    def __init__(self, clock: Clock = time.perf_counter) -> None:
        self._clock = clock
        self._start = clock()

    @property
    def ms(self) -> float:
        return round((self._clock() - self._start) * 1000, 3)

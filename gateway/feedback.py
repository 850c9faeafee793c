"""Users' verdicts on pattern runs (RF-010 scenario 20: a pattern's accuracy is the share of
its rated runs whose outcome satisfied the user).

The gateway follows every run through its events: a run is known from its first event and
finished at its RESULT. A user rates a finished run once (a second rating replaces the
first). Only the most recent runs are remembered, so the ledger's memory stays bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gateway.events import EventKind, Pattern, PatternEvent
from gateway.patterns._common import invalid
from mesh.core.errors import MeshError, NotFoundError

RUNS_REMEMBERED = 10_000
"""How many runs (the most recent) may still be rated."""


@dataclass(slots=True)
class _Run:
    pattern: Pattern
    status: str = ""
    """The RESULT's status (COMPLETED, PARTIAL, FAILED); empty while the run goes on."""
    satisfied: bool | None = None


@dataclass(frozen=True, slots=True)
class Rating:
    """What a rating changed: the run's pattern, and the run's rating before (None if none)."""

    pattern: Pattern
    previous: bool | None


class RunLedger:
    def __init__(self, capacity: int = RUNS_REMEMBERED) -> None:
        self.capacity = capacity
        self._runs: OrderedDict[str, _Run] = OrderedDict()

    def observe(self, event: PatternEvent) -> None:
        """Follows a run through its events (every run of a parallel run has its own)."""
        run = self._runs.get(event.run_id)
        if run is None:
            if not event.run_id:
                return
            run = self._runs[event.run_id] = _Run(event.pattern)
            if len(self._runs) > self.capacity:
                self._runs.popitem(last=False)
        if event.kind is EventKind.RESULT and event.pattern is run.pattern:
            run.status = str(event.data.get("status", "FAILED"))

    def rate(self, run_id: str, satisfied: bool) -> Rating:
        """Records the user's verdict on a finished run's outcome."""
        if not run_id:
            raise invalid("run_id", "run_id is required")
        run = self._runs.get(run_id)
        if run is None:
            raise NotFoundError(
                f"run {run_id} is not known here (the gateway remembers its last "
                f"{self.capacity} runs)",
                reason="RUN_NOT_FOUND",
            )
        if not run.status:
            raise MeshError(
                f"run {run_id} has no result to rate (still running, or ended without one)",
                code="FAILED_PRECONDITION",
                reason="RUN_NOT_FINISHED",
            )
        if run.status == "FAILED":
            raise MeshError(
                f"run {run_id} failed: it has no outcome to rate",
                code="FAILED_PRECONDITION",
                reason="RUN_FAILED",
            )
        previous, run.satisfied = run.satisfied, satisfied
        return Rating(run.pattern, previous)

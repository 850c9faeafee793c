"""Users' verdicts on pattern runs (RF-010 scenario 20: a pattern's accuracy is the share of
its rated runs whose outcome satisfied the user).

The gateway follows every run through its events: a run is known from its first event and
finished at its RESULT. A user rates a finished run once (a second rating replaces the
first). Only the most recent runs are remembered, so the ledger's memory stays bounded.

A rated group chat also rates its members: an agent that recommended the option the group
chose was right if the user was satisfied, and one that recommended another was right if the
user was not. That track record is the "historical accuracy" RT-011's conflict resolution
weighs (the group chat strategy "expertise_weighted").
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from gateway.events import EventKind, Pattern, PatternEvent
from gateway.patterns._common import invalid
from gateway.patterns.group_chat import GroupChatSpec
from gateway.patterns.handoff import WorkflowSpec
from mesh.core.errors import MeshError, NotFoundError
from mesh.core.model import JSON

logger = logging.getLogger("gateway.feedback")
RUNS_REMEMBERED = 10_000
"""How many runs (the most recent) may still be rated."""


AGENTS_REMEMBERED = 10_000
"""How many agents' track records the ledger keeps (the mesh registers at most as many)."""


@dataclass(slots=True)
class _Run:
    pattern: Pattern
    status: str = ""
    """The RESULT's status (COMPLETED, PARTIAL, FAILED); empty while the run goes on."""
    satisfied: bool | None = None
    backed: dict[str, bool] = field(default_factory=dict)
    """A group chat's members: whether each recommended the option the group chose."""


@dataclass(slots=True)
class AgentRecord:
    """An agent's track record: of the rated group chats it took part in, how often its own
    recommendation was right (it backed the outcome the user was satisfied with, or opposed
    one the user was not)."""

    rated: int = 0
    right: int = 0

    @property
    def accuracy(self) -> float:
        return self.right / self.rated if self.rated else 0.0


@dataclass(frozen=True, slots=True)
class Rating:
    """What a rating changed: the run's pattern, and the run's rating before (None if none)."""

    pattern: Pattern
    previous: bool | None


class RunLedger:
    def __init__(self, capacity: int = RUNS_REMEMBERED) -> None:
        self.capacity = capacity
        self._runs: OrderedDict[str, _Run] = OrderedDict()
        self._agents: dict[str, AgentRecord] = {}

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
            if run.pattern is Pattern.GROUP_CHAT:
                run.backed = _backing(event.data)

    def inform(self, spec: object) -> None:
        """Gives the group chats of a pattern spec (one, or a workflow's group-chat steps)
        their members' historical accuracy."""
        if isinstance(spec, GroupChatSpec):
            groups = [spec]
        elif isinstance(spec, WorkflowSpec):
            groups = [s.group_chat for s in spec.steps if s.group_chat is not None]
        else:
            groups = []
        for group in groups:
            group.accuracy = {
                agent_id: accuracy
                for agent_id in group.agent_ids
                if (accuracy := self.accuracy(agent_id)) is not None
            }

    def accuracy(self, agent_id: str) -> float | None:
        """The share of an agent's rated group chats in which it was right (None: none)."""
        record = self._agents.get(agent_id)
        return record.accuracy if record is not None and record.rated else None

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
        logger.info(
            "feedback on %s run %s: %s",
            run.pattern.value,
            run_id,
            "satisfied" if satisfied else "not satisfied",
            extra={
                "event": {
                    "category": "feedback",
                    "pattern": run.pattern.value,
                    "run_id": run_id,
                    "satisfied": satisfied,
                    "replaced": previous is not None,
                }
            },
        )
        for agent_id, backed in run.backed.items():
            record = self._agents.get(agent_id)
            if record is None:
                if len(self._agents) >= AGENTS_REMEMBERED:
                    continue
                record = self._agents[agent_id] = AgentRecord()
            if previous is None:
                record.rated += 1
            else:
                record.right -= backed == previous
            record.right += backed == satisfied
        return Rating(run.pattern, previous)


def _backing(result: dict[str, JSON]) -> dict[str, bool]:
    """From a group chat's result: whether each member's last recommendation was the option
    the group chose (nothing when the group reached no decision)."""
    aggregate = result.get("aggregate")
    if not isinstance(aggregate, dict):
        return {}
    chosen = aggregate.get("winner", aggregate.get("consensus"))
    if not isinstance(chosen, str):
        return {}
    last: dict[str, JSON] = {}
    contributions = result.get("contributions")
    for contribution in contributions if isinstance(contributions, list) else []:
        if isinstance(contribution, dict):
            last[str(contribution.get("agent_id"))] = contribution.get("recommendation")
    return {agent_id: said == chosen for agent_id, said in last.items()}

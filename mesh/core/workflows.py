"""A workflow's status in the shared state (RT-011 hand-off protocol: "update shared state"):
``workflow/<workflow_id>``, written by the broker at each hand-off (the agent that has the
workflow now, the step, who handed it on, the task; status IN_PROGRESS) and, by whoever runs
the workflow, once it ends (COMPLETED, or FAILED with the step it failed at and why: RF-010
scenario 10).

Every write is a compare-and-set on the version read: a hand-off of an earlier step than the
one recorded (one retried late, or racing on another replica) leaves the status as it is, and
an ending is written only over a status there is (none is made for a workflow whose hand-offs
were not recorded), keeping what the hand-offs wrote and the time it has left.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from mesh.core.errors import NotFoundError, StateConflictError
from mesh.core.model import JSON, Handoff, Message
from mesh.core.state import MAX_KEY_LENGTH, StateEntry

WORKFLOW_KEY_PREFIX = "workflow/"
"""A workflow's status in the shared state is ``workflow/<workflow_id>``."""
MAX_WORKFLOW_ID = MAX_KEY_LENGTH - len(WORKFLOW_KEY_PREFIX)
"""Characters of a workflow id at most: its status's key must fit the shared state's."""
IN_PROGRESS = "IN_PROGRESS"
ENDED = frozenset({"COMPLETED", "FAILED"})
TRIES = 3
"""Compare-and-set attempts before a write that keeps meeting newer ones gives up."""


class StatusStore(Protocol):
    """What recording a status needs of a shared state: the broker's own, or one reached
    through a client."""

    async def get(self, key: str) -> StateEntry: ...

    async def put(
        self,
        key: str,
        value: JSON,
        agent_id: str,
        *,
        expected_version: int | None = None,
        ttl: float | None = None,
    ) -> StateEntry: ...


def workflow_id_problem(workflow_id: str) -> str | None:
    """Why ``workflow_id`` cannot name a workflow (None when it can): its status is kept as
    ``workflow/<workflow_id>``, and shown in logs and on the dashboard."""
    if len(workflow_id) > MAX_WORKFLOW_ID or not workflow_id.isprintable():
        return (
            f"workflow_id must be printable and at most {MAX_WORKFLOW_ID} characters "
            f"(its status is the shared state's {WORKFLOW_KEY_PREFIX}<workflow_id>)"
        )
    return None


def key_of(workflow_id: str) -> str:
    return f"{WORKFLOW_KEY_PREFIX}{workflow_id}"


def step_of(status: JSON) -> int:
    """The step a workflow's recorded status is at (0 for a value that is no status)."""
    step = status.get("step") if isinstance(status, dict) else None
    return step if isinstance(step, int) else 0


def hop_of(status: JSON) -> int:
    """The hand-off count a recorded status is at (0 when its hand-off did not say)."""
    hop = status.get("hop") if isinstance(status, dict) else None
    return hop if isinstance(hop, int) else 0


def comes_after(kept: JSON, new: JSON) -> bool:
    """Whether a kept status is the later one: by the hand-offs' count when both say it (a
    workflow the gateway runs may go back to an earlier step), else by step."""
    kept_hop, new_hop = hop_of(kept), hop_of(new)
    if kept_hop and new_hop:
        return kept_hop > new_hop
    return step_of(kept) > step_of(new)


def handed_off(message: Message) -> dict[str, JSON]:
    """The status a HANDOFF message gives its workflow (with the ``hop`` its metadata
    counts, when it does)."""
    handoff = Handoff.from_message(message)
    hop = message.metadata.get("hop")
    counted: dict[str, JSON] = {"hop": hop} if isinstance(hop, int) and hop > 0 else {}
    return {
        **counted,
        "workflow_id": handoff.workflow_id,
        "status": IN_PROGRESS,
        "current_agent": message.to_agent,
        "step": handoff.step_number,
        "from_agent": message.from_agent,
        "task_description": handoff.task_description,
        "message_id": message.message_id,
        "handed_off_at": message.timestamp.isoformat(),
    }


def ended(
    status: JSON,
    outcome: str,
    at: datetime,
    *,
    failed_at_step: int | None = None,
    error_reason: str = "",
) -> dict[str, JSON]:
    """The recorded status, the workflow's ending added (RF-010 scenario 10's fields when it
    failed; ``failed_at_step`` by default the step the status is at)."""
    if outcome not in ENDED:
        raise ValueError(f"a workflow ends COMPLETED or FAILED, not {outcome!r}")
    value: dict[str, JSON] = dict(status) if isinstance(status, dict) else {}
    value.update(status=outcome, finished_at=at.isoformat())
    if outcome == "FAILED":
        step = step_of(status) if failed_at_step is None else failed_at_step
        value.update(failed_at_step=step, error_reason=error_reason)
    else:  # (over an ending written before: its failure is no longer the workflow's)
        value.pop("failed_at_step", None)
        value.pop("error_reason", None)
    return value


async def _read(state: StatusStore, key: str) -> StateEntry | None:
    try:
        return await state.get(key)
    except NotFoundError:
        return None


async def record_hand_off(state: StatusStore, message: Message, ttl: float) -> None:
    """Writes the status a hand-off gives its workflow, kept ``ttl`` seconds; leaves a status
    at a later step. Raises what the state refuses (full, locked, a conflict each try)."""
    status = handed_off(message)
    key = key_of(str(status["workflow_id"]))
    for _ in range(TRIES):
        current = await _read(state, key)
        if current is not None and comes_after(current.value, status):
            return
        try:
            await state.put(
                key,
                status,
                message.from_agent,
                expected_version=current.version if current else 0,
                ttl=ttl,
            )
            return
        except StateConflictError as error:
            if error.reason != "VERSION_CONFLICT":
                raise
    raise StateConflictError(f"{key!r} kept changing", reason="VERSION_CONFLICT")


async def record_ending(
    state: StatusStore,
    workflow_id: str,
    outcome: str,
    by: str,
    at: datetime,
    *,
    failed_at_step: int | None = None,
    error_reason: str = "",
) -> StateEntry | None:
    """Adds a workflow's ending to its recorded status, for the time the status has left;
    None (nothing written) when no status is recorded."""
    key = key_of(workflow_id)
    for _ in range(TRIES):
        current = await _read(state, key)
        if current is None:
            return None
        left = None
        if current.expires_at is not None:
            left = max(1.0, (current.expires_at - at).total_seconds())
        value = ended(
            current.value, outcome, at, failed_at_step=failed_at_step, error_reason=error_reason
        )
        try:
            return await state.put(key, value, by, expected_version=current.version, ttl=left)
        except StateConflictError as error:
            if error.reason != "VERSION_CONFLICT":
                raise
    raise StateConflictError(f"{key!r} kept changing", reason="VERSION_CONFLICT")

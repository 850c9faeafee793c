"""Hand-off workflows (RF-010 pattern 2): agents in sequence, each receiving a HANDOFF with the
accumulated context; agents (or the workflow's routes) choose the next step; a failure stops the
workflow and hands an error off to the notification agent; a group-chat step switches pattern
mid-workflow and resumes with the group's decision."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from gateway.dispatch import Dispatcher
from gateway.events import Emit, EventKind, Pattern, PatternEvent
from gateway.patterns._common import (
    CANCELLED_WHY,
    GATEWAY_ID,
    MAX_AGENTS,
    Stopwatch,
    check_wait,
    invalid,
    new_id,
)
from gateway.patterns.group_chat import GroupChatSpec, run_group_chat
from gateway.tracing import tracer
from mesh.core.errors import MeshError
from mesh.core.model import JSON, Handoff, Message, MessageType
from mesh.core.workflows import workflow_id_problem

logger = logging.getLogger("gateway.handoff")
END = "END"
FAILED_STATUSES = frozenset({"FAILED", "ERROR"})
RESERVED_KEYS = frozenset({"action", "status", "next_agent", "next_task", "error", "result"})
DEFAULT_MAX_HOPS = 16


@dataclass(slots=True, kw_only=True)
class WorkflowStep:
    """One step: an agent, or a group chat whose decision is the step's status."""

    agent_id: str = ""
    task_description: str = ""
    routes: dict[str, str] = field(default_factory=dict)
    """Result status -> next agent (or "END"), when the agent does not choose itself."""
    group_chat: GroupChatSpec | None = None
    parallel: list[str] = field(default_factory=list)
    """A parallel-merge step's agents: each gets the hand-off at once (RT-011 "A || B -> C")."""

    @property
    def name(self) -> str:
        if self.group_chat is not None:
            return self.agent_id or "group_chat"
        if self.parallel:
            return self.agent_id or "|".join(self.parallel)
        return self.agent_id


@dataclass(slots=True, kw_only=True)
class WorkflowSpec:
    steps: list[WorkflowStep]
    task: str
    context: dict[str, JSON] = field(default_factory=dict)
    constraints: dict[str, JSON] = field(default_factory=dict)
    failure_agent: str = ""
    max_hops: int = DEFAULT_MAX_HOPS
    step_timeout: float = 10.0
    workflow_id: str = ""
    from_agent: str = "user"

    def validate(self) -> None:
        if not self.steps:
            raise invalid("steps", "a workflow needs at least one step")
        if len(self.steps) > MAX_AGENTS:
            raise invalid("steps", f"a workflow takes at most {MAX_AGENTS} steps")
        if not self.task:
            raise invalid("task", "task is required")
        if self.workflow_id and (problem := workflow_id_problem(self.workflow_id)):
            raise invalid("workflow_id", problem)
        for i, step in enumerate(self.steps):
            if step.group_chat is None and not step.parallel and not step.agent_id:
                raise invalid(
                    f"steps[{i}].agent_id",
                    "each step needs an agent_id, a group_chat or parallel_agent_ids",
                )
            if step.parallel:
                if step.group_chat is not None:
                    raise invalid(
                        f"steps[{i}].parallel_agent_ids", "a step is a group chat or parallel"
                    )
                if len(step.parallel) > MAX_AGENTS or len(set(step.parallel)) != len(step.parallel):
                    raise invalid(
                        f"steps[{i}].parallel_agent_ids",
                        f"at most {MAX_AGENTS} agents, none repeated",
                    )
            if step.group_chat is not None:
                if not step.group_chat.query:
                    step.group_chat.query = step.task_description or self.task
                step.group_chat.validate()
        if not 1 <= self.max_hops <= 1000:
            raise invalid("max_hops", "max_hops must be within 1..1000")
        check_wait("step_timeout", self.step_timeout)

    def index_of(self, agent_id: str, after: int) -> int | None:
        """The next step run by ``agent_id`` after position ``after``, else its first step."""
        names = [s.name for s in self.steps]
        for i in range(after + 1, len(names)):
            if names[i] == agent_id:
                return i
        return names.index(agent_id) if agent_id in names else None


@dataclass(slots=True)
class StepOutcome:
    status: str
    data: dict[str, JSON]
    next_agent: str = ""
    next_task: str = ""
    error: str = ""


def read_outcome(answer: Message) -> StepOutcome:
    """An agent's answer to a HANDOFF: status, result data, chosen next agent, error."""
    content = answer.content or {}
    if answer.message_type is MessageType.ERROR:
        return StepOutcome("FAILED", {}, error=str(content.get("error") or "agent error"))
    result = content.get("result")
    data = (
        result
        if isinstance(result, dict)
        else {k: v for k, v in content.items() if k not in RESERVED_KEYS}
    )
    status = str(content.get("status") or "DONE").upper()
    return StepOutcome(
        status=status,
        data=data,
        next_agent=str(content.get("next_agent") or ""),
        next_task=str(content.get("next_task") or ""),
        error=str(content.get("error") or ""),
    )


CANCELLED_REASON = f"the run was cancelled: {CANCELLED_WHY}"
"""The error_reason recorded for a workflow whose run the gateway did not finish."""


async def run_workflow(spec: WorkflowSpec, dispatcher: Dispatcher, emit: Emit) -> dict[str, JSON]:
    """Executes the workflow step by step through real hand-off messages; returns the result.
    A run cancelled part way (its caller gone) records its workflow FAILED at the step it was
    at, rather than leaving its status IN_PROGRESS for good."""
    spec.validate()
    workflow_id = spec.workflow_id or new_id("wf")
    at_step = [0]  # the index of the step the run is at
    try:
        return await _run_steps(spec, workflow_id, dispatcher, emit, at_step)
    except asyncio.CancelledError:
        failure: dict[str, JSON] = {"failed_at_step": at_step[0], "error_reason": CANCELLED_REASON}
        await _record_ending(dispatcher, workflow_id, failure)
        raise


async def _run_steps(
    spec: WorkflowSpec, workflow_id: str, dispatcher: Dispatcher, emit: Emit, at_step: list[int]
) -> dict[str, JSON]:
    clock = Stopwatch()

    async def event(kind: EventKind, summary: str, **fields: Any) -> None:
        await emit(
            PatternEvent(
                run_id=workflow_id,
                pattern=Pattern.HAND_OFF,
                kind=kind,
                summary=summary,
                elapsed_ms=clock.ms,
                **fields,
            )
        )

    await event(
        EventKind.WORKFLOW_CREATED,
        f"workflow {workflow_id} created with {len(spec.steps)} steps",
        data={
            "workflow_id": workflow_id,
            "current_step": 0,
            "status": "CREATED",
            "steps": [
                {
                    "step": i + 1,
                    "agent_id": s.name,
                    "pattern": "GROUP_CHAT"
                    if s.group_chat
                    else ("PARALLEL_MERGE" if s.parallel else "HAND_OFF"),
                    **({"agents": list(s.parallel)} if s.parallel else {}),
                }
                for i, s in enumerate(spec.steps)
            ],
        },
    )

    accumulated: dict[str, JSON] = {}
    previous_results: list[JSON] = []
    path: list[str] = []
    previous_agent = spec.from_agent
    previous_result: JSON = None
    task = spec.task
    index: int | None = 0
    hops = 0
    current_step = 0
    failure: dict[str, JSON] | None = None
    last_outcome: StepOutcome | None = None

    while index is not None and index < len(spec.steps):
        step = spec.steps[index]
        at_step[0] = index
        if hops >= spec.max_hops:
            failure = {
                "failed_at_step": index,
                "agent_id": step.name,
                "error_reason": f"workflow exceeded {spec.max_hops} hand-offs (loop protection)",
            }
            break
        hops += 1
        step_number = index + 1
        step_task = step.task_description or task
        context: dict[str, JSON] = {
            **spec.context,
            "task": spec.task,
            "previous_results": list(previous_results),
            "accumulated_context": dict(accumulated),
        }
        if step.group_chat is not None:
            outcome = await _group_step(spec, step, step_number, context, dispatcher, emit, event)
        elif step.parallel:
            outcome = await _parallel_step(
                spec,
                workflow_id,
                step,
                step_number,
                step_task,
                context,
                previous_agent,
                previous_result,
                dispatcher,
                event,
                hops,
            )
        else:
            outcome = await _agent_step(
                spec,
                workflow_id,
                step,
                step_number,
                step_task,
                context,
                previous_agent,
                previous_result,
                dispatcher,
                event,
                hops,
            )
        last_outcome = outcome
        path.append(step.name)
        current_step = index + 1
        await event(
            EventKind.STEP_RESULT,
            f"step {step_number} {step.name}: {outcome.status}",
            agent_id=step.name,
            step=step_number,
            data={
                "step_number": step_number,
                "agent_id": step.name,
                "status": outcome.status,
                "result": outcome.data,
                "error": outcome.error,
                "current_step": current_step,
            },
        )
        if outcome.status in FAILED_STATUSES:
            failure = {
                "failed_at_step": index,
                "agent_id": step.name,
                "error_reason": outcome.error or outcome.status,
            }
            break
        previous_results.append(outcome.data)
        if step.parallel:  # each agent's result, in the step's order
            for part in outcome.data.values():
                if isinstance(part, dict):
                    accumulated.update(part)
        else:
            accumulated.update(outcome.data)
        previous_agent, previous_result = step.name, outcome.data
        task = outcome.next_task or spec.task
        chosen = outcome.next_agent or step.routes.get(outcome.status, "")
        if chosen:
            _log_decision(workflow_id, step, step_number, outcome, chosen)
        if chosen == END:
            break
        if chosen:
            index = spec.index_of(chosen, index)
            if index is None:
                failure = {
                    "failed_at_step": current_step - 1,
                    "agent_id": step.name,
                    "error_reason": f"{step.name} routed to {chosen}, which is not a step",
                }
                break
        else:
            index += 1

    result: dict[str, JSON] = {
        "workflow_id": workflow_id,
        "status": "FAILED" if failure else "COMPLETED",
        "current_step": current_step,
        "path": path,
        "previous_results": previous_results,
        "accumulated_context": accumulated,
        "final_result": last_outcome.data if last_outcome else None,
        "final_status": last_outcome.status if last_outcome else None,
        "hops": hops,
    }
    if failure is not None:
        result.update(failure)
        await event(
            EventKind.FAILURE,
            # Summaries count steps from 1, as the step events do; failed_at_step (RF-010
            # scenario 10) is the step's index.
            f"workflow failed at step {int(failure['failed_at_step']) + 1} "
            f"{failure['agent_id']}: {failure['error_reason']}",
            agent_id=str(failure["agent_id"]),
            data=dict(failure),
        )
        if spec.failure_agent and spec.failure_agent != failure["agent_id"]:
            result["notification"] = await _notify_failure(
                spec, workflow_id, failure, accumulated, dispatcher, event, hops
            )
    await _record_ending(dispatcher, workflow_id, failure)
    result["duration_ms"] = clock.ms
    await event(
        EventKind.RESULT,
        f"workflow {result['status'].lower()} after {len(path)} steps",
        data=result,
    )
    return result


async def _record_ending(
    dispatcher: Dispatcher, workflow_id: str, failure: dict[str, JSON] | None
) -> None:
    """The workflow's ending, added to its status in the shared state (RF-010 scenario 10:
    status FAILED, failed_at_step, error_reason), after the hand-off that notified the failure
    (which moved the status on). A status that cannot be written is logged; the workflow's
    result stands."""
    try:
        if failure is None:
            await dispatcher.record_ending(
                workflow_id, "COMPLETED", failed_at_step=None, error_reason=""
            )
        else:
            step = failure["failed_at_step"]
            await dispatcher.record_ending(
                workflow_id,
                "FAILED",
                failed_at_step=step if isinstance(step, int) else None,
                error_reason=str(failure["error_reason"]),
            )
    except MeshError as error:
        logger.warning(
            "workflow %s: its ending was not recorded in the shared state: %s",
            workflow_id,
            error.message,
            extra={
                "event": {
                    "category": "workflow_status",
                    "workflow_id": workflow_id,
                    "error": error.message,
                }
            },
        )


def _log_decision(
    workflow_id: str, step: WorkflowStep, step_number: int, outcome: StepOutcome, chosen: str
) -> None:
    """A conditional hand-off (RF-009 scenario 10, "conditional logic logged"): where the
    workflow goes after a step, and what decided it, the agent or the step's routes."""
    logger.info(
        "workflow %s: %s at step %d said %s, next %s",
        workflow_id,
        step.name,
        step_number,
        outcome.status,
        chosen,
        extra={
            "event": {
                "category": "handoff_decision",
                "workflow_id": workflow_id,
                "from_agent": step.name,
                "step_number": step_number,
                "status": outcome.status,
                "to_agent": chosen,
                "decided_by": "agent" if outcome.next_agent else "routes",
            }
        },
    )


async def _agent_step(
    spec: WorkflowSpec,
    workflow_id: str,
    step: WorkflowStep,
    step_number: int,
    task: str,
    context: dict[str, JSON],
    previous_agent: str,
    previous_result: JSON,
    dispatcher: Dispatcher,
    event: Any,
    hop: int,
) -> StepOutcome:
    handoff = Handoff(
        task_description=task,
        context=context,
        previous_result=previous_result,
        constraints=spec.constraints,
        workflow_id=workflow_id,
        step_number=step_number,
    )
    message = Message(
        from_agent=previous_agent,
        to_agent=step.agent_id,
        message_type=MessageType.HANDOFF,
        content=handoff.to_content(),
        metadata={**handoff.to_metadata(), "hop": hop},
        reply_to=GATEWAY_ID,
    )
    await event(
        EventKind.HANDOFF,
        f"hand-off {previous_agent} -> {step.agent_id} (step {step_number})",
        agent_id=step.agent_id,
        step=step_number,
        data={
            "from_agent": previous_agent,
            "to_agent": step.agent_id,
            "step_number": step_number,
            "task_description": task,
            "message_id": message.message_id,
            "context_size_kb": handoff.context_size_kb,
        },
    )
    with tracer().start_as_current_span(
        "hand_off.step",
        attributes={
            "workflow_id": workflow_id,
            "agent": step.agent_id,
            "step_number": step_number,
            "from_agent": previous_agent,
        },
    ) as span:
        try:
            answer = await dispatcher.ask(message, spec.step_timeout)
        except MeshError as error:
            span.set_attribute("error", error.message)
            return StepOutcome("FAILED", {}, error=f"{step.agent_id}: {error.message}")
        outcome = read_outcome(answer)
        span.set_attribute("status", outcome.status)
        return outcome


async def _parallel_step(
    spec: WorkflowSpec,
    workflow_id: str,
    step: WorkflowStep,
    step_number: int,
    task: str,
    context: dict[str, JSON],
    previous_agent: str,
    previous_result: JSON,
    dispatcher: Dispatcher,
    event: Any,
    hop: int,
) -> StepOutcome:
    """Hands the task to every agent of the step at once and merges their outcomes: the
    data by agent, the status theirs when they agree (else MIXED), FAILED if any failed."""
    branches = [
        WorkflowStep(agent_id=agent_id, task_description=step.task_description)
        for agent_id in step.parallel
    ]
    outcomes = await asyncio.gather(
        *(
            _agent_step(
                spec,
                workflow_id,
                branch,
                step_number,
                task,
                context,
                previous_agent,
                previous_result,
                dispatcher,
                event,
                hop,
            )
            for branch in branches
        )
    )
    by_agent = dict(zip(step.parallel, outcomes, strict=True))
    failed = {a: o for a, o in by_agent.items() if o.status in FAILED_STATUSES}
    if failed:
        return StepOutcome(
            "FAILED",
            {a: o.data for a, o in by_agent.items()},
            error="; ".join(f"{a}: {o.error or o.status}" for a, o in failed.items()),
        )
    statuses = {o.status for o in outcomes}
    chosen = {o.next_agent for o in outcomes}
    return StepOutcome(
        statuses.pop() if len(statuses) == 1 else "MIXED",
        {a: o.data for a, o in by_agent.items()},
        next_agent=chosen.pop() if len(chosen) == 1 else "",  # only when they all agree
    )


async def _group_step(
    spec: WorkflowSpec,
    step: WorkflowStep,
    step_number: int,
    context: dict[str, JSON],
    dispatcher: Dispatcher,
    emit: Emit,
    event: Any,
) -> StepOutcome:
    """Pauses the hand-off, runs a group chat, resumes with the group's decision."""
    assert step.group_chat is not None
    group = step.group_chat
    group.context = {**group.context, **context}
    switch = Stopwatch()
    logger.info(
        "pattern switch HAND_OFF -> GROUP_CHAT at step %d",
        step_number,
        extra={
            "event": {
                "category": "pattern_switch",
                "from_pattern": "HAND_OFF",
                "to_pattern": "GROUP_CHAT",
                "at_step": step_number,
                "agents": list(group.agent_ids),
            }
        },
    )
    await event(
        EventKind.PATTERN_SWITCH,
        f"pausing hand-off at step {step_number} for a group chat",
        step=step_number,
        data={
            "from_pattern": "HAND_OFF",
            "to_pattern": "GROUP_CHAT",
            "at_step": step_number,
            "agents": list(group.agent_ids),
            "reason": "decision requires expert consensus",
        },
    )
    result = await run_group_chat(group, dispatcher, emit)
    aggregate = result["aggregate"]
    assert isinstance(aggregate, dict)
    decision = str(
        aggregate.get("consensus")
        or aggregate.get("winner")
        or aggregate.get("recommendation")
        or ("NO_DECISION" if aggregate.get("decided") is False else "")  # "unanimous", split
    )
    logger.info(
        "pattern switch GROUP_CHAT -> HAND_OFF at step %d: %s",
        step_number,
        decision,
        extra={
            "event": {
                "category": "pattern_switch",
                "from_pattern": "GROUP_CHAT",
                "to_pattern": "HAND_OFF",
                "at_step": step_number,
                "decision": decision,
                "switch_ms": switch.ms,
            }
        },
    )
    await event(
        EventKind.PATTERN_SWITCH,
        f"resuming hand-off at step {step_number} with decision {decision}",
        step=step_number,
        data={
            "from_pattern": "GROUP_CHAT",
            "to_pattern": "HAND_OFF",
            "at_step": step_number,
            "decision": decision,
            "group_id": result["group_id"],
            "switch_ms": switch.ms,
        },
    )
    if not result["answered"]:
        return StepOutcome("FAILED", {}, error="no member of the group chat answered")
    return StepOutcome(
        decision.upper(),
        {
            "decision": decision,
            "group_id": result["group_id"],
            "group_recommendation": aggregate.get("recommendation"),
        },
    )


async def _notify_failure(
    spec: WorkflowSpec,
    workflow_id: str,
    failure: dict[str, JSON],
    accumulated: dict[str, JSON],
    dispatcher: Dispatcher,
    event: Any,
    hops: int,
) -> JSON:
    """The error hand-off of RF-010 scenario 10: the notification agent tells the customer.
    It counts as the hop after the workflow's last (``hops``): the status moves on to it
    whatever step the workflow had gone back to."""
    failed_agent = str(failure["agent_id"])
    handoff = Handoff(
        task_description=f"Notify failure: {failure['error_reason']}",
        context={
            "task": spec.task,
            "error": failure["error_reason"],
            "failed_at_step": failure["failed_at_step"],
            "failed_agent": failed_agent,
            "accumulated_context": accumulated,
        },
        previous_result={"status": "FAILED", "error": failure["error_reason"]},
        constraints=spec.constraints,
        workflow_id=workflow_id,
        step_number=int(failure["failed_at_step"]) + 2,
    )
    message = Message(
        from_agent=failed_agent,
        to_agent=spec.failure_agent,
        message_type=MessageType.HANDOFF,
        content=handoff.to_content(),
        metadata={**handoff.to_metadata(), "error_handoff": True, "hop": hops + 1},
        reply_to=GATEWAY_ID,
    )
    await event(
        EventKind.HANDOFF,
        f"error hand-off {failed_agent} -> {spec.failure_agent}",
        agent_id=spec.failure_agent,
        data={
            "from_agent": failed_agent,
            "to_agent": spec.failure_agent,
            "error_handoff": True,
            "task_description": handoff.task_description,
            "message_id": message.message_id,
        },
    )
    try:
        answer = await dispatcher.ask(message, spec.step_timeout)
    except MeshError as error:
        return {"status": "FAILED", "error": error.message}
    outcome = read_outcome(answer)
    return {"status": outcome.status, **outcome.data}

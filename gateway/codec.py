"""Protobuf <-> domain conversion for the Gateway service; the only place that does it."""

from __future__ import annotations

from google.protobuf import json_format, struct_pb2

from gateway.events import EventKind, Pattern, PatternEvent
from gateway.metrics import PatternTally
from gateway.patterns.collaborative import FilteringSpec
from gateway.patterns.consensus import DEFAULT_INSIGHT_TTL, ConsensusSpec
from gateway.patterns.group_chat import GroupChatSpec
from gateway.patterns.handoff import DEFAULT_MAX_HOPS, WorkflowSpec, WorkflowStep
from gateway.patterns.research import ResearchSpec
from mesh.codec import datetime_to_timestamp, dict_to_struct, duration_seconds, struct_to_dict
from mesh.core.model import JSON
from mesh.serving import ANSWER_BYTES
from mesh.v1 import gateway_pb2

PATTERN_TO_PB = {
    Pattern.GROUP_CHAT: gateway_pb2.PATTERN_GROUP_CHAT,
    Pattern.HAND_OFF: gateway_pb2.PATTERN_HAND_OFF,
    Pattern.COLLABORATIVE_FILTERING: gateway_pb2.PATTERN_COLLABORATIVE_FILTERING,
    Pattern.PARALLEL: gateway_pb2.PATTERN_PARALLEL,
    Pattern.CONSENSUS: gateway_pb2.PATTERN_CONSENSUS,
    Pattern.RESEARCH: gateway_pb2.PATTERN_RESEARCH,
}
KIND_TO_PB = {kind: gateway_pb2.EventKind.Value(f"EVENT_KIND_{kind.value}") for kind in EventKind}


def _seconds(pb: object, name: str, default: float) -> float:
    return duration_seconds(getattr(pb, name)) if pb.HasField(name) else default  # type: ignore[attr-defined]


def group_chat_spec(pb: gateway_pb2.RunGroupChatRequest) -> GroupChatSpec:
    return GroupChatSpec(
        agent_ids=list(pb.agent_ids),
        query=pb.query,
        rounds=pb.rounds or 1,
        strategy=pb.strategy or "consensus",
        option_label=pb.option_label or "options",
        agent_timeout=_seconds(pb, "agent_timeout", 10.0),
        group_id=pb.group_id,
        context=struct_to_dict(pb.context),
        levels=dict(pb.hierarchy),
        expertise=dict(pb.expertise),
    )


def workflow_spec(pb: gateway_pb2.RunHandoffWorkflowRequest) -> WorkflowSpec:
    return WorkflowSpec(
        steps=[
            WorkflowStep(
                agent_id=s.agent_id,
                task_description=s.task_description,
                routes=dict(s.routes),
                group_chat=group_chat_spec(s.group_chat) if s.HasField("group_chat") else None,
                parallel=list(s.parallel_agent_ids),
            )
            for s in pb.steps
        ],
        task=pb.task,
        context=struct_to_dict(pb.context),
        constraints=struct_to_dict(pb.constraints),
        failure_agent=pb.failure_agent,
        max_hops=pb.max_hops or DEFAULT_MAX_HOPS,
        step_timeout=_seconds(pb, "step_timeout", 10.0),
        workflow_id=pb.workflow_id,
    )


def filtering_spec(pb: gateway_pb2.RunCollaborativeFilteringRequest) -> FilteringSpec:
    return FilteringSpec(
        agent_ids=list(pb.agent_ids),
        weights=dict(pb.weights),
        query=pb.query,
        method=pb.method or "weighted",
        seed=pb.seed,
        agent_timeout=_seconds(pb, "agent_timeout", 5.0),
        parameters=struct_to_dict(pb.parameters),
    )


def consensus_spec(pb: gateway_pb2.RunConsensusRequest) -> ConsensusSpec:
    spec = ConsensusSpec(
        problem=pb.problem,
        threshold=pb.threshold or 0.67,
        quorum=pb.quorum,
        weights=dict(pb.reviewer_weights),
        early_termination=not pb.wait_for_all_votes,
        agent_timeout=_seconds(pb, "agent_timeout", 10.0),
        insight_ttl=_seconds(pb, "insight_ttl", DEFAULT_INSIGHT_TTL),
    )
    if pb.reviewer_ids:
        spec.reviewer_ids = list(pb.reviewer_ids)
    spec.proposer_id = pb.proposer_id or spec.proposer_id
    spec.facilitator_id = pb.facilitator_id or spec.facilitator_id
    return spec


def research_spec(pb: gateway_pb2.RunResearchRequest) -> ResearchSpec:
    return ResearchSpec(
        query=pb.query,
        documents=pb.documents,
        max_iterations=pb.max_iterations or 3,
        subagent_timeout=_seconds(pb, "subagent_timeout", 10.0),
        tool_timeout=_seconds(pb, "tool_timeout", 2.0),
        dependencies={k: list(v.depends_on) for k, v in pb.dependencies.items()},
        break_cycles=not pb.fail_on_cycle,
        constraints=struct_to_dict(pb.constraints),
        report_name=pb.report_name,
    )


def event_to_pb(event: PatternEvent, out: gateway_pb2.PatternEvent) -> gateway_pb2.PatternEvent:
    out.run_id = event.run_id
    out.pattern = PATTERN_TO_PB[event.pattern]
    out.kind = KIND_TO_PB[event.kind]
    datetime_to_timestamp(event.timestamp, out.timestamp)
    out.elapsed_ms = event.elapsed_ms
    out.agent_id = event.agent_id
    out.step = event.step
    out.round = event.round
    out.summary = event.summary
    dict_to_struct(event.data, out.data)
    if out.ByteSize() > ANSWER_BYTES:
        _leave_out_largest(out)
    return out


def _leave_out_largest(out: gateway_pb2.PatternEvent) -> None:
    """Replaces the largest value of the event's data, at whatever depth (descending into
    the largest field of each object or list), by ``{"omitted_bytes": n}`` until the event
    fits in ANSWER_BYTES: a group chat's RESULT repeats every answer (contributions, history,
    the aggregate), each of which came whole in an event of its own before."""
    size = out.ByteSize()
    while size > ANSWER_BYTES and out.data.fields:
        children = list(out.data.fields.values())
        value = max(children, key=struct_pb2.Value.ByteSize)
        while children := _children(value):
            value = max(children, key=struct_pb2.Value.ByteSize)
        omitted = struct_pb2.Struct()
        omitted["omitted_bytes"] = value.ByteSize()
        value.struct_value.CopyFrom(omitted)
        size, before = out.ByteSize(), size
        if size >= before:  # (what is left is no larger than its omission: the summary is)
            return


def _children(value: struct_pb2.Value) -> list[struct_pb2.Value]:
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        fields = value.struct_value.fields
        # (an omission already made is not descended into again)
        return [] if "omitted_bytes" in fields else list(fields.values())
    return list(value.list_value.values) if kind == "list_value" else []


def preset_request(preset: dict[str, JSON], message_type: type) -> object:
    """A preset from the routing table, read as the request message of its pattern."""
    return json_format.ParseDict(preset, message_type(), ignore_unknown_fields=False)


def stats_to_pb(
    pattern: Pattern, tally: PatternTally, out: gateway_pb2.PatternStats
) -> gateway_pb2.PatternStats:
    out.pattern = PATTERN_TO_PB[pattern]
    out.runs = tally.runs
    out.completed = tally.completed
    out.partial = tally.partial
    out.failed = tally.failed
    out.duration_avg_seconds = tally.duration_avg_seconds
    out.completion_rate = tally.completion_rate
    out.consensus_rate = tally.consensus_rate
    out.rated = tally.rated
    out.satisfied = tally.satisfied
    out.accuracy = tally.accuracy
    return out

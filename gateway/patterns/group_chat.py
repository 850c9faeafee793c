"""Group chat (RF-010 pattern 1): every agent sees the query and the shared history; their
contributions are aggregated by unanimous consensus, weighted voting or highest confidence."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from gateway.dispatch import Dispatcher
from gateway.events import Emit, EventKind, Pattern, PatternEvent
from gateway.patterns._common import (
    GATEWAY_ID,
    Stopwatch,
    check_group,
    check_wait,
    clean,
    invalid,
    new_id,
    nobody_answered,
    pick,
    unit_value,
)
from gateway.tracing import span_name, tracer
from mesh.core.errors import MeshError, MessageTooLargeError
from mesh.core.model import JSON, Message, MessageType
from mesh.core.workflows import MAX_WORKFLOW_ID, workflow_id_problem
from mesh.tracing import inject

STRATEGIES = (
    "consensus",
    "weighted_voting",
    "highest_confidence",
    "majority",
    "unanimous",
    "hierarchy",
    "expertise_weighted",
)
EXPERTISE_WEIGHT, CONFIDENCE_WEIGHT, ACCURACY_WEIGHT = 0.5, 0.3, 0.2
"""RT-011 conflict resolution: a recommendation's weight is 0.5 x the agent's expertise in the
domain + 0.3 x its confidence + 0.2 x its historical accuracy."""
NEUTRAL = 0.5
"""The expertise of an agent not rated for the domain, the accuracy of one with no record."""
DEFAULT_CONFIDENCE = 0.5
DEFAULT_LEVEL = 2
"""RT-011 conflict resolution by hierarchy: orchestrator 0, specialized agents 1, general
agents 2 (an agent given no level)."""
MAX_ROUNDS = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class Contribution:
    """One agent's answer in a round."""

    agent_id: str
    recommendation: str
    confidence: float
    reasoning: str
    round: int = 1
    timestamp: str = ""
    latency_ms: float = 0.0

    def to_dict(self) -> dict[str, JSON]:
        return {
            "agent_id": self.agent_id,
            "recommendation": self.recommendation,
            "confidence": self.confidence,
            "reasoning": self.reasoning,
            "round": self.round,
            "timestamp": self.timestamp,
            "latency_ms": self.latency_ms,
        }


def contribution_from(agent_id: str, content: Mapping[str, JSON], **extra: Any) -> Contribution:
    """Reads an agent's answer: recommendation (or result), confidence (0 to 1, default 0.5)
    and reasoning; MessageValidationError when there is no recommendation to count or the
    confidence is not one."""
    recommendation = content.get("recommendation", content.get("result"))
    return Contribution(
        agent_id=agent_id,
        recommendation=pick(recommendation, "recommendation"),
        confidence=unit_value(content.get("confidence"), DEFAULT_CONFIDENCE, "confidence"),
        reasoning=str(content.get("reasoning", "")),
        **extra,
    )


def aggregate(
    contributions: Sequence[Contribution],
    strategy: str = "consensus",
    option_label: str = "options",
    levels: Mapping[str, int] | None = None,
    expertise: Mapping[str, float] | None = None,
    accuracy: Mapping[str, float] | None = None,
) -> dict[str, JSON]:
    """Aggregates contributions (RF-010 scenarios 4 and 5; RT-011 conflict resolution).

    consensus: unanimous -> the shared recommendation with confidence HIGH; otherwise
    weighted voting. weighted_voting: each option scores the sum of its confidences.
    highest_confidence: the single most confident contribution. majority: the option with
    the most votes (ties: the higher summed confidence). unanimous: a decision only when
    every agent recommends the same. hierarchy: only the contributions of the highest level
    present count (``levels``: 0 highest, DEFAULT_LEVEL for agents not listed), aggregated
    as by consensus. expertise_weighted: each option scores the summed weights of its
    recommendations, 0.5 x expertise + 0.3 x confidence + 0.2 x historical accuracy (NEUTRAL
    for an agent missing from ``expertise`` or ``accuracy``).
    """
    if not contributions:
        return {
            "recommendation": None,
            "confidence": "NONE",
            "reasoning": [],
            "note": "No contributions to aggregate",
            "unanimous": False,
        }
    if strategy not in STRATEGIES:
        raise invalid("strategy", f"strategy must be one of {', '.join(STRATEGIES)}")
    if strategy == "highest_confidence":
        best = max(contributions, key=lambda c: c.confidence)
        return {
            "recommendation": best.recommendation,
            "confidence": best.confidence,
            "reasoning": [best.reasoning],
            "agent_id": best.agent_id,
            "note": "Selected based on highest confidence",
            "unanimous": len({c.recommendation for c in contributions}) == 1,
        }
    options = {c.recommendation for c in contributions}
    if strategy == "majority":
        return majority_vote(contributions, option_label)
    if strategy == "unanimous" and len(options) > 1:
        return {
            "recommendation": None,
            "decided": False,
            "confidence": "NONE",
            "votes": dict(collections.Counter(c.recommendation for c in contributions)),
            "reasoning": [c.reasoning for c in contributions],
            "note": f"No unanimous decision: {len(options)} different {option_label} recommended",
            "unanimous": False,
        }
    if strategy == "hierarchy":
        return hierarchy_vote(contributions, option_label, levels or {})
    if strategy == "expertise_weighted":
        return expertise_vote(contributions, option_label, expertise or {}, accuracy or {})
    if strategy in ("consensus", "unanimous") and len(options) == 1:
        [choice] = options
        return {
            "consensus": choice,
            "confidence": "HIGH",
            "reasoning": [c.reasoning for c in contributions],
            "recommendation": f"{choice} (unanimous expert consensus)",
            "votes": {choice: len(contributions)},
            "unanimous": True,
        }
    return weighted_vote(contributions, option_label)


def majority_vote(contributions: Sequence[Contribution], option_label: str) -> dict[str, JSON]:
    """The option most agents recommend; a tie goes to the higher summed confidence, then
    alphabetical order."""
    counts = collections.Counter(c.recommendation for c in contributions)
    confidence: dict[str, float] = {}
    for c in contributions:
        confidence[c.recommendation] = confidence.get(c.recommendation, 0.0) + c.confidence
    winner = sorted(counts, key=lambda o: (-counts[o], -confidence[o], o))[0]
    unanimous = len(counts) == 1
    tied = sum(1 for o in counts if counts[o] == counts[winner]) > 1
    return {
        "recommendation": f"{winner} (majority: {counts[winner]} of {len(contributions)} votes)",
        "winner": winner,
        "votes": dict(counts),
        "majority": counts[winner] * 2 > len(contributions),
        "tie": tied,
        "confidence": clean(counts[winner] / len(contributions)),
        "reasoning": [c.reasoning for c in contributions if c.recommendation == winner],
        "note": (
            f"Disagreement detected: {len(counts)} different {option_label} recommended"
            if not unanimous
            else "Majority vote over a unanimous group"
        ),
        "unanimous": unanimous,
    }


def hierarchy_vote(
    contributions: Sequence[Contribution], option_label: str, levels: Mapping[str, int]
) -> dict[str, JSON]:
    """Higher-level agents override lower ones: the contributions of the highest level
    present decide, by consensus (weighted voting when they disagree)."""
    level_of = {c.agent_id: levels.get(c.agent_id, DEFAULT_LEVEL) for c in contributions}
    top = min(level_of.values())
    deciding = [c for c in contributions if level_of[c.agent_id] == top]
    result = aggregate(deciding, "consensus", option_label)
    overruled = sorted(
        {c.agent_id for c in contributions if level_of[c.agent_id] != top}
        & {c.agent_id for c in contributions if c.recommendation not in _chosen(result)}
    )
    result.update(
        level=top,
        decided_by=[c.agent_id for c in deciding],
        overruled=overruled,  # lower-level agents that recommended otherwise
        unanimous=len({c.recommendation for c in contributions}) == 1,
    )
    return result


def expertise_vote(
    contributions: Sequence[Contribution],
    option_label: str,
    expertise: Mapping[str, float],
    accuracy: Mapping[str, float],
) -> dict[str, JSON]:
    """RT-011's conflict resolver: recommendations weighted by the agent's expertise,
    confidence and track record."""
    weights = {
        c.agent_id: clean(
            EXPERTISE_WEIGHT * expertise.get(c.agent_id, NEUTRAL)
            + CONFIDENCE_WEIGHT * c.confidence
            + ACCURACY_WEIGHT * accuracy.get(c.agent_id, NEUTRAL)
        )
        for c in contributions
    }
    result = _vote(
        contributions, [weights[c.agent_id] for c in contributions], option_label,
        "Expertise-weighted vote",
    )  # fmt: skip
    result["recommendation"] = f"{result['winner']} (expertise-weighted vote)"
    result["weights"] = dict(weights)
    result["historical_accuracy"] = {
        c.agent_id: accuracy[c.agent_id] for c in contributions if c.agent_id in accuracy
    }
    return result


def _chosen(result: Mapping[str, JSON]) -> set[str]:
    winner = result.get("winner", result.get("consensus"))
    return {winner} if isinstance(winner, str) else set()


def weighted_vote(contributions: Sequence[Contribution], option_label: str) -> dict[str, JSON]:
    """Each option scores the summed confidence of the agents that recommend it."""
    confidences = [c.confidence for c in contributions]
    result = _vote(contributions, confidences, option_label, "Weighted voting")
    votes = result["votes"]
    assert isinstance(votes, dict)
    single = all(n == 1 for n in votes.values())
    how = "highest confidence" if single else "highest weighted vote"
    result["recommendation"] = f"{result['winner']} ({how})"
    return result


def _vote(
    contributions: Sequence[Contribution],
    weights: Sequence[float],
    option_label: str,
    kind: str,
) -> dict[str, JSON]:
    """Each option scores the summed weights of its recommendations; the highest wins, a tie
    going to the heaviest single recommendation, then alphabetical order."""
    scores: dict[str, float] = {}
    counts: dict[str, int] = {}
    best_single: dict[str, float] = {}
    for c, weight in zip(contributions, weights, strict=True):
        scores[c.recommendation] = scores.get(c.recommendation, 0.0) + weight
        counts[c.recommendation] = counts.get(c.recommendation, 0) + 1
        best_single[c.recommendation] = max(best_single.get(c.recommendation, 0.0), weight)
    winner = sorted(scores, key=lambda o: (-scores[o], -best_single[o], o))[0]
    total = sum(scores.values())
    unanimous = len(scores) == 1
    return {
        "recommendation": winner,
        "winner": winner,
        "score": clean(scores[winner]),
        "scores": {o: clean(v) for o, v in scores.items()},
        "votes": counts,
        "confidence": clean(scores[winner] / total) if total else 0.0,
        "reasoning": [c.reasoning for c in contributions if c.recommendation == winner],
        "note": (
            f"Disagreement detected: {len(scores)} different {option_label} recommended"
            if not unanimous
            else f"{kind} over a unanimous group"
        ),
        "unanimous": unanimous,
    }


@dataclass(slots=True, kw_only=True)
class GroupChatSpec:
    """What to run: who, what, how many rounds, how to aggregate."""

    agent_ids: list[str]
    query: str
    rounds: int = 1
    strategy: str = "consensus"
    option_label: str = "options"
    agent_timeout: float = 10.0
    group_id: str = ""
    context: dict[str, JSON] = field(default_factory=dict)
    from_agent: str = "user"
    levels: dict[str, int] = field(default_factory=dict)
    """Hierarchy levels by agent id, for the "hierarchy" strategy (0 highest)."""
    expertise: dict[str, float] = field(default_factory=dict)
    """Expertise in the query's domain by agent id (0 to 1), for "expertise_weighted"."""
    accuracy: dict[str, float] = field(default_factory=dict)
    """The agents' historical accuracy (0 to 1), from users' feedback: the gateway fills it."""

    def validate(self) -> None:
        check_group("agent_ids", self.agent_ids, "a group chat")
        strangers = sorted(set(self.levels) - set(self.agent_ids))
        if strangers:
            raise invalid("hierarchy", f"levels for agents not in the group: {strangers}")
        if any(level < 0 for level in self.levels.values()):
            raise invalid("hierarchy", "levels must not be negative (0 is the highest)")
        strangers = sorted(set(self.expertise) - set(self.agent_ids))
        if strangers:
            raise invalid("expertise", f"expertise for agents not in the group: {strangers}")
        if any(not 0.0 <= e <= 1.0 for e in self.expertise.values()):
            raise invalid("expertise", "expertise must be within 0 and 1")
        if not self.query:
            raise invalid("query", "query is required")
        if self.group_id and workflow_id_problem(self.group_id):
            # (Held to a workflow id's rules: it is the workflow id of the group's trace.)
            raise invalid(
                "group_id", f"group_id must be printable and at most {MAX_WORKFLOW_ID} characters"
            )
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise invalid("rounds", f"rounds must be within 1..{MAX_ROUNDS}")
        if self.strategy not in STRATEGIES:
            raise invalid("strategy", f"strategy must be one of {', '.join(STRATEGIES)}")
        check_wait("agent_timeout", self.agent_timeout)


async def run_group_chat(
    spec: GroupChatSpec, dispatcher: Dispatcher, emit: Emit
) -> dict[str, JSON]:
    """Creates the group, broadcasts the query round by round, aggregates; returns the result.

    Agents that do not answer within ``agent_timeout`` are named and left out; the others'
    answers are aggregated all the same.
    """
    spec.validate()
    group_id = spec.group_id or new_id("group")
    clock = Stopwatch()
    history: list[dict[str, JSON]] = []

    async def event(kind: EventKind, summary: str, **fields: Any) -> None:
        await emit(
            PatternEvent(
                run_id=group_id,
                pattern=Pattern.GROUP_CHAT,
                kind=kind,
                summary=summary,
                elapsed_ms=clock.ms,
                **fields,
            )
        )

    with tracer().start_as_current_span(
        "group_chat",
        attributes={"group_id": group_id, "workflow_id": group_id, "agents": len(spec.agent_ids)},
    ) as root:
        return await _run(spec, dispatcher, group_id, clock, history, event, root)


async def _run(
    spec: GroupChatSpec,
    dispatcher: Dispatcher,
    group_id: str,
    clock: Stopwatch,
    history: list[dict[str, JSON]],
    event: Any,
    root: Any,
) -> dict[str, JSON]:
    await event(
        EventKind.GROUP_CREATED,
        f"group {group_id} created with {len(spec.agent_ids)} agents",
        data={
            "group_id": group_id,
            "agents": list(spec.agent_ids),
            "status": "ACTIVE",
            "message_history": [],
            "query": spec.query,
            "rounds": spec.rounds,
        },
    )
    missing: dict[str, str] = {}
    contributions: list[Contribution] = []
    stopped_early, rounds_run = "", 0
    for round_number in range(1, spec.rounds + 1):
        content: dict[str, JSON] = {"query": spec.query}
        if spec.rounds > 1 or history:
            content["round"] = round_number
            content["history"] = list(history)
        if spec.context:
            content["context"] = spec.context
        # The broadcast's span travels in the message: every agent's work joins this trace.
        broadcast = tracer().start_span(
            "group_chat.broadcast",
            context=trace.set_span_in_context(root),
            attributes={
                "group_id": group_id,
                "round": round_number,
                "recipients": len(spec.agent_ids),
            },
        )
        with trace.use_span(broadcast, end_on_exit=True):
            headers = inject()
        message = Message(
            from_agent=spec.from_agent,
            to_agent="group",
            message_type=MessageType.BROADCAST,
            content=content,
            reply_to=GATEWAY_ID,
            metadata={"group_id": group_id},
            headers=headers,
        )
        history.append(
            {
                "from_agent": spec.from_agent,
                "message_type": "BROADCAST",
                "content": {"query": spec.query},
                "round": round_number,
            }
        )
        await event(
            EventKind.BROADCAST_SENT,
            f"round {round_number}: query broadcast to {len(spec.agent_ids)} agents",
            round=round_number,
            data={
                "message_id": message.message_id,
                "from_agent": spec.from_agent,
                "message_type": "BROADCAST",
                "content": {"query": spec.query},
                "recipients": list(spec.agent_ids),
            },
        )
        sent_at = clock.ms
        this_round: list[Contribution] = []
        items = dispatcher.gather(message, spec.agent_ids, spec.agent_timeout)
        try:
            async with contextlib.aclosing(items):  # left early: the gather is given up
                async for item in items:
                    try:
                        answer = item.answer()
                        contribution = contribution_from(
                            item.agent_id,
                            answer.content or {},
                            round=round_number,
                            timestamp=answer.timestamp.isoformat(),
                            latency_ms=round(clock.ms - sent_at, 3),
                        )
                    except MeshError as error:  # none, an ERROR, or one the aggregation cannot use
                        missing[item.agent_id] = error.message
                        await event(
                            EventKind.AGENT_MISSING,
                            f"{item.agent_id} gave no answer: {error.message}",
                            agent_id=item.agent_id,
                            round=round_number,
                            data={"agent_id": item.agent_id, "reason": error.message},
                        )
                        continue
                    this_round.append(contribution)
                    history.append(
                        {
                            "from_agent": item.agent_id,
                            "message_type": "RESPONSE",
                            **contribution.to_dict(),
                        }
                    )
                    await event(
                        EventKind.CONTRIBUTION,
                        f"{item.agent_id}: {contribution.recommendation} "
                        f"(confidence {contribution.confidence:g})",
                        agent_id=item.agent_id,
                        round=round_number,
                        data=contribution.to_dict(),
                    )
        except MessageTooLargeError as error:
            if round_number == 1:
                raise  # (the query and context alone: the caller's to shorten)
            # The shared history outgrew the broker's message limit: the rounds run so far
            # stand, and the chat says why it stopped.
            history.pop()  # (this round's broadcast, which no agent got)
            stopped_early = (
                f"round {round_number} was not run: its broadcast, with the shared history, "
                f"was refused ({error.message})"
            )
            await event(
                EventKind.FAILURE,
                stopped_early,
                round=round_number,
                data={"round": round_number, "reason": error.message},
            )
            break
        rounds_run = round_number
        # Aggregation reads contributions in the group's order, not in arrival order.
        order = {agent_id: i for i, agent_id in enumerate(spec.agent_ids)}
        this_round.sort(key=lambda c: order.get(c.agent_id, len(order)))
        contributions = this_round or contributions
    aggregation_clock = Stopwatch()
    with tracer().start_as_current_span(
        "group_chat.aggregate", attributes={"group_id": group_id, "strategy": spec.strategy}
    ):
        result = aggregate(
            contributions,
            spec.strategy,
            spec.option_label,
            spec.levels,
            spec.expertise,
            spec.accuracy,
        )
    outcome = (
        str(result.get("recommendation") or result.get("note"))
        if contributions
        else nobody_answered(missing)
    )
    await event(
        EventKind.AGGREGATION,
        outcome if contributions else "nothing to aggregate: no agent answered",
        data={"strategy": spec.strategy, **result, "aggregation_ms": aggregation_clock.ms},
    )
    answered = sorted({c.agent_id for c in contributions})
    slowest = max(contributions, key=lambda c: c.latency_ms, default=None)
    critical_path = [
        "group_chat.broadcast",
        *([span_name(slowest.agent_id, "analyze")] if slowest else []),
        "group_chat.aggregate",
    ]
    status = (
        "FAILED" if not contributions else "PARTIAL" if missing or stopped_early else "COMPLETED"
    )
    final: dict[str, JSON] = {
        "group_id": group_id,
        "status": status,
        "query": spec.query,
        "agents": list(spec.agent_ids),
        "answered": answered,
        "missing": sorted(missing),
        "missing_reasons": missing,
        "contributions": [c.to_dict() for c in contributions],
        "message_history": history,
        "aggregate": result,
        "unanimous": bool(result.get("unanimous")),
        "critical_path": critical_path,
        "rounds_run": rounds_run,
        **({"stopped_early": stopped_early} if stopped_early else {}),
        "duration_ms": clock.ms,
    }
    await event(EventKind.RESULT, f"group chat {status.lower()}: {outcome}", data=final)
    return final

"""Collaborative filtering (RF-010 pattern 3): specialist agents score the options in parallel;
their scores are combined by weight, or their picks by confidence, with a fixed tie-break."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
from gateway.tracing import now_ns, record_span, span_name, tracer
from mesh.core.errors import MeshError
from mesh.core.model import JSON, Message, MessageType

METHODS = ("weighted", "confidence")
WEIGHT_TOLERANCE = 0.001
TIE_EPSILON = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentOpinion:
    """One specialist's view: a score per option, its pick and its confidence."""

    agent_id: str
    weight_key: str
    scores: dict[str, float]
    recommendation: str
    confidence: float

    def to_dict(self) -> dict[str, JSON]:
        return {
            "agent_id": self.agent_id,
            "weight_key": self.weight_key,
            "scores": dict(self.scores),
            "recommendation": self.recommendation,
            "confidence": self.confidence,
        }


def opinion_from(
    agent_id: str, weight_key: str, content: Mapping[str, JSON], method: str = "weighted"
) -> AgentOpinion:
    """An agent's answer as an opinion; MessageValidationError when the answer gives the
    method nothing to aggregate (no scores to weigh, or no pick to count), so that the agent
    is reported missing with that reason."""
    raw = content.get("scores")
    scores = (
        {str(k): unit_value(v, 0.0, f"scores.{k}") for k, v in raw.items()}
        if isinstance(raw, dict)
        else {}
    )
    given = content.get("recommendation")
    if given is None or given == "":
        # (no pick of its own: the option it scored highest, the first by name of equals)
        recommendation = max(sorted(scores), key=lambda o: scores[o]) if scores else ""
    else:
        recommendation = pick(given, "recommendation")
    confidence = unit_value(
        content.get("confidence"), scores.get(recommendation, 0.5), "confidence"
    )
    if method == "weighted" and not scores:
        raise invalid("scores", "the answer has no scores to weigh")
    if not recommendation:
        raise invalid("recommendation", "the answer has neither a recommendation nor scores")
    return AgentOpinion(
        agent_id=agent_id,
        weight_key=weight_key,
        scores=scores,
        recommendation=recommendation,
        confidence=confidence,
    )


def validate_weights(weights: Mapping[str, float]) -> None:
    if not weights:
        raise invalid("weights", "weights are required")
    if any(not 0 <= w <= 1 for w in weights.values()):  # (NaN is not either)
        raise invalid("weights", "weights must be numbers from 0 to 1")
    total = sum(weights.values())
    if abs(total - 1.0) > WEIGHT_TOLERANCE:
        raise invalid("weights", f"weights must sum to 1.0, got {clean(total):g}")


def weighted_scores(
    opinions: Sequence[AgentOpinion], weights: Mapping[str, float]
) -> dict[str, float]:
    """Each option's weighted score: the sum over agents of weight x score (scenario 13)."""
    options = sorted({o for op in opinions for o in op.scores})
    return {
        option: clean(
            sum(weights.get(op.weight_key, 0.0) * op.scores.get(option, 0.0) for op in opinions)
        )
        for option in options
    }


def confidence_votes(opinions: Sequence[AgentOpinion]) -> dict[str, dict[str, JSON]]:
    """Votes per option with the average confidence of its voters (scenario 14)."""
    voters: dict[str, list[AgentOpinion]] = {}
    for op in opinions:
        if op.recommendation:
            voters.setdefault(op.recommendation, []).append(op)
    return {
        option: {
            "votes": len(ops),
            "agents": [op.agent_id for op in ops],
            "avg_confidence": clean(sum(op.confidence for op in ops) / len(ops)),
        }
        for option, ops in sorted(voters.items())
    }


def break_tie(
    tied: Sequence[str],
    opinions: Sequence[AgentOpinion],
    weights: Mapping[str, float],
    seed: int = 0,
) -> tuple[str, str]:
    """Picks one of ``tied`` (scenario 15) and says how.

    1. the highest individual agent score, comparing agents from the most heavily weighted
       down; 2. the most agent votes; 3. a random pick, seeded, so the same inputs always give
    the same winner.
    """
    candidates = sorted(tied)
    ranked = sorted(opinions, key=lambda op: (-weights.get(op.weight_key, 0.0), op.agent_id))
    for op in ranked:
        best = max(op.scores.get(o, 0.0) for o in candidates)
        leaders = [o for o in candidates if abs(op.scores.get(o, 0.0) - best) <= TIE_EPSILON]
        if len(leaders) < len(candidates):
            others = ", ".join(f"{op.scores.get(o, 0.0):g}" for o in candidates if o not in leaders)
            if len(leaders) == 1:
                return leaders[0], (
                    f"highest individual agent score: {op.weight_key or op.agent_id}"
                    f" {best:g} > {others}"
                )
            candidates = leaders
    votes = {o: sum(1 for op in opinions if op.recommendation == o) for o in candidates}
    most = max(votes.values())
    leaders = [o for o in candidates if votes[o] == most]
    if len(leaders) == 1:
        return leaders[0], f"most agent votes: {most}"
    return random.Random(seed).choice(leaders), f"random selection (seed {seed})"


def decide(
    opinions: Sequence[AgentOpinion],
    weights: Mapping[str, float],
    method: str = "weighted",
    seed: int = 0,
) -> dict[str, JSON]:
    """The recommendation with its breakdown, by weighted scores or by confidence."""
    if method not in METHODS:
        raise invalid("method", f"method must be one of {', '.join(METHODS)}")
    if not opinions:
        return {"recommendation": None, "method": method, "note": "no agent answered"}
    if method == "weighted":
        scores = weighted_scores(opinions, weights)
        key: dict[str, float] = scores
        breakdown: JSON = scores
    else:
        votes = confidence_votes(opinions)
        key = {o: float(v["avg_confidence"]) for o, v in votes.items()}
        breakdown = votes
    if not key:  # (opinions without scores, or without picks: opinion_from refuses those)
        return {"recommendation": None, "method": method, "note": "no option to choose from"}
    best = max(key.values())
    tied = [o for o, s in key.items() if abs(s - best) <= TIE_EPSILON]
    result: dict[str, JSON] = {"method": method, "breakdown": breakdown}
    if len(tied) > 1:
        winner, how = break_tie(tied, opinions, weights, seed)
        result.update(tie=sorted(tied), tie_break=how)
    else:
        winner = tied[0]
    result.update(recommendation=winner, score=clean(key[winner]))
    return result


@dataclass(slots=True, kw_only=True)
class FilteringSpec:
    agent_ids: list[str]
    weights: dict[str, float]
    query: str
    method: str = "weighted"
    seed: int = 0
    agent_timeout: float = 5.0
    parameters: dict[str, JSON] = field(default_factory=dict)
    run_id: str = ""
    from_agent: str = "user"

    def validate(self) -> None:
        check_group("agent_ids", self.agent_ids, "collaborative filtering")
        if not self.query:
            raise invalid("query", "query is required")
        validate_weights(self.weights)
        if self.method not in METHODS:
            raise invalid("method", f"method must be one of {', '.join(METHODS)}")
        check_wait("agent_timeout", self.agent_timeout)


def weight_keys(
    agent_ids: Sequence[str], weights: Mapping[str, float], types: Mapping[str, Sequence[str]]
) -> dict[str, str]:
    """Each agent's weight: keyed by its id, or by one of its agent types (``types``: of
    the registered agents; one not registered has no key unless its id is one, and will be
    named missing when asked)."""
    keys = {}
    for agent_id in agent_ids:
        if agent_id in weights:
            keys[agent_id] = agent_id
            continue
        if agent_id not in types:
            continue  # not registered: it will be missing, its weight with it
        match = next((t for t in types[agent_id] if t in weights), None)
        if match is None:
            raise invalid(
                "weights",
                f"no weight for agent {agent_id}: by id, or by one of its agent types "
                f"({', '.join(types[agent_id]) or 'none'})",
            )
        keys[agent_id] = match
    return keys


async def run_filtering(spec: FilteringSpec, dispatcher: Dispatcher, emit: Emit) -> dict[str, JSON]:
    """Asks every agent in parallel, then aggregates; the slow or silent are named."""
    spec.validate()
    registered = {a.agent_id: a.agent_types for a in await dispatcher.agents()}
    keys = weight_keys(spec.agent_ids, spec.weights, registered)
    run_id = spec.run_id or new_id("cf")
    clock = Stopwatch()

    async def event(kind: EventKind, summary: str, **fields: Any) -> None:
        await emit(
            PatternEvent(
                run_id=run_id,
                pattern=Pattern.COLLABORATIVE_FILTERING,
                kind=kind,
                summary=summary,
                elapsed_ms=clock.ms,
                **fields,
            )
        )

    message = Message(
        from_agent=spec.from_agent,
        to_agent="group",
        message_type=MessageType.REQUEST,
        content={"action": "score", "query": spec.query, "parameters": dict(spec.parameters)},
        reply_to=GATEWAY_ID,
        metadata={"run_id": run_id},
    )
    await event(
        EventKind.BROADCAST_SENT,
        f"asking {len(spec.agent_ids)} agents in parallel",
        data={
            "message_id": message.message_id,
            "recipients": list(spec.agent_ids),
            "query": spec.query,
            "weights": dict(spec.weights),
        },
    )
    opinions: list[AgentOpinion] = []
    durations: dict[str, float] = {}
    missing: dict[str, str] = {}
    sent_ns = now_ns()
    items = dispatcher.gather(message, spec.agent_ids, spec.agent_timeout)
    async with contextlib.aclosing(items):  # left early: the gather is given up
        async for item in items:
            record_span(
                span_name(item.agent_id, "score"),
                sent_ns,
                now_ns(),
                None,
                agent=item.agent_id,
                run_id=run_id,
                answered=item.response is not None,
            )
            try:
                answer = item.answer()
                key = keys.get(item.agent_id)
                if key is None:  # (it registered while the run began)
                    raise MeshError(f"{item.agent_id} was not registered when the run began")
                opinion = opinion_from(item.agent_id, key, answer.content or {}, spec.method)
            except MeshError as error:  # none, an ERROR, or scores the aggregation cannot use
                missing[item.agent_id] = error.message
                await event(
                    EventKind.AGENT_MISSING,
                    f"{item.agent_id} gave no scores: {error.message}",
                    agent_id=item.agent_id,
                    data={"agent_id": item.agent_id, "reason": error.message},
                )
                continue
            durations[item.agent_id] = clock.ms
            opinions.append(opinion)
            await event(
                EventKind.SCORES,
                f"{item.agent_id} scored {len(opinion.scores)} options; "
                f"picks {opinion.recommendation}",
                agent_id=item.agent_id,
                data={**opinion.to_dict(), "latency_ms": durations[item.agent_id]},
            )
    order = {agent_id: i for i, agent_id in enumerate(spec.agent_ids)}
    opinions.sort(key=lambda op: order[op.agent_id])  # the request's order, not arrival order
    aggregation = Stopwatch()
    # With agents missing, the weights of those that answered are scaled back to 1.0.
    answered_weight = sum(spec.weights[keys[op.agent_id]] for op in opinions)
    weights = (
        {k: w / answered_weight for k, w in spec.weights.items()}
        if missing and answered_weight
        else dict(spec.weights)
    )
    with tracer().start_as_current_span(
        "collaborative_filtering.aggregate", attributes={"run_id": run_id, "method": spec.method}
    ):
        decision = decide(opinions, weights, spec.method, spec.seed)
    await event(
        EventKind.AGGREGATION,
        f"{decision.get('recommendation')} (score {decision.get('score')})"
        if opinions
        else "nothing to aggregate: no agent gave scores",
        data={**decision, "aggregation_ms": aggregation.ms},
    )
    status = "COMPLETED" if not missing else ("PARTIAL" if opinions else "FAILED")
    result: dict[str, JSON] = {
        "run_id": run_id,
        "status": status,
        "query": spec.query,
        "recommendation": decision.get("recommendation"),
        "score": decision.get("score"),
        "decision": decision,
        "opinions": [op.to_dict() for op in opinions],
        "agent_durations_ms": durations,
        "missing": sorted(missing),
        "missing_reasons": dict(sorted(missing.items())),
        "weights": weights,
        "duration_ms": clock.ms,
    }
    summary = (
        f"recommendation: {decision.get('recommendation')}"
        if opinions
        else f"no recommendation: {nobody_answered(missing)}"
    )
    await event(EventKind.RESULT, summary, data=result)
    return result

"""Consensus building: a proposer proposes, reviewers vote approve / reject / modify in parallel,
a facilitator decides by the decision matrix (approval weight = approve + 0.5 x modify).

Ratios are compared with the threshold to the nearest half percent, so that 2 of 3 votes (66.7%)
meet the 2/3 threshold written as 0.67, as the decision matrix requires; a threshold of 1.0
means unanimous, exactly.
"""

from __future__ import annotations

import math
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
    invalid,
    new_id,
    unit_value,
)
from mesh.core.errors import MeshError, shown
from mesh.core.model import JSON, Message, MessageType

VOTE_WEIGHTS = {"approve": 1.0, "modify": 0.5, "reject": 0.0}
THRESHOLDS_NOTE = "0.51 simple majority, 0.67 two-thirds, 0.75 three-quarters, 1.0 unanimous"
TOLERANCE = 0.005


@dataclass(frozen=True, slots=True, kw_only=True)
class Vote:
    reviewer_id: str
    vote: str
    feedback: str = ""
    confidence: float = 1.0

    def to_dict(self) -> dict[str, JSON]:
        return {
            "reviewer_id": self.reviewer_id,
            "vote": self.vote,
            "feedback": self.feedback,
            "confidence": self.confidence,
        }


def vote_from(reviewer_id: str, content: Mapping[str, JSON]) -> Vote:
    kind = str(content.get("vote", "")).lower()
    if kind not in VOTE_WEIGHTS:
        raise invalid("vote", f"vote must be approve, reject or modify, got {shown(kind)}")
    return Vote(
        reviewer_id=reviewer_id,
        vote=kind,
        feedback=str(content.get("feedback", "")),
        confidence=unit_value(content.get("confidence"), 1.0, "confidence"),
    )


def meets(ratio: float, threshold: float) -> bool:
    if threshold >= 1.0:
        return ratio >= 1.0 - 1e-12
    return ratio >= threshold - TOLERANCE


def decide(
    votes: Sequence[Vote],
    *,
    threshold: float = 0.67,
    quorum: int = 0,
    weights: Mapping[str, float] | None = None,
) -> dict[str, JSON]:
    """The decision of the spec's matrix, with a rationale and the consensus level."""
    if not 0.5 < threshold <= 1.0:
        raise invalid(
            "threshold", f"threshold must be above 0.5 and at most 1.0 ({THRESHOLDS_NOTE})"
        )
    weights = weights or {}
    counts = {
        kind: sum(1 for v in votes if v.vote == kind) for kind in ("approve", "modify", "reject")
    }
    tally = f"{counts['approve']} approve, {counts['modify']} modify, {counts['reject']} reject"
    if len(votes) < max(quorum, 1):
        return {
            "decision": "NO_QUORUM",
            "consensus_level": "0.0%",
            "approval_ratio": 0.0,
            "rejection_ratio": 0.0,
            "votes_counted": len(votes),
            "quorum": quorum,
            "counts": counts,
            "rationale": f"No quorum: {len(votes)} of {max(quorum, 1)} required votes ({tally})",
        }
    total = sum(weights.get(v.reviewer_id, 1.0) for v in votes)
    approval = sum(weights.get(v.reviewer_id, 1.0) * VOTE_WEIGHTS[v.vote] for v in votes) / total
    rejection = sum(weights.get(v.reviewer_id, 1.0) for v in votes if v.vote == "reject") / total
    level = f"{approval * 100:.1f}%"
    if meets(approval, threshold):
        decision = "ACCEPT"
        rationale = f"Consensus reached with {level} approval ({tally})"
    elif meets(rejection, threshold):
        decision = "REJECT"
        rationale = f"Rejected with {rejection * 100:.1f}% rejection ({tally})"
    else:
        decision = "REQUEST_REVISION"
        rationale = (
            f"No {threshold * 100:.0f}% majority: {level} approval, "
            f"{rejection * 100:.1f}% rejection ({tally}); revision requested"
        )
    return {
        "decision": decision,
        "consensus_level": level,
        "approval_ratio": round(approval, 6),
        "rejection_ratio": round(rejection, 6),
        "threshold": threshold,
        "counts": counts,
        "votes_counted": len(votes),
        "quorum": quorum,
        "rationale": rationale,
        "weighted": bool(weights),
    }


def settled(
    votes: Sequence[Vote],
    remaining: Sequence[str],
    *,
    threshold: float,
    quorum: int = 0,
    weights: Mapping[str, float] | None = None,
) -> str | None:
    """The decision, if the votes still to come cannot change it; else None.

    Approval is lowest when every remaining reviewer rejects and highest when every one
    approves, so those two cases bound every mix.
    """
    if not remaining:
        return str(decide(votes, threshold=threshold, quorum=quorum, weights=weights)["decision"])
    if len(votes) < quorum:
        return None

    def outcome(kind: str) -> str:
        filled = [*votes, *(Vote(reviewer_id=r, vote=kind) for r in remaining)]
        return str(decide(filled, threshold=threshold, weights=weights)["decision"])

    worst, best = outcome("reject"), outcome("approve")
    if worst == "ACCEPT":
        return "ACCEPT"
    if best == "REJECT":
        return "REJECT"
    if best != "ACCEPT" and worst != "REJECT":
        return "REQUEST_REVISION"
    return None


def needed(answer: Message, role: str, agent_id: str, key: str, reason: str) -> dict[str, JSON]:
    """The content of an answer the round cannot go on without (the proposer's, the
    facilitator's): MeshError ABORTED with ``reason`` when it is an ERROR, or when ``key`` is
    not a non-empty string in it."""
    content = dict(answer.content or {})
    if answer.message_type is MessageType.ERROR:
        said = content.get("error") or "agent error"
        raise MeshError(f"the {role} {agent_id} failed: {said}", code="ABORTED", reason=reason)
    value = content.get(key)
    if not isinstance(value, str) or not value:
        raise MeshError(
            f"the {role} {agent_id} answered without a {key}", code="ABORTED", reason=reason
        )
    content.pop("action", None)
    return content


DEFAULT_INSIGHT_TTL = 86_400.0
"""A day: what every run writes to the shared memory pool leaves it then, so that a mesh
that runs consensus rounds for months does not fill the pool (which then refuses writes)."""


@dataclass(slots=True, kw_only=True)
class ConsensusSpec:
    problem: str
    reviewer_ids: list[str] = field(
        default_factory=lambda: ["reviewer_1", "reviewer_2", "reviewer_3"]
    )
    proposer_id: str = "proposer"
    facilitator_id: str = "facilitator"
    threshold: float = 0.67
    quorum: int = 0
    weights: dict[str, float] = field(default_factory=dict)
    early_termination: bool = True
    agent_timeout: float = 10.0
    insight_ttl: float = DEFAULT_INSIGHT_TTL
    """Seconds the shared memory pool keeps the run's proposal, votes and decision (0: until
    they are deleted)."""
    run_id: str = ""

    def validate(self) -> None:
        if not self.problem:
            raise invalid("problem", "problem is required")
        check_group("reviewer_ids", self.reviewer_ids, "consensus building")
        if not 0.5 < self.threshold <= 1.0:
            raise invalid(
                "threshold", f"threshold must be above 0.5 and at most 1.0 ({THRESHOLDS_NOTE})"
            )
        if not 0 <= self.quorum <= len(self.reviewer_ids):
            raise invalid("quorum", "quorum must be within 0 and the number of reviewers")
        if any(not 0 < w < math.inf for w in self.weights.values()):  # (NaN is not either)
            raise invalid("reviewer_weights", "reviewer weights must be positive numbers")
        check_wait("agent_timeout", self.agent_timeout)
        if self.insight_ttl < 0:
            raise invalid("insight_ttl", "insight_ttl must not be negative")


async def run_consensus(spec: ConsensusSpec, dispatcher: Dispatcher, emit: Emit) -> dict[str, JSON]:
    spec.validate()
    run_id = spec.run_id or new_id("consensus")
    clock = Stopwatch()

    async def event(kind: EventKind, summary: str, **fields: Any) -> None:
        await emit(
            PatternEvent(
                run_id=run_id,
                pattern=Pattern.CONSENSUS,
                kind=kind,
                summary=summary,
                elapsed_ms=clock.ms,
                **fields,
            )
        )

    def ask(to: str, content: dict[str, JSON]) -> Message:
        return Message(
            from_agent=GATEWAY_ID, to_agent=to, content=content, metadata={"run_id": run_id}
        )

    try:
        answer = await dispatcher.ask(
            ask(
                spec.proposer_id,
                {"action": "propose", "problem": spec.problem, "insight_ttl": spec.insight_ttl},
            ),
            spec.agent_timeout,
        )
    except MeshError as error:
        raise MeshError(
            f"the proposer {spec.proposer_id} did not propose: {error.message}",
            code=error.code,
            reason=error.reason,
        ) from None
    proposal = needed(answer, "proposer", spec.proposer_id, "proposal_id", "PROPOSAL_FAILED")
    proposal_id = str(proposal["proposal_id"])
    await event(
        EventKind.PROPOSAL,
        f"{spec.proposer_id} proposed: {proposal.get('proposal')}",
        agent_id=spec.proposer_id,
        data=proposal,
    )

    review = Message(
        from_agent=GATEWAY_ID,
        to_agent="reviewers",
        message_type=MessageType.REQUEST,
        content={
            "action": "review",
            "proposal_id": proposal_id,
            "problem": spec.problem,
            "insight_ttl": spec.insight_ttl,
        },
        reply_to=GATEWAY_ID,
        metadata={"run_id": run_id},
    )
    await event(
        EventKind.BROADCAST_SENT,
        f"proposal {proposal_id} sent to {len(spec.reviewer_ids)} reviewers",
        data={"proposal_id": proposal_id, "recipients": list(spec.reviewer_ids)},
    )
    votes: list[Vote] = []
    missing: dict[str, str] = {}
    early: str | None = None
    pending = list(spec.reviewer_ids)
    items = dispatcher.gather(review, spec.reviewer_ids, spec.agent_timeout)
    try:
        async for item in items:
            pending.remove(item.agent_id)
            try:
                vote = vote_from(item.agent_id, item.answer().content or {})
            except MeshError as error:  # none, an ERROR, or a vote that cannot count
                missing[item.agent_id] = error.message
                await event(
                    EventKind.AGENT_MISSING,
                    f"{item.agent_id} did not vote: {error.message}",
                    agent_id=item.agent_id,
                    data={"agent_id": item.agent_id, "reason": error.message},
                )
            else:
                votes.append(vote)
                await event(
                    EventKind.VOTE,
                    f"{item.agent_id}: {vote.vote} (confidence {vote.confidence:g})",
                    agent_id=item.agent_id,
                    data=vote.to_dict(),
                )
            if spec.early_termination and pending:
                early = settled(
                    votes,
                    [r for r in pending if r not in missing],
                    threshold=spec.threshold,
                    quorum=spec.quorum,
                    weights=spec.weights,
                )
                if early is not None:
                    break
    finally:
        await items.aclose()
    skipped = list(pending) if early else []

    try:
        answer = await dispatcher.ask(
            ask(
                spec.facilitator_id,
                {
                    "action": "facilitate",
                    "proposal_id": proposal_id,
                    "reviewers": [v.reviewer_id for v in votes],
                    "threshold": spec.threshold,
                    "quorum": spec.quorum,
                    "weights": dict(spec.weights),
                    "insight_ttl": spec.insight_ttl,
                },
            ),
            spec.agent_timeout,
        )
    except MeshError as error:
        raise MeshError(
            f"the facilitator {spec.facilitator_id} did not decide: {error.message}",
            code=error.code,
            reason=error.reason,
        ) from None
    decision = needed(answer, "facilitator", spec.facilitator_id, "decision", "DECISION_FAILED")
    if skipped:
        decision["early_termination"] = (
            f"decided after {len(votes)} of "
            f"{len(spec.reviewer_ids)} votes: the rest could not "
            "change the outcome"
        )
    await event(
        EventKind.DECISION,
        f"{decision.get('decision')}: {decision.get('rationale')}",
        agent_id=spec.facilitator_id,
        data=decision,
    )
    status = "COMPLETED" if not missing else ("PARTIAL" if votes else "FAILED")
    result: dict[str, JSON] = {
        "run_id": run_id,
        "status": status,
        "problem": spec.problem,
        "proposal": proposal,
        "votes": [v.to_dict() for v in votes],
        "decision": decision,
        "missing": sorted(missing),
        "missing_reasons": dict(sorted(missing.items())),
        "skipped": skipped,
        "duration_ms": clock.ms,
        "stats": decision.pop("memory_stats", None),
    }
    await event(
        EventKind.RESULT,
        f"consensus: {decision.get('decision')} ({decision.get('consensus_level')})",
        data=result,
    )
    return result

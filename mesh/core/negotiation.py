"""Peer-to-peer negotiation (RT-011 coordination, "peer_to_peer"): an agent proposes terms
to its peers directly, with no orchestrator between them; each peer accepts, rejects, or
counters with terms of its own; the proposer revises and asks again, for at most
``negotiation_rounds`` rounds and ``negotiation_timeout`` seconds in all.

This module is the negotiation's rules, with no I/O: what a round's answers mean and what the
next round proposes. The SDK (``MeshClient.negotiate``) carries the rounds over the broker.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from mesh.core.errors import FieldViolation, MessageValidationError, shown
from mesh.core.model import JSON

MAX_PEERS = 10
"""RT-011 peer_to_peer max_peers_per_agent: the most peers one negotiation may involve."""
MAX_ROUNDS = 3
"""RT-011 peer_to_peer negotiation_rounds."""
MAX_SECONDS = 5.0
"""RT-011 peer_to_peer negotiation_timeout: a negotiation's whole duration."""
ACTION = "negotiate"
"""The content.action of a proposal; peers answer it like any request."""


class Decision(enum.StrEnum):
    ACCEPT = "accept"
    REJECT = "reject"
    COUNTER = "counter"


class Status(enum.StrEnum):
    AGREED = "AGREED"
    """Every peer accepted the same terms."""
    REJECTED = "REJECTED"
    """A peer rejected the terms outright (or could not negotiate): no further round."""
    NO_AGREEMENT = "NO_AGREEMENT"
    """Peers still countered after the last round."""
    TIMED_OUT = "TIMED_OUT"
    """A peer did not answer before the negotiation's time was up."""


@dataclass(frozen=True, slots=True)
class Reply:
    """One peer's answer to one round's proposal."""

    peer: str
    decision: Decision
    proposal: dict[str, JSON] | None = None
    """A counter's terms."""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Round:
    number: int
    proposal: dict[str, JSON]
    replies: tuple[Reply, ...]
    missing: tuple[str, ...] = ()
    """Peers that did not answer in time."""


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Status
    proposal: dict[str, JSON]
    """The agreed terms (AGREED), else the last terms proposed."""
    rounds: tuple[Round, ...] = field(default=())
    negotiation_id: str = ""

    @property
    def agreed(self) -> bool:
        return self.status is Status.AGREED


Revise = Callable[[dict[str, JSON], Sequence[Reply]], dict[str, JSON]]
"""The proposer's policy: from its proposal and the round's counters, the next proposal."""


def adopt_counters(proposal: dict[str, JSON], counters: Sequence[Reply]) -> dict[str, JSON]:
    """The default policy: the counters' terms are taken over the proposal's, peer by peer."""
    revised = dict(proposal)
    for reply in counters:
        revised.update(reply.proposal or {})
    return revised


def check(peers: Sequence[str], rounds: int, timeout: float, proposer: str) -> None:
    """A negotiation's limits: 1 to MAX_PEERS distinct peers other than the proposer, 1 to
    MAX_ROUNDS rounds, a timeout within (0, MAX_SECONDS]."""
    problems = []
    if not peers:
        problems.append(FieldViolation("peers", "a negotiation needs at least one peer"))
    elif len(peers) > MAX_PEERS:
        problems.append(FieldViolation("peers", f"a negotiation takes at most {MAX_PEERS} peers"))
    elif len(set(peers)) != len(peers) or any(not p for p in peers):
        problems.append(FieldViolation("peers", "peers must be distinct agent ids"))
    elif proposer in peers:
        problems.append(FieldViolation("peers", "an agent does not negotiate with itself"))
    if not 1 <= rounds <= MAX_ROUNDS:
        problems.append(FieldViolation("rounds", f"rounds must be within 1 and {MAX_ROUNDS}"))
    if not 0 < timeout <= MAX_SECONDS:
        problems.append(
            FieldViolation("timeout", f"timeout must be above 0 and at most {MAX_SECONDS:g} s")
        )
    if problems:
        raise MessageValidationError.from_violations(problems)


def proposal_content(
    negotiation_id: str, number: int, proposal: dict[str, JSON], topic: str
) -> dict[str, JSON]:
    """What a peer receives: content.action "negotiate" and the round's terms."""
    return {
        "action": ACTION,
        "parameters": {
            "negotiation_id": negotiation_id,
            "topic": topic,
            "round": number,
            "proposal": proposal,
        },
    }


def read_reply(peer: str, content: Mapping[str, JSON] | None) -> Reply:
    """A peer's answer: {"decision": "accept" | "reject" | "counter", "proposal": {...},
    "reason": "..."}; anything else is read as a rejection that says why."""
    content = content or {}
    raw = content.get("decision")
    reason = content.get("reason")
    reason = reason if isinstance(reason, str) else ""
    try:
        decision = Decision(str(raw).lower())
    except ValueError:
        return Reply(peer, Decision.REJECT, reason=f"unreadable decision {shown(raw)}")
    terms = content.get("proposal")
    if decision is Decision.COUNTER and not isinstance(terms, dict):
        return Reply(peer, Decision.REJECT, reason="a counter without a proposal object")
    return Reply(peer, decision, terms if decision is Decision.COUNTER else None, reason)


def conclude(
    number: int,
    rounds: int,
    proposal: dict[str, JSON],
    replies: Sequence[Reply],
    missing: Sequence[str],
    revise: Revise = adopt_counters,
) -> tuple[Status | None, dict[str, JSON]]:
    """What a round's answers mean: the negotiation's status when it ends here, with the
    final terms; or None and the next round's terms."""
    if missing:
        return Status.TIMED_OUT, proposal
    if any(r.decision is Decision.REJECT for r in replies):
        return Status.REJECTED, proposal
    counters = [r for r in replies if r.decision is Decision.COUNTER]
    if not counters:
        return Status.AGREED, proposal
    if number >= rounds:
        return Status.NO_AGREEMENT, proposal
    return None, revise(proposal, counters)


def accept(reason: str = "") -> dict[str, JSON]:
    """A peer's answer that accepts the terms (return it from a "negotiate" handler)."""
    return {"decision": Decision.ACCEPT.value, "reason": reason}


def reject(reason: str = "") -> dict[str, JSON]:
    """A peer's answer that ends the negotiation: these terms, and any like them, will not do."""
    return {"decision": Decision.REJECT.value, "reason": reason}


def counter(proposal: dict[str, JSON], reason: str = "") -> dict[str, JSON]:
    """A peer's answer that proposes other terms for the next round."""
    return {"decision": Decision.COUNTER.value, "proposal": proposal, "reason": reason}

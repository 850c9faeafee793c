"""The consensus decision matrix, thresholds, quorum, weights and early settlement (pure)."""

from __future__ import annotations

import pytest

from gateway.patterns.consensus import ConsensusSpec, Vote, decide, settled
from mesh.core.errors import MessageValidationError


def votes(approve: int, reject: int, modify: int) -> list[Vote]:
    kinds = ["approve"] * approve + ["reject"] * reject + ["modify"] * modify
    return [Vote(reviewer_id=f"r{i}", vote=k) for i, k in enumerate(kinds)]


@pytest.mark.parametrize(
    ("approve", "reject", "modify", "level", "decision"),
    [
        (3, 0, 0, "100.0%", "ACCEPT"),
        (2, 1, 0, "66.7%", "ACCEPT"),
        (2, 0, 1, "83.3%", "ACCEPT"),
        (1, 2, 0, "33.3%", "REJECT"),
        (0, 3, 0, "0.0%", "REJECT"),
        (1, 1, 1, "50.0%", "REQUEST_REVISION"),
        (0, 2, 1, "16.7%", "REJECT"),
    ],
)
def test_decision_matrix(approve: int, reject: int, modify: int, level: str, decision: str) -> None:
    result = decide(votes(approve, reject, modify))
    assert (result["consensus_level"], result["decision"]) == (level, decision)


def test_rationale_names_the_counts() -> None:
    result = decide(votes(2, 0, 1))
    assert (
        result["rationale"]
        == "Consensus reached with 83.3% approval (2 approve, 1 modify, 0 reject)"
    )


@pytest.mark.parametrize(
    ("threshold", "approve", "reject", "modify", "decision"),
    [
        (0.51, 2, 2, 0, "REQUEST_REVISION"),  # 50% is not a majority
        (0.51, 3, 2, 0, "ACCEPT"),
        (0.75, 2, 1, 0, "REQUEST_REVISION"),  # 67% < 75%
        (0.75, 3, 1, 0, "ACCEPT"),
        (1.0, 2, 0, 1, "REQUEST_REVISION"),  # unanimity means every vote approves
        (1.0, 3, 0, 0, "ACCEPT"),
        (1.0, 0, 3, 0, "REJECT"),
    ],
)
def test_thresholds(
    threshold: float, approve: int, reject: int, modify: int, decision: str
) -> None:
    assert decide(votes(approve, reject, modify), threshold=threshold)["decision"] == decision


def test_quorum() -> None:
    result = decide(votes(2, 0, 0), quorum=3)
    assert result["decision"] == "NO_QUORUM"
    assert result["rationale"].startswith("No quorum: 2 of 3 required votes")
    assert decide(votes(3, 0, 0), quorum=3)["decision"] == "ACCEPT"


def test_weighted_reviewers() -> None:
    ballot = [
        Vote(reviewer_id="senior", vote="approve"),
        Vote(reviewer_id="junior_1", vote="reject"),
        Vote(reviewer_id="junior_2", vote="modify"),
    ]
    assert decide(ballot)["decision"] == "REQUEST_REVISION"  # 50% unweighted
    weighted = decide(ballot, weights={"senior": 3.0})
    assert weighted["consensus_level"] == "70.0%"  # (3 + 0.5) / 5
    assert weighted["decision"] == "ACCEPT"


def test_threshold_must_be_a_majority() -> None:
    with pytest.raises(MessageValidationError, match=r"threshold must be above 0\.5"):
        decide(votes(1, 0, 0), threshold=0.4)


def test_settled_once_remaining_votes_cannot_change_the_outcome() -> None:
    assert settled(votes(2, 0, 0), ["r9"], threshold=0.67) == "ACCEPT"
    assert settled(votes(0, 2, 0), ["r9"], threshold=0.67) == "REJECT"
    assert settled(votes(1, 0, 0), ["r8", "r9"], threshold=0.67) is None
    assert settled(votes(1, 1, 0), ["r9"], threshold=0.67) is None
    assert settled(votes(1, 1, 1), ["r8"], threshold=0.75) == "REQUEST_REVISION"
    assert settled(votes(2, 0, 0), ["r9"], threshold=0.67, quorum=3) is None


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_reviewer_weights_must_be_positive_numbers(weight: float) -> None:
    """An infinite weight made every ratio NaN; a NaN one passed the old check."""
    spec = ConsensusSpec(problem="p", weights={"reviewer_1": weight})
    with pytest.raises(MessageValidationError, match="reviewer weights must be positive numbers"):
        spec.validate()
    ConsensusSpec(problem="p", weights={"reviewer_1": 3.0}).validate()

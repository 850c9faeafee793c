"""How a group chat settles its agents' disagreement (RT-011 conflict resolution: voting by
majority, weighted or unanimous, and agent hierarchy), and which answers can count at all,
without a mesh."""

from __future__ import annotations

import pytest

from gateway.patterns.collaborative import opinion_from, validate_weights
from gateway.patterns.consensus import vote_from
from gateway.patterns.group_chat import Contribution, GroupChatSpec, aggregate, contribution_from
from mesh.core.errors import MessageValidationError


def said(agent_id: str, recommendation: str, confidence: float) -> Contribution:
    return Contribution(
        agent_id=agent_id, recommendation=recommendation, confidence=confidence, reasoning=agent_id
    )


SPLIT = [
    said("A", "Buy AAPL", 0.6),
    said("B", "Buy AAPL", 0.5),
    said("C", "Buy MSFT", 0.95),
]


def test_majority_goes_with_the_most_votes_not_the_most_confidence() -> None:
    result = aggregate(SPLIT, "majority", "stocks")
    assert result["winner"] == "Buy AAPL"
    assert result["recommendation"] == "Buy AAPL (majority: 2 of 3 votes)"
    assert result["votes"] == {"Buy AAPL": 2, "Buy MSFT": 1}
    assert result["majority"] is True and result["tie"] is False
    assert result["note"] == "Disagreement detected: 2 different stocks recommended"
    # Weighted voting, on the same answers, follows the confidence instead.
    assert aggregate(SPLIT, "weighted_voting")["winner"] == "Buy AAPL"  # 1.1 against 0.95
    assert aggregate(SPLIT[1:], "weighted_voting")["winner"] == "Buy MSFT"


def test_a_majority_tie_goes_to_the_higher_summed_confidence() -> None:
    result = aggregate([said("A", "X", 0.4), said("B", "Y", 0.9)], "majority")
    assert result["winner"] == "Y" and result["tie"] is True and result["majority"] is False


def test_unanimous_decides_only_when_every_agent_agrees() -> None:
    split = aggregate(SPLIT, "unanimous", "stocks")
    assert split["recommendation"] is None and split["decided"] is False
    assert split["note"] == "No unanimous decision: 2 different stocks recommended"
    agreed = aggregate(SPLIT[:2], "unanimous")
    assert agreed["recommendation"] == "Buy AAPL (unanimous expert consensus)"
    assert agreed["unanimous"] is True


def test_higher_level_agents_override_lower_ones() -> None:
    levels = {"C": 0}  # C speaks for the orchestrator; A and B are general agents (level 2)
    result = aggregate(SPLIT, "hierarchy", "stocks", levels)
    assert result["consensus"] == "Buy MSFT"
    assert result["level"] == 0 and result["decided_by"] == ["C"]
    assert result["overruled"] == ["A", "B"]
    assert result["unanimous"] is False
    # Two agents at the top level who disagree: weighted voting between them alone.
    both = aggregate(SPLIT, "hierarchy", "stocks", {"A": 1, "C": 1})
    assert both["winner"] == "Buy MSFT" and both["decided_by"] == ["A", "C"]
    assert both["overruled"] == ["B"]
    # Nobody given a level: everyone is at level 2, as by consensus.
    assert aggregate(SPLIT, "hierarchy")["winner"] == "Buy AAPL"


def test_levels_must_name_members_and_not_be_negative() -> None:
    for levels in ({"Stranger": 0}, {"A": -1}):
        spec = GroupChatSpec(agent_ids=["A", "B"], query="q", strategy="hierarchy", levels=levels)
        with pytest.raises(MessageValidationError):
            spec.validate()


def test_expertise_confidence_and_track_record_weigh_each_recommendation() -> None:
    contributions = [
        said("A", "Buy AAPL", 0.8),
        said("B", "Buy MSFT", 0.9),
        said("C", "Buy MSFT", 0.6),
    ]
    result = aggregate(
        contributions,
        "expertise_weighted",
        "stocks",
        expertise={"A": 0.9, "B": 0.2, "C": 0.3},
        accuracy={"C": 1.0},  # A and B have no record yet: 0.5
    )
    # 0.5 x expertise + 0.3 x confidence + 0.2 x accuracy
    assert result["weights"] == {"A": 0.79, "B": 0.47, "C": 0.53}
    assert result["scores"] == {"Buy AAPL": 0.79, "Buy MSFT": 1.0}
    assert result["recommendation"] == "Buy MSFT (expertise-weighted vote)"
    assert result["historical_accuracy"] == {"C": 1.0}
    # Without expertise or a record, everyone is neutral: confidence decides.
    neutral = aggregate(contributions[:2], "expertise_weighted")
    assert neutral["winner"] == "Buy MSFT" and neutral["weights"] == {"A": 0.59, "B": 0.62}


def test_expertise_must_be_a_share_for_members() -> None:
    for expertise in ({"Stranger": 0.5}, {"A": 1.5}):
        spec = GroupChatSpec(agent_ids=["A"], query="q", expertise=expertise)
        with pytest.raises(MessageValidationError):
            spec.validate()


@pytest.mark.parametrize("confidence", [float("nan"), float("inf"), -0.1, 85, "high", True])
def test_an_answer_whose_confidence_is_not_a_share_cannot_count(confidence: object) -> None:
    """Agents are other processes: a NaN would win every comparison it is in, 85 (for 85%)
    would outweigh every other answer. Such an answer is refused, saying why; one that gives
    no confidence counts at 0.5."""
    content = {"recommendation": "Buy AAPL", "confidence": confidence}
    with pytest.raises(MessageValidationError, match="confidence must be a number from 0 to 1"):
        contribution_from("A", content)  # type: ignore[arg-type]
    with pytest.raises(MessageValidationError, match="confidence must be a number from 0 to 1"):
        vote_from("A", {"vote": "approve", "confidence": confidence})  # type: ignore[dict-item]
    with pytest.raises(MessageValidationError, match="confidence must be a number from 0 to 1"):
        opinion_from("A", "price", content)  # type: ignore[arg-type]
    assert contribution_from("A", {"recommendation": "Buy AAPL"}).confidence == 0.5
    assert contribution_from("A", {"recommendation": "X", "confidence": 1}).confidence == 1.0


def test_a_score_that_is_not_a_share_cannot_count() -> None:
    with pytest.raises(MessageValidationError, match=r"scores\.Hotel B must be a number from 0"):
        opinion_from("A", "price", {"scores": {"Hotel A": 0.9, "Hotel B": 1.5}})
    opinion = opinion_from("A", "price", {"scores": {"Hotel A": 0.9, "Hotel B": 0}})
    assert opinion.recommendation == "Hotel A" and opinion.confidence == 0.9


@pytest.mark.parametrize(
    "content",
    [
        {},
        {"recommendation": None},
        {"recommendation": ""},
        {"recommendation": "  "},
        {"recommendation": {"ticker": "AAPL"}},
        {"result": ["AAPL"]},
        {"recommendation": 5.0},
        {"recommendation": True},
        {"confidence": 0.9},
    ],
)
def test_an_answer_without_a_pick_cannot_count(content: dict[str, object]) -> None:
    """An answer with no recommendation took part in the vote as the option "" (three of
    them were an "unanimous expert consensus" on nothing) and a list or None became the option
    "['AAPL']" or "None". Such an answer is refused, saying why: the agent is missing."""
    with pytest.raises(MessageValidationError, match="recommendation must be a non-empty string"):
        contribution_from("A", content)  # type: ignore[arg-type]
    if content:  # (collaborative filtering, by confidence: a pick or scores to take one from)
        with pytest.raises(MessageValidationError, match="recommendation"):
            opinion_from("A", "price", content, "confidence")  # type: ignore[arg-type]
    assert contribution_from("A", {"result": "Buy AAPL"}).recommendation == "Buy AAPL"


def test_collaborative_answers_must_give_the_method_something_to_aggregate() -> None:
    """Weighing needs scores, counting picks needs a pick: an answer with neither failed the
    whole run (max() of nothing, INTERNAL); now its agent is reported missing."""
    with pytest.raises(MessageValidationError, match="no scores to weigh"):
        opinion_from("A", "price", {"recommendation": "Hotel A", "confidence": 0.9})
    with pytest.raises(MessageValidationError, match="neither a recommendation nor scores"):
        opinion_from("A", "price", {"confidence": 0.9}, "confidence")
    picked = opinion_from(
        "A", "price", {"recommendation": "Hotel A", "confidence": 0.9}, "confidence"
    )
    assert (picked.recommendation, picked.confidence, picked.scores) == ("Hotel A", 0.9, {})
    derived = opinion_from("A", "price", {"scores": {"B": 0.4, "A": 0.4}}, "confidence")
    assert derived.recommendation == "A"  # (its best score; the first by name of equals)


@pytest.mark.parametrize("weight", [-0.1, 1.5, float("nan"), float("inf")])
def test_collaborative_weights_must_be_shares(weight: float) -> None:
    """A NaN weight passed (NaN is neither negative nor off 1.0 in a sum) and failed the run
    with an IndexError; now it is refused like any other that is not a share."""
    weights = {"price": weight, "quality": 0.4, "location": 0.3, "reviews": 0.1}
    with pytest.raises(MessageValidationError, match="weights must be numbers from 0 to 1"):
        validate_weights(weights)
    validate_weights({"price": 0.2, "quality": 0.4, "location": 0.3, "reviews": 0.1})


def test_a_refusal_quotes_an_answer_cut_short() -> None:
    """Each refusal is in an AGENT_MISSING event and in the result's missing_reasons: an answer
    of 400 KB quoted whole made every run that named it megabytes long."""
    with pytest.raises(MessageValidationError) as info:
        contribution_from("A", {"recommendation": {"report": "x" * 400_000}})
    assert len(info.value.message) < 200
    assert info.value.message.startswith(
        "recommendation must be a non-empty string, got {'report': 'xxx"
    )
    with pytest.raises(MessageValidationError) as info:
        vote_from("A", {"vote": "y" * 400_000})
    assert len(info.value.message) < 200

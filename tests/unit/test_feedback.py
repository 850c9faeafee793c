"""Users' ratings of pattern runs and the accuracy they add up to (RF-010 scenario 20)."""

from __future__ import annotations

import pytest

from gateway.events import EventKind, Pattern, PatternEvent
from gateway.feedback import RunLedger
from gateway.metrics import PatternMetrics
from mesh.core.errors import MeshError


def event(
    run_id: str, kind: EventKind, pattern: Pattern = Pattern.GROUP_CHAT, **data: str
) -> PatternEvent:
    return PatternEvent(run_id=run_id, pattern=pattern, kind=kind, summary="", data=dict(data))


def finished(ledger: RunLedger, run_id: str, status: str = "COMPLETED", **kw: Pattern) -> None:
    ledger.observe(event(run_id, EventKind.GROUP_CREATED, **kw))
    ledger.observe(event(run_id, EventKind.RESULT, status=status, **kw))


def refused(ledger: RunLedger, run_id: str) -> MeshError:
    with pytest.raises(MeshError) as caught:
        ledger.rate(run_id, True)
    return caught.value


def test_accuracy_is_the_share_of_rated_runs_that_satisfied() -> None:
    ledger, metrics = RunLedger(), PatternMetrics()
    for i in range(4):
        finished(ledger, f"cf-{i}", pattern=Pattern.COLLABORATIVE_FILTERING)
    finished(ledger, "group-1")
    for run_id, satisfied in (("cf-0", True), ("cf-1", True), ("cf-2", False)):
        tally = metrics.feedback(ledger.rate(run_id, satisfied), satisfied)
    assert (tally.rated, tally.satisfied) == (3, 2)
    assert tally.accuracy == pytest.approx(2 / 3)
    # The other patterns are untouched, and an unrated pattern's accuracy is 0.
    assert metrics.tallies[Pattern.GROUP_CHAT].rated == 0
    assert metrics.tallies[Pattern.GROUP_CHAT].accuracy == 0.0


def test_rating_a_run_again_replaces_its_rating() -> None:
    ledger, metrics = RunLedger(), PatternMetrics()
    finished(ledger, "group-1")
    metrics.feedback(ledger.rate("group-1", False), False)
    tally = metrics.feedback(ledger.rate("group-1", True), True)
    assert (tally.rated, tally.satisfied, tally.accuracy) == (1, 1, 1.0)
    tally = metrics.feedback(ledger.rate("group-1", False), False)
    assert (tally.rated, tally.satisfied, tally.accuracy) == (1, 0, 0.0)


def test_only_a_finished_run_with_an_outcome_can_be_rated() -> None:
    ledger = RunLedger()
    ledger.observe(event("group-1", EventKind.GROUP_CREATED))
    error = refused(ledger, "group-1")
    assert (error.code, error.reason) == ("FAILED_PRECONDITION", "RUN_NOT_FINISHED")
    finished(ledger, "wf-1", status="FAILED", pattern=Pattern.HAND_OFF)
    error = refused(ledger, "wf-1")
    assert (error.code, error.reason) == ("FAILED_PRECONDITION", "RUN_FAILED")
    finished(ledger, "group-2", status="PARTIAL")  # some agents missing: still an outcome
    assert ledger.rate("group-2", True).pattern is Pattern.GROUP_CHAT
    error = refused(ledger, "nobody-ran-this")
    assert (error.code, error.reason) == ("NOT_FOUND", "RUN_NOT_FOUND")
    assert refused(ledger, "").code == "INVALID_ARGUMENT"


def test_a_pattern_run_inside_another_does_not_finish_it() -> None:
    ledger = RunLedger()
    ledger.observe(event("wf-1", EventKind.WORKFLOW_CREATED, Pattern.HAND_OFF))
    # A group chat the workflow switched to, reporting under the workflow's id.
    ledger.observe(event("wf-1", EventKind.RESULT, Pattern.GROUP_CHAT, status="COMPLETED"))
    assert refused(ledger, "wf-1").reason == "RUN_NOT_FINISHED"
    ledger.observe(event("wf-1", EventKind.RESULT, Pattern.HAND_OFF, status="COMPLETED"))
    assert ledger.rate("wf-1", True).pattern is Pattern.HAND_OFF


def test_the_ledger_forgets_the_oldest_runs_beyond_its_capacity() -> None:
    ledger = RunLedger(capacity=3)
    for i in range(5):
        finished(ledger, f"group-{i}")
    assert refused(ledger, "group-0").code == "NOT_FOUND"
    assert refused(ledger, "group-1").code == "NOT_FOUND"
    for i in (2, 3, 4):
        assert ledger.rate(f"group-{i}", True).previous is None


def group_result(run_id: str, winner: str, said: dict[str, str]) -> PatternEvent:
    contributions = [{"agent_id": a, "recommendation": r} for a, r in said.items()]
    return PatternEvent(
        run_id=run_id,
        pattern=Pattern.GROUP_CHAT,
        kind=EventKind.RESULT,
        summary="",
        data={
            "status": "COMPLETED",
            "aggregate": {"winner": winner},
            "contributions": contributions,  # type: ignore[dict-item]
        },
    )


def test_a_rated_group_chat_rates_its_members_too() -> None:
    ledger = RunLedger()
    said = {"A": "Buy AAPL", "B": "Buy AAPL", "C": "Buy MSFT"}
    ledger.observe(group_result("group-1", "Buy AAPL", said))
    ledger.observe(group_result("group-2", "Buy AAPL", said))
    assert ledger.accuracy("A") is None  # nothing rated yet
    ledger.rate("group-1", False)  # the user did not like AAPL: C was right
    assert (ledger.accuracy("A"), ledger.accuracy("C")) == (0.0, 1.0)
    ledger.rate("group-2", True)  # this time AAPL was right
    assert (ledger.accuracy("A"), ledger.accuracy("C")) == (0.5, 0.5)
    ledger.rate("group-2", False)  # changed their mind: the rating is replaced, not added
    assert (ledger.accuracy("A"), ledger.accuracy("B"), ledger.accuracy("C")) == (0.0, 0.0, 1.0)
    # A group chat that decided nothing rates nobody.
    ledger.observe(
        PatternEvent(
            run_id="group-3",
            pattern=Pattern.GROUP_CHAT,
            kind=EventKind.RESULT,
            summary="",
            data={"status": "COMPLETED", "aggregate": {"decided": False}},
        )
    )
    ledger.rate("group-3", True)
    assert ledger.accuracy("C") == 1.0

"""The rules of a peer-to-peer negotiation, without a mesh: reading answers, ending rounds."""

from __future__ import annotations

from mesh.core.negotiation import Decision, Reply, Status, adopt_counters, conclude, read_reply


def test_answers_are_read_and_anything_unreadable_is_a_rejection_that_says_why() -> None:
    assert read_reply("A", {"decision": "ACCEPT"}) == Reply("A", Decision.ACCEPT)
    assert read_reply("A", {"decision": "counter", "proposal": {"price": 5}, "reason": "r"}) == (
        Reply("A", Decision.COUNTER, {"price": 5}, "r")
    )
    maybe = read_reply("A", {"decision": "maybe"})
    assert maybe.decision is Decision.REJECT and "maybe" in maybe.reason
    vague = read_reply("A", {"decision": "counter", "proposal": 5})
    assert vague.decision is Decision.REJECT and "proposal" in vague.reason
    assert read_reply("A", None).decision is Decision.REJECT


def test_a_round_ends_the_negotiation_or_proposes_the_next_terms() -> None:
    yes, no = Reply("A", Decision.ACCEPT), Reply("B", Decision.REJECT, reason="no")
    more = Reply("B", Decision.COUNTER, {"price": 9})
    terms = {"price": 5, "item": "lamp"}
    assert conclude(1, 3, terms, [yes], []) == (Status.AGREED, terms)
    assert conclude(1, 3, terms, [yes, no], []) == (Status.REJECTED, terms)
    assert conclude(1, 3, terms, [yes], ["B"]) == (Status.TIMED_OUT, terms)  # B never answered
    assert conclude(1, 3, terms, [yes, more], []) == (None, {"price": 9, "item": "lamp"})
    assert conclude(3, 3, terms, [yes, more], []) == (Status.NO_AGREEMENT, terms)


def test_counters_are_taken_over_the_terms_in_peer_order() -> None:
    counters = [
        Reply("A", Decision.COUNTER, {"price": 7}),
        Reply("B", Decision.COUNTER, {"price": 9, "days": 3}),
    ]
    assert adopt_counters({"price": 5, "days": 1, "item": "x"}, counters) == {
        "price": 9,
        "days": 3,
        "item": "x",
    }

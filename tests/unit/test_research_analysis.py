"""Research analysis, planning, cycles and stopping criteria (pure)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.research.analysis import (
    MAX_CLAIM_CHARS,
    QUERY_TOPIC,
    detect_conflicts,
    distinct,
    extract_claims,
    gaps_of,
    is_finding,
    plan_topics,
    query_topic,
    resolve,
    topics_of,
)
from agents.research.corpus import snippet, split_pages
from gateway.patterns.research import (
    Answers,
    analyze_query,
    detect_cycle,
    load_topics,
    stopping_reason,
)

LEXICON = load_topics()


def finding(
    claim: str,
    *,
    topic: str = "recycling_rate",
    kind: str = "factual",
    value: str = "",
    tier: str = "article",
    date: str = "2024-01-01",
    url: str = "",
) -> dict:
    return {
        "claim": claim,
        "topic": topic,
        "kind": kind,
        "value": value or claim,
        "tier": tier,
        "date": date,
        "source_url": url or f"https://example.org/{abs(hash(claim))}",
    }


@pytest.mark.parametrize(
    ("query", "documents", "kind"),
    [
        ("What is the lithium-ion battery recycling rate?", False, "simple"),
        ("What is the lithium-ion battery recycling rate?", True, "docs"),
        ("What is the latest lithium-ion battery recycling rate?", False, "web"),
        ("Compare the latest recycling rate with the EU collection target", True, "all"),
        # Current data is asked for in whole words: "know" holds "now" and asks for nothing.
        ("What do we know about heat pumps in cold climates?", True, "docs"),
        ("What do we know about heat pumps in cold climates?", False, "simple"),
        ("Heat pumps in cold climates: the latest figures", False, "web"),
    ],
)
def test_routing_by_query_kind(query: str, documents: bool, kind: str) -> None:
    assert analyze_query(query, documents, LEXICON)["kind"] == kind


def test_topics_and_gaps() -> None:
    topics = topics_of("recycling rate and cost per tonne of lithium", LEXICON)
    assert topics == ["recycling_rate", "recovery_cost"]
    assert gaps_of(topics, [finding("x")], LEXICON) == ["cost of recovering lithium per tonne"]


def test_a_query_naming_no_topic_of_the_lexicon_is_researched_on_its_own_words() -> None:
    topics, lexicon = plan_topics("How do heat pumps perform in cold climates?", LEXICON)
    assert topics == [QUERY_TOPIC]
    entry = lexicon[QUERY_TOPIC]
    assert entry["label"] == "How do heat pumps perform in cold climates"
    assert entry["kind"] == "general"
    # Stop words left out; plurals and endings cut to what the word's forms share.
    assert entry["keywords"] == ["heat", "pump", "perfo*", "cold", "clima*"]
    assert entry["min_hits"] == 3  # more than half, three will do
    assert {k: v for k, v in lexicon.items() if k != QUERY_TOPIC} == LEXICON
    # A query naming a topic of the lexicon keeps to the lexicon.
    assert plan_topics("the recycling rate in Europe", LEXICON) == (["recycling_rate"], LEXICON)
    # A query of no words of its own has no topic: its scope is ambiguous.
    assert query_topic("What about the latest news on that?") is None
    assert plan_topics("What about the latest news on that?", LEXICON) == ([], LEXICON)
    assert query_topic("the CAP theorem")["min_hits"] == 2  # type: ignore[index]


def test_a_general_claim_is_a_sentence_holding_most_of_the_querys_words() -> None:
    topics, lexicon = plan_topics("How do heat pumps perform in cold climates?", LEXICON)
    text = (
        "Air-source heat pumps keep working in cold climates down to -25 C. "
        "A heat pump performs worse in the cold. "  # heat, pump, perfo, cold: a claim
        "Heat pumps are popular. "  # two of five: not enough
        "Pumpkins grow in cold climates with heat. "  # heat, cold, clima: three of five
        "The weather was fine."
    )
    found = extract_claims(text, topics, lexicon, {"source_url": "u", "tier": "blog"})
    assert [f["claim"] for f in found] == [
        "Air-source heat pumps keep working in cold climates down to -25 C.",
        "A heat pump performs worse in the cold.",
        "Pumpkins grow in cold climates with heat.",
    ]
    assert {(f["topic"], f["kind"], f["value"]) for f in found} == {(QUERY_TOPIC, "general", "")}
    # A figure makes a blog's claim of medium confidence, as for any topic.
    assert [f["confidence"] for f in found] == ["medium", "low", "low"]
    # A short word is a word: "cap" is not "capacity".
    cap_topics, cap_lexicon = plan_topics("the CAP theorem", LEXICON)
    text = "Battery capacity and the theorem of Pythagoras. The CAP theorem trades consistency."
    found = extract_claims(text, cap_topics, cap_lexicon, {"source_url": "u"})
    assert [f["claim"] for f in found] == ["The CAP theorem trades consistency."]


def test_general_claims_are_never_taken_for_conflicts() -> None:
    a = finding("Heat pumps work at -25 C.", topic=QUERY_TOPIC, kind="general", value="")
    b = finding("Heat pumps do not work at -25 C.", topic=QUERY_TOPIC, kind="general", value="")
    assert detect_conflicts([a, b]) == []
    assert gaps_of([QUERY_TOPIC], [a], {}) == []  # (a topic no lexicon defines: no gap named)


def test_claims_keep_their_provenance() -> None:
    text = "Intro. The official recycling rate was 46% in 2022. Other things."
    [claim] = extract_claims(
        text,
        ["recycling_rate"],
        LEXICON,
        {"document_id": "d1", "page": 2, "date": "2023-01-01", "tier": "official"},
    )
    assert claim["claim"] == "The official recycling rate was 46% in 2022."
    assert (claim["document_id"], claim["page"], claim["value"]) == ("d1", 2, "46%")
    assert claim["confidence"] == "high"
    assert "Intro." in claim["excerpt"]


def test_factual_conflicts_are_resolved_by_source_tier() -> None:
    official = finding("Rate is 46%", value="46%", tier="official")
    blog = finding("Rate is 5%", value="5%", tier="blog")
    conflict = resolve(blog, official)
    assert conflict["resolution"] == "B_PREFERRED"
    assert conflict["preferred"] == "Rate is 46%"


def test_factual_conflicts_of_one_tier_stay_unresolved() -> None:
    [conflict] = detect_conflicts(
        [finding("Rate is 46%", value="46%"), finding("Rate is 59%", value="59%")]
    )
    assert conflict["resolution"] == "UNRESOLVED"
    assert "both versions shown" in conflict["note"]


def test_temporal_conflicts_mark_the_newest_current() -> None:
    old = finding(
        "Target 45%", topic="collection_target", kind="temporal", value="45%", date="2021-04-20"
    )
    new = finding(
        "Target 63% by 2027",
        topic="collection_target",
        kind="temporal",
        value="63%",
        date="2023-08-17",
    )
    conflict = resolve(old, new)
    assert conflict["resolution"] == "NEWEST_CURRENT"
    assert (conflict["current"], conflict["previous"]) == ("Target 63% by 2027", "Target 45%")


def test_interpretive_conflicts_show_both() -> None:
    a = finding("It is viable", topic="economic_viability", kind="interpretive", value="positive")
    b = finding(
        "It is not viable", topic="economic_viability", kind="interpretive", value="negative"
    )
    assert resolve(a, b)["resolution"] == "BOTH_SHOWN"


def test_no_conflict_when_values_agree() -> None:
    assert (
        detect_conflicts([finding("A says 63%", value="63%"), finding("B says 63%", value="63%")])
        == []
    )


def test_cycles_are_found_and_named() -> None:
    graph = {
        "web-search-agent": ["document-analysis-agent"],
        "document-analysis-agent": ["web-search-agent"],
        "synthesis-agent": [],
    }
    assert detect_cycle(graph) == [
        "document-analysis-agent",
        "web-search-agent",
        "document-analysis-agent",
    ]
    assert detect_cycle({"a": ["b"], "b": ["c"], "c": []}) is None


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"gaps": []}, "all gaps answered"),
        ({"iterations": 3}, "reached 3 iterations"),
        ({"iterations": 2, "new_claims": 0}, "new findings only repeat known claims"),
        ({"findings": [{"confidence": "high"}]}, "every claim has high confidence"),
        (
            {"iterations": 2, "findings": [{"confidence": "low"}] * 4},
            "at least 2 findings per open gap",
        ),
    ],
)
def test_each_stopping_criterion(kwargs: dict, reason: str) -> None:
    base = {
        "iterations": 1,
        "max_iterations": 3,
        "gaps": ["g1"],
        "new_claims": 5,
        "findings": [{"confidence": "low"}],
        "min_findings_per_gap": 2,
    }
    assert stopping_reason(**{**base, **kwargs}) == reason


def test_refinement_goes_on_while_gaps_remain() -> None:
    assert (
        stopping_reason(
            iterations=1,
            max_iterations=3,
            gaps=["g"],
            new_claims=3,
            findings=[{"confidence": "low"}],
            min_findings_per_gap=2,
        )
        is None
    )


def test_a_researchers_answer_is_kept_as_far_as_it_can_be_read() -> None:
    """The spec's rule for an unexpected format: normalize, do not escalate. Findings that
    are objects with a claim are kept, the rest left out and noted; so are gaps that are not
    strings. (A findings value of 5 or a topic that is an object failed the whole run.)"""
    answers = Answers()
    good = finding("Rate is 5%")
    content = {"findings": [good, "Rate is 50%", {"claim": ""}, {"claim": "x", "topic": {}}]}
    assert answers.findings("web", content, "findings") == [good]
    assert answers.findings("web", {"findings": 5}, "findings") == []
    assert answers.findings("web", {}, "findings") == []
    assert answers.strings("synthesis", {"gaps": ["a", 1, None]}, "gaps") == ["a"]
    assert answers.text("synthesis", {"summary": ["x"]}, "summary") == ""
    assert answers.problems == [
        "web: findings must be a list of objects; left out ['Rate is 50%']",
        "web: a finding needs a claim that is a non-empty string (and a topic, if any, that is"
        " a string); left out [{'claim': ''}, {'claim': 'x', 'topic': {}}]",
        "web: findings must be a list of objects, got 5",
        "synthesis: gaps must be a list of strings; left out [1, None]",
        "synthesis: summary must be a string, got ['x']",
    ]
    assert is_finding(good) and not is_finding({"claim": "  "}) and not is_finding([good])


@pytest.mark.parametrize(
    ("raw", "action", "failure"),
    [
        (
            {"suggested_action": "skip", "failure_type": "timeout_complete"},
            "skip",
            "timeout_complete",
        ),
        ({"suggested_action": "panic"}, "report_gap", "unknown"),
        ("timed out", "report_gap", "unknown"),
    ],
)
def test_an_escalation_the_coordinator_cannot_read_documents_the_gap(
    raw: object, action: str, failure: str
) -> None:
    """An escalation without a suggested action the coordinator knows (KeyError: the run
    failed INTERNAL) is taken as report_gap, so what could not be done is in the report."""
    answers = Answers()
    up = answers.escalation("web", {"escalation": raw}, "the query", 2)
    assert up is not None
    assert (up["suggested_action"], up["failure_type"]) == (action, failure)
    assert (up["agent_id"], up["attempted_query"], up["partial_results"]) == ("web", "the query", 2)
    assert bool(answers.problems) == (action != "skip")
    assert answers.escalation("web", {"escalation": None}, "q", 0) is None


def test_a_long_page_is_split_at_line_breaks_then_spaces() -> None:
    assert split_pages("one\ftwo") == ["one", "two"]
    lines = "".join(f"line {i:04d}\n" for i in range(100))  # 10 characters a line
    pages = split_pages(lines, most=95)
    assert all(len(p) <= 95 and p.endswith("\n") for p in pages)
    assert "".join(pages) == lines
    words = "word " * 40
    assert [len(p) for p in split_pages(words, most=48)][:3] == [45, 45, 45]
    assert split_pages("x" * 100, most=48) == ["x" * 48, "x" * 48, "x" * 4]


@given(st.text(alphabet="ab \n\f", max_size=400), st.integers(min_value=2, max_value=60))
def test_splitting_pages_keeps_every_character_in_order(text: str, most: int) -> None:
    pages = split_pages(text, most)
    assert all(len(p) <= most for p in pages)
    assert "".join(pages) == text.replace("\f", "")
    assert len(pages) >= text.count("\f") + 1


def test_a_snippet_shows_the_sentence_with_most_of_the_searched_words() -> None:
    text = (
        "Batteries were mentioned once here. "
        + "Filler words go on and on. " * 10
        + "The recycling rate of lithium batteries rose. "
        + "More filler follows. " * 10
    )
    shown = snippet(text, ["recycling", "rate", "lithium", "batteries"], size=12)
    assert shown.startswith("... The recycling rate of lithium batteries rose. More filler")
    assert shown.endswith(" ...") and len(shown.split()) == 1 + 12 + 1
    # A text shorter than the run is shown whole; none of the words: its beginning.
    assert snippet("Lithium, mostly.", ["lithium"]) == "Lithium, mostly."
    assert snippet("one two three four", ["five"], size=2) == "one two ..."
    assert snippet(" .. ", ["x"]) == ""


@given(
    st.text(alphabet="abAB .\n", max_size=200),
    st.sets(st.sampled_from(["a", "b", "ab", "ba", "aa"]), min_size=1),
    st.integers(min_value=1, max_value=8),
)
def test_a_snippet_holds_as_many_searched_words_as_any_run_of_its_length(
    text: str, words: set[str], size: int
) -> None:
    shown = snippet(text, words, size)
    tokens = re.findall(r"[^\W_]+", text)
    if not tokens:
        assert shown == ""
        return
    cut = shown.removeprefix("... ").removesuffix(" ...")
    assert cut in text
    runs = [tokens[i : i + size] for i in range(max(1, len(tokens) - size + 1))]
    most = max(len({t.lower() for t in run} & words) for run in runs)
    assert re.findall(r"[^\W_]+", cut) in runs
    assert len({t.lower() for t in re.findall(r"[^\W_]+", cut)} & words) == most
    if not shown.startswith("... "):  # (where no "..." is shown, the text does not go on)
        assert text.lstrip(" .\n").startswith(cut)
    if not shown.endswith(" ..."):
        assert text.rstrip(" .\n").endswith(cut.rstrip(" .\n"))


def test_a_claim_said_again_by_its_source_is_one_finding() -> None:
    source = {"document_id": "survey", "page": 1, "tier": "article"}
    text = "The recycling rate was 40% last year. " * 50
    found = extract_claims(text, ["recycling_rate"], LEXICON, source)
    assert len(found) == 50
    elsewhere = extract_claims(text, ["recycling_rate"], LEXICON, {**source, "document_id": "b"})
    kept = distinct([*found, *elsewhere])
    assert [f["document_id"] for f in kept] == ["survey", "b"]


def test_a_sentence_without_full_stops_is_cut_to_a_claim() -> None:
    text = "The recycling rate was 40% " + "and more " * 500
    [claim] = extract_claims(text, ["recycling_rate"], LEXICON, {"tier": "blog"})
    assert len(claim["claim"]) == MAX_CLAIM_CHARS

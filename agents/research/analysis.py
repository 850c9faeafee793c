"""Research analysis without I/O: topics of a query, claims in a text, conflicts between
findings and the resolution policy (factual by source tier, interpretive both shown, temporal
newest marked current), and gaps.

A query that names none of the lexicon's topics is researched on its own words: one topic,
:data:`QUERY_TOPIC` (kind "general"), whose claims are the sentences that hold most of them.
General claims are kept with their sources but never compared: nothing says two of them speak
of the same thing."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Finding = dict[str, Any]
MAX_CLAIM_CHARS = 1_000
"""A claim is a sentence; one longer than this (text without full stops) is cut, as its
excerpt is at 400: a finding stays small whatever the document."""
TIER_PRIORITY = {"official": 3, "article": 2, "blog": 1, "unknown": 0}
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)?\s*%?")
_NEGATION = re.compile(r"\b(not|no|never|only|without)\b", re.IGNORECASE)
_STOP_WORDS = (
    "a an and are as at be by do does for from how in is it its of on or that the this to was "
    "what when where which who why will with about tell me us you"
)
_STOP = frozenset(_STOP_WORDS.split())
QUERY_TOPIC = "_query"
"""The topic of a query that names none of the lexicon's: the query's own words."""
_VAGUE_WORDS = (
    "latest current today news recent now online web new there that these those thing things "
    "some any more most much many know explain find give list show please"
)
_VAGUE = frozenset(_VAGUE_WORDS.split())
"""Words that ask for something without saying what: a query of only these is ambiguous."""


def query_terms(query: str) -> list[str]:
    return [w for w in re.findall(r"[a-z0-9-]+", query.lower()) if w not in _STOP and len(w) > 2]


def topics_of(query: str, lexicon: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The lexicon topics a query asks about: a keyword, or most words of the label, appear."""
    text = query.lower()
    found = []
    for topic, entry in lexicon.items():
        label_words = [w for w in query_terms(str(entry["label"]))]
        hits = sum(1 for w in label_words if w in text)
        if any(k in text for k in entry["keywords"]) or (
            label_words and hits * 2 > len(label_words)
        ):
            found.append(topic)
    return found


def _stem(term: str) -> str:
    """What a word's other forms share: a short word itself ("pumps" and "pump" are "pump",
    which a plural "s" or "es" may follow), a longer one its start, marked "*" ("batteries"
    and "battery" start "batte*", "recycling" and "recycled" "recycl*")."""
    if len(term) > 3 and term.endswith("s") and not term.endswith("ss"):
        term = term[:-1]
    return term if len(term) <= 5 else term[: max(5, len(term) - 3)] + "*"


def _word_pattern(stem: str) -> str:
    """The regular expression of the words a :func:`_stem` stands for."""
    if stem.endswith("*"):
        return rf"\b{re.escape(stem[:-1])}"
    return rf"\b{re.escape(stem)}(?:s|es)?\b"


def query_topic(query: str) -> dict[str, Any] | None:
    """The lexicon entry of :data:`QUERY_TOPIC` for ``query``: its label the query, its
    keywords the stems of its words (stop words, vague words and bare numbers left out); a
    sentence speaks to it when it holds more than half of them (three will do), as words.
    None for a query with no word of its own ("what about the latest news on that?"): its
    scope is ambiguous."""
    terms = [t for t in query_terms(query) if t not in _VAGUE and not t.isdigit()]
    stems = list(dict.fromkeys(_stem(t) for t in terms))
    if not stems:
        return None
    return {
        "label": query.strip().rstrip("?!.").strip(),
        "kind": "general",
        "keywords": stems,
        "min_hits": min(3, len(stems) // 2 + 1),
    }


def plan_topics(
    query: str, lexicon: Mapping[str, Mapping[str, Any]]
) -> tuple[list[str], dict[str, Mapping[str, Any]]]:
    """The topics ``query`` asks about, and the lexicon that defines them: the lexicon's own
    topics it names; else its own words as :data:`QUERY_TOPIC`; else none (the lexicon as
    given). The coordinator and the subagents, given the same query, find the same."""
    topics = topics_of(query, lexicon)
    entry = None if topics else query_topic(query)
    if entry is None:
        return topics, dict(lexicon)
    return [QUERY_TOPIC], {**lexicon, QUERY_TOPIC: entry}


def _speaks_to(lowered: str, entry: Mapping[str, Any]) -> bool:
    """Whether a sentence (lower case) speaks to a lexicon entry: a keyword of a lexicon topic
    anywhere in it; for the general topic, enough of its stems, as words."""
    if entry.get("kind") != "general":
        return any(k in lowered for k in entry["keywords"])
    hits = sum(1 for k in entry["keywords"] if re.search(_word_pattern(k), lowered))
    return hits >= int(entry.get("min_hits") or 1)


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text.replace("\n", " ")) if s.strip()]


def value_of(sentence: str, kind: str) -> str:
    """What a claim asserts, to compare claims of one topic: a number, or a stance (a general
    claim asserts nothing comparable: "")."""
    if kind == "general":
        return ""
    if kind == "interpretive":
        return "negative" if _NEGATION.search(sentence) else "positive"
    numbers = _NUMBER.findall(sentence)
    percents = [n.replace(" ", "") for n in numbers if n.strip().endswith("%")]
    candidates: list[str] = percents or [str(n).strip() for n in numbers] or [sentence.lower()]
    return candidates[0]


def extract_claims(
    text: str,
    topics: Iterable[str],
    lexicon: Mapping[str, Mapping[str, Any]],
    source: Mapping[str, Any],
) -> list[Finding]:
    """Sentences that speak to a wanted topic, with their provenance (``source`` holds the
    url or document and page, date, tier)."""
    found: list[Finding] = []
    parts = sentences(text)
    tier = str(source.get("tier") or "unknown")
    for index, sentence in enumerate(parts):
        lowered = sentence.lower()
        for topic in topics:
            entry = lexicon.get(topic)
            if entry is None or not _speaks_to(lowered, entry):
                continue  # (a topic another lexicon has: not this one's to find)
            kind = str(entry["kind"])
            has_number = bool(_NUMBER.search(sentence))
            if kind not in ("interpretive", "general") and not has_number:
                continue  # a factual or temporal sentence without a figure asserts nothing
            confidence = (
                "high"
                if tier == "official" or (has_number and tier == "article")
                else ("medium" if has_number or tier == "article" else "low")
            )
            excerpt = " ".join(parts[max(0, index - 1) : index + 2])
            found.append(
                {
                    "claim": sentence[:MAX_CLAIM_CHARS],
                    "topic": topic,
                    "kind": kind,
                    "value": value_of(sentence, kind),
                    "confidence": confidence,
                    "excerpt": excerpt[:400],
                    **dict(source),
                }
            )
            break
    return found


def distinct(findings: Iterable[Finding]) -> list[Finding]:
    """The findings in order, each claim once per source (a document says the same thing on
    many pages, a page many times: one finding is its provenance; the first is kept)."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for finding in findings:
        key = (
            str(finding.get("claim")),
            str(finding.get("source_url") or finding.get("document_id") or ""),
        )
        if key not in seen:
            seen.add(key)
            kept.append(finding)
    return kept


def is_finding(value: Any) -> bool:
    """Whether the analysis can use ``value`` as a finding: an object whose claim is a
    non-empty string and whose topic, when it names one, is a string (findings come from
    other agents, maybe in other languages)."""
    return (
        isinstance(value, dict)
        and isinstance(value.get("claim"), str)
        and bool(value["claim"].strip())
        and isinstance(value.get("topic", ""), str)
    )


def source_of(finding: Finding) -> str:
    if "source_url" in finding:
        return str(finding["source_url"])
    return f"{finding.get('document_id')}:p{finding.get('page')}"


def one_line(text: object) -> str:
    """``text`` as it goes on one line of the Markdown report: each line break (a newline,
    a carriage return, and the rest Python counts) a space. A claim that came with one would
    otherwise end its list item there, and what followed would read as the report's own
    structure (a heading, another item)."""
    return " ".join(str(text).splitlines())


def claim_key(finding: Finding) -> tuple[str, str]:
    return (str(finding.get("topic")), str(finding.get("claim")).strip().lower())


def dedupe(findings: Iterable[Finding]) -> list[Finding]:
    seen: set[tuple[str, str, str]] = set()
    out = []
    for f in findings:
        key = (*claim_key(f), source_of(f))
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def resolve(a: Finding, b: Finding) -> dict[str, Any]:
    """One conflict between two findings of a topic, resolved by the policy of its kind."""
    kind = str(a.get("kind"))
    conflict: dict[str, Any] = {
        "topic": a.get("topic"),
        "kind": kind,
        "claim_a": a["claim"],
        "claim_b": b["claim"],
        "sources": [source_of(a), source_of(b)],
    }
    if kind == "factual":
        diff = TIER_PRIORITY.get(str(a.get("tier")), 0) - TIER_PRIORITY.get(str(b.get("tier")), 0)
        if diff:
            winner, loser = (a, b) if diff > 0 else (b, a)
            conflict.update(
                resolution="A_PREFERRED" if diff > 0 else "B_PREFERRED",
                preferred=winner["claim"],
                confidence="high",
                note=f"{winner.get('tier')} source preferred over {loser.get('tier')}",
            )
        else:
            conflict.update(
                resolution="UNRESOLVED",
                confidence="low",
                note="sources of the same tier disagree: both versions shown; "
                "manual verification needed",
            )
    elif kind == "temporal":
        newer, older = (a, b) if str(a.get("date", "")) >= str(b.get("date", "")) else (b, a)
        conflict.update(
            resolution="NEWEST_CURRENT",
            current=newer["claim"],
            current_date=newer.get("date"),
            previous=older["claim"],
            previous_date=older.get("date"),
            note="the newest source is marked current; the older value is history",
        )
    else:
        conflict.update(
            resolution="BOTH_SHOWN", note="both perspectives are valid; the context decides"
        )
    return conflict


def detect_conflicts(findings: Sequence[Finding]) -> list[dict[str, Any]]:
    """Pairs of findings on one topic that assert different values (general findings
    assert none that compare)."""
    conflicts = []
    for i, a in enumerate(findings):
        if a.get("kind") == "general":
            continue
        for b in findings[i + 1 :]:
            if (
                a.get("topic") == b.get("topic")
                and b.get("kind") != "general"
                and a.get("value") != b.get("value")
                and source_of(a) != source_of(b)
            ):
                conflicts.append(resolve(a, b))
    return conflicts


def gaps_of(
    topics: Iterable[str], findings: Iterable[Finding], lexicon: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    covered = {f.get("topic") for f in findings}
    return [str(lexicon[t]["label"]) for t in topics if t not in covered and t in lexicon]

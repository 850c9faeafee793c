"""Research analysis without I/O: topics of a query, claims in a text, conflicts between
findings and the resolution policy (factual by source tier, interpretive both shown, temporal
newest marked current), and gaps."""

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


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text.replace("\n", " ")) if s.strip()]


def value_of(sentence: str, kind: str) -> str:
    """What a claim asserts, to compare claims of one topic: a number, or a stance."""
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
            entry = lexicon[topic]
            if not any(k in lowered for k in entry["keywords"]):
                continue
            kind = str(entry["kind"])
            has_number = bool(_NUMBER.search(sentence))
            if kind != "interpretive" and not has_number:
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
    """Pairs of findings on one topic that assert different values."""
    conflicts = []
    for i, a in enumerate(findings):
        for b in findings[i + 1 :]:
            if (
                a.get("topic") == b.get("topic")
                and a.get("value") != b.get("value")
                and source_of(a) != source_of(b)
            ):
                conflicts.append(resolve(a, b))
    return conflicts


def gaps_of(
    topics: Iterable[str], findings: Iterable[Finding], lexicon: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    covered = {f.get("topic") for f in findings}
    return [str(lexicon[t]["label"]) for t in topics if t not in covered]

"""The research coordinator (hub and spoke): analyses the query, plans which subagents to call,
checks the task graph for cycles (named, and broken when allowed), runs independent subagents
in parallel with explicit context only, handles escalations, refines on the synthesis's gaps
until a stopping criterion holds, and has the report written."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.dispatch import Dispatcher
from gateway.events import Emit, EventKind, Pattern, PatternEvent
from gateway.patterns._common import GATEWAY_ID, Stopwatch, check_wait, invalid, new_id
from mesh.core.errors import MeshError, shown
from mesh.core.model import JSON, Message, MessageType

WEB, DOCS, SYNTHESIS, REPORT = (
    "web-search-agent",
    "document-analysis-agent",
    "synthesis-agent",
    "report-agent",
)
ALTERNATIVE = {WEB: DOCS, DOCS: WEB}
CURRENT_DATA_WORDS = (
    "latest",
    "current",
    "today",
    "news",
    "recent",
    "now",
    "online",
    "web",
    "2024",
    "2025",
    "2026",
)
TOPICS_FILE = Path(__file__).resolve().parents[2] / "agents" / "data" / "research" / "topics.json"


class CircularDependencyError(MeshError):
    """The subagents' tasks wait for each other; the cycle is named in the message."""

    code = "FAILED_PRECONDITION"
    reason = "CIRCULAR_DEPENDENCY"


@dataclass(slots=True, kw_only=True)
class ResearchSpec:
    query: str
    documents: bool = True
    max_iterations: int = 3
    min_findings_per_gap: int = 2
    subagent_timeout: float = 10.0
    tool_timeout: float = 2.0
    dependencies: dict[str, list[str]] = field(default_factory=dict)
    break_cycles: bool = True
    constraints: dict[str, JSON] = field(default_factory=dict)
    report_name: str = ""
    run_id: str = ""

    def validate(self) -> None:
        if not self.query.strip():
            raise invalid("query", "query is required")
        if not 1 <= self.max_iterations <= 10:
            raise invalid("max_iterations", "max_iterations must be within 1..10")
        check_wait("subagent_timeout", self.subagent_timeout)
        if self.tool_timeout <= 0:
            raise invalid("tool_timeout", "tool_timeout must be positive")
        if self.report_name and (problem := report_name_problem(self.report_name)):
            raise invalid("report_name", problem)


MAX_REPORT_NAME_BYTES = 200
"""A report's name in UTF-8 at most: with ".json" after it, within the 255 bytes a file name
may have."""


def report_name_problem(name: str) -> str:
    """Why ``name`` cannot name a report's files ("" when it can): the report agent writes
    ``<name>.md`` and ``<name>.json`` into its folder and nowhere else, so a path, a hidden
    name or one too long for a file would have the whole run end in an escalation."""
    if "/" in name or "\\" in name or name.startswith(".") or not name.isprintable():
        return f"report_name must be a plain file name (no path, not hidden), not {name!r:.80}"
    if len(name.encode()) > MAX_REPORT_NAME_BYTES:
        return f"report_name must be at most {MAX_REPORT_NAME_BYTES} bytes of UTF-8"
    return ""


ACTIONS = ("retry_with_other_agent", "skip", "report_gap")
"""What a subagent's escalation may suggest; anything else is taken as report_gap."""


@dataclass(slots=True)
class Answers:
    """The subagents' answers as the coordinator can use them, and what had to be set aside.

    Subagents are other processes, maybe in other languages. The spec's rule for an
    unexpected format is to parse or normalize it rather than escalate: so the coordinator
    keeps what it can read (findings and conflicts that are objects, gaps and files that are
    strings) and notes the rest, per agent, in the run's result (``malformed_answers``)."""

    problems: list[str] = field(default_factory=list)

    def objects(self, agent_id: str, content: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
        return [v for v in self._list(agent_id, content, key, "objects") if isinstance(v, dict)]

    def findings(self, agent_id: str, content: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
        """Findings: objects with a claim that is a non-empty string (and a topic, when they
        name one, that is a string)."""
        from agents.research.analysis import is_finding

        objects = self.objects(agent_id, content, key)
        kept = [f for f in objects if is_finding(f)]
        if len(kept) < len(objects):
            left_out = [f for f in objects if not is_finding(f)]
            self.problems.append(
                f"{agent_id}: a finding needs a claim that is a non-empty string (and a topic,"
                f" if any, that is a string); left out {shown(left_out)}"
            )
        return kept

    def strings(self, agent_id: str, content: Mapping[str, Any], key: str) -> list[str]:
        return [v for v in self._list(agent_id, content, key, "strings") if isinstance(v, str)]

    def _list(self, agent_id: str, content: Mapping[str, Any], key: str, kind: str) -> list[Any]:
        value = content.get(key)
        if value is None:
            return []
        wanted = dict if kind == "objects" else str
        if not isinstance(value, list):
            self.problems.append(f"{agent_id}: {key} must be a list of {kind}, got {shown(value)}")
            return []
        dropped = [v for v in value if not isinstance(v, wanted)]
        if dropped:
            self.problems.append(
                f"{agent_id}: {key} must be a list of {kind}; left out {shown(dropped)}"
            )
        return value

    def text(self, agent_id: str, content: Mapping[str, Any], key: str) -> str:
        value = content.get(key)
        if value is None or isinstance(value, str):
            return value or ""
        self.problems.append(f"{agent_id}: {key} must be a string, got {shown(value)}")
        return ""

    def escalation(
        self, agent_id: str, content: Mapping[str, Any], query: str, findings: int
    ) -> dict[str, Any] | None:
        """A subagent's escalation (the spec's EscalationMessage), or None: a suggested action
        the coordinator does not know is taken as report_gap, so the gap is documented."""
        raw = content.get("escalation")
        if not raw:
            return None
        if not isinstance(raw, dict):
            self.problems.append(f"{agent_id}: escalation must be an object, got {shown(raw)}")
            raw = {}
        action = raw.get("suggested_action")
        if action not in ACTIONS:
            self.problems.append(
                f"{agent_id}: suggested_action must be one of {', '.join(ACTIONS)},"
                f" got {shown(action)}: taken as report_gap"
            )
            action = "report_gap"
        failure = raw.get("failure_type")
        attempted = raw.get("attempted_query")
        return {
            **raw,
            "agent_id": agent_id,
            "failure_type": failure if isinstance(failure, str) and failure else "unknown",
            "attempted_query": attempted if isinstance(attempted, str) and attempted else query,
            "partial_results": findings,
            "suggested_action": action,
        }


def load_topics(path: Path = TOPICS_FILE) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def analyze_query(query: str, documents: bool, lexicon: Mapping[str, Any]) -> dict[str, Any]:
    """Which subagents a query needs: current data -> web; documents -> document analysis;
    a comparison or many topics -> every source in parallel; neither -> synthesis alone."""
    from agents.research.analysis import plan_topics

    words = set(re.findall(r"[a-z0-9]+", query.lower()))
    topics, _ = plan_topics(query, lexicon)
    needs_web = not words.isdisjoint(CURRENT_DATA_WORDS)  # (whole words: "know" is not "now")
    complex_query = "compare" in words or len(topics) >= 3
    use_web = needs_web or complex_query
    use_docs = documents
    kind = "all" if use_web and use_docs else "web" if use_web else "docs" if use_docs else "simple"
    reason = {
        "all": "several sources are needed: web and documents in parallel",
        "web": "the query asks for current data",
        "docs": "documents are available",
        "simple": "no current data asked for and no documents: synthesis only",
    }[kind]
    return {
        "kind": kind,
        "use_web": use_web,
        "use_docs": use_docs,
        "topics": topics,
        "reason": reason,
    }


def detect_cycle(graph: Mapping[str, list[str]]) -> list[str] | None:
    """The first dependency cycle as a path (a -> b -> a), or None."""
    visited: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in stack:
            return [*stack[stack.index(node) :], node]
        if node in visited:
            return None
        visited.add(node)
        stack.append(node)
        for dep in graph.get(node, []):
            cycle = visit(dep)
            if cycle:
                return cycle
        stack.pop()
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def stopping_reason(
    *,
    iterations: int,
    max_iterations: int,
    gaps: list[str],
    new_claims: int,
    findings: list[dict[str, Any]],
    min_findings_per_gap: int,
) -> str | None:
    """Why refinement stops now (the spec's completeness criteria), or None to go on."""
    if not gaps:
        return "all gaps answered"
    if iterations >= max_iterations:
        return f"reached {max_iterations} iterations"
    if iterations > 1 and new_claims == 0:
        return "new findings only repeat known claims"
    if findings and all(f.get("confidence") == "high" for f in findings):
        return "every claim has high confidence"
    if iterations > 1 and len(findings) / max(len(gaps), 1) >= min_findings_per_gap:
        return f"at least {min_findings_per_gap} findings per open gap"
    return None


def conflict_summary(conflict: Mapping[str, Any]) -> str:
    """A conflict in a line: its topic, how it was resolved, and between which two sources
    (a topic may hold several conflicts, between different pairs)."""
    line = f"{conflict.get('topic')}: {conflict.get('resolution')}"
    sources = conflict.get("sources")
    if isinstance(sources, list) and len(sources) == 2:
        line += f" ({sources[0]} vs {sources[1]})"
    return line


async def run_research(spec: ResearchSpec, dispatcher: Dispatcher, emit: Emit) -> dict[str, JSON]:
    from agents.research.analysis import claim_key, dedupe

    spec.validate()
    run_id = spec.run_id or new_id("research")
    clock = Stopwatch()
    lexicon = await asyncio.to_thread(load_topics)
    answers = Answers()

    async def event(kind: EventKind, summary: str, **fields: Any) -> None:
        await emit(
            PatternEvent(
                run_id=run_id,
                pattern=Pattern.RESEARCH,
                kind=kind,
                summary=summary,
                elapsed_ms=clock.ms,
                **fields,
            )
        )

    plan = analyze_query(spec.query, spec.documents, lexicon)
    researchers = [a for a, on in ((WEB, plan["use_web"]), (DOCS, plan["use_docs"])) if on]
    graph: dict[str, list[str]] = {a: [] for a in researchers}
    for agent_id, deps in spec.dependencies.items():
        if agent_id in graph:
            graph[agent_id] = [d for d in deps if d in graph]
    graph[SYNTHESIS] = list(researchers)
    graph[REPORT] = [SYNTHESIS]
    await event(
        EventKind.PLAN,
        f"{plan['kind']}: {plan['reason']}",
        data={**plan, "agents": [*researchers, SYNTHESIS, REPORT], "graph": graph},
    )
    cycle = detect_cycle(graph)
    defaults: set[str] = set()
    if cycle:
        named = " → ".join(cycle)
        if not spec.break_cycles:
            raise CircularDependencyError(f"circular dependency between tasks: {named}")
        blocked = cycle[-2]
        graph[blocked] = [d for d in graph[blocked] if d != cycle[-1]]
        defaults.add(blocked)
        await event(
            EventKind.ESCALATION,
            f"cycle {named} broken: {blocked} runs with default input and its own timeout",
            agent_id=blocked,
            data={
                "cycle": cycle,
                "broken_edge": [blocked, cycle[-1]],
                "failure_type": "circular_dependency",
            },
        )

    constraints = {**spec.constraints, "topics": plan["topics"], "tool_timeout": spec.tool_timeout}
    findings: list[dict[str, Any]] = []
    extra_gaps: list[str] = []
    escalations: list[dict[str, Any]] = []
    partial_agents: set[str] = set()
    synthesis: dict[str, Any] = {}
    iterations = 0
    stopped = "no research agents needed" if not researchers else ""

    async def ask(agent_id: str, content: dict[str, JSON]) -> dict[str, Any]:
        message = Message(
            from_agent=GATEWAY_ID,
            to_agent=agent_id,
            content=content,
            reply_to=GATEWAY_ID,
            metadata={"run_id": run_id},
        )
        answer = await dispatcher.ask(message, spec.subagent_timeout)
        if answer.message_type is MessageType.ERROR:
            raise MeshError(
                f"{agent_id} failed: {(answer.content or {}).get('error') or 'agent error'}",
                code="ABORTED",
                reason="AGENT_ERROR",
            )
        return dict(answer.content or {})

    async def synthesize(agent_id: str, content: dict[str, JSON]) -> dict[str, Any]:
        """The synthesis agent's answer, normalized (see Answers)."""
        said = await ask(agent_id, content)
        return {
            **said,
            "summary": answers.text(agent_id, said, "summary"),
            "findings": answers.findings(agent_id, said, "findings"),
            "conflicts": answers.objects(agent_id, said, "conflicts"),
            "gaps": answers.strings(agent_id, said, "gaps"),
        }

    async def research(
        agent_id: str, focus: str, prior: list[dict[str, Any]], tried: set[str]
    ) -> list[dict[str, Any]]:
        tried.add(agent_id)
        context = {**constraints, "focus": focus}
        try:
            # Explicit context only: the query, prior findings, constraints. No history.
            result = await ask(
                agent_id,
                {
                    "action": "research",
                    "query": spec.query,
                    "prior_findings": prior,
                    "constraints": context,
                },
            )
        except MeshError as error:
            partial_agents.add(agent_id)
            extra_gaps.append(f"{agent_id} gave no results ({error.code}: {error.message})")
            await event(
                EventKind.AGENT_MISSING,
                f"{agent_id}: {error.message}",
                agent_id=agent_id,
                data={
                    "agent_id": agent_id,
                    "reason": error.message,
                    "code": error.code,
                    "partial": True,
                },
            )
            return []
        got = answers.findings(agent_id, result, "findings")
        partial = result.get("partial") is True
        if partial:
            partial_agents.add(agent_id)
        errors = result.get("errors")
        up = answers.escalation(agent_id, result, spec.query, len(got))
        if up:
            escalations.append(up)
            await event(
                EventKind.ESCALATION,
                f"{agent_id} escalated {up['failure_type']}: {up['suggested_action']}",
                agent_id=agent_id,
                data=up,
            )
            action = up["suggested_action"]
            other = ALTERNATIVE.get(agent_id)
            if action != "skip":
                extra_gaps.append(
                    f"Could not complete: {up['attempted_query']} "
                    f"({up['failure_type']} in {agent_id})"
                )
            if action == "retry_with_other_agent" and other and other not in tried:
                return got + await research(other, focus, prior, tried)
        await event(
            EventKind.FINDINGS,
            f"{agent_id}: {len(got)} findings" + (" (partial)" if partial else ""),
            agent_id=agent_id,
            data={
                "agent_id": agent_id,
                "findings": got,
                "partial": partial,
                "errors": errors
                if isinstance(errors, list)
                else []
                if errors is None
                else [errors],
            },
        )
        return got

    while True:
        iterations += 1
        focus = str(synthesis["gaps"][0]) if synthesis.get("gaps") and iterations > 1 else ""
        known = {claim_key(f) for f in findings}
        before = len(findings)
        tried: set[str] = set()
        # Independent researchers run in parallel; one that depends on another waits for it
        # and gets its findings as prior findings (a broken cycle's agent gets none).
        results: dict[str, list[dict[str, Any]]] = {}
        ready = [a for a in researchers if not graph.get(a)]
        waiting = [a for a in researchers if graph.get(a)]
        for agent_id, got in zip(
            ready,
            await asyncio.gather(*(research(a, focus, list(findings), tried) for a in ready)),
            strict=True,
        ):
            results[agent_id] = got
        for agent_id in waiting:
            prior = [f for dep in graph[agent_id] for f in results.get(dep, [])]
            results[agent_id] = await research(agent_id, focus, list(findings) + prior, tried)
        for got in results.values():
            findings.extend(got)
        findings = dedupe(findings)
        new_claims = len({claim_key(f) for f in findings[before:]} - known)
        synthesis = await synthesize(
            SYNTHESIS,
            {
                "action": "synthesize",
                "query": spec.query,
                "prior_findings": findings,
                "constraints": constraints,
            },
        )
        stopped = (
            stopped
            or stopping_reason(
                iterations=iterations,
                max_iterations=spec.max_iterations,
                gaps=list(synthesis.get("gaps") or []),
                new_claims=new_claims,
                findings=findings,
                min_findings_per_gap=spec.min_findings_per_gap,
            )
            or ""
        )
        await event(
            EventKind.ITERATION,
            f"iteration {iterations}: {len(findings)} findings, "
            f"{len(synthesis.get('gaps') or [])} gaps"
            + (f"; stopping: {stopped}" if stopped else ""),
            round=iterations,
            data={
                "iteration": iterations,
                "findings": len(findings),
                "new_claims": new_claims,
                "gaps": synthesis.get("gaps") or [],
                "focus": focus,
                "stopped_because": stopped,
            },
        )
        if stopped:
            break

    for conflict in synthesis.get("conflicts") or []:
        await event(EventKind.CONFLICT, conflict_summary(conflict), data=conflict)
    open_gaps = list(dict.fromkeys([*(synthesis.get("gaps") or []), *extra_gaps]))
    said = await ask(
        REPORT,
        {
            "action": "report",
            "query": spec.query,
            "prior_findings": [],
            "constraints": {
                **constraints,
                "open_gaps": open_gaps,
                "report_name": spec.report_name or run_id,
            },
            "synthesis": synthesis,
        },
    )
    report = {
        **said,
        "title": answers.text(REPORT, said, "title"),
        "files": answers.strings(REPORT, said, "files"),
        "citations": answers.objects(REPORT, said, "citations"),
    }
    await event(
        EventKind.REPORT,
        f"report written: {', '.join(report['files'])}",
        agent_id=REPORT,
        data={
            "title": report["title"],
            "files": report["files"],
            "citations": len(report["citations"]),
        },
    )
    result: dict[str, JSON] = {
        "run_id": run_id,
        "status": "PARTIAL" if partial_agents else "COMPLETED",
        "query": spec.query,
        "plan": plan,
        "iterations": iterations,
        "stopped_because": stopped,
        "findings": findings,
        "conflicts": synthesis.get("conflicts") or [],
        "summary": synthesis.get("summary"),
        "gaps": open_gaps,
        "escalations": escalations,
        "partial_agents": sorted(partial_agents),
        "defaults_used": sorted(defaults),
        "report": report,
        "malformed_answers": answers.problems,
        "duration_ms": clock.ms,
    }
    await event(
        EventKind.RESULT,
        f"research {result['status'].lower()}: {len(findings)} findings,"
        f" {len(open_gaps)} open gaps",
        data=result,
    )
    return result

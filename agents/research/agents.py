"""The research subagents, each with only the tools of its role (enforced by the mesh):
web search (web_search, web_fetch), document analysis (read, grep), synthesis (none) and
report (write). They get explicit context — query, prior findings, constraints — and never
the coordinator's history. A failure they cannot work around is escalated in the answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agents.reasoning import Reasoner, reasoner_from_env
from agents.research import analysis
from agents.research.analysis import one_line
from agents.research.corpus import DATA
from mesh import Agent, AgentContext, Message
from mesh.core.errors import MeshError
from mesh.core.model import JSON
from mesh.core.tools import ToolFailedError, ToolPermissionError, ToolTimeoutError

_CONFIDENCE = {"high": 0, "medium": 1, "low": 2}
"""A finding's confidence, as the order in which a summary cites them."""
MAX_FINDINGS = 100
"""Findings a researcher's answer carries at most (the first found, each claim once per
source); how many more it found is ``findings_left_out``. An answer stays well under the
mesh's message limit whatever the documents hold."""


def _lexicon(path: Path = DATA / "topics.json") -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def escalation(
    agent_id: str, failure: str, query: str, partial: list[Any], action: str, detail: str
) -> dict[str, Any]:
    return {
        "findings": partial,
        "partial": True,
        "escalation": {
            "agent_id": agent_id,
            "failure_type": failure,
            "attempted_query": query,
            "partial_results": len(partial),
            "suggested_action": action,
            "detail": detail,
        },
    }


class _Researcher(Agent):
    """Calls tools through the mesh; a timeout is retried once, a business error never."""

    def __init__(self, agent_id: str | None = None, *, topics_file: Path | None = None) -> None:
        super().__init__(agent_id)
        self.topics_file = topics_file or DATA / "topics.json"

    async def tool(
        self,
        ctx: AgentContext,
        name: str,
        args: dict[str, JSON],
        timeout: float,
        errors: list[dict[str, Any]],
    ) -> Any:
        for attempt in (1, 2):
            try:
                return await ctx.client.call_tool(
                    name, args, timeout=timeout, agent_id=self.agent_id
                )
            except ToolTimeoutError:
                if attempt == 2:
                    errors.append({"tool": name, "args": args, "error": "timeout", "retried": True})
                    return None
                await asyncio.sleep(0.05)  # a timeout is worth one more try
            except ToolFailedError as error:
                errors.append(
                    {"tool": name, "args": args, "error": error.message, "retried": False}
                )
                return None
        return None

    async def lexicon(self, query: str) -> dict[str, Any]:
        """The topics file, with the query's own topic when it names none of the file's (as
        the coordinator planned it: see analysis.plan_topics)."""
        base = await asyncio.to_thread(_lexicon, self.topics_file)
        return analysis.plan_topics(query, base)[1]

    def context(self, message: Message) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        content = message.content or {}
        return (
            str(content.get("query") or ""),
            [f for f in content.get("prior_findings") or [] if analysis.is_finding(f)],
            dict(content.get("constraints") or {}),
        )


class _SourceResearcher(_Researcher):
    """A researcher over one kind of source: finds candidate pages, reads them, extracts the
    claims on the wanted topics, and escalates what it cannot work around."""

    async def pages(
        self,
        ctx: AgentContext,
        query: str,
        constraints: dict[str, Any],
        lexicon: dict[str, Any],
        timeout: float,
        errors: list[dict[str, Any]],
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yields (text, provenance) for each page read."""
        raise NotImplementedError
        yield  # pragma: no cover

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        query, prior, constraints = self.context(message)
        topics = list(constraints.get("topics") or [])
        lexicon = await self.lexicon(query)
        if not topics:
            return escalation(
                self.agent_id,
                "ambiguous_scope",
                query,
                [],
                "report_gap",
                "the query names no topic this agent can research",
            )
        timeout = float(constraints.get("tool_timeout") or 2.0)
        errors: list[dict[str, Any]] = []
        findings: list[dict[str, Any]] = []
        try:
            async for text, source in self.pages(ctx, query, constraints, lexicon, timeout, errors):
                findings.extend(analysis.extract_claims(text, topics, lexicon, source))
        except ToolPermissionError as error:
            return escalation(
                self.agent_id, "access_denied", query, [], "retry_with_other_agent", error.message
            )
        timeouts = [e for e in errors if e["error"] == "timeout"]
        if timeouts and not findings:
            return {
                **escalation(
                    self.agent_id,
                    "timeout_complete",
                    query,
                    [],
                    "report_gap",
                    f"{len(timeouts)} tool calls timed out",
                ),
                "errors": errors,
            }
        findings = analysis.distinct(findings)
        return {
            "findings": findings[:MAX_FINDINGS],
            "findings_left_out": max(0, len(findings) - MAX_FINDINGS),
            "partial": bool(timeouts),
            "errors": errors,
            "used_prior_findings": len(prior),
        }


class WebSearchAgent(_SourceResearcher):
    """Searches the web and turns what it reads into findings with their sources."""

    agent_id = "web-search-agent"
    agent_types = ("research", "web")
    capabilities = ("web_research",)

    async def pages(
        self,
        ctx: AgentContext,
        query: str,
        constraints: dict[str, Any],
        lexicon: dict[str, Any],
        timeout: float,
        errors: list[dict[str, Any]],
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        search = f"{query} {constraints.get('focus') or ''}".strip()
        hits = (
            await self.tool(ctx, "web_search", {"query": search, "limit": 5}, timeout, errors) or []
        )
        for hit in hits:
            page = await self.tool(ctx, "web_fetch", {"url": hit["url"]}, timeout, errors)
            if page is not None:
                yield (
                    page["text"],
                    {
                        "source_url": page["url"],
                        "title": page["title"],
                        "date_accessed": page["date_accessed"],
                        "date": page["published"],
                        "tier": page["tier"],
                    },
                )


class DocumentAnalysisAgent(_SourceResearcher):
    """Searches the local documents (full-text index) and reads the pages that match."""

    agent_id = "document-analysis-agent"
    agent_types = ("research", "documents")
    capabilities = ("document_research",)

    async def pages(
        self,
        ctx: AgentContext,
        query: str,
        constraints: dict[str, Any],
        lexicon: dict[str, Any],
        timeout: float,
        errors: list[dict[str, Any]],
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        words = " ".join(
            [
                query,
                str(constraints.get("focus") or ""),
                *(
                    " ".join(lexicon[t]["keywords"])
                    for t in constraints.get("topics") or []
                    if t in lexicon
                ),
            ]
        )
        hits = await self.tool(ctx, "grep", {"pattern": words, "limit": 20}, timeout, errors) or []
        for hit in hits:
            page = await self.tool(
                ctx,
                "read",
                {"document_id": hit["document_id"], "page": hit["page"]},
                timeout,
                errors,
            )
            if page is not None:
                yield (
                    page["text"],
                    {
                        "document_id": page["document_id"],
                        "page": page["page"],
                        "title": page["title"],
                        "date": page["date"],
                        "tier": page["tier"],
                    },
                )


class SynthesisAgent(_Researcher):
    """Merges findings without losing their sources, detects and resolves conflicts, names
    the gaps. It has no tools: it only works on what it is given."""

    agent_id = "synthesis-agent"
    agent_types = ("research", "synthesis")
    capabilities = ("synthesis",)

    def __init__(
        self,
        agent_id: str | None = None,
        *,
        topics_file: Path | None = None,
        reasoner: Reasoner | None = None,
    ) -> None:
        super().__init__(agent_id, topics_file=topics_file)
        self.reasoner = reasoner

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        query, prior, constraints = self.context(message)
        topics = list(constraints.get("topics") or [])
        lexicon = await self.lexicon(query)
        findings = analysis.dedupe(prior)
        conflicts = analysis.detect_conflicts(findings)
        gaps = analysis.gaps_of(topics, findings, lexicon)
        lines = []
        for topic in topics:
            on_topic = [f for f in findings if f.get("topic") == topic]
            if not on_topic or topic not in lexicon:
                continue
            if lexicon[topic]["kind"] == "general":
                # Claims that compare to nothing: the surest three, most confident first.
                surest = sorted(
                    on_topic, key=lambda f: _CONFIDENCE.get(str(f.get("confidence")), 3)
                )
                lines.append(
                    f"{lexicon[topic]['label']}: " + " ".join(f["claim"] for f in surest[:3])
                )
                continue
            settled = next(
                (
                    c
                    for c in conflicts
                    if c["topic"] == topic and c["resolution"] in ("A_PREFERRED", "B_PREFERRED")
                ),
                None,
            )
            current = next(
                (
                    c
                    for c in conflicts
                    if c["topic"] == topic and c["resolution"] == "NEWEST_CURRENT"
                ),
                None,
            )
            claim = (
                (settled or {}).get("preferred")
                or (current or {}).get("current")
                or on_topic[0]["claim"]
            )
            lines.append(f"{lexicon[topic]['label']}: {claim}")
        rule_summary = " ".join(lines) or f"No findings answer: {query}"

        async def summarize(task: str, inputs: dict[str, Any]) -> dict[str, Any]:
            return {"summary": rule_summary}

        # Only the prose goes through the reasoner: findings, their sources, conflicts and
        # gaps stay as computed, so provenance survives whatever writes the summary.
        reasoner = self.reasoner or reasoner_from_env(summarize)
        answer = await reasoner.complete(
            "summarize",
            {
                "query": query,
                "findings": findings,
                "conflicts": conflicts,
                "gaps": gaps,
                "rule_summary": rule_summary,
            },
            '{"summary": str (cite no source that is not among the findings)}',
        )
        summary = str(answer.get("summary") or rule_summary)
        return {"summary": summary, "findings": findings, "conflicts": conflicts, "gaps": gaps}


class ReportAgent(_Researcher):
    """Writes the report as Markdown and JSON, citing every finding inline as [ref-N]."""

    agent_id = "report-agent"
    agent_types = ("research", "report")
    capabilities = ("report",)

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        query, _, constraints = self.context(message)
        synthesis = dict((message.content or {}).get("synthesis") or {})
        findings = [f for f in synthesis.get("findings") or [] if analysis.is_finding(f)]
        citations, refs = [], {}
        for i, finding in enumerate(findings, start=1):
            ref = f"ref-{i}"
            refs[analysis.source_of(finding) + "|" + finding["claim"]] = ref
            citation: dict[str, Any] = {
                "id": ref,
                "source": analysis.source_of(finding),
                "claim": finding["claim"],
                "tier": finding.get("tier"),
            }
            if "date_accessed" in finding:
                citation["accessed"] = finding["date_accessed"]
            if "page" in finding:
                citation["page"] = finding["page"]
            if finding.get("date"):
                citation["date"] = finding["date"]
            citations.append(citation)

        def cite(claim: str) -> str:
            ids = [r for key, r in refs.items() if key.endswith("|" + claim)]
            line = one_line(claim)
            return f"{line} [{', '.join(ids)}]" if ids else line

        title = f"Research report: {query}"
        body = [
            f"# {one_line(title)}",
            "",
            "## Summary",
            "",
            str(synthesis.get("summary", "")),
            "",
            "## Findings",
            "",
        ]
        body += [f"- {cite(f['claim'])} ({f.get('confidence')} confidence)" for f in findings]
        body += ["", "## Conflicts", ""]
        conflicts = [c for c in synthesis.get("conflicts") or [] if is_conflict(c)]
        for c in conflicts:
            if c["resolution"] == "NEWEST_CURRENT":
                body.append(
                    f"- **{one_line(c.get('topic'))}** (temporal): current "
                    f"({one_line(c.get('current_date'))}): "
                    f"{cite(c['current'])}; earlier ({one_line(c.get('previous_date'))}): "
                    f"{cite(c['previous'])}"
                )
            elif c["resolution"] == "BOTH_SHOWN":
                body.append(
                    f"- **{one_line(c.get('topic'))}** (interpretive, both perspectives shown): "
                    f"{cite(c['claim_a'])} — versus — {cite(c['claim_b'])}"
                )
            elif c["resolution"] == "UNRESOLVED":
                body.append(
                    f"- **{one_line(c.get('topic'))}** (factual, UNRESOLVED: "
                    f"{one_line(c.get('note'))}): "
                    f"{cite(c['claim_a'])} — versus — {cite(c['claim_b'])}"
                )
            else:
                body.append(
                    f"- **{one_line(c.get('topic'))}** (factual, resolved by source tier: "
                    f"{one_line(c.get('note'))}): {cite(c['preferred'])}"
                )
        if not conflicts:
            body.append("- none")
        gaps = [str(g) for g in constraints.get("open_gaps") or synthesis.get("gaps") or []]
        body += ["", "## Open gaps", ""] + ([f"- {one_line(g)}" for g in gaps] or ["- none"])
        body += ["", "## Sources", ""] + [f"[{c['id']}] {one_line(c['source'])}" for c in citations]
        text = "\n".join(body) + "\n"
        name = str(constraints.get("report_name") or "report")
        report = {"title": title, "body": text, "citations": citations, "gaps": gaps}
        files = []
        for filename, content in (
            (f"{name}.md", text),
            (f"{name}.json", json.dumps(report, indent=2)),
        ):
            try:
                written = await ctx.client.call_tool(
                    "write", {"filename": filename, "content": content}, agent_id=self.agent_id
                )
                files.append(written["path"])
            except MeshError as error:
                return {
                    **report,
                    "files": files,
                    **escalation(
                        self.agent_id, "access_denied", query, [], "report_gap", error.message
                    ),
                }
        return {**report, "files": files}


CONFLICT_FIELDS = {
    "NEWEST_CURRENT": ("current", "previous"),
    "BOTH_SHOWN": ("claim_a", "claim_b"),
    "UNRESOLVED": ("claim_a", "claim_b"),
    "A_PREFERRED": ("preferred",),
    "B_PREFERRED": ("preferred",),
}
"""Per resolution (analysis.resolve), the claims a report shows for a conflict."""


def is_conflict(value: Any) -> bool:
    """Whether the report can show ``value`` as a conflict: an object with a known
    resolution and, as strings, the claims that resolution shows."""
    if not isinstance(value, dict):
        return False
    claims = CONFLICT_FIELDS.get(str(value.get("resolution")))
    return claims is not None and all(isinstance(value.get(k), str) for k in claims)


def research_agents() -> list[Agent]:
    return [WebSearchAgent(), DocumentAnalysisAgent(), SynthesisAgent(), ReportAgent()]

"""The research coordinator through the gateway's gRPC API, with subagents on the mesh and
their tools run by the mesh under per-agent allow-lists."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agents.research import RESEARCH_POLICY, research_agents, research_tools
from agents.research.corpus import DATA, DocumentFolder, SnapshotSearch
from gateway.client import GatewayClient
from gateway.server import serve_gateway
from mesh import LocalMesh
from mesh.core.errors import MeshError
from mesh.core.tools import ToolHost, ToolPermissionError, UnknownToolError
from mesh.v1 import tools_pb2, tools_pb2_grpc

FULL_QUERY = (
    "Compare the latest lithium-ion battery recycling rate, the EU collection target, "
    "whether recycling is economically viable and the cost per tonne"
)


class Research:
    def __init__(self, local: LocalMesh, client: GatewayClient, out: Path) -> None:
        self.local, self.client, self.out = local, client, out

    async def run(self, **request: Any) -> list[dict[str, Any]]:
        return await self.client.collect(self.client.research(**request))


def kinds(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


async def research_mesh(
    tmp_path: Path,
    *,
    web: Any = None,
    policy: dict[str, list[str]] | None = None,
    docs: DocumentFolder | None = None,
) -> AsyncIterator[Research]:
    host = ToolHost(
        research_tools(web=web, docs=docs or DocumentFolder(), output=tmp_path),
        policy or RESEARCH_POLICY,
    )
    async with LocalMesh(tool_host=host) as local:
        for agent in research_agents():
            await local.add_agent(agent)
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address, timeout=60) as client:
                yield Research(local, client, tmp_path)
        finally:
            await gateway.stop(0.5)


@pytest.fixture
async def research(tmp_path: Path) -> AsyncIterator[Research]:
    async for r in research_mesh(tmp_path):
        yield r


async def test_routing_by_query_kind_shows_in_the_plan(research: Research) -> None:
    simple = await research.run(query="What is the lithium-ion battery recycling rate?")
    plan = kinds(simple, "PLAN")[0]["data"]
    assert (plan["kind"], plan["agents"]) == ("simple", ["synthesis-agent", "report-agent"])
    assert kinds(simple, "FINDINGS") == []
    assert simple[-1]["data"]["gaps"] == ["lithium-ion battery recycling rate"]

    web = await research.run(query="What is the latest lithium-ion battery recycling rate?")
    assert [e["agent_id"] for e in kinds(web, "FINDINGS")] == ["web-search-agent"]
    docs = await research.run(
        query="What is the lithium-ion battery recycling rate?", documents=True
    )
    assert [e["agent_id"] for e in kinds(docs, "FINDINGS")] == ["document-analysis-agent"]
    both = await research.run(query=FULL_QUERY, documents=True)
    assert kinds(both, "PLAN")[0]["data"]["kind"] == "all"
    assert {e["agent_id"] for e in kinds(both, "FINDINGS")} == {
        "web-search-agent",
        "document-analysis-agent",
    }


async def test_a_tool_outside_the_allow_list_is_refused(research: Research) -> None:
    async with research.local.client("synthesis-agent") as synthesis:
        with pytest.raises(ToolPermissionError, match="synthesis-agent may not use web_search"):
            await synthesis.call_tool("web_search", {"query": "batteries"})
        hits = await synthesis.call_tool(
            "web_search", {"query": "batteries"}, agent_id="web-search-agent"
        )
        assert hits
    async with grpc.aio.insecure_channel(research.local.address) as channel:
        stub = tools_pb2_grpc.ToolServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.InvokeTool(tools_pb2.InvokeToolRequest(agent_id="report-agent", tool="read"))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        allowed = await stub.ListTools(tools_pb2.ListToolsRequest(agent_id="web-search-agent"))
        assert [t.name for t in allowed.tools] == ["web_fetch", "web_search"]


@pytest.mark.parametrize(
    ("agent_id", "tool", "arguments", "said"),
    [
        ("document-analysis-agent", "read", {"page": 1}, "document_id must be a non-empty string"),
        (
            "document-analysis-agent",
            "read",
            {"document_id": "industry-survey-2024", "page": "two"},
            "page must be a whole number, got 'two'",
        ),
        ("document-analysis-agent", "grep", {"pattern": "rate", "limit": -5}, "at least 1"),
        ("web-search-agent", "web_fetch", {}, "url must be a non-empty string, got None"),
        ("web-search-agent", "web_search", {"query": "x", "limit": 2.5}, "whole number"),
        ("report-agent", "write", {"filename": "a.md", "content": {"a": 1}}, "content must be a"),
    ],
)
async def test_a_tool_called_with_arguments_it_cannot_take_says_which(
    research: Research, agent_id: str, tool: str, arguments: dict[str, Any], said: str
) -> None:
    """An agent in any language may call a tool with what it has: an argument missing or of
    the wrong kind is refused naming it (a business error: not worth a retry), not with the
    bare name of a Python exception; a search's limit counts from 1 (SQLite took -5 as no
    limit at all) and stops at 100."""
    async with research.local.client(agent_id) as client:
        with pytest.raises(MeshError) as refused:
            await client.call_tool(tool, arguments)
        assert refused.value.code == "FAILED_PRECONDITION"
        assert said in refused.value.message
        hits = await client.call_tool(
            "grep", {"pattern": "the", "limit": 10**9}, agent_id=("document-analysis-agent")
        )
        assert isinstance(hits, list) and len(hits) <= 100


async def test_a_tool_asked_of_a_broker_that_runs_none_is_said_so() -> None:
    async with LocalMesh() as local, local.client("web-search-agent") as client:
        with pytest.raises(UnknownToolError, match="the broker runs no tools"):
            await client.call_tool("web_search", {"query": "batteries"})


async def test_provenance_is_preserved_end_to_end(research: Research) -> None:
    events = await research.run(query=FULL_QUERY, documents=True, report_name="batteries")
    result = events[-1]["data"]
    snapshot = json.loads((DATA / "web_snapshot.json").read_text())
    urls = {p["url"]: p for p in snapshot["pages"]}
    docs = DocumentFolder()
    for finding in result["findings"]:
        assert finding["claim"] and finding["excerpt"] and finding["confidence"]
        if "source_url" in finding:
            assert finding["claim"] in urls[finding["source_url"]]["text"]
            assert finding["date_accessed"] and finding["date"]
        else:
            page = docs.documents[finding["document_id"]]["pages"][finding["page"] - 1]
            assert finding["claim"] in page
    report = result["report"]
    # The files are named by their full path, wherever the caller runs.
    assert result["report"]["files"] == [
        str((research.out / name).resolve()) for name in ("batteries.md", "batteries.json")
    ]
    body = (research.out / "batteries.md").read_text()
    assert body == report["body"]
    assert (
        json.loads((research.out / "batteries.json").read_text())["citations"]
        == report["citations"]
    )
    cited = set(re.findall(r"ref-\d+", body))
    ids = {c["id"] for c in report["citations"]}
    assert cited == ids and len(ids) == len(result["findings"])
    for citation in report["citations"]:
        if citation["source"].startswith("https://"):
            assert citation["source"] in urls and citation["accessed"]
        else:
            doc_id, _, page = citation["source"].rpartition(":p")
            assert doc_id in docs.documents and int(page) == citation["page"]
            assert citation["claim"] in docs.documents[doc_id]["pages"][int(page) - 1]


async def test_conflicts_are_detected_and_each_policy_applied(research: Research) -> None:
    events = await research.run(query=FULL_QUERY, documents=True)
    conflicts = [e["data"] for e in kinds(events, "CONFLICT")]
    by = {(c["topic"], c["resolution"]) for c in conflicts}
    assert ("recycling_rate", "A_PREFERRED") in by or ("recycling_rate", "B_PREFERRED") in by
    assert ("collection_target", "NEWEST_CURRENT") in by
    assert ("economic_viability", "BOTH_SHOWN") in by
    # Each event says between which sources: a topic's conflicts are told apart.
    summaries = [e["summary"] for e in kinds(events, "CONFLICT")]
    assert len(set(summaries)) == len(summaries) == len(conflicts)
    for conflict, summary in zip(conflicts, summaries, strict=True):
        first, second = conflict["sources"]
        assert summary == f"{conflict['topic']}: {conflict['resolution']} ({first} vs {second})"
    official = [
        c for c in conflicts if c["topic"] == "recycling_rate" and "official" in c.get("note", "")
    ]
    assert all("46%" in c["preferred"] for c in official) and official
    temporal = [c for c in conflicts if c["resolution"] == "NEWEST_CURRENT"]
    assert all("63%" in c["current"] and "45%" in c["previous"] for c in temporal)
    body = events[-1]["data"]["report"]["body"]
    assert "both perspectives shown" in body and "current (2023-08-17)" in body
    assert "## Open gaps\n\n- cost of recovering lithium per tonne" in body


async def test_a_cycle_is_detected_named_and_broken_or_refused(research: Research) -> None:
    cycle = {
        "web-search-agent": {"depends_on": ["document-analysis-agent"]},
        "document-analysis-agent": {"depends_on": ["web-search-agent"]},
    }
    with pytest.raises(MeshError) as info:
        await research.run(query=FULL_QUERY, documents=True, dependencies=cycle, fail_on_cycle=True)
    assert info.value.code == "FAILED_PRECONDITION"
    assert (
        "document-analysis-agent → web-search-agent → document-analysis-agent" in info.value.message
    )
    events = await research.run(query=FULL_QUERY, documents=True, dependencies=cycle)
    [broken] = [
        e
        for e in kinds(events, "ESCALATION")
        if e["data"].get("failure_type") == "circular_dependency"
    ]
    assert broken["data"]["cycle"] == [
        "document-analysis-agent",
        "web-search-agent",
        "document-analysis-agent",
    ]
    result = events[-1]["data"]
    assert result["defaults_used"] == ["web-search-agent"]
    assert result["status"] == "COMPLETED" and result["findings"]


async def test_a_report_name_that_is_no_plain_file_name_is_refused_before_any_work(
    research: Research,
) -> None:
    """A path, a hidden name or one too long for a file: INVALID_ARGUMENT naming
    report_name at once, where the whole run went ahead and ended in an escalation (the
    report agent's write refused) with no report written."""
    for name in ("../../escape", "a/b", ".hidden", "x" * 300, "tab\there"):
        with pytest.raises(MeshError) as info:
            await research.run(query=FULL_QUERY, report_name=name)
        assert info.value.code == "INVALID_ARGUMENT"
        assert [v.field for v in info.value.field_violations] == ["report_name"]
    assert list(research.out.iterdir()) == []
    events = await research.run(query=FULL_QUERY, documents=False, report_name="batteries q3")
    assert events[-1]["data"]["status"] == "COMPLETED"
    assert sorted(p.name for p in research.out.iterdir()) == [
        "batteries q3.json",
        "batteries q3.md",
    ]


class SlowSnapshot(SnapshotSearch):
    """The snapshot, with one slow site and one link to a page that does not exist."""

    async def search(self, query: str, limit: int) -> list[dict[str, Any]]:
        hits = await super().search(query, limit)
        return [*hits, {"url": "https://missing.example/404", "title": "gone", "snippet": ""}]

    async def fetch(self, url: str) -> dict[str, Any]:
        if "greentech-blog" in url:
            import asyncio

            await asyncio.sleep(5)
        return await super().fetch(url)


async def test_a_timeout_gives_partial_results_and_is_told_from_a_business_error(
    tmp_path: Path,
) -> None:
    async for r in research_mesh(tmp_path, web=SlowSnapshot()):
        events = await r.run(
            query="What is the latest lithium-ion battery recycling rate?", tool_timeout="0.2s"
        )
    [found] = kinds(events, "FINDINGS")
    assert found["data"]["partial"] is True
    errors = {e["args"].get("url"): e for e in found["data"]["errors"]}
    slow = errors["https://greentech-blog.example/battery-myths"]
    assert (slow["error"], slow["retried"]) == ("timeout", True)
    missing = errors["https://missing.example/404"]
    assert missing["retried"] is False and "HTTP 404" in missing["error"]
    result = events[-1]["data"]
    assert result["status"] == "PARTIAL"
    assert result["partial_agents"] == ["web-search-agent"]
    assert any("46%" in f["claim"] for f in result["findings"])  # the fast sites still count


class AllSlow(SnapshotSearch):
    async def fetch(self, url: str) -> dict[str, Any]:
        import asyncio

        await asyncio.sleep(5)
        return await super().fetch(url)


async def test_escalations_are_handled_as_the_table_says(tmp_path: Path) -> None:
    # Access denied: the coordinator retries with the other agent and reports the gap.
    no_web = {**RESEARCH_POLICY, "web-search-agent": []}
    async for r in research_mesh(tmp_path, policy=no_web):
        events = await r.run(
            query="What is the latest lithium-ion battery recycling rate?", documents=False
        )
        [up] = kinds(events, "ESCALATION")
        assert (up["data"]["failure_type"], up["data"]["suggested_action"]) == (
            "access_denied",
            "retry_with_other_agent",
        )
        assert [e["agent_id"] for e in kinds(events, "FINDINGS")] == ["document-analysis-agent"]
        assert any("access_denied" in g for g in events[-1]["data"]["gaps"])

        # Ambiguous scope: nothing to research, reported as a gap.
        events = await r.run(query="What about the latest news on that?")
        [up] = kinds(events, "ESCALATION")
        assert up["data"]["failure_type"] == "ambiguous_scope"
        assert any("ambiguous_scope" in g for g in events[-1]["data"]["gaps"])

    # Every tool call timing out: escalated with what little there is, reported as a gap.
    async for r in research_mesh(tmp_path, web=AllSlow()):
        events = await r.run(
            query="What is the latest lithium-ion battery recycling rate?",
            tool_timeout="0.1s",
            max_iterations=1,
        )
        [up] = kinds(events, "ESCALATION")
        assert (up["data"]["failure_type"], up["data"]["suggested_action"]) == (
            "timeout_complete",
            "report_gap",
        )
        assert any("timeout_complete" in g for g in events[-1]["data"]["gaps"])


async def test_iteration_stops_by_its_criteria(research: Research) -> None:
    answered = await research.run(
        query="What is the lithium-ion battery recycling rate?", documents=True
    )
    assert answered[-1]["data"]["stopped_because"] == "all gaps answered"
    capped = await research.run(query=FULL_QUERY, documents=True, max_iterations=1)
    assert capped[-1]["data"]["stopped_because"] == "reached 1 iterations"
    repeated = await research.run(query=FULL_QUERY, documents=True)
    result = repeated[-1]["data"]
    assert result["iterations"] == 2
    assert result["stopped_because"] == "new findings only repeat known claims"
    second = kinds(repeated, "ITERATION")[1]["data"]
    assert second["focus"] == "cost of recovering lithium per tonne"  # refined on the gap
    assert result["gaps"] == ["cost of recovering lithium per tonne"]  # left open, listed


async def test_subagents_get_explicit_context_only(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    from agents.research.agents import DocumentAnalysisAgent

    class Recording(DocumentAnalysisAgent):
        async def handle(self, message: Any, ctx: Any) -> dict[str, Any]:
            seen.append(dict(message.content))
            return await super().handle(message, ctx)

    host = ToolHost(research_tools(docs=DocumentFolder(), output=tmp_path), RESEARCH_POLICY)
    async with LocalMesh(tool_host=host) as local:
        for agent in research_agents():
            await local.add_agent(
                Recording() if agent.agent_id == "document-analysis-agent" else agent
            )
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                await client.collect(
                    client.research(
                        query="What is the lithium-ion battery recycling rate?",
                        documents=True,
                        constraints={"language": "en"},
                    )
                )
        finally:
            await gateway.stop(0.5)
    [content] = seen
    assert set(content) == {"action", "query", "prior_findings", "constraints"}
    assert content["constraints"]["language"] == "en"
    assert content["constraints"]["topics"] == ["recycling_rate"]


async def test_a_large_document_is_searched_in_pages_and_cited_once(tmp_path: Path) -> None:
    """A document of 4 MB with no form feeds (a log, an export) beside the shipped ones: it
    is read in pages of bounded size, so a search takes no longer than in small ones, and
    its claim, said on every line, is one finding (before: the search ran past the tool's
    timeout, and a page's findings made an answer larger than a message may be)."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for shipped in (DATA / "docs").glob("*.txt"):
        (folder / shipped.name).write_text(shipped.read_text())
    line = "The recycling rate of lithium-ion batteries was 40% in this export. " * 10
    (folder / "export.txt").write_text("Tier: blog\n" + (line + "\n") * 6_000)
    docs = DocumentFolder(folder)
    assert len(docs.documents["export"]["pages"]) > 200
    assert max(len(p) for p in docs.documents["export"]["pages"]) <= 16_000
    async for r in research_mesh(tmp_path / "out", docs=docs):
        events = await r.run(
            query="What is the lithium-ion battery recycling rate according to the documents?",
            documents=True,
        )
        assert kinds(events, "PLAN")[0]["data"]["agents"][0] == "document-analysis-agent"
        result = events[-1]["data"]
        assert result["status"] == "COMPLETED" and not result["gaps"]
        [found] = kinds(events, "FINDINGS")
        exported = [f for f in found["data"]["findings"] if f["document_id"] == "export"]
        assert len(exported) == 1 and exported[0]["claim"].startswith("The recycling rate")


HEAT_PUMPS = """Title: Heat pumps in cold climates
Date: 2025-05-01
Tier: article

Air-source heat pumps keep working in cold climates down to -25 C. Their efficiency falls as
the outdoor air gets colder.
Ground-source heat pumps are more efficient in cold climates but cost more to install.
\fMany households in cold climates pair a heat pump with a backup boiler.
The weather was fine in May.
"""


async def test_documents_on_any_topic_are_researched_on_the_querys_own_words(
    tmp_path: Path,
) -> None:
    """A folder of the user's own documents, on a topic the shipped lexicon does not know:
    the query's own words make its topic, the sentences that hold most of them are its
    findings, with their provenance, and the report cites each. General claims are not
    compared with one another (no conflicts), and nothing is left as a gap once found."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "heat-pumps.txt").write_text(HEAT_PUMPS)
    async for r in research_mesh(tmp_path / "out", docs=DocumentFolder(folder)):
        events = await r.run(
            query="What do we know about heat pumps in cold climates?",
            documents=True,
            report_name="heat-pumps",
        )
        [plan] = kinds(events, "PLAN")
        assert plan["data"]["kind"] == "docs"  # ("know" asks for no current data)
        assert plan["data"]["topics"] == ["_query"]
        result = events[-1]["data"]
        assert result["status"] == "COMPLETED"
        found = sorted((f["document_id"], f["page"], f["claim"]) for f in result["findings"])
        assert found == [
            (
                "heat-pumps",
                1,
                "Air-source heat pumps keep working in cold climates down to -25 C.",
            ),
            (
                "heat-pumps",
                1,
                "Ground-source heat pumps are more efficient in cold climates but cost more"
                " to install.",
            ),
            (
                "heat-pumps",
                2,
                "Many households in cold climates pair a heat pump with a backup boiler.",
            ),
        ]
        assert result["conflicts"] == [] and result["gaps"] == []
        assert result["summary"].startswith("What do we know about heat pumps in cold climates: ")
        assert "Air-source heat pumps keep working" in result["summary"]
        body = (r.out / "heat-pumps.md").read_text()
        cited = re.findall(r"^\[ref-\d+\] (.+)$", body, flags=re.MULTILINE)
        assert sorted(cited) == ["heat-pumps:p1", "heat-pumps:p1", "heat-pumps:p2"]
        assert "The weather" not in body

        # A query of no words of its own is still an ambiguous scope, escalated as a gap.
        events = await r.run(query="What about the latest news on that?", documents=True)
        assert {e["data"]["failure_type"] for e in kinds(events, "ESCALATION")} == {
            "ambiguous_scope"
        }

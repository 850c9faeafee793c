"""`agentmesh demo`: every pattern through the gateway over gRPC, as a readable report."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from gateway.client import GatewayClient
from gateway.patterns.research import conflict_summary

Printer = Callable[[str], None]


@dataclass(frozen=True)
class Scenario:
    """One pattern run of the demo (and of the benchmarks' pattern figures)."""

    name: str
    """A short name: the benchmarks report the run as ``pattern.<name>``."""
    title: str
    rpc: str
    """The GatewayService method, e.g. ``Route`` or ``RunConsensus``."""
    request: dict[str, Any]
    expect: str = "COMPLETED"
    """The status its RESULT ends with on the sample agents and their shipped data."""


SCENARIOS: list[Scenario] = [
    Scenario(
        "group_chat",
        "Group chat: stock experts (RF-010 1-5)",
        "Route",
        {"request_type": "stock_recommendation", "query": "What stock should I buy?"},
    ),
    Scenario(
        "handoff",
        "Hand-off workflow: refund approved (RF-010 6-8)",
        "Route",
        {
            "request_type": "refund_request",
            "query": "Process refund for order #12345",
            "parameters": {"order_id": "12345"},
        },
    ),
    Scenario(
        "handoff_rejected",
        "Hand-off workflow: seller rejects, payment skipped (RF-010 9)",
        "Route",
        {
            "request_type": "refund_request",
            "query": "Process refund for order #12346",
            "parameters": {"order_id": "12346"},
        },
    ),
    Scenario(
        "handoff_failed",
        "Hand-off workflow: payment fails (RF-010 10)",
        "Route",
        {
            "request_type": "refund_request",
            "query": "Process refund for order #12347",
            "parameters": {"order_id": "12347"},
        },
        expect="FAILED",
    ),
    Scenario(
        "handoff_parallel",
        "Hand-off workflow: three checks in parallel, merged (RT-011)",
        "RunHandoffWorkflow",
        {
            "task": "Process refund for order #12345",
            "context": {"order_id": "12345"},
            "steps": [
                {"agent_id": "CustomerAgent"},
                {
                    "parallel_agent_ids": ["PolicyAgent", "FraudCheckAgent", "FinanceAgent"],
                    "routes": {"MIXED": "NotificationAgent", "REJECTED": "NotificationAgent"},
                },
                {"agent_id": "PaymentAgent"},
                {"agent_id": "NotificationAgent"},
            ],
        },
    ),
    Scenario(
        "pattern_switch",
        "Pattern switch: hand-off pauses for a group chat (RF-010 17)",
        "Route",
        {
            "request_type": "refund_with_review",
            "query": "Process refund for order #12345",
            "parameters": {"order_id": "12345"},
        },
    ),
    Scenario(
        "collaborative_filtering",
        "Collaborative filtering: weighted scores (RF-010 11-13)",
        "Route",
        {"request_type": "hotel_recommendation", "query": "Hotel in Paris near Eiffel Tower"},
    ),
    Scenario(
        "collaborative_filtering_confidence",
        "Collaborative filtering: confidence-based (RF-010 14)",
        "RunCollaborativeFiltering",
        {
            "agent_ids": ["PriceAgent", "QualityAgent", "LocationAgent", "ReviewsAgent"],
            "weights": {"price": 0.2, "quality": 0.4, "location": 0.3, "reviews": 0.1},
            "query": "Hotel in Paris near Eiffel Tower",
            "method": "confidence",
        },
    ),
    Scenario(
        "consensus",
        "Consensus building: proposal, votes, decision",
        "RunConsensus",
        {"problem": "Should we migrate to microservices?", "wait_for_all_votes": True},
    ),
    Scenario(
        "research",
        "Research: hub and spoke over the web snapshot and local documents",
        "RunResearch",
        {
            "query": "Compare the latest lithium-ion battery recycling rate, the EU collection "
            "target, whether recycling is economically viable and the cost per tonne",
            "documents": True,
            "report_name": "demo-research",
        },
    ),
    Scenario(
        "parallel",
        "Parallel patterns: hotel and flight at once (RF-010 18)",
        "RunParallel",
        {
            "patterns": [
                {"name": "hotel", "route": {"request_type": "hotel_recommendation"}},
                {"name": "flight", "route": {"request_type": "flight_recommendation"}},
            ]
        },
    ),
]


def _result_lines(result: dict[str, Any]) -> list[str]:
    """The few lines of a result a person wants to read."""
    lines = []
    aggregate = result.get("aggregate")
    if isinstance(aggregate, dict):
        lines.append(f"recommendation: {aggregate.get('recommendation')}")
        if aggregate.get("note"):
            lines.append(f"note: {aggregate['note']}")
        if aggregate.get("scores"):
            scores = sorted(aggregate["scores"].items())
            lines.append("scores: " + ", ".join(f"{k} {v:g}" for k, v in scores))
    if "path" in result:
        lines.append(f"status: {result['status']}   path: {' -> '.join(result['path'])}")
        lines.append(
            f"current_step: {result['current_step']}   "
            f"accumulated_context: {json.dumps(result.get('accumulated_context'))}"
        )
        if result.get("error_reason"):
            lines.append(
                f"failed_at_step: {result.get('failed_at_step')} (from 0)   "
                f"error_reason: {result['error_reason']}"
            )
        final = result.get("notification") or result.get("final_result")
        if isinstance(final, dict) and final.get("email"):
            lines.append(f"customer email: {final['email']!r}")
    if "opinions" in result and isinstance(result.get("decision"), dict):
        d = result["decision"]
        lines.append(
            f"recommendation: {d.get('recommendation')} (score {d.get('score')}, "
            f"method {d.get('method')})"
        )
        breakdown = d.get("breakdown") or {}
        cells = [
            f"{k} {v:g}"
            if isinstance(v, int | float)
            else f"{k} {v.get('votes')} votes avg {v.get('avg_confidence'):g}"
            for k, v in sorted(breakdown.items())
        ]
        lines.append("breakdown: " + ", ".join(cells))
        if d.get("tie_break"):
            lines.append(f"tie broken by {d['tie_break']}")
    if "votes" in result and isinstance(result.get("decision"), dict):
        d = result["decision"]
        lines.append(f"proposal: {result['proposal'].get('proposal')}")
        lines.append(
            "votes: " + ", ".join(f"{v['reviewer_id']} {v['vote']}" for v in result["votes"])
        )
        lines.append(
            f"decision: {d.get('decision')} at {d.get('consensus_level')}: {d.get('rationale')}"
        )
    if "report" in result and isinstance(result.get("report"), dict):
        lines.append(
            f"plan: {result['plan'].get('kind')} ({result['plan'].get('reason')}); "
            f"{len(result['findings'])} findings in {result['iterations']} iterations, "
            f"stopped: {result['stopped_because']}"
        )
        for c in result.get("conflicts") or []:
            lines.append(f"conflict on {conflict_summary(c)}")
        for gap in result.get("gaps") or []:
            lines.append(f"open gap: {gap}")
        for path in result["report"].get("files") or []:
            lines.append(f"report: {path}")
    if "results" in result:
        for name, sub in result["results"].items():
            rec = sub.get("recommendation")
            lines.append(f"{name}: {rec} in {result['durations_ms'][name]:.1f} ms")
        lines.append(
            f"total {result['duration_ms']:.1f} ms vs sum of parts "
            f"{result['sum_of_durations_ms']:.1f} ms"
        )
    if result.get("missing"):
        lines.append(f"missing agents: {', '.join(result['missing'])}")
    return lines


async def show(title: str, events: AsyncIterator[dict[str, Any]], out: Printer) -> dict[str, Any]:
    out("")
    out(f"== {title}")
    out(f"   {'ms':>8}  {'event':<16} {'agent':<26} summary")
    started = time.perf_counter()
    last: dict[str, Any] = {}
    async for event in events:
        out(
            f"   {event['elapsed_ms']:8.2f}  {event['kind']:<16} {event['agent_id'] or '-':<26} "
            f"{event['summary']}"
        )
        last = event
    wall_ms = (time.perf_counter() - started) * 1000
    result = last.get("data", {})
    for line in _result_lines(result):
        out(f"   -> {line}")
    out(f"   -> {wall_ms:.1f} ms end to end through the gateway")
    return {"title": title, "status": result.get("status"), "ms": wall_ms}


async def run_demo(gateway: str, out: Printer = print) -> int:
    out(f"agentmesh demo: every pattern through the gateway at {gateway}")
    summary = []
    async with GatewayClient(gateway) as client:
        for scenario in SCENARIOS:
            row = await show(scenario.title, client.run(scenario.rpc, scenario.request), out)
            summary.append({**row, "expect": scenario.expect})
        stats = await client.pattern_stats()
    out("")
    out("== Summary")
    width = max(len("pattern run"), *(len(row["title"]) for row in summary))
    out(f"   {'pattern run':<{width}} {'status':<10} {'ms':>8}")
    for row in summary:
        out(f"   {row['title']:<{width}} {row['status']!s:<10} {row['ms']:8.1f}")
    out("")
    out(
        f"   {'pattern':<26} {'runs':>5} {'completed':>9} {'avg ms':>8} {'completion':>10} "
        f"{'consensus':>9} {'accuracy':>8}"
    )
    for name, s in stats.items():
        if s["runs"]:
            avg_ms = s["duration_avg_seconds"] * 1000
            accuracy = f"{s['accuracy']:8.2f}" if s["rated"] else f"{'-':>8}"  # nobody rated
            # (unanimous runs: a group chat's figure alone)
            consensus = f"{s['consensus_rate']:9.2f}" if name == "GROUP_CHAT" else f"{'-':>9}"
            out(
                f"   {name:<26} {s['runs']:>5} {s['completed']:>9} {avg_ms:8.1f} "
                f"{s['completion_rate']:10.2f} {consensus} {accuracy}"
            )
    for row in summary:  # (other data, --data-dir, may decide otherwise: said, not failed)
        if row["status"] != row["expect"]:
            out(
                f"   note: {row['title']} ended {row['status']}; "
                f"on the shipped sample data it ends {row['expect']}"
            )
    # A run ends COMPLETED or FAILED (a refund the data refuses); anything else went wrong.
    failed = [row for row in summary if row["status"] not in ("COMPLETED", "FAILED")]
    return 1 if failed else 0

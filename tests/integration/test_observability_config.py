"""The Prometheus alert rules and the Grafana dashboard speak of metrics the mesh exports."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import yaml

from gateway.client import GatewayClient
from gateway.embedded import EmbeddedMesh

OBS = Path(__file__).resolve().parents[2] / "deploy" / "base" / "observability"


def metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b(agentmesh_[a-z_]+)", expr))
    return {re.sub(r"_(bucket|count|sum)$", "", n) for n in names}


async def scrape(port: int) -> set[str]:
    url = f"http://127.0.0.1:{port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    names = set()
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name + ("_total" if kind == "counter" else ""))
            names.add(name)
    return names


async def test_rules_and_dashboard_use_exported_metrics(embedded: EmbeddedMesh) -> None:
    async with GatewayClient(embedded.gateway.address) as client:
        await client.collect(client.route("stock_recommendation"))
    assert embedded.broker.metrics_port
    exported = await scrape(embedded.broker.metrics_port)
    rules = yaml.safe_load((OBS / "alerts.yaml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    assert {a["alert"] for a in alerts} == {
        "AgentmeshSendLatencyHigh",
        "AgentmeshReceiveLatencyHigh",
        "AgentmeshRoundtripLatencyHigh",
        "AgentmeshHandoffLatencyHigh",
        "AgentmeshBroadcastLatencyHigh",
        "AgentmeshRoutingLatencyHigh",
        "AgentmeshQueueDepthHigh",
        "AgentmeshDropRateHigh",
        "AgentmeshAgentInstanceLost",
        "AgentmeshPushAgentUnreachable",
        "AgentmeshGatewayRunsRefused",
        "AgentmeshCallsRefused",
        "AgentmeshCertificateExpiresSoon",
    }
    thresholds = {
        a["alert"]: float(found[0])
        for a in alerts
        if (found := re.findall(r">\s*([\d.]+)\s*$", a["expr"].strip()))
    }
    assert thresholds["AgentmeshSendLatencyHigh"] == 0.020
    assert thresholds["AgentmeshRoundtripLatencyHigh"] == 0.100
    assert thresholds["AgentmeshHandoffLatencyHigh"] == 0.500
    assert thresholds["AgentmeshQueueDepthHigh"] == 500
    assert thresholds["AgentmeshDropRateHigh"] == 0.01
    dashboard = json.loads((OBS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set().union(*(metric_names(e) for e in [*exprs, *(a["expr"] for a in alerts)]))
    missing = {n for n in used if n not in exported}
    assert not missing, f"not exported: {missing}"
    assert len(dashboard["panels"]) >= 10

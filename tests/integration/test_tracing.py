"""One trace across processes: client -> gateway -> broker -> agents -> broker -> gateway, with
the time messages waited in queues, exported as JSON lines and read back by `agentmesh trace`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from pathlib import Path

import pytest
from opentelemetry import trace

from gateway.client import GatewayClient
from mesh.logs import JsonFormatter
from mesh.tracing import configure_tracing, load_spans
from tests.integration.test_processes import ROOT, start, stop

pytestmark = pytest.mark.processes
EXPERTS = ["IndustryExpertAgent", "TechnicalAnalysisAgent", "FundamentalAnalysisAgent"]


async def test_a_group_chat_across_processes_is_one_trace(tmp_path: Path) -> None:
    os.environ["AGENTMESH_TRACE_DIR"] = str(tmp_path)
    try:
        broker = await start("broker", "--port", "0", ready=r"listening on (\S+?)[,\s]")
        agents = await start(
            "agent",
            "agents.stocks:stock_experts",
            "--broker",
            broker.address,
            ready=r"FundamentalAnalysisAgent serving on (\S+),",
        )
        gateway = await start(
            "gateway", "--broker", broker.address, "--port", "0", ready=r"listening on (\S+?)[,\s]"
        )
    finally:
        del os.environ["AGENTMESH_TRACE_DIR"]
    provider = configure_tracing("test-client", tmp_path)
    assert provider is not None
    try:
        with trace.get_tracer("test").start_as_current_span("user.asks") as root:
            async with GatewayClient(gateway.address) as client:
                events = await client.collect(
                    client.group_chat(
                        agent_ids=EXPERTS, query="What stock should I buy?", group_id="wf_traced"
                    )
                )
        assert events[-1]["data"]["status"] == "COMPLETED"
    finally:
        for proc in (gateway, agents, broker):
            assert await stop(proc) == 0  # a clean stop flushes each process's spans
        provider.force_flush()
    trace_id = f"{root.get_span_context().trace_id:032x}"
    spans = [s for s in load_spans(tmp_path) if s["trace_id"] == trace_id]
    by_id = {s["span_id"]: s for s in spans}
    services = {s["service"] for s in spans}
    # (the test process names its service after whichever test installed its provider)
    assert {"agentmesh-gateway", "agentmesh-broker", "agentmesh-agent"} <= services

    def parent(span: dict) -> dict:
        return by_id[span["parent_span_id"]]

    [top] = [s for s in spans if s["name"] == "user.asks"]
    [rpc] = [s for s in spans if s["name"] == "gateway.group_chat"]
    [chat] = [s for s in spans if s["name"] == "group_chat"]
    [broadcast] = [s for s in spans if s["name"] == "group_chat.broadcast"]
    [aggregate] = [s for s in spans if s["name"] == "group_chat.aggregate"]
    assert parent(rpc) is top and parent(chat) is rpc
    assert parent(broadcast) is chat and parent(aggregate) is chat
    queued = [s for s in spans if s["name"] == "broker.queue"]
    analyzed = [s for s in spans if s["name"].endswith(".analyze")]
    assert sorted(s["attributes"]["agent"] for s in analyzed) == sorted(EXPERTS)
    for span in analyzed:
        wait = parent(span)
        assert wait["name"] == "broker.queue" and wait["service"] == "agentmesh-broker"
        assert wait["attributes"]["agent"] == span["attributes"]["agent"]
        assert wait["attributes"]["queue_wait_ms"] >= 0
        assert parent(wait) is broadcast
        assert span["service"] == "agentmesh-agent"
        assert span["attributes"]["group_id"] == "wf_traced"
    assert len(queued) == 3

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mesh.cli",
        "trace",
        "wf_traced",
        "--dir",
        str(tmp_path),
        "--png",
        str(tmp_path / "waterfall.png"),
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await process.communicate()
    text = out.decode()
    assert process.returncode == 0, text
    assert text.startswith(f"trace {trace_id}:")
    assert re.search(r"^\* user\.asks\s+\[[^\]]+\]", text, flags=re.M)
    assert re.search(r"^\*\s+gateway\.group_chat\s+\[agentmesh-gateway\]", text, flags=re.M)
    assert re.search(r"broker\.queue\s+\[agentmesh-broker\].*queue_wait_ms=", text)
    assert "* critical path" in text
    png = tmp_path / "waterfall.png"
    if "wrote" in text:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_log_lines_carry_the_trace_id() -> None:
    tracer = trace.get_tracer("test")
    record = logging.LogRecord("mesh.test", logging.INFO, __file__, 1, "hello %s", ("x",), None)
    with tracer.start_as_current_span("work") as span:
        line = json.loads(JsonFormatter().format(record))
    context = span.get_span_context()
    if context.is_valid:  # with an SDK provider installed (as other tests do) ids are real
        assert line["trace_id"] == f"{context.trace_id:032x}"
        assert line["span_id"] == f"{context.span_id:016x}"
    assert line["message"] == "hello x"

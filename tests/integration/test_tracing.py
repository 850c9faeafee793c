"""One trace across processes: client -> gateway -> broker -> agents -> broker -> gateway, with
the time messages waited in queues, exported as JSON lines and read back by `agentmesh trace`;
the broker's calls to push agents' servers as hops of it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.client import GatewayClient
from mesh import AgentContext, LocalMesh, MeshError, Message, agent, connect
from mesh.logs import JsonFormatter
from mesh.push import HANDLE_MESSAGE
from mesh.tracing import configure_tracing, load_spans
from mesh.v1 import message_pb2
from tests.helpers.plain_agent import PlainAgent, echo, start_plain
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
        "mesh",
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


async def test_a_push_to_an_agents_server_is_a_client_span_of_the_trace(
    span_exporter: InMemorySpanExporter,
) -> None:
    """The broker's call to a push agent's server is a hop of the trace: a client span below
    the message's time in the queue, whose context the call carries (in its metadata and in
    the message), so the agent's own work hangs below it."""

    async def refuse(message: message_pb2.Message, context: Any) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such account")

    @agent("QuoteDesk")
    async def quotes(message: Message, ctx: AgentContext) -> dict[str, Any]:
        return {"price": 100}

    span_exporter.clear()
    ledger, refuser = PlainAgent(echo), PlainAgent(refuse)
    servers = [await start_plain(ledger), await start_plain(refuser)]
    try:
        async with LocalMesh() as mesh, mesh.client("Cashier") as client:
            await mesh.add_agent(quotes, delivery_mode="push")
            for agent_id, (_, address) in zip(("LedgerAgent", "Refuser"), servers, strict=True):
                await client.register(agent_id, address=address, delivery_mode="push")
            with trace.get_tracer("test").start_as_current_span("user.asks") as root:
                await client.request("LedgerAgent", {"action": "post", "parameters": {}})
                await client.request("QuoteDesk", {"action": "quote"})
                with pytest.raises(MeshError, match="no such account"):
                    await client.request("Refuser", {"action": "post"})
    finally:
        for server, _ in servers:
            await server.stop(None)
    trace_id = root.get_span_context().trace_id
    spans = [s for s in span_exporter.get_finished_spans() if s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in spans}
    calls = {s.attributes["agent"]: s for s in spans if s.name == HANDLE_MESSAGE}
    assert sorted(calls) == ["LedgerAgent", "QuoteDesk", "Refuser"]
    for agent_id, call in calls.items():
        assert call.kind is SpanKind.CLIENT
        assert call.attributes["rpc.system"] == "grpc"
        assert call.attributes["rpc.service"] == "mesh.v1.AgentService"
        assert call.attributes["rpc.method"] == "HandleMessage"
        assert call.parent is not None
        queued = by_id[call.parent.span_id]
        assert queued.name == "broker.queue" and queued.attributes["agent"] == agent_id
    assert calls["LedgerAgent"].attributes["rpc.grpc.status_code"] == 0
    assert calls["LedgerAgent"].status.status_code is StatusCode.UNSET
    refused = calls["Refuser"]
    assert refused.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert refused.status.status_code is StatusCode.ERROR
    assert refused.status.description == "INVALID_ARGUMENT: no such account"
    # A plain server finds the call's span in the metadata and in the message alike.
    ledger_call = calls["LedgerAgent"].context
    flags = int(ledger_call.trace_flags)
    traceparent = f"00-{ledger_call.trace_id:032x}-{ledger_call.span_id:016x}-{flags:02x}"
    assert [m["traceparent"] for m in ledger.metadata] == [traceparent]
    assert [m.headers["traceparent"] for m in ledger.seen] == [traceparent]
    # The SDK's push agent works below it.
    [handled] = [s for s in spans if s.name == "quote_desk.handle"]
    assert handled.parent is not None
    assert handled.parent.span_id == calls["QuoteDesk"].context.span_id


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """The receiving end of OTLP over gRPC, as an OpenTelemetry Collector serves it: keeps
    each export's spans with the service.name of the process that sent them."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self.arrived = asyncio.Event()

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append((attributes.get("service.name", ""), span))
        self.arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_spans_reach_an_otlp_collector_as_one_trace() -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT, as a deployment beside an OpenTelemetry Collector sets it:
    the broker's and the agent's spans of one request arrive there over OTLP/gRPC, in the
    caller's trace, each under its process's service name (the agent's named by
    OTEL_SERVICE_NAME), the agent's span under the broker's."""
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    broker = agent = None
    try:
        broker = await start("broker", "--port", "0", ready=r"listening on (\S+?)[,\s]", env=env)
        agent = await start(
            "agent",
            "tests.helpers.process_agents:Payment",
            "--broker",
            broker.address,
            ready=r"serving on (\S+)",
            env={**env, "OTEL_SERVICE_NAME": "payments"},
        )
        trace_id, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        async with connect(broker.address, agent_id="Cashier") as client:
            answer = await client.request(
                "PaymentAgent",
                {"action": "process_payment", "parameters": {"amount": 450}},
                headers={"traceparent": f"00-{trace_id}-{caller_span}-01"},
            )
        assert answer.content["status"] == "PAID"
        async with asyncio.timeout(20):  # exported within a tenth of a second, as configured
            while {"agentmesh-broker", "payments"} - {s for s, _ in collector.spans}:
                await collector.arrived.wait()
                collector.arrived.clear()
    finally:
        for proc in (agent, broker):
            if proc is not None:
                assert await stop(proc) == 0
        await server.stop(None)
    ours = [(s, span) for s, span in collector.spans if span.trace_id.hex() == trace_id]
    [(_, queued)] = [(s, x) for s, x in ours if x.name == "broker.queue"]
    [(_, handled)] = [(s, x) for s, x in ours if s == "payments"]  # OTEL_SERVICE_NAME's
    assert {s for s, x in ours if x is queued} == {"agentmesh-broker"}
    assert queued.parent_span_id.hex() == caller_span
    assert handled.parent_span_id == queued.span_id
    assert handled.name == "payment.handle"  # the agent's type, as every agent's span is
    attributes = {a.key: a.value for a in handled.attributes}
    assert attributes["agent"].string_value == "PaymentAgent"
    assert attributes["action"].string_value == "process_payment"

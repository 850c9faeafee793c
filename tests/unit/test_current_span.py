"""current_span: free when nothing is recorded, and the caller's trace context still travels."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace

from mesh import tracing

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def not_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "recording", lambda: False)


def untouched() -> dict[str, str]:
    raise AssertionError("attributes are built only for a recorded span")


@pytest.mark.usefixtures("not_recording")
def test_without_a_recorder_or_a_trace_context_there_is_no_span() -> None:
    with tracing.current_span("request x", attributes=untouched) as span:
        assert span is trace.INVALID_SPAN
        assert tracing.inject({"a": "1"}) == {"a": "1"}


@pytest.mark.usefixtures("not_recording")
def test_without_a_recorder_the_trace_context_of_a_message_travels_on() -> None:
    parent = tracing.extract({"traceparent": PARENT})
    with tracing.current_span("worker.handle", context=parent, attributes=untouched):
        sent = tracing.inject({})
    assert sent["traceparent"].split("-")[1] == PARENT.split("-")[1]  # the same trace
    assert tracing.inject({}) == {}  # and is current no longer


RECORDING = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from mesh import tracing
print(tracing.recording())
if {set_provider}:
    trace.set_tracer_provider(TracerProvider())
    print(tracing.recording())
"""


@pytest.mark.parametrize(
    ("env", "set_provider", "said"),
    [
        ({}, False, ["False"]),
        ({}, True, ["False", "True"]),  # a provider set in code, after the first question
        ({"OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider"}, False, ["True"]),
    ],
)
def test_recording_follows_the_global_provider(
    env: dict[str, str], set_provider: bool, said: list[str]
) -> None:
    """In a fresh interpreter each: the answer changes when a provider is set, in code or by
    OpenTelemetry's environment variable."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", RECORDING.format(set_provider=set_provider)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == said


SAMPLED = """
import asyncio, json
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, DEFAULT_ON, ParentBased
from mesh import Message, tracing
from mesh.config import BrokerConfig
from mesh.core.broker import Broker
from mesh.core.model import AgentInfo

exporter = InMemorySpanExporter()
provider = TracerProvider(sampler={sampler})
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
built = []

def attributes():
    built.append(1)
    return {{"agent": "worker"}}

async def main():
    broker = Broker(BrokerConfig())
    await broker.register(AgentInfo(agent_id="worker"))
    out = {{}}
    for flags in ("00", "01"):
        parent = "{trace_id}-" + flags
        exporter.clear()
        built.clear()
        context = tracing.extract({{"traceparent": parent}})
        with tracing.current_span("worker.handle", context=context, attributes=attributes):
            sent = tracing.inject({{}})["traceparent"]
        await broker.send(Message(
            from_agent="driver", to_agent="worker", content={{"action": "a"}},
            headers={{"traceparent": parent, "tracestate": "vendor=1"}},
        ))
        [delivered] = await broker.receive("worker")
        out[flags] = {{
            "spans": sorted(s.name for s in exporter.get_finished_spans()),
            "attributes_built": len(built),
            "sent": sent,
            "delivered": delivered.headers,
        }}
    print(json.dumps(out))

asyncio.run(main())
"""
TRACE_ID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"


def traced_in_a_fresh_interpreter(sampler: str) -> dict[str, Any]:
    """What current_span and the broker's queue do under a trace context whose parent was
    not sampled ("00") and one whose parent was ("01"), with ``sampler`` in a fresh process
    (a tracer keeps the sampler of the provider it was made from)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", SAMPLED.format(sampler=sampler, trace_id=TRACE_ID)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_an_unsampled_parent_costs_no_span_and_its_context_travels_on_as_it_came() -> None:
    """OpenTelemetry's default sampler follows the parent's decision: under a parent that was
    not sampled no span is started (no attributes built), and what is sent or delivered
    carries the parent's own context, tracestate included."""
    traced = traced_in_a_fresh_interpreter("DEFAULT_ON")
    unsampled = traced["00"]
    assert unsampled["spans"] == []
    assert unsampled["attributes_built"] == 0
    assert unsampled["sent"] == f"{TRACE_ID}-00"
    assert unsampled["delivered"] == {"traceparent": f"{TRACE_ID}-00", "tracestate": "vendor=1"}
    sampled = traced["01"]
    assert sampled["spans"] == ["broker.queue", "worker.handle"]
    assert sampled["attributes_built"] == 1
    assert sampled["delivered"]["tracestate"] == "vendor=1"  # through the broker's span too
    for carried in (sampled["sent"], sampled["delivered"]["traceparent"]):
        _, trace_id, span_id, flags = carried.split("-")
        assert trace_id == TRACE_ID.split("-")[1]  # the same trace,
        assert span_id != TRACE_ID.split("-")[2]  # under this process's span
        assert flags == "01"


@pytest.mark.parametrize(
    "sampler", ["ALWAYS_ON", "ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON)"]
)
def test_a_sampler_that_records_under_unsampled_parents_is_obeyed(sampler: str) -> None:
    unsampled = traced_in_a_fresh_interpreter(sampler)["00"]
    assert unsampled["spans"] == ["broker.queue", "worker.handle"]
    assert unsampled["attributes_built"] == 1
    assert unsampled["sent"].split("-")[1] == TRACE_ID.split("-")[1]


RECORDED = """
import asyncio, json
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from mesh import tracing

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)

def block(error):
    with tracing.current_span("outer", attributes=lambda: {"agent": "worker"}) as outer:
        with tracing.current_span("inner"):
            assert trace.get_current_span().get_span_context().span_id != 0
        assert trace.get_current_span() is outer
        if error:
            raise error

async def cancelled():
    with tracing.current_span("cancelled"):
        await asyncio.sleep(10)

async def main():
    task = asyncio.create_task(cancelled())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

block(None)
try:
    block(ValueError("boom"))
except ValueError as error:
    raised = str(error)
asyncio.run(main())
spans = {}
for span in exporter.get_finished_spans():
    spans.setdefault(span.name, []).append({
        "parent": span.parent.span_id if span.parent else None,
        "id": span.context.span_id,
        "status": span.status.status_code.name,
        "description": span.status.description,
        "events": [event.name for event in span.events],
        "attributes": dict(span.attributes),
    })
print(json.dumps({"spans": spans, "raised": raised,
                  "current_after": trace.get_current_span() is trace.INVALID_SPAN}))
"""


def test_a_recorded_span_is_current_in_its_block_and_ends_with_it_recording_an_error() -> None:
    """What OpenTelemetry's start_as_current_span does: the span is the current one inside
    the block (a span started there is its child), ended when the block ends, and an
    exception leaving the block is recorded on it and sets its status; a cancelled task's
    span just ends. Each block leaves the context as it found it."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", RECORDED], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout)
    spans = result["spans"]
    assert result["raised"] == "boom"
    assert result["current_after"] is True
    assert [s["status"] for s in spans["outer"]] == ["UNSET", "ERROR"]
    assert spans["outer"][1]["description"] == "ValueError: boom"
    assert [s["events"] for s in spans["outer"]] == [[], ["exception"]]
    assert all(s["attributes"] == {"agent": "worker"} for s in spans["outer"])
    assert [s["parent"] for s in spans["inner"]] == [s["id"] for s in spans["outer"]]
    assert [s["parent"] for s in spans["outer"]] == [None, None]
    assert spans["cancelled"] == [
        {
            "parent": None,
            "id": spans["cancelled"][0]["id"],
            "status": "UNSET",
            "description": None,
            "events": [],
            "attributes": {},
        }
    ]


W3C_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"


@pytest.mark.parametrize(
    "headers",
    [
        {"traceparent": f"{W3C_PARENT}-01"},
        {"traceparent": f"{W3C_PARENT}-00"},
        {"traceparent": f"{W3C_PARENT}-03"},
        {"traceparent": f"{W3C_PARENT}-01", "tracestate": "vendor=1,other=x"},
        {"traceparent": f" {W3C_PARENT}-01"},  # leading blank
        {"traceparent": f"{W3C_PARENT}-01-extra"},  # version 00 has four fields
        {"traceparent": "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra"},
        {"traceparent": "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        {"traceparent": "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01"},
        {"traceparent": "00-00000000000000000000000000000000-b7ad6b7169203331-01"},
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"},
        {"traceparent": "00-0af7651916cd43dd-b7ad6b7169203331-01"},
        {"traceparent": ""},
        {"other": "1"},
    ],
)
def test_extract_reads_a_message_s_trace_context_as_the_w3c_propagator_does(
    headers: dict[str, str],
) -> None:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    found = tracing.extract(headers)
    expected = TraceContextTextMapPropagator().extract(headers)
    if "traceparent" not in headers:
        assert found is None
        return
    assert found is not None
    ours = trace.get_current_span(found).get_span_context()
    theirs = trace.get_current_span(expected).get_span_context()
    assert ours == theirs
    assert (ours.is_valid, ours.is_remote, ours.trace_flags, ours.trace_state) == (
        theirs.is_valid,
        theirs.is_remote,
        theirs.trace_flags,
        theirs.trace_state,
    )

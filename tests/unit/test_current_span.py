"""current_span: free when nothing is recorded, and the caller's trace context still travels."""

from __future__ import annotations

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

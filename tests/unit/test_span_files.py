"""Span files: what --trace-dir writes, and how much of it a long run keeps."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from mesh.tracing import JsonlSpanExporter, load_spans

ROOT = Path(__file__).resolve().parents[2]


def write_spans(exporter: JsonlSpanExporter, count: int) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "broker"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    for i in range(count):
        with tracer.start_as_current_span(f"span-{i}"):
            pass
    provider.shutdown()


def test_a_long_run_keeps_the_latest_spans_in_a_bounded_number_of_files(tmp_path: Path) -> None:
    exporter = JsonlSpanExporter(tmp_path / "spans-broker-7.jsonl", max_bytes=4000, keep=3)
    write_spans(exporter, 300)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["spans-broker-7.1.jsonl", "spans-broker-7.2.jsonl", "spans-broker-7.jsonl"]
    longest_line = max(len(line) for p in tmp_path.iterdir() for line in p.open())
    assert all(p.stat().st_size < 4000 + longest_line for p in tmp_path.iterdir())
    names = [s["name"] for s in sorted(load_spans(tmp_path), key=lambda s: s["start_ns"])]
    # The oldest went with the oldest file; what is kept is the latest, in order, unbroken.
    assert 0 < len(names) < 300
    assert names == [f"span-{i}" for i in range(300 - len(names), 300)]


def test_a_process_started_again_appends_to_its_file(tmp_path: Path) -> None:
    path = tmp_path / "spans-broker-7.jsonl"
    write_spans(JsonlSpanExporter(path), 2)
    write_spans(JsonlSpanExporter(path), 1)
    assert [s["name"] for s in load_spans(tmp_path)] == ["span-0", "span-1", "span-0"]


def test_every_attribute_a_span_may_carry_is_written_as_it_was(tmp_path: Path) -> None:
    """Strings (any script), booleans, integers of any size, floats and sequences of them: one
    line each, read back equal, the spans around an unusual one kept too."""
    provider = TracerProvider(resource=Resource.create({"service.name": "broker"}))
    path = tmp_path / "spans-broker-1.jsonl"
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
    tracer = provider.get_tracer("test")
    written = {
        "agent": "Señor-代理",
        "retried": True,
        "attempt": 3,
        "queue_wait_ms": 1.25,
        "huge": 2**70,
        "agents": ("A", "B"),
        "weights": (0.5, 0.25),
    }
    for name, attributes in (("before", {"n": 1}), ("odd", written), ("after", {"n": 2})):
        with tracer.start_as_current_span(name, attributes=attributes):
            pass
    provider.shutdown()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    spans = load_spans(tmp_path)
    assert [s["name"] for s in spans] == ["before", "odd", "after"]
    assert spans[1]["attributes"] == {
        **written,
        "agents": ["A", "B"],
        "weights": [0.5, 0.25],
    }
    assert spans[1]["service"] == "broker"
    assert spans[1]["status"] == "UNSET"


def test_lines_that_are_not_spans_are_skipped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A process killed while it wrote a span leaves the line cut short; other writers may
    leave anything. The spans around such lines are read (before: one such line failed
    `agentmesh trace` and the dashboard's waterfall for every trace of the folder)."""
    path = tmp_path / "spans-broker-7.jsonl"
    write_spans(JsonlSpanExporter(path), 2)
    with path.open("ab") as out:
        out.write(b'{"trace_id": "ab", "span_id": \n')  # cut short by a kill
        out.write(b"\xff\xfe not text\n[1, 2]\n")
        out.write(b'{"trace_id": "ab", "span_id": "cd", "start_ns": "soon"}\n')
    write_spans(JsonlSpanExporter(path), 1)  # the process started again
    with caplog.at_level(logging.WARNING, logger="mesh.tracing"):
        assert [s["name"] for s in load_spans(tmp_path)] == ["span-0", "span-1", "span-0"]
    assert f"skipped 4 lines of {path} that are not spans" in caplog.messages


def test_span_files_of_processes_long_gone_are_deleted_as_tracing_starts(tmp_path: Path) -> None:
    """A mesh restarted every day for weeks leaves a span file (or several) per process: those
    of processes that are gone, last written over 30 days ago, are deleted as a process starts
    tracing to the folder; a running process's, however old, and recent ones stay."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    month_ago = time.time() - 31 * 86_400
    files = {
        "old": f"spans-broker-{gone.pid}.jsonl",
        "old_rotated": f"spans-agent-Planner-{gone.pid}.2.jsonl",
        "recent": f"spans-gateway-{gone.pid + 1_000_000}.jsonl",
        "running": f"spans-broker-{os.getpid()}.jsonl",
        "not_spans": "notes.jsonl",
    }
    for name in files.values():
        (tmp_path / name).write_text("{}\n")
    for key in ("old", "old_rotated", "running", "not_spans"):
        os.utime(tmp_path / files[key], (month_ago, month_ago))
    starts = (
        "import sys; from mesh.tracing import configure_tracing;"
        " configure_tracing('gateway', sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", starts, str(tmp_path)], check=True, cwd=ROOT)
    left = {p.name for p in tmp_path.iterdir()}
    assert left >= {files["recent"], files["running"], files["not_spans"]}
    assert files["old"] not in left and files["old_rotated"] not in left

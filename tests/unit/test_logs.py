"""The processes' JSON log lines: written by a thread of their own, with the logging thread's
span, none lost at stop, dropped and counted when the writer falls behind."""

from __future__ import annotations

import io
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext

from mesh.logs import (
    JsonFormatter,
    LogWriter,
    WrittenAside,
    configure_logging,
    event_log,
    stop_logging,
)

log = logging.getLogger("mesh.test")


@pytest.fixture
def root_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        stop_logging()
        root.handlers[:] = handlers
        root.setLevel(level)


def lines(err: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def test_events_are_written_by_the_writer_thread_with_the_span_they_were_logged_in(
    root_restored: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("WARNING")
    span = NonRecordingSpan(SpanContext(trace_id=0xABC, span_id=0xDEF, is_remote=False))
    with trace.use_span(span):
        log.info("handoff %s -> %s", "A", "B", extra={"event": {"category": "handoff"}})
    log.info("not an event: below the level")
    log.warning("after the span")
    stop_logging()  # writes what is still waiting
    first, second = lines(capsys.readouterr().err)
    assert first["message"] == "handoff A -> B" and first["category"] == "handoff"
    assert (first["trace_id"], first["span_id"]) == (f"{0xABC:032x}", f"{0xDEF:016x}")
    assert second["message"] == "after the span" and "trace_id" not in second


def test_after_stop_records_are_written_at_once(
    root_restored: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("INFO")
    stop_logging()
    log.info("written by the caller", extra={"event": {"category": "registry"}})
    [line] = lines(capsys.readouterr().err)
    assert line["message"] == "written by the caller" and line["category"] == "registry"


def test_a_writer_that_falls_behind_loses_records_and_says_how_many() -> None:
    records: queue.Queue[logging.LogRecord] = queue.Queue(2)
    handler = WrittenAside(records)
    for i in range(5):
        handler.handle(logging.LogRecord("mesh.test", logging.INFO, "", 0, "record %d", (i,), None))
    assert [records.get_nowait().getMessage() for _ in range(2)] == ["record 0", "record 1"]
    handler.handle(logging.LogRecord("mesh.test", logging.INFO, "", 0, "record 5", None, None))
    dropped, kept = records.get_nowait(), records.get_nowait()
    assert dropped.levelno == logging.WARNING
    assert dropped.getMessage() == "3 log records dropped: the log writer fell behind"
    assert kept.getMessage() == "record 5" and records.empty()


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_the_records_of_a_moment_are_written_together_and_none_waits_for_stop() -> None:
    stream = CountingStream()
    target = logging.StreamHandler(stream)
    target.setFormatter(JsonFormatter())
    records: queue.Queue[logging.LogRecord] = queue.Queue(100)
    wake = threading.Event()
    handler = WrittenAside(records, wake)
    for i in range(50):  # queued before the writer runs: one moment's records, for sure
        handler.handle(logging.LogRecord("mesh.test", logging.INFO, "", 0, "burst %d", (i,), None))
    writer = LogWriter(records, wake, target)
    writer.start()
    try:
        deadline = time.monotonic() + 10
        while stream.getvalue().count("\n") < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [json.loads(line)["message"] for line in stream.getvalue().splitlines()] == [
            f"burst {i}" for i in range(50)
        ]
        assert stream.writes == 1  # one write for the burst, not one per record
        handler.handle(logging.LogRecord("mesh.test", logging.INFO, "", 0, "later", None, None))
        while '"later"' not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream.getvalue().splitlines()[-1].endswith('"message":"later"}')  # not at stop
        assert stream.writes == 2
        handler.handle(logging.LogRecord("mesh.test", logging.INFO, "", 0, "last", None, None))
    finally:
        writer.stop()  # writes what is still waiting
    assert stream.getvalue().splitlines()[-1].endswith('"message":"last"}')


def event_record(message: str, level: int = logging.INFO) -> logging.LogRecord:
    record = logging.LogRecord("mesh.test", level, "", 0, message, None, None)
    record.event = {"category": "handoff"}
    return record


def written(*records: logging.LogRecord, to: logging.StreamHandler[Any]) -> None:
    """Through a writer thread, as configure_logging does, until each is written."""
    queued: queue.Queue[logging.LogRecord] = queue.Queue(100)
    wake = threading.Event()
    aside = WrittenAside(queued, wake)
    for record in records:
        aside.handle(record)
    writer = LogWriter(queued, wake, to)
    writer.start()
    writer.stop()


def test_the_event_log_keeps_events_whatever_the_level(
    root_restored: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "logs" / "events.jsonl"
    configure_logging("ERROR", event_log_path=path)
    log.info("handoff A -> B", extra={"event": {"category": "handoff", "to_agent": "B"}})
    log.warning("a warning, not an event")
    log.error("an error, not an event")
    stop_logging()
    [event] = lines(path.read_text())
    assert event["message"] == "handoff A -> B" and event["to_agent"] == "B"
    assert [line["message"] for line in lines(capsys.readouterr().err)] == [
        "an error, not an event"
    ]


def test_the_event_log_starts_a_file_a_day_and_keeps_the_last_days(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    earlier = [
        tmp_path / f"events.jsonl.{date(2020, 1, 1) + timedelta(days=d):%Y-%m-%d}"
        for d in range(35)
    ]
    for old in earlier:  # as the rollovers of 35 earlier days left them
        old.write_text("{}\n")
    handler = event_log(path, days=30)
    try:
        written(event_record("today"), to=handler)
        assert [line["message"] for line in lines(path.read_text())] == ["today"]
        handler.rolloverAt = int(time.time()) - 1  # midnight has passed
        written(event_record("tomorrow"), to=handler)
    finally:
        handler.close()
    assert [line["message"] for line in lines(path.read_text())] == ["tomorrow"]
    kept = sorted(p for p in tmp_path.iterdir() if p.name.startswith("events.jsonl."))
    assert len(kept) == 30  # the 29 most recent earlier days and yesterday's
    assert kept[:-1] == earlier[-29:]
    assert [line["message"] for line in lines(kept[-1].read_text())] == ["today"]


def test_only_events_go_to_the_event_log(tmp_path: Path) -> None:
    handler = event_log(tmp_path / "events.jsonl")
    try:
        plain = logging.LogRecord("mesh.test", logging.WARNING, "", 0, "plain", None, None)
        written(plain, event_record("debug", logging.DEBUG), event_record("kept"), to=handler)
    finally:
        handler.close()
    assert [line["message"] for line in lines((tmp_path / "events.jsonl").read_text())] == ["kept"]
    with pytest.raises(ValueError, match="at least one day"):
        event_log(tmp_path / "other.jsonl", days=0)

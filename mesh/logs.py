"""Structured JSON logs: one object per line, with the event fields a record carries.

A process's records are written by a thread of their own (:class:`WrittenAside`): the event
loop hands a record over and goes on, so it never waits on stderr (a pipe whose reader is slow
would stall every stream of the process) nor spends its turn on formatting. The thread wakes
once for the records of a moment (:data:`LINGER_SECONDS`), not once per record: each wake-up
of a second thread costs the process a hand-over of the interpreter lock."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import logging.handlers
import queue
import sys
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from logging.handlers import TimedRotatingFileHandler
from pathlib import Path
from typing import Any

from opentelemetry import trace

EVENT_ATTR = "event"
SPAN_ATTR = "span_ids"
"""Where a record handed to the writer thread keeps the (trace id, span id) it was logged in."""
QUEUE_SIZE = 10_000
"""Records waiting for the writer thread at most; more are dropped, and counted in a line."""
LINGER_SECONDS = 0.05
"""How long the writer thread, woken by a record, waits for others to write them together."""
EVENT_LOG_DAYS = 30
"""Days of structured events an event log keeps (RF-009: hand-off logs are kept 30 days)."""


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line; ``extra={"event": {...}}`` adds fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        # Handed over by another thread: the ids it captured (or none), not this thread's.
        ids = record.__dict__[SPAN_ATTR] if SPAN_ATTR in record.__dict__ else _span_ids()
        if ids:
            line["trace_id"] = f"{ids[0]:032x}"
            line["span_id"] = f"{ids[1]:016x}"
        event = getattr(record, EVENT_ATTR, None)
        if isinstance(event, dict):
            line.update(event)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, separators=(",", ":"))


class ShownRecords(logging.Filter):
    """The records of ``level`` and above, and, while ``level`` is WARNING or lower, the
    structured events (records with an ``event``: hand-offs, broadcasts, registrations,
    retries, ...) from INFO up: the audit trail RF-009 asks for is written by default."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level:
            return True
        return self.level <= logging.WARNING and is_event(record)


class EventRecords(logging.Filter):
    """The structured events from INFO up, whatever the level of the other outputs: what an
    event log keeps."""

    def filter(self, record: logging.LogRecord) -> bool:
        return is_event(record)


def is_event(record: logging.LogRecord) -> bool:
    """A structured event (``extra={"event": {...}}``) from INFO up."""
    return record.levelno >= logging.INFO and isinstance(getattr(record, EVENT_ATTR, None), dict)


class AnyOf(logging.Filter):
    """The records that at least one of ``filters`` lets through."""

    def __init__(self, *filters: logging.Filter) -> None:
        super().__init__()
        self.any_of = filters

    def filter(self, record: logging.LogRecord) -> bool:
        return any(f.filter(record) for f in self.any_of)


def event_log(path: str | Path, days: int = EVENT_LOG_DAYS) -> TimedRotatingFileHandler:
    """The structured events (hand-offs, broadcasts, registrations, expiries, ...) as JSON
    lines in ``path``, whatever the log level: a new file every day at midnight UTC, the
    earlier ones renamed ``<path>.<YYYY-MM-DD>`` and deleted once ``days`` are kept. One
    process a file: processes sharing one would rename it under each other."""
    if days < 1:
        raise ValueError("an event log keeps at least one day")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handler = TimedRotatingFileHandler(
        path, when="midnight", utc=True, backupCount=days, encoding="utf-8"
    )
    handler.setFormatter(JsonFormatter())
    handler.addFilter(EventRecords())
    return handler


def _span_ids() -> tuple[int, int] | None:
    span = trace.get_current_span().get_span_context()
    return (span.trace_id, span.span_id) if span.is_valid else None


class WrittenAside(logging.handlers.QueueHandler):
    """Hands records over to the writer thread (a :class:`LogWriter`) with what only the
    logging thread knows: the message with its arguments filled in, and the current span's
    ids. When the writer is :data:`QUEUE_SIZE` records behind, records are
    dropped rather than waited for; the next one that fits is preceded by a warning that
    says how many."""

    def __init__(
        self, records: queue.Queue[logging.LogRecord], wake: threading.Event | None = None
    ) -> None:
        super().__init__(records)
        self.dropped = 0
        self.wake = wake
        """Set when a record is queued (the writer thread waits on it)."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg, record.args = record.getMessage(), None
        setattr(record, SPAN_ATTR, _span_ids())
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            if self.dropped:
                self.queue.put_nowait(self._dropped_record(record))
                self.dropped = 0
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
        if self.wake is not None and not self.wake.is_set():
            self.wake.set()

    def _dropped_record(self, record: logging.LogRecord) -> logging.LogRecord:
        return logging.LogRecord(
            record.name,
            logging.WARNING,
            record.pathname,
            record.lineno,
            f"{self.dropped} log records dropped: the log writer fell behind",
            None,
            None,
        )


class LogWriter(threading.Thread):
    """Writes the queued records through each of ``handlers`` (its filters and format), those
    of a moment in one write a handler: woken by the first, it waits :data:`LINGER_SECONDS`
    for company."""

    def __init__(
        self,
        records: queue.Queue[logging.LogRecord],
        wake: threading.Event,
        *handlers: logging.StreamHandler[Any],
    ) -> None:
        super().__init__(name="log-writer", daemon=True)
        self.records = records
        self.wake = wake
        self.handlers = handlers
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            self.wake.wait()
            self._stopping.wait(LINGER_SECONDS)  # (cut short by stop)
            self.wake.clear()  # before the drain: a record queued after it wakes us again
            self._drain()
        self._drain()

    def _drain(self) -> None:
        records = []
        while True:
            try:
                records.append(self.records.get_nowait())
            except queue.Empty:
                break
        for handler in self.handlers:
            _write(handler, records)

    def stop(self) -> None:
        """Writes every record queued so far, then ends the thread."""
        self._stopping.set()
        self.wake.set()
        self.join()


def _write(handler: logging.StreamHandler[Any], records: Sequence[logging.LogRecord]) -> None:
    """The records ``handler`` lets through, in one write (after a file's rollover, when one
    is due)."""
    lines = []
    for record in records:
        if not handler.filter(record):
            continue
        try:
            lines.append(handler.format(record) + handler.terminator)
        except Exception:
            handler.handleError(record)
    if not lines:
        return
    with handler.lock or contextlib.nullcontext():
        try:
            if isinstance(handler, TimedRotatingFileHandler) and handler.shouldRollover(
                records[-1]
            ):
                handler.doRollover()
            handler.stream.write("".join(lines))
            handler.flush()
        except Exception:  # (a closed stderr at exit: nothing to write to)
            pass


_writer: LogWriter | None = None


def configure_logging(
    level: str = "INFO",
    *,
    json_lines: bool = True,
    event_log_path: str | Path | None = None,
    event_log_days: int = EVENT_LOG_DAYS,
) -> None:
    """Sends the mesh's logs to stderr, as JSON lines by default: ``level`` and above, and
    the structured events unless ``level`` is ERROR or CRITICAL; with ``event_log_path``,
    the structured events to that file too, whatever the level, for ``event_log_days`` days
    (:func:`event_log`). A thread of their own writes them (:func:`stop_logging`, also run
    at exit, writes those still waiting)."""
    global _writer
    threshold = logging.getLevelName(level.upper())
    if not isinstance(threshold, int):
        raise ValueError(f"unknown log level {level!r}")
    stop_logging()
    writer = logging.StreamHandler(sys.stderr)
    if json_lines:
        writer.setFormatter(JsonFormatter())
    else:
        writer.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    shown = ShownRecords(threshold)
    writer.addFilter(shown)
    outputs: list[logging.StreamHandler[Any]] = [writer]
    wanted: list[logging.Filter] = [shown]
    if event_log_path is not None:
        outputs.append(event_log(event_log_path, event_log_days))
        wanted.append(EventRecords())
    records: queue.Queue[logging.LogRecord] = queue.Queue(QUEUE_SIZE)
    wake = threading.Event()
    handler = WrittenAside(records, wake)
    handler.addFilter(AnyOf(*wanted))  # (in the logging thread: what no output writes stays)
    _writer = LogWriter(records, wake, *outputs)
    _writer.start()
    atexit.unregister(stop_logging)  # (once, however often logging is configured)
    atexit.register(stop_logging)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    events = threshold <= logging.WARNING or event_log_path is not None
    root.setLevel(min(threshold, logging.INFO) if events else threshold)


def stop_logging() -> None:
    """Writes the records still waiting and stops the writer thread; records logged after
    are written at once, by the thread that logs them."""
    global _writer
    writer, _writer = _writer, None
    if writer is None:
        return
    writer.stop()
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, WrittenAside)]
    root.handlers.extend(writer.handlers)

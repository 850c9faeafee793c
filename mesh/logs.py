"""Structured JSON logs: one object per line, with the event fields a record carries."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

EVENT_ATTR = "event"


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line; ``extra={"event": {...}}`` adds fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            line["trace_id"] = f"{span.trace_id:032x}"
            line["span_id"] = f"{span.span_id:016x}"
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
        return (
            self.level <= logging.WARNING
            and record.levelno >= logging.INFO
            and isinstance(getattr(record, EVENT_ATTR, None), dict)
        )


def configure_logging(level: str = "INFO", *, json_lines: bool = True) -> None:
    """Sends the mesh's logs to stderr, as JSON lines by default: ``level`` and above, and
    the structured events unless ``level`` is ERROR or CRITICAL."""
    threshold = logging.getLevelName(level.upper())
    if not isinstance(threshold, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(ShownRecords(threshold))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(min(threshold, logging.INFO) if threshold <= logging.WARNING else threshold)

"""Tracing across every hop: W3C trace context travels in each message's headers, through the
broker's queues, so one trace covers client -> gateway -> broker -> agent -> broker -> gateway.

Exporters: spans as JSON lines in a folder (the embedded default, no collector needed; one file
per process, read back by `agentmesh trace`), and OTLP when the standard OTEL_EXPORTER_OTLP_*
variables name an endpoint. Without either, tracing costs next to nothing: the API is a no-op.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from contextvars import Token
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased
from opentelemetry.trace import Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger("mesh.tracing")
TRACE_HEADERS = ("traceparent", "tracestate")


_TRACER = trace.get_tracer("agentmesh")


def tracer() -> trace.Tracer:
    """The mesh's tracer: a proxy that follows the provider set later (or stays a no-op), got
    once instead of per message."""
    return _TRACER


_UNSET = object()
_provider_from_env: list[bool] = []
"""Whether OTEL_PYTHON_TRACER_PROVIDER names a provider to load, read on the first question."""


def recording() -> bool:
    """Whether this process records spans (a tracer provider of the SDK is set). Asked for
    every message: the global provider is read directly, since OpenTelemetry's accessor looks
    an environment variable up on each call while no provider is set (here it is looked up
    once). The accessor decides when that variable names a provider to load, or where the
    global is not found (another layout of the API)."""
    provider = getattr(trace, "_TRACER_PROVIDER", _UNSET)
    if provider is None:
        if not _provider_from_env:
            _provider_from_env.append("OTEL_PYTHON_TRACER_PROVIDER" in os.environ)
        if not _provider_from_env[0]:
            return False
    if provider is None or provider is _UNSET:
        provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


_DROPS_UNSAMPLED = "remoteParentNotSampled:AlwaysOffSampler"
_sampler_seen: list[tuple[object, bool]] = []
"""The sampler last asked about, and whether it drops the children of unsampled parents."""


def drops_unsampled_parents() -> bool:
    """Whether this process's sampler drops every span whose remote parent was not sampled:
    a ``ParentBased`` sampler keeping its default for that case (what OpenTelemetry's
    default and every ``OTEL_TRACES_SAMPLER=parentbased_*`` configure). Read once per
    sampler."""
    sampler = getattr(trace.get_tracer_provider(), "sampler", None)
    if not _sampler_seen or _sampler_seen[0][0] is not sampler:
        drops = False
        if isinstance(sampler, ParentBased):
            description: str = sampler.get_description()  # type: ignore[no-untyped-call]
            drops = _DROPS_UNSAMPLED in description
        _sampler_seen[:] = [(sampler, drops)]
    return _sampler_seen[0][1]


def records_under(context: otel_context.Context) -> bool:
    """Whether a span started under a message's trace context would be recorded here. Most
    messages of a mesh that samples 10% of its traces carry an unsampled context: their
    spans would be dropped, so they are not started at all (no sampler call, no ids, no
    attributes), and the message's own context travels on as it came."""
    if not recording():
        return False
    parent = trace.get_current_span(context).get_span_context()
    return parent.trace_flags.sampled or not parent.is_remote or not drops_unsampled_parents()


class _Attached:
    """A message's trace context made current for a ``with`` block, with no span of this
    process's (its span would not be recorded here)."""

    __slots__ = ("_context", "_token")

    def __init__(self, context: otel_context.Context) -> None:
        self._context = context
        self._token: Token[otel_context.Context] | None = None

    def __enter__(self) -> trace.Span:
        self._token = otel_context.attach(self._context)
        return trace.get_current_span(self._context)

    def __exit__(self, *exception: object) -> None:
        if self._token is not None:
            otel_context.detach(self._token)


def current_span(
    name: str,
    *,
    context: otel_context.Context | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    attributes: Callable[[], dict[str, Any]] | None = None,
) -> AbstractContextManager[trace.Span]:
    """``tracer().start_as_current_span`` for the hot paths. When this process records no
    spans and there is no trace context to carry on (``context``), it costs nothing: no span,
    no attributes (built only when a span is), the current context left as it is, so what
    is sent still carries whatever trace context is current. With a trace context whose span
    would not be recorded (no recorder here, or an unsampled parent the sampler follows),
    that context is made current as it is: what is sent carries the same trace on."""
    if context is None:
        if not recording():
            return contextlib.nullcontext(trace.INVALID_SPAN)
    elif not records_under(context):
        return _Attached(context)
    span = tracer().start_span(
        name, context=context, kind=kind, attributes=attributes() if attributes else None
    )
    return _Current(span)


class _Current:
    """What ``start_as_current_span`` does with a started span: it is made current for the
    ``with`` block, an exception leaving the block is recorded on it (and sets its status),
    and it ends with the block. A plain context manager: the SDK's is two generator-based
    ones deep, a sixth of a recorded span's time."""

    __slots__ = ("_token", "span")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self._token: Token[otel_context.Context] | None = None

    def __enter__(self) -> trace.Span:
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._token is not None:
            otel_context.detach(self._token)
        span = self.span
        if isinstance(error, Exception) and span.is_recording():
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()


@functools.lru_cache(maxsize=4096)
def span_name(agent_id: str, operation: str) -> str:
    """ "TechnicalAnalyst" -> "technical_analyst.analyze" (a trailing "Agent" is dropped)."""
    base = agent_id[:-5] if agent_id.endswith("Agent") and len(agent_id) > 5 else agent_id
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).replace("-", "_").lower()
    return f"{snake}.{operation}"


def inject(headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers with the current span's trace context added (when there is one)."""
    return headers_for(trace.get_current_span(), headers or {})


def headers_for(span: trace.Span, headers: Mapping[str, str]) -> dict[str, str]:
    """The headers carrying ``span``'s context (not necessarily the current span's): its
    ``traceparent``, and its ``tracestate`` when it has one (a vendor's entries travel on)."""
    carrier = dict(headers)
    ctx = span.get_span_context()
    if ctx.is_valid:
        # W3C traceparent written directly: the hot path needs no propagator machinery.
        carrier["traceparent"] = (
            f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
        )
        if ctx.trace_state:
            carrier["tracestate"] = ctx.trace_state.to_header()
    return carrier


def without_trace(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k not in TRACE_HEADERS}


_W3C = TraceContextTextMapPropagator()


_TRACEPARENT_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_NO_CONTEXT = otel_context.Context()


def extract(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The trace context a message carries, or None. What nearly every message carries, a
    version-00 ``traceparent`` alone, is read here directly (with 40% fewer instructions
    than the propagator's, in every process a message passes); anything else, a
    ``tracestate`` with it included, is read by OpenTelemetry's W3C propagator."""
    traceparent = headers.get("traceparent")
    if traceparent is None:
        return None
    if "tracestate" not in headers and (found := _TRACEPARENT_00.fullmatch(traceparent)):
        trace_id, span_id = int(found[1], 16), int(found[2], 16)
        if trace_id and span_id:
            parent = trace.SpanContext(
                trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(found[3], 16))
            )
            return trace.set_span_in_context(trace.NonRecordingSpan(parent), _NO_CONTEXT)
    return _W3C.extract(headers)


TRACE_FILE_BYTES = 32 * 1024 * 1024
"""Bytes at most in one span file before the next is started."""
TRACE_FILES_KEPT = 4
"""Span files kept per process (the current one and the last full ones): a mesh left running
under load would otherwise fill its disk with spans, and every reader of the folder reads
them all."""


TRACE_FILE_DAYS = 30
"""Days a span file of a process that is gone is kept after its last write (as long as the
event log keeps its days): restarts over weeks would otherwise pile files up in the folder,
and every reader of the folder reads them all."""
_SPAN_FILE = re.compile(r"spans-.+-(\d+)(?:\.\d+)?\.jsonl")


def prune_span_files(folder: Path, days: float = TRACE_FILE_DAYS) -> list[Path]:
    """Deletes the folder's span files last written over ``days`` ago by processes no longer
    running (a process that runs still, however quiet, keeps its files); returns them."""
    cutoff = datetime.now(UTC).timestamp() - days * 86_400
    pruned = []
    for path in folder.glob("spans-*.jsonl"):
        named = _SPAN_FILE.fullmatch(path.name)
        with contextlib.suppress(OSError):  # (gone meanwhile: another process pruned it)
            if named is None or path.stat().st_mtime >= cutoff or _running(int(named[1])):
                continue
            path.unlink()
            pruned.append(path)
    if pruned:
        logger.info(
            "deleted %d span files of processes gone, last written over %g days ago",
            len(pruned),
            days,
        )
    return pruned


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # (another user's; no pid at all: left be)
        return True
    return True


class JsonlSpanExporter(SpanExporter):
    """Writes each finished span as one JSON object per line (from the exporter's thread),
    to ``spans-<service>-<pid>.jsonl``; past ``max_bytes`` that file becomes ``...-<pid>.1.jsonl``
    (the one before ``.2``, and so on) and a new one starts, ``keep`` files in all."""

    def __init__(
        self, path: Path, *, max_bytes: int = TRACE_FILE_BYTES, keep: int = TRACE_FILES_KEPT
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        self.keep = max(1, keep)
        self._lock = threading.Lock()
        self._file = path.open("ab")
        self._written = self._file.tell()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [_encoded(span_record(span)) for span in spans]
        with self._lock:
            start = 0
            for i, line in enumerate(lines):
                if self._written >= self.max_bytes:
                    self._file.write(b"".join(lines[start:i]))
                    start = i
                    self._rotate()
                self._written += len(line)
            self._file.write(b"".join(lines[start:]))
            self._file.flush()
        return SpanExportResult.SUCCESS

    def _older(self, n: int) -> Path:
        return self.path.with_suffix(f".{n}{self.path.suffix}")

    def _rotate(self) -> None:
        self._file.close()
        self._older(self.keep - 1).unlink(missing_ok=True)
        for n in range(self.keep - 2, 0, -1):
            if self._older(n).exists():
                self._older(n).rename(self._older(n + 1))
        if self.keep > 1:
            self.path.rename(self._older(1))
        self._file = self.path.open("wb")
        self._written = 0

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def _encoded(record: dict[str, Any]) -> bytes:
    """One line of a span file: orjson takes a tenth of the json module's time, in a thread
    that shares the interpreter with the process's event loop; what it cannot write (an
    integer attribute beyond 64 bits) the json module writes."""
    try:
        return orjson.dumps(record, default=str, option=orjson.OPT_APPEND_NEWLINE)
    except orjson.JSONEncodeError:
        return json.dumps(record, default=str).encode() + b"\n"


def span_record(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None
    parent = span.parent
    start, end = span.start_time or 0, span.end_time or 0
    attributes = span.attributes
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "name": span.name,
        "service": _service(span.resource),
        "start_ns": start,
        "end_ns": end,
        "start": datetime.fromtimestamp(start / 1e9, UTC).isoformat(),
        "duration_ms": round((end - start) / 1e6, 3),
        "attributes": {key: attributes[key] for key in attributes} if attributes else {},
        "status": span.status.status_code.name,
    }


_services: list[tuple[Resource, str]] = []


def _service(resource: Resource) -> str:
    """The resource's service name (a process's spans share one resource: read once)."""
    if not _services or _services[0][0] is not resource:
        _services[:] = [(resource, str(resource.attributes.get("service.name", "")))]
    return _services[0][1]


_provider: TracerProvider | None = None


def configure_tracing(
    service: str, trace_dir: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> TracerProvider | None:
    """Installs a tracer provider for this process when a trace folder (flag or
    AGENTMESH_TRACE_DIR) or an OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT) is configured.
    When an SDK provider is installed already, the exporters are added to it."""
    global _provider
    env = os.environ if environ is None else environ
    folder = trace_dir or env.get("AGENTMESH_TRACE_DIR") or None
    otlp = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not folder and not otlp:
        return None
    current = trace.get_tracer_provider()
    provider = (
        current
        if isinstance(current, TracerProvider)
        else TracerProvider(
            resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or service})
        )
    )
    if folder:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", service)
        if Path(folder).is_dir():
            prune_span_files(Path(folder))
        exporter = JsonlSpanExporter(Path(folder) / f"spans-{safe}-{os.getpid()}.jsonl")
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    if otlp:
        # Imported only when asked for: it loads the OTLP protos, which no other path needs.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if provider is not current:
        trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flushes and closes the exporters (call before the process exits)."""
    if _provider is not None:
        _provider.force_flush()


# -- reading traces back ------------------------------------------------------------------------


_SPAN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "trace_id": str,
    "span_id": str,
    "parent_span_id": (str, type(None)),
    "name": str,
    "service": str,
    "start_ns": int,
    "end_ns": int,
    "duration_ms": (int, float),
    "attributes": dict,
    "status": str,
}
"""What a span line of the files holds, as :func:`span_record` writes it."""


def load_spans(folder: str | Path) -> list[dict[str, Any]]:
    """The spans of a folder's span files. A line that is not a span (the last one a process
    killed in the middle of writing it left cut short, or anything else) is skipped, and how
    many were is logged: one such line does not take every trace of the folder with it."""
    spans = []
    for path in sorted(Path(folder).glob("spans-*.jsonl")):
        skipped = 0
        for line in path.read_bytes().splitlines():
            if not line.strip():
                continue
            span = _span_of(line)
            if span is None:
                skipped += 1
            else:
                spans.append(span)
        if skipped:
            logger.warning("skipped %d lines of %s that are not spans", skipped, path)
    return spans


def _span_of(line: bytes) -> dict[str, Any] | None:
    try:
        span = json.loads(line)
    except ValueError:  # (not JSON, or not UTF-8)
        return None
    if not isinstance(span, dict) or not all(
        isinstance(span.get(name), kind) for name, kind in _SPAN_FIELDS.items()
    ):
        return None
    return span


def find_trace(spans: Sequence[dict[str, Any]], wanted: str) -> list[dict[str, Any]]:
    """The spans of the trace(s) a trace id (or its prefix), or a workflow, group or run id
    found in span attributes, names."""
    ids = {s["trace_id"] for s in spans if s["trace_id"].startswith(wanted)}
    if not ids:
        ids = {
            s["trace_id"]
            for s in spans
            if wanted in {str(v) for v in s.get("attributes", {}).values()}
        }
    return sorted((s for s in spans if s["trace_id"] in ids), key=lambda s: s["start_ns"])


def critical_path(spans: Sequence[dict[str, Any]]) -> list[str]:
    """From each root, the child that finishes last, down to a leaf: the chain that sets the
    trace's end time."""
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for s in spans:
        parent = s["parent_span_id"] if s["parent_span_id"] in by_id else None
        children.setdefault(parent, []).append(s)
    path: list[str] = []
    level = children.get(None, [])
    while level:
        last = max(level, key=lambda s: s["end_ns"])
        path.append(last["span_id"])
        level = children.get(last["span_id"], [])
    return path


def render_tree(spans: Sequence[dict[str, Any]]) -> list[str]:
    """The trace as an indented tree with offsets and durations; * marks the critical path."""
    if not spans:
        return []
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for s in spans:
        parent = s["parent_span_id"] if s["parent_span_id"] in by_id else None
        children.setdefault(parent, []).append(s)
    hot = set(critical_path(spans))
    t0 = min(s["start_ns"] for s in spans)
    lines = [
        f"trace {spans[0]['trace_id']}: {len(spans)} spans, "
        f"{(max(s['end_ns'] for s in spans) - t0) / 1e6:.2f} ms"
    ]

    def walk(node: dict[str, Any], depth: int) -> None:
        mark = "*" if node["span_id"] in hot else " "
        attrs = node.get("attributes", {})
        extra = ", ".join(
            f"{k}={attrs[k]}" for k in ("agent", "queue_wait_ms", "step_number") if k in attrs
        )
        lines.append(
            f"{mark} {'  ' * depth}{node['name']}  [{node['service']}]  "
            f"+{(node['start_ns'] - t0) / 1e6:.2f} ms  {node['duration_ms']:.2f} ms"
            + (f"  ({extra})" if extra else "")
        )
        for child in sorted(children.get(node["span_id"], []), key=lambda s: s["start_ns"]):
            walk(child, depth + 1)

    for root in sorted(children.get(None, []), key=lambda s: s["start_ns"]):
        walk(root, 0)
    lines.append("* critical path")
    return lines


def render_waterfall(spans: Sequence[dict[str, Any]], path: Path) -> bool:
    """A waterfall PNG of the trace (matplotlib, from the bench extra); False without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    hot = set(critical_path(spans))
    t0 = min(s["start_ns"] for s in spans)
    ordered = sorted(spans, key=lambda s: s["start_ns"])
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(ordered) + 1.2))
    for i, s in enumerate(ordered):
        ax.barh(
            i,
            max(s["duration_ms"], 0.02),
            left=(s["start_ns"] - t0) / 1e6,
            color="tab:red" if s["span_id"] in hot else "tab:blue",
        )
    ax.set_yticks(range(len(ordered)), [f"{s['name']} [{s['service']}]" for s in ordered])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the trace started (red: critical path)")
    ax.set_title(f"trace {ordered[0]['trace_id'][:16]}...")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

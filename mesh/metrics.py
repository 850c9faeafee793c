"""Broker metrics: counters kept as integers (for GetQueueStats) and in Prometheus form.

Each broker owns its own CollectorRegistry, so several brokers can live in one process (as in
tests) and /metrics shows exactly one broker's figures.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(slots=True)
class Totals:
    sent: int = 0
    delivered: int = 0
    expired: int = 0
    dropped: int = 0
    validation_errors: int = 0
    dead_lettered: int = 0
    redelivered: int = 0
    handoffs: int = 0
    broadcasts: int = 0
    requests: int = 0
    request_timeouts: int = 0
    late_answers: int = 0


class RecentLatencies:
    """The most recent latencies (a bounded window), for percentiles over time."""

    def __init__(self, size: int = 2048) -> None:
        self._window: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._window.append(seconds)

    def percentiles_ms(self) -> tuple[float, float, float]:
        """(p50, p95, p99) in milliseconds; zeros before the first sample."""
        if not self._window:
            return (0.0, 0.0, 0.0)
        ordered = sorted(self._window)
        n = len(ordered)

        def pct(p: float) -> float:
            return ordered[min(n - 1, max(0, round(p / 100 * n + 0.5) - 1))] * 1000

        return (pct(50), pct(95), pct(99))


class BrokerMetrics:
    """The broker's counters, gauges and latency histograms (RT-011 required metrics)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.totals = Totals()
        self.recent_send = RecentLatencies()
        self.recent_roundtrip = RecentLatencies()
        self._sent_by_type: dict[str, Any] = {}
        self._received_by_path: dict[str, Any] = {}
        r = self.registry
        self.messages_sent = Counter(
            "agentmesh_messages_sent",
            "Messages accepted by the broker.",
            ["message_type"],
            registry=r,
        )
        self.messages_received = Counter(
            "agentmesh_messages_received",
            "Messages handed to receivers (receive or subscription delivery).",
            ["path"],
            registry=r,
        )
        self.messages_dropped = Counter(
            "agentmesh_messages_dropped", "Messages refused for capacity.", ["reason"], registry=r
        )
        self.messages_expired = Counter(
            "agentmesh_messages_expired", "Messages whose TTL passed before delivery.", registry=r
        )
        self.validation_errors = Counter(
            "agentmesh_validation_errors", "Messages refused by validation.", registry=r
        )
        self.dead_lettered = Counter(
            "agentmesh_messages_dead_lettered",
            "Messages moved to the dead-letter queue.",
            registry=r,
        )
        self.redelivered = Counter(
            "agentmesh_messages_redelivered", "Redeliveries after nack or lease expiry.", registry=r
        )
        self.handoffs = Counter("agentmesh_handoffs", "HANDOFF messages accepted.", registry=r)
        self.broadcasts = Counter(
            "agentmesh_broadcasts", "Broadcasts sent.", ["selective"], registry=r
        )
        self.requests = Counter(
            "agentmesh_requests", "Request/response calls by outcome.", ["outcome"], registry=r
        )
        self.late_answers = Counter(
            "agentmesh_late_answers",
            "Answers that came after their request or gather had ended (given up, past its"
            " deadline, or answered already): dropped.",
            registry=r,
        )
        self.queue_depth = Gauge(
            "agentmesh_queue_depth", "Messages waiting per agent.", ["agent"], registry=r
        )
        self.messages_held = Gauge(
            "agentmesh_messages_held",
            "Messages held by the broker (waiting and in flight).",
            registry=r,
        )

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.send_latency = histogram(
            "agentmesh_send_latency_seconds", "Time for the broker to accept a message."
        )
        self.receive_latency = histogram(
            "agentmesh_receive_latency_seconds", "Time for the broker to serve a receive."
        )
        self.roundtrip_latency = histogram(
            "agentmesh_roundtrip_latency_seconds", "Request to correlated response, at the broker."
        )
        self.handoff_latency = histogram(
            "agentmesh_handoff_latency_seconds",
            "Hand-off acceptance to delivery to the next agent.",
        )
        self.broadcast_latency = histogram(
            "agentmesh_broadcast_latency_seconds", "Time to fan a broadcast out to every queue."
        )
        self.queue_wait = histogram(
            "agentmesh_queue_wait_seconds", "Time messages waited in a queue before delivery."
        )

    def sent(self, message_type: str, seconds: float) -> None:
        self.totals.sent += 1
        child = self._sent_by_type.get(message_type)
        if child is None:
            child = self._sent_by_type[message_type] = self.messages_sent.labels(message_type)
        child.inc()
        self.send_latency.observe(seconds)
        self.recent_send.add(seconds)

    def delivered(self, path: str, count: int = 1) -> None:
        self.totals.delivered += count
        child = self._received_by_path.get(path)
        if child is None:
            child = self._received_by_path[path] = self.messages_received.labels(path)
        child.inc(count)

    def dropped(self, reason: str, count: int = 1) -> None:
        self.totals.dropped += count
        self.messages_dropped.labels(reason).inc(count)

    def expired(self) -> None:
        self.totals.expired += 1
        self.messages_expired.inc()

    def invalid(self) -> None:
        self.totals.validation_errors += 1
        self.validation_errors.inc()

    def dead_letter(self) -> None:
        self.totals.dead_lettered += 1
        self.dead_lettered.inc()

    def redelivery(self) -> None:
        self.totals.redelivered += 1
        self.redelivered.inc()

    def handoff(self) -> None:
        self.totals.handoffs += 1
        self.handoffs.inc()

    def broadcast(self, selective: bool, seconds: float) -> None:
        self.totals.broadcasts += 1
        self.broadcasts.labels("true" if selective else "false").inc()
        self.broadcast_latency.observe(seconds)

    def late_answer(self) -> None:
        self.totals.late_answers += 1
        self.late_answers.inc()

    def request(self, outcome: str, seconds: float | None = None) -> None:
        self.totals.requests += 1
        if outcome == "timeout":
            self.totals.request_timeouts += 1
        self.requests.labels(outcome).inc()
        if seconds is not None:
            self.roundtrip_latency.observe(seconds)
            self.recent_roundtrip.add(seconds)

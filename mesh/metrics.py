"""Broker metrics: counters kept as integers (for GetQueueStats) and in Prometheus form.

Each broker owns its own CollectorRegistry, so several brokers can live in one process (as in
tests) and /metrics shows exactly one broker's figures.

The counters and histograms a message goes through are updated on the broker's event loop
alone, so they are plain numbers read by the registry when it is scraped
(:class:`LoopCounter`, :class:`LoopHistogram`): prometheus_client's own take a lock per
increment, which came to about a tenth of the broker's work on a batch of sends. The
exposition is the same (``_total``, ``_bucket``/``_sum``/``_count``).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.utils import floatToGoString

logger = logging.getLogger("mesh.metrics")

REFRESH_TIMEOUT = 2.0
"""Seconds a scrape waits for the queue gauges to be read; past it, it shows the last read."""

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
    withdrawn: int = 0


class RecentLatencies:
    """The most recent latencies (a bounded window), for percentiles over time."""

    def __init__(self, size: int = 2048) -> None:
        self._window: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._window.append(seconds)

    def percentiles_ms(self) -> tuple[float, float, float]:
        """(p50, p95, p99) in milliseconds; zeros before the first sample. Safe to call from
        another thread than the one adding (a scrape): the window is copied in one step."""
        ordered = sorted(tuple(self._window))
        if not ordered:
            return (0.0, 0.0, 0.0)
        n = len(ordered)

        def pct(p: float) -> float:
            return ordered[min(n - 1, max(0, round(p / 100 * n + 0.5) - 1))] * 1000

        return (pct(50), pct(95), pct(99))


class LoopCounter:
    """A counter, with or without labels, for one thread's use; scraped through
    :class:`LoopMetrics`."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], LoopCounter.Child] = {}
        self._own = self.Child() if not self.labelnames else None

    class Child:
        __slots__ = ("value",)

        def __init__(self) -> None:
            self.value = 0.0

        def inc(self, amount: float = 1) -> None:
            self.value += amount

    def labels(self, *values: str) -> LoopCounter.Child:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.Child()
        return child

    def remove(self, *values: str) -> None:
        """Drops the series of these label values (what it counted is gone for good)."""
        self._children.pop(values, None)

    def inc(self, amount: float = 1) -> None:
        assert self._own is not None, f"{self.name} has labels"
        self._own.value += amount

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        if self._own is not None:
            family.add_metric((), self._own.value)
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value)
        return family


class LoopHistogram:
    """A histogram for one thread's use; scraped through :class:`LoopMetrics`."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.doc = doc
        self._bounds = tuple(buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def collect(self) -> Metric:
        running, buckets = 0, []
        for bound, count in zip(
            (*map(floatToGoString, self._bounds), "+Inf"), list(self._counts), strict=True
        ):
            running += count
            buckets.append((bound, running))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self._sum)


class LoopMetrics:
    """The registry's view of a set of loop metrics (a custom collector)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._metrics: list[LoopCounter | LoopHistogram] = []
        registry.register(self)

    def add(self, metric: LoopCounter | LoopHistogram) -> None:
        self._metrics.append(metric)

    def counter(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> LoopCounter:
        counter = LoopCounter(name, doc, labelnames)
        self.add(counter)
        return counter

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> LoopHistogram:
        histogram = LoopHistogram(name, doc, buckets)
        self.add(histogram)
        return histogram

    def collect(self) -> Iterator[Metric]:
        for metric in list(self._metrics):
            yield metric.collect()


RT011 = "multi_agent_"
"""The prefix of RT-011's required metrics as Prometheus names them (multi_agent.message.
send_latency_p50 is multi_agent_message_send_latency_p50)."""


def rt011_gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(f"{RT011}{name}", doc, value=value)


def rt011_count(name: str, doc: str, value: float) -> Metric:
    """A count under RT-011's own name: untyped, since a counter's name must end in _total."""
    return UnknownMetricFamily(f"{RT011}{name}", doc, value=value)


RT011_FIGURES = {
    "multi_agent.message.send_latency_p50": "send_latency_p50_ms",
    "multi_agent.message.send_latency_p95": "send_latency_p95_ms",
    "multi_agent.message.send_latency_p99": "send_latency_p99_ms",
    "multi_agent.message.receive_latency_p50": "receive_latency_p50_ms",
    "multi_agent.message.receive_latency_p95": "receive_latency_p95_ms",
    "multi_agent.message.roundtrip_latency_p50": "roundtrip_latency_p50_ms",
    "multi_agent.message.roundtrip_latency_p95": "roundtrip_latency_p95_ms",
    "multi_agent.handoff.latency_p50": "handoff_latency_p50_ms",
    "multi_agent.handoff.latency_p95": "handoff_latency_p95_ms",
    "multi_agent.broadcast.latency_p50": "broadcast_latency_p50_ms",
    "multi_agent.message.dropped_count": "dropped_count",
    "multi_agent.message.expired_count": "expired_count",
    "message_validation_errors": "validation_errors",
    "messages_sent_count": "sent_count",
    "messages_received_count": "delivered_count",
    "handoffs_count": "handoff_count",
    "message_drop_rate": "drop_rate",
}
"""The broker's RT-011 required metrics and RF-009 scenario 20's figures, by name, and the
field of mesh.v1.BrokerTotals (and of :meth:`BrokerMetrics.figures`) that holds each. (Queue
depth, also required, is per agent: the queue gauges.)"""


class QueueGauges:
    """``agentmesh_queue_depth`` (per agent) and ``agentmesh_messages_held``, as the broker
    last read them from its store. A scrape from another thread (the /metrics server) first
    asks the broker's loop to read them (:attr:`refresh`), so what it shows is what the
    queues hold at that moment; nothing is read between scrapes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.depths: dict[str, int] = {}
        self.held = 0
        self.watches = 0
        self.watches_ended: Mapping[str, int] = {}
        self.unreachable: Mapping[str, int] = {}
        """Per agent taking its messages by push, its instances whose server the broker
        cannot reach."""
        self.refresh: Callable[[], Coroutine[Any, Any, None]] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        self._refresh()
        depth = GaugeMetricFamily(
            "agentmesh_queue_depth", "Messages waiting per agent.", labels=["agent"]
        )
        required = GaugeMetricFamily(
            f"{RT011}message_queue_depth",
            "RT-011 multi_agent.message.queue_depth: messages waiting per agent.",
            labels=["agent"],
        )
        for agent_id, waiting in sorted(self.depths.items()):
            depth.add_metric([agent_id], waiting)
            required.add_metric([agent_id], waiting)
        yield depth
        yield required
        yield GaugeMetricFamily(
            "agentmesh_messages_held",
            "Messages held by the broker (waiting and in flight).",
            value=self.held,
        )
        yield GaugeMetricFamily(
            "agentmesh_state_watches",
            "Watches of the shared state open on this broker (WatchState; at most 1000).",
            value=self.watches,
        )
        unreachable = GaugeMetricFamily(
            "agentmesh_push_instances_unreachable",
            "Instances of an agent taking its messages by push whose server the broker cannot"
            " reach (its messages wait for it; gathers leave it out once none can be reached).",
            labels=["agent"],
        )
        for agent_id, count in sorted(self.unreachable.items()):
            unreachable.add_metric([agent_id], count)
        yield unreachable
        ended = CounterMetricFamily(
            "agentmesh_state_watches_ended",
            "Watches the broker ended, by reason: WATCH_BEHIND (the watcher read too slowly),"
            " UNAVAILABLE (changes missed), SHUTTING_DOWN.",
            labels=["reason"],
        )
        for reason, count in sorted(self.watches_ended.items()):
            ended.add_metric([reason], count)
        yield ended

    def _refresh(self) -> None:
        loop, refresh = self.loop, self.refresh
        if loop is None or refresh is None or loop.is_closed() or not loop.is_running():
            return
        try:
            if asyncio.get_running_loop() is loop:
                return  # collected on the loop itself: it cannot wait for itself
        except RuntimeError:
            pass
        future = asyncio.run_coroutine_threadsafe(refresh(), loop)
        try:
            future.result(REFRESH_TIMEOUT)
        except concurrent.futures.TimeoutError:
            future.cancel()
            logger.warning("the queue gauges were not read within %.0f s", REFRESH_TIMEOUT)
        except Exception as error:  # the scrape shows the last values
            logger.warning("the queue gauges could not be read: %s", error)


class BrokerMetrics:
    """The broker's counters, gauges and latency histograms (RT-011 required metrics)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.totals = Totals()
        self.recent_send = RecentLatencies()
        self.recent_receive = RecentLatencies()
        self.recent_roundtrip = RecentLatencies()
        self.recent_handoff = RecentLatencies()
        self.recent_broadcast = RecentLatencies()
        self._sent_by_type: dict[str, LoopCounter.Child] = {}
        self._received_by_path: dict[str, LoopCounter.Child] = {}
        r = self.registry
        loop = LoopMetrics(r)
        self.messages_sent = loop.counter(
            "agentmesh_messages_sent",
            "Messages accepted by the broker.",
            ["message_type"],
        )
        self.messages_received = loop.counter(
            "agentmesh_messages_received",
            "Messages handed to receivers (receive or subscription delivery).",
            ["path"],
        )
        self.messages_dropped = loop.counter(
            "agentmesh_messages_dropped", "Messages refused for capacity.", ["reason"]
        )
        self.messages_expired = loop.counter(
            "agentmesh_messages_expired", "Messages whose TTL passed before delivery."
        )
        self.validation_errors = loop.counter(
            "agentmesh_validation_errors", "Messages refused by validation."
        )
        self.calls_refused = loop.counter(
            "agentmesh_calls_refused",
            "Calls and session frames refused for their credential: UNAUTHENTICATED (none, or"
            " one not valid: a revoked token still in use) or PERMISSION_DENIED (acting as an"
            " agent it may not).",
            ["code"],
        )
        self.dead_lettered = loop.counter(
            "agentmesh_messages_dead_lettered",
            "Messages moved to the dead-letter queue.",
        )
        self.redelivered = loop.counter(
            "agentmesh_messages_redelivered", "Redeliveries after nack or lease expiry."
        )
        self.dead_letters_requeued = loop.counter(
            "agentmesh_dead_letters_requeued",
            "Dead letters put back in their queue (RequeueDeadLetters).",
        )
        self.instances_lost = loop.counter(
            "agentmesh_agent_instances_lost",
            "Agent instances taken off because their subscription ended without them"
            " deregistering (a process killed or out of memory, its connection gone).",
            ["agent"],
        )
        self.agents_forgotten = loop.counter(
            "agentmesh_agents_forgotten",
            "Agents taken off the registry because no instance had served them for"
            " forget_lost_after seconds.",
        )
        self.leases_extended = loop.counter(
            "agentmesh_leases_extended",
            "Leases extended while their handler still worked (ExtendLease).",
        )
        self.deferred = loop.counter(
            "agentmesh_messages_deferred",
            "Deliveries handed back to come again later (a nack's redeliver_after, a"
            " handler's RetryLater).",
        )
        self.cancelled = loop.counter(
            "agentmesh_messages_cancelled",
            "Messages their sender took back before delivery (CancelMessages).",
        )
        self.scheduled = loop.counter(
            "agentmesh_messages_scheduled",
            "Messages accepted to be delivered later (deliver_at ahead of the broker's clock).",
        )
        self.withdrawn = loop.counter(
            "agentmesh_messages_withdrawn",
            "Requests taken out of their agent's queue because their requester gave up"
            " (cancelled, or past its deadline), by where they were: waiting, or in flight"
            " (their subscriber told, when it asked to be).",
            ["state"],
        )
        self.pushes = loop.counter(
            "agentmesh_push_calls",
            "HandleMessage calls the broker made to agents that take their messages by push,"
            " by the status they ended with (OK, UNAVAILABLE, ...).",
            ["code"],
        )
        self.handoffs = loop.counter("agentmesh_handoffs", "HANDOFF messages accepted.")
        self.broadcasts = loop.counter("agentmesh_broadcasts", "Broadcasts sent.", ["selective"])
        self.requests = loop.counter(
            "agentmesh_requests", "Request/response calls by outcome.", ["outcome"]
        )
        self.late_answers = loop.counter(
            "agentmesh_late_answers",
            "Answers that came after their request or gather had ended (given up, past its"
            " deadline, or answered already): dropped.",
        )
        self.queues = QueueGauges(r)

        def histogram(name: str, doc: str) -> LoopHistogram:
            return loop.histogram(name, doc, LATENCY_BUCKETS)

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
        self.gather_latency = histogram(
            "agentmesh_gather_latency_seconds",
            "Gather (scatter-gather): asked to the last answer, or to the deadline.",
        )
        r.register(_RequiredFigures(self))

    def sent(self, message_type: str, seconds: float) -> None:
        self.totals.sent += 1
        child = self._sent_by_type.get(message_type)
        if child is None:
            child = self._sent_by_type[message_type] = self.messages_sent.labels(message_type)
        child.inc()
        self.send_latency.observe(seconds)
        self.recent_send.add(seconds)

    def receive_served(self, seconds: float) -> None:
        self.receive_latency.observe(seconds)
        self.recent_receive.add(seconds)

    def handoff_delivered(self, queued_seconds: float) -> None:
        self.handoff_latency.observe(queued_seconds)
        self.recent_handoff.add(queued_seconds)

    @property
    def drop_rate(self) -> float:
        """Messages refused for capacity (or lost to a failed fan-out) per message offered."""
        offered = self.totals.sent + self.totals.dropped
        return self.totals.dropped / offered if offered else 0.0

    def delivered(self, path: str, count: int = 1) -> None:
        self.totals.delivered += count
        child = self._received_by_path.get(path)
        if child is None:
            child = self._received_by_path[path] = self.messages_received.labels(path)
        child.inc(count)

    def dropped(self, reason: str, count: int = 1) -> None:
        self.totals.dropped += count
        self.messages_dropped.labels(reason).inc(count)

    def agent_gone(self, agent_id: str, *, forgotten: bool = False) -> None:
        """The agent left the registry: its own series go with it (agents that come and go
        under new ids would otherwise grow them without end)."""
        self.instances_lost.remove(agent_id)
        if forgotten:
            self.agents_forgotten.inc()

    def expired(self) -> None:
        self.totals.expired += 1
        self.messages_expired.inc()

    def refused_call(self, code: str) -> None:
        self.calls_refused.labels(code).inc()

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
        self.recent_broadcast.add(seconds)

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

    def withdrew(self, waiting: int, in_flight: int) -> None:
        """Requests withdrawn, their requester gone: so many still waiting, so many leased."""
        self.totals.withdrawn += waiting + in_flight
        self.withdrawn.labels("waiting").inc(waiting)
        self.withdrawn.labels("in_flight").inc(in_flight)

    def figures(self) -> dict[str, float]:
        """Every figure of mesh.v1.BrokerTotals these metrics hold, by its field: the counts
        since the broker started, the latency percentiles in milliseconds over the most
        recent operations (send_latency_p50_ms, ...), and the drop rate."""
        t = self.totals
        out: dict[str, float] = {
            "sent_count": t.sent,
            "delivered_count": t.delivered,
            "expired_count": t.expired,
            "dropped_count": t.dropped,
            "validation_errors": t.validation_errors,
            "dead_lettered_count": t.dead_lettered,
            "redelivered_count": t.redelivered,
            "handoff_count": t.handoffs,
            "broadcast_count": t.broadcasts,
            "withdrawn_count": t.withdrawn,
        }
        for figure, window in (
            ("send", self.recent_send),
            ("receive", self.recent_receive),
            ("roundtrip", self.recent_roundtrip),
            ("handoff", self.recent_handoff),
            ("broadcast", self.recent_broadcast),
        ):
            for pct, value in zip((50, 95, 99), window.percentiles_ms(), strict=True):
                out[f"{figure}_latency_p{pct}_ms"] = value
        out["drop_rate"] = self.drop_rate
        return out

    def gathered(self, seconds: float) -> None:
        """A gather that ended: its time (to the last answer, or to its deadline) is its own
        figure, not a request/response roundtrip."""
        self.requests.labels("gather").inc()
        self.gather_latency.observe(seconds)


class _RequiredFigures:
    """RT-011's required metrics of the broker and RF-009 scenario 20's figures under their
    own names (:data:`RT011_FIGURES`): latencies in milliseconds as RT-011 states its targets,
    over the most recent 2,048 of each. (The histograms above hold the same latencies for
    histogram_quantile; queue depth is yielded with the queue gauges, read at scrape time.)"""

    def __init__(self, metrics: BrokerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        figures = self._metrics.figures()
        for name, field in RT011_FIGURES.items():
            value = figures[field]
            exported = name.removeprefix("multi_agent.").replace(".", "_")  # RT011 + this
            if field.endswith("_ms"):
                yield rt011_gauge(exported, f"{name}: milliseconds, most recent 2,048.", value)
            elif field == "drop_rate":
                yield rt011_gauge(exported, f"{name}: dropped per message offered.", value)
            else:
                yield rt011_count(exported, f"{name}, since the broker started.", value)

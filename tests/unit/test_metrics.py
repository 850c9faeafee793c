"""The broker's loop metrics scrape exactly as prometheus_client's own counters and histograms."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mesh.metrics import LATENCY_BUCKETS, BrokerMetrics, LoopMetrics


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_loop_metrics_expose_what_prometheus_client_would() -> None:
    observations = [0.00005, 0.0001, 0.0003, 0.002, 0.002, 0.7, 3.0, 42.0]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopMetrics(ours)
    histogram = loop.histogram("x_latency_seconds", "Latency.", LATENCY_BUCKETS)
    reference = Histogram("x_latency_seconds", "Latency.", buckets=LATENCY_BUCKETS, registry=theirs)
    for seconds in observations:
        histogram.observe(seconds)
        reference.observe(seconds)
    counter = loop.counter("x_sent", "Sent.", ["kind"])
    plain = loop.counter("x_dropped", "Dropped.")
    reference_counter = Counter("x_sent", "Sent.", ["kind"], registry=theirs)
    reference_plain = Counter("x_dropped", "Dropped.", registry=theirs)
    for kind, amount in [("REQUEST", 1), ("HANDOFF", 2), ("REQUEST", 3)]:
        counter.labels(kind).inc(amount)
        reference_counter.labels(kind).inc(amount)
    plain.inc()
    reference_plain.inc()
    assert samples(ours) == samples(theirs)
    assert samples(ours)[("x_latency_seconds_bucket", (("le", "0.0001"),))] == 2  # le: inclusive
    assert samples(ours)[("x_latency_seconds_count", ())] == len(observations)


def test_the_broker_metrics_count_what_happened() -> None:
    metrics = BrokerMetrics()
    metrics.sent("REQUEST", 0.0004)
    metrics.sent("REQUEST", 0.002)
    metrics.delivered("subscription", 3)
    metrics.request("timeout", 5.0)
    found = samples(metrics.registry)
    assert found[("agentmesh_messages_sent_total", (("message_type", "REQUEST"),))] == 2
    assert found[("agentmesh_messages_received_total", (("path", "subscription"),))] == 3
    assert found[("agentmesh_requests_total", (("outcome", "timeout"),))] == 1
    assert found[("agentmesh_send_latency_seconds_bucket", (("le", "0.0005"),))] == 1
    assert found[("agentmesh_send_latency_seconds_sum", ())] == pytest.approx(0.0024)
    assert found[("agentmesh_roundtrip_latency_seconds_count", ())] == 1
    assert metrics.totals.request_timeouts == 1

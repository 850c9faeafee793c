"""Pattern metrics (RF-010 scenario 20, RT-011): durations, consensus and completion rates,
the users' satisfaction (accuracy), routing and aggregation latency, conflict resolutions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric

from gateway.events import Pattern
from gateway.feedback import Rating
from mesh.core.model import JSON
from mesh.metrics import RecentLatencies, rt011_count, rt011_gauge

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2)


@dataclass(slots=True)
class PatternTally:
    runs: int = 0
    completed: int = 0
    partial: int = 0
    failed: int = 0
    total_seconds: float = 0.0
    unanimous: int = 0
    rated: int = 0
    satisfied: int = 0

    @property
    def duration_avg_seconds(self) -> float:
        return self.total_seconds / self.runs if self.runs else 0.0

    @property
    def completion_rate(self) -> float:
        return self.completed / self.runs if self.runs else 0.0

    @property
    def consensus_rate(self) -> float:
        return self.unanimous / self.runs if self.runs else 0.0

    @property
    def accuracy(self) -> float:
        """The share of rated runs whose outcome satisfied the user (RF-010 scenario 20)."""
        return self.satisfied / self.rated if self.rated else 0.0


class PatternMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.tallies = {p: PatternTally() for p in Pattern}
        self.duration = Histogram(
            "agentmesh_pattern_duration_seconds",
            "Pattern run duration.",
            ["pattern"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.runs = Counter(
            "agentmesh_pattern_runs", "Pattern runs by outcome.", ["pattern", "status"], registry=r
        )
        self.active = Gauge(
            "agentmesh_pattern_runs_active",
            "Pattern runs in progress on this gateway (at most its --max-runs).",
            registry=r,
        )
        self.refusals = Counter(
            "agentmesh_pattern_runs_refused",
            "Pattern runs refused before they started, by reason (TOO_MANY_RUNS).",
            ["pattern", "reason"],
            registry=r,
        )
        self.calls_refused = Counter(
            "agentmesh_gateway_calls_refused",
            "Gateway calls refused for their credential: UNAUTHENTICATED (none, or one not"
            " valid: a revoked token still in use) or PERMISSION_DENIED.",
            ["code"],
            registry=r,
        )
        self.consensus_rate = Gauge(
            "agentmesh_group_chat_consensus_rate",
            "Share of group chats that ended unanimous.",
            registry=r,
        )
        self.completion_rate = Gauge(
            "agentmesh_pattern_completion_rate",
            "Share of runs that completed, per pattern.",
            ["pattern"],
            registry=r,
        )
        self.feedback_count = Counter(
            "agentmesh_pattern_feedback",
            "Users' ratings of finished runs, per pattern (a rating replaced counts again).",
            ["pattern", "satisfied"],
            registry=r,
        )
        self.accuracy = Gauge(
            "agentmesh_pattern_accuracy",
            "Share of rated runs whose outcome satisfied the user, per pattern.",
            ["pattern"],
            registry=r,
        )
        self.routing_latency = Histogram(
            "agentmesh_routing_latency_seconds",
            "Time to route a request to a pattern.",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.aggregation_latency = Histogram(
            "agentmesh_aggregation_latency_seconds",
            "Time to aggregate agents' answers.",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.conflicts = Counter(
            "agentmesh_conflict_resolutions",
            "Disagreements resolved by voting or tie-breaks.",
            registry=r,
        )
        self.conflict_latency = Histogram(
            "agentmesh_conflict_resolution_latency_seconds",
            "Time to resolve a disagreement.",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        # RT-011's required metrics of the orchestration, under their own names.
        self.recent_routing = RecentLatencies()
        self.recent_aggregation = RecentLatencies()
        self.conflicts_resolved = 0
        self.conflict_seconds = 0.0
        r.register(self)

    def observe(self, pattern: Pattern, result: dict[str, JSON], seconds: float) -> None:
        status = str(result.get("status", "FAILED"))
        tally = self.tallies[pattern]
        tally.runs += 1
        tally.total_seconds += seconds
        if status == "COMPLETED":
            tally.completed += 1
        elif status == "PARTIAL":
            tally.partial += 1
        else:
            tally.failed += 1
        self.duration.labels(pattern.value).observe(seconds)
        self.runs.labels(pattern.value, status).inc()
        self.completion_rate.labels(pattern.value).set(tally.completion_rate)
        if pattern is Pattern.GROUP_CHAT:
            if result.get("unanimous"):
                tally.unanimous += 1
            self.consensus_rate.set(tally.consensus_rate)

    def refused_call(self, code: str) -> None:
        self.calls_refused.labels(code).inc()

    def refused(self, pattern: Pattern, reason: str) -> None:
        self.refusals.labels(pattern.value, reason).inc()

    def feedback(self, rating: Rating, satisfied: bool) -> PatternTally:
        """Counts a user's rating of a run (replacing that run's earlier one)."""
        tally = self.tallies[rating.pattern]
        if rating.previous is None:
            tally.rated += 1
        elif rating.previous:
            tally.satisfied -= 1
        tally.satisfied += satisfied
        self.feedback_count.labels(rating.pattern.value, str(satisfied).lower()).inc()
        self.accuracy.labels(rating.pattern.value).set(tally.accuracy)
        return tally

    def routed(self, seconds: float) -> None:
        self.routing_latency.observe(seconds)
        self.recent_routing.add(seconds)

    def aggregation(self, seconds: float, conflict: bool) -> None:
        self.aggregation_latency.observe(seconds)
        self.recent_aggregation.add(seconds)
        if conflict:
            self.conflicts.inc()
            self.conflict_latency.observe(seconds)
            self.conflicts_resolved += 1
            self.conflict_seconds += seconds

    def collect(self) -> Iterator[Metric]:
        """RT-011's required metrics of the orchestration under their own names, in
        milliseconds (percentiles over the most recent 2,048)."""
        yield rt011_gauge(
            "orchestration_routing_latency_p95",
            "RT-011 multi_agent.orchestration.routing_latency_p95: milliseconds.",
            self.recent_routing.percentiles_ms()[1],
        )
        yield rt011_gauge(
            "orchestration_aggregation_latency_p95",
            "RT-011 multi_agent.orchestration.aggregation_latency_p95: milliseconds.",
            self.recent_aggregation.percentiles_ms()[1],
        )
        yield rt011_count(
            "conflict_resolution_count",
            "RT-011 multi_agent.conflict.resolution_count, since the gateway started.",
            self.conflicts_resolved,
        )
        average = self.conflict_seconds / self.conflicts_resolved if self.conflicts_resolved else 0
        yield rt011_gauge(
            "conflict_resolution_latency_avg",
            "RT-011 multi_agent.conflict.resolution_latency_avg: milliseconds.",
            average * 1000,
        )

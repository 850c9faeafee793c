"""Configuration: frozen dataclasses validated on construction, from flags or environment."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

ENV_PREFIX = "AGENTMESH_"


def _from_env(cls: type[Any], environ: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """Reads every field of a config dataclass from PREFIX + FIELD_NAME, converting by type."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = environ.get(prefix + f.name.upper())
        if raw is None or raw == "":
            continue
        kind = str(f.type)
        try:
            if kind.startswith("int"):
                values[f.name] = int(raw)
            elif kind.startswith("float"):
                values[f.name] = float(raw)
            elif kind.startswith("bool"):
                values[f.name] = raw.strip().lower() in {"1", "true", "yes", "on"}
            else:
                values[f.name] = raw
        except ValueError as exc:
            raise ValueError(f"{prefix}{f.name.upper()}: {exc}") from None
    return values


QUEUE_TYPES = ("priority_queue", "fifo")
DELIVERY_GUARANTEES = ("at_least_once", "at_most_once")


DEFAULT_BROKER = "127.0.0.1:50051"
"""Where a broker listens, and its clients and agents look for it, unless told
(AGENTMESH_BROKER for them)."""
MAX_TTL = 86_400
"""The longest ttl a message may ask for by default, in seconds (a day)."""
DEFAULT_LEASE_SECONDS = 30.0
"""How long a delivery stays leased unless acknowledged, by default."""
RETRY_BACKOFF_SECONDS = (0.1, 0.5, 2.0)
"""RT-011 retry_backoff_ms: the waits before the retries of something refused for a moment."""
MAX_RETRY_DELAY = 60.0
"""The longest wait before a retry that a refusal's google.rpc.RetryInfo is heeded for: a
retry waits RT-011's backoff, or the wait the refusal asks for when longer, up to this."""


def retry_backoff(retry: int) -> float:
    """The wait before retry number ``retry`` (from 0): RT-011's backoff, its last repeated."""
    return RETRY_BACKOFF_SECONDS[min(max(retry, 0), len(RETRY_BACKOFF_SECONDS) - 1)]


def retry_wait(backoff: float, asked: float | None) -> float:
    """The wait before a retry: ``backoff``, or the wait the refusal asked for (its RetryInfo)
    when longer, up to MAX_RETRY_DELAY."""
    if asked is None:
        return backoff
    return max(backoff, min(asked, MAX_RETRY_DELAY))


@dataclass(frozen=True, slots=True, kw_only=True)
class BrokerConfig:
    """Limits and defaults of the broker (RT-011 message queue configuration)."""

    max_messages_per_agent: int = 1000
    max_total_messages: int = 10_000
    default_ttl: int = 3600
    max_ttl: int = MAX_TTL
    max_delivery_attempts: int = 4
    """RT-011 max_retries = 3: one delivery plus three redeliveries, then dead-letter."""
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    default_max_in_flight: int = 64
    max_in_flight_limit: int = 10_000
    max_message_bytes: int = 1024 * 1024
    max_context_bytes: int = 256 * 1024
    """Largest hand-off context (as UTF-8 JSON)."""
    max_headers: int = 64
    max_header_bytes: int = 8 * 1024
    max_id_length: int = 256
    max_agents: int = 10_000
    max_pending_requests: int = 10_000
    max_dead_letters: int = 10_000
    max_insights: int = 10_000
    """Insights the shared memory pool holds at most. When it is full, a write takes out the
    insight with a ttl nearest its end; with none that has a ttl, it is refused."""
    max_state_entries: int = 10_000
    """Entries the shared state holds at most. When it is full, a write of a new entry takes
    out the entry with a ttl nearest its end that nobody holds a lock on (a workflow's status
    of a day ago, say); with none, it is refused."""
    max_batch_size: int = 1000
    retry_after_seconds: float = 0.1
    low_priority_share: float = 0.8
    """LOW messages may fill this share of a queue (and of the broker); the rest is kept for
    HIGH and MEDIUM, so a flood of LOW traffic cannot starve them."""
    sweep_interval: float = 0.2
    default_request_timeout: float = 30.0
    store: str = "memory://"
    """Where queues live: memory:// (the embedded default), sqlite:///path/to/queues.db
    (durable: accepted messages survive a crash and restart) or redis://host:6379/0 (shared
    by several broker replicas)."""
    queue_type: str = "priority_queue"
    """RT-011 queue type: priority_queue (HIGH, then MEDIUM, then LOW; within a priority by
    timestamp, then arrival) or fifo (arrival order; priorities still count for capacity). A
    topic is what a broadcast to agent types is."""
    workflow_status_ttl: float = 86_400.0
    """RT-011 hand-off protocol: each hand-off of a workflow records its status (the agent that
    has it now, its step) in the shared state as ``workflow/<workflow_id>``, kept this many
    seconds after the workflow's last hand-off; 0 records none."""
    forget_lost_after: float = 86_400.0
    """An agent no process has served for this many seconds (its last instance died, or its
    connection was lost, and none came back) is taken off the registry, as a deregistration
    would; what waits in its queue stays there until its ttl ends, for an instance that
    registers again. 0 keeps such agents for good. Agents that come and go under new ids (a
    pod's name, a process's) would otherwise fill the registry over weeks."""
    delivery_guarantee: str = "at_least_once"
    """RT-011 delivery guarantee: at_least_once (a delivery not acknowledged is delivered
    again, max_delivery_attempts in all, then dead-lettered) or at_most_once (never delivered
    twice: one not acknowledged goes to the dead-letter queue)."""

    def __post_init__(self) -> None:
        positive = (
            "max_messages_per_agent",
            "max_total_messages",
            "default_ttl",
            "max_ttl",
            "max_delivery_attempts",
            "lease_seconds",
            "default_max_in_flight",
            "max_in_flight_limit",
            "max_message_bytes",
            "max_context_bytes",
            "max_agents",
            "max_pending_requests",
            "max_dead_letters",
            "max_insights",
            "max_state_entries",
            "max_batch_size",
            "sweep_interval",
            "default_request_timeout",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 < self.low_priority_share <= 1:
            raise ValueError("low_priority_share must be within (0, 1]")
        if not 0 <= self.workflow_status_ttl <= 365 * 86_400:
            raise ValueError("workflow_status_ttl must be within 0 and 365 days, in seconds")
        if not 0 <= self.forget_lost_after <= 365 * 86_400:
            raise ValueError("forget_lost_after must be within 0 and 365 days, in seconds")
        if not self.store.startswith(
            ("memory://", "sqlite://", "redis://", "rediss://")
        ) and not self.store.endswith((".db", ".sqlite", ".sqlite3")):
            raise ValueError(
                "store must be memory://, sqlite:///path/to/queues.db or redis://host:port/db"
            )
        if self.default_ttl > self.max_ttl:
            raise ValueError("default_ttl must not exceed max_ttl")
        if self.queue_type not in QUEUE_TYPES:
            hint = " (for a topic, broadcast to agent types)" if self.queue_type == "topic" else ""
            raise ValueError(f"queue_type must be {' or '.join(QUEUE_TYPES)}{hint}")
        if self.delivery_guarantee not in DELIVERY_GUARANTEES:
            hint = (
                " (exactly once is at_least_once with idempotent handlers: a re-sent message id"
                " is accepted once, and a redelivery says its attempt)"
                if self.delivery_guarantee == "exactly_once"
                else ""
            )
            raise ValueError(f"delivery_guarantee must be {' or '.join(DELIVERY_GUARANTEES)}{hint}")

    @property
    def delivery_attempts(self) -> int:
        """Deliveries of a message at most: one when at_most_once."""
        return 1 if self.delivery_guarantee == "at_most_once" else self.max_delivery_attempts

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = ENV_PREFIX) -> Self:
        """Reads AGENTMESH_MAX_MESSAGES_PER_AGENT and friends."""
        return cls(**_from_env(cls, os.environ if environ is None else environ, prefix))

    def evolve(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Where a server listens. Port 0 picks a free port."""

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = -1
    """HTTP port of /metrics: -1 disables it, 0 picks a free port."""
    grace_seconds: float = 5.0
    health_port: int = -1
    """Port of a plaintext grpc.health.v1 server beside it, for probes that cannot speak
    TLS: -1 none, 0 a free port."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be within 0..65535")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be within -1..65535")
        if not -1 <= self.health_port <= 65535:
            raise ValueError("health_port must be within -1..65535")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = ENV_PREFIX) -> Self:
        return cls(**_from_env(cls, os.environ if environ is None else environ, prefix))


@dataclass(frozen=True, slots=True, kw_only=True)
class SecurityConfig:
    """TLS and credentials, for servers and for clients (AGENTMESH_TLS_CERT and friends).

    A server uses TLS when it has ``tls_cert``/``tls_key``, and mutual TLS (client
    certificates required and verified) when it also has ``tls_ca``, unless
    ``tls_client_auth`` is ``"none"`` (a server that is also a client, such as the gateway,
    has ``tls_ca`` to verify its own server); it requires a
    credential on every call when it has a ``credentials_file`` or uses mutual TLS. With none
    of these, it is the insecure embedded default and says so at start-up.
    A client uses TLS when it has ``tls_ca`` (the CA that signed the server's certificate),
    presents ``tls_client_cert``/``tls_client_key`` for mutual TLS, and sends ``token`` (or
    what ``token_file`` holds) as a bearer token on every call.
    """

    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    credentials_file: str = ""
    tls_client_cert: str = ""
    tls_client_key: str = ""
    tls_server_name: str = ""
    """Overrides the name checked in the server's certificate (when dialling by IP)."""
    token: str = field(default="", repr=False)
    token_file: str = ""
    """A file holding the bearer token, read again when it changes (with it, ``token`` is
    not sent)."""
    tls_client_auth: str = "require"
    """Whether a server with ``tls_ca`` requires its callers' certificates (``"require"``)
    or asks for none (``"none"``)."""

    def __post_init__(self) -> None:
        if self.tls_client_auth not in ("require", "none"):
            raise ValueError(
                f"tls_client_auth must be require or none, not {self.tls_client_auth!r}"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise ValueError("tls_client_cert and tls_client_key go together")
        if self.tls_client_cert and not self.tls_ca:
            raise ValueError("a client certificate needs tls_ca to verify the server")

    @property
    def mutual(self) -> bool:
        """Whether a server with this configuration requires client certificates."""
        return bool(self.tls_cert and self.tls_ca and self.tls_client_auth == "require")

    @property
    def secured(self) -> bool:
        """Whether a server with this configuration authenticates its callers."""
        return bool(self.credentials_file or self.mutual)

    def describe(self) -> str:
        """For start-up lines: what protects the server (never a secret)."""
        if not self.tls_cert and not self.secured:
            return "insecure: plaintext, no credentials (localhost development only)"
        parts = []
        if self.tls_cert:
            parts.append("mutual TLS" if self.mutual else "TLS")
        else:
            parts.append("plaintext")
        if self.credentials_file:
            parts.append("credentials required")
        elif self.secured:
            parts.append("client certificates identify callers")
        return ", ".join(parts)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = ENV_PREFIX) -> Self:
        return cls(**_from_env(cls, os.environ if environ is None else environ, prefix))

    def evolve(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)


ENV_PROBLEMS: list[str] = []
"""What is wrong with the AGENTMESH_* settings read as the mesh loads (the command line
refuses to start with any; :func:`check_environment` says them to a program as it starts a
server or opens a channel)."""


def seconds_from_env(name: str, default: float) -> int:
    """Milliseconds (100 at least) from a positive number of seconds in the environment; the
    default, and a problem noted, for anything else."""
    raw = os.environ.get(name, "")
    try:
        seconds = float(raw) if raw else default
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):  # (NaN, an infinity, 0, negative)
        ENV_PROBLEMS.append(f"{name} must be a positive number of seconds, got {raw!r}")
        seconds = default
    return max(100, int(seconds * 1000))


def check_environment() -> None:
    """ValueError naming each AGENTMESH_* setting the mesh could not take."""
    if ENV_PROBLEMS:
        raise ValueError("; ".join(ENV_PROBLEMS))

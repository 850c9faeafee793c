"""Queue stores that count what the broker asks of them, the URL of each kind of store a
broker process may be started on, and two broker replicas sharing a store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mesh import connect
from mesh.client import NO_RETRY, MeshClient
from mesh.config import BrokerConfig
from mesh.core.broker import Broker
from mesh.core.queue import InMemoryQueueStore
from mesh.server import serve_broker

BROKER_STORES = ["memory", "sqlite", "redis", "redis-cluster"]


def store_url(kind: str, request: pytest.FixtureRequest, folder: Path) -> str:
    """The ``--store`` of a broker on a store of ``kind`` (one of BROKER_STORES): SQLite in
    ``folder``, Redis and the Redis Cluster the session's, emptied for the test."""
    if kind == "memory":
        return "memory://"
    if kind == "sqlite":
        return f"sqlite:///{folder / 'mesh.db'}"
    return str(request.getfixturevalue("redis_url" if kind == "redis" else "redis_cluster_url"))


class CountingLeases:
    """Mixed in before a queue store: counts the operations that lease (each a round trip on
    a shared store)."""

    leases = 0

    async def lease_many(self, *args: Any, **kwargs: Any) -> Any:
        self.leases += 1
        return await super().lease_many(*args, **kwargs)  # type: ignore[misc]


class CountingStore(CountingLeases, InMemoryQueueStore):
    """The in-memory store, counting its leases."""


@dataclass(frozen=True, slots=True)
class TwoReplicas:
    """Two brokers in this process sharing one store, and a client on each."""

    broker_a: Broker
    broker_b: Broker
    via_a: MeshClient
    via_b: MeshClient


@asynccontextmanager
async def two_replicas(url: str, *, grace: float = 0) -> AsyncIterator[TwoReplicas]:
    """Brokers A and B on the store at ``url`` (Redis, or a Redis Cluster), and a client on
    each ("alice" on A, "bob" on B, neither retrying); both stopped after (within ``grace``)."""
    config = BrokerConfig(store=url)
    broker_a, server_a = await serve_broker(broker_config=config)
    try:
        broker_b, server_b = await serve_broker(broker_config=config)
        try:
            async with (
                connect(server_a.address, agent_id="alice", retry=NO_RETRY) as via_a,
                connect(server_b.address, agent_id="bob", retry=NO_RETRY) as via_b,
            ):
                yield TwoReplicas(broker_a, broker_b, via_a, via_b)
        finally:
            await server_b.stop(grace)
    finally:
        await server_a.stop(grace)

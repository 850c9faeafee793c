"""Queue stores that count what the broker asks of them, and the URL of each kind of store a
broker process may be started on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mesh.core.queue import InMemoryQueueStore

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

"""Queue stores that count what the broker asks of them."""

from __future__ import annotations

from typing import Any

from mesh.core.queue import InMemoryQueueStore


class CountingLeases:
    """Mixed in before a queue store: counts the operations that lease (each a round trip on
    a shared store)."""

    leases = 0

    async def lease_many(self, *args: Any, **kwargs: Any) -> Any:
        self.leases += 1
        return await super().lease_many(*args, **kwargs)  # type: ignore[misc]


class CountingStore(CountingLeases, InMemoryQueueStore):
    """The in-memory store, counting its leases."""

"""The shared memory pool: insights written by agents, read by tags, segment and importance,
kept until deleted or until their ttl ends."""

from __future__ import annotations

import heapq
import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

from mesh.core.errors import FieldViolation, LimitExceededError, MessageValidationError
from mesh.core.model import JSON, utc_now

DEFAULT_READ_LIMIT = 100


@dataclass(frozen=True, slots=True, kw_only=True)
class Insight:
    agent_id: str
    content: JSON
    tags: tuple[str, ...] = ()
    importance: float = 0.5
    segment: str = "default"
    metadata: dict[str, JSON] = field(default_factory=dict)
    insight_id: str = ""
    created_at: datetime | None = None
    ttl: float = 0.0
    """Seconds the pool keeps it; 0: until it is deleted."""
    expires_at: datetime | None = None
    """When it leaves the pool (from ttl, as it is written)."""


@dataclass(frozen=True, slots=True)
class MemoryStats:
    total_insights: int
    agents_involved: int
    tag_distribution: dict[str, int]
    segment_distribution: dict[str, int]
    capacity: int


def pool_full(capacity: int) -> LimitExceededError:
    """The refusal of a write to a pool that holds its limit (the same from every pool)."""
    return LimitExceededError(f"the shared memory pool holds its limit of {capacity} insights")


def as_stored(insight: Insight, seq: int, now: datetime | None = None) -> Insight:
    """An insight as a pool keeps it: its id from ``seq``, its time (``now``), its tags once
    each, and when it leaves (from its ttl)."""
    created = now or utc_now()
    return Insight(
        agent_id=insight.agent_id,
        content=insight.content,
        tags=tuple(dict.fromkeys(insight.tags)),
        importance=insight.importance,
        segment=insight.segment or "default",
        metadata=dict(insight.metadata),
        insight_id=f"insight_{seq}",
        created_at=created,
        ttl=insight.ttl,
        expires_at=created + timedelta(seconds=insight.ttl) if insight.ttl > 0 else None,
    )


def nothing_named() -> MessageValidationError:
    """The refusal of a delete that names no insight (it would empty the pool)."""
    return MessageValidationError.from_violations(
        [
            FieldViolation(
                "insight_ids",
                "name the insights to delete: insight_ids, tags, segment or agent_id",
            )
        ]
    )


class MemoryPool(Protocol):
    """What the Memory service needs of a pool: this module's, or one in Redis."""

    async def write(self, insight: Insight) -> Insight: ...

    async def read(
        self,
        *,
        tags: Iterable[str] = (),
        segment: str = "",
        min_importance: float = 0.0,
        limit: int = 0,
        agent_id: str = "",
    ) -> list[Insight]: ...

    async def stats(self) -> MemoryStats: ...

    async def delete(
        self,
        *,
        insight_ids: Iterable[str] = (),
        tags: Iterable[str] = (),
        segment: str = "",
        agent_id: str = "",
    ) -> int: ...


class SharedMemoryPool:
    """Bounded: writes over ``capacity`` are refused (RESOURCE_EXHAUSTED), and each insight's
    content is limited to ``max_content_bytes`` of JSON."""

    def __init__(
        self,
        *,
        capacity: int = 10_000,
        max_content_bytes: int = 64 * 1024,
        max_tags: int = 32,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.capacity = capacity
        self.max_content_bytes = max_content_bytes
        self.max_tags = max_tags
        self._clock = clock
        """Seconds since the epoch (tests drive time with it); the wall clock by default."""
        self._insights: dict[str, Insight] = {}
        """By id, in the order written."""
        self._expiry: list[tuple[float, str]] = []
        """(when it leaves, id) of the insights with a ttl; a deleted one stays until then."""
        self._ids = itertools.count(1)

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self._clock(), UTC) if self._clock else utc_now()

    def _purge(self, now: datetime) -> None:
        """Removes the insights whose ttl has ended."""
        moment = now.timestamp()
        while self._expiry and self._expiry[0][0] <= moment:
            self._insights.pop(heapq.heappop(self._expiry)[1], None)

    def check(self, insight: Insight) -> None:
        """An insight's validation (a store in Redis shares it)."""
        problems = []
        if not insight.agent_id:
            problems.append(FieldViolation("insight.agent_id", "agent_id is required"))
        if insight.content is None:
            problems.append(FieldViolation("insight.content", "content is required"))
        elif len(json.dumps(insight.content, default=str).encode()) > self.max_content_bytes:
            problems.append(
                FieldViolation(
                    "insight.content", f"content must be at most {self.max_content_bytes} bytes"
                )
            )
        if not 0.0 <= insight.importance <= 1.0:
            problems.append(
                FieldViolation("insight.importance", "importance must be within 0 and 1")
            )
        if len(insight.tags) > self.max_tags or any(not t for t in insight.tags):
            problems.append(
                FieldViolation("insight.tags", f"at most {self.max_tags} tags, none of them empty")
            )
        if not (insight.ttl >= 0 and math.isfinite(insight.ttl)):
            problems.append(FieldViolation("insight.ttl", "ttl must not be negative"))
        if problems:
            raise MessageValidationError.from_violations(problems)

    async def write(self, insight: Insight) -> Insight:
        self.check(insight)
        now = self._now()
        self._purge(now)
        if len(self._insights) >= self.capacity:
            raise pool_full(self.capacity)
        stored = as_stored(insight, next(self._ids), now)
        self._insights[stored.insight_id] = stored
        if stored.expires_at is not None:
            if len(self._expiry) > 2 * len(self._insights) + 1024:  # deleted ones pile up
                self._expiry = [e for e in self._expiry if e[1] in self._insights]
                heapq.heapify(self._expiry)
            heapq.heappush(self._expiry, (stored.expires_at.timestamp(), stored.insight_id))
        return stored

    async def read(
        self,
        *,
        tags: Iterable[str] = (),
        segment: str = "",
        min_importance: float = 0.0,
        limit: int = 0,
        agent_id: str = "",
    ) -> list[Insight]:
        self._purge(self._now())
        found = self._matching(tags=tags, segment=segment, agent_id=agent_id)
        found = [i for i in found if i.importance >= min_importance]
        # Most important first, then newest first (the pool keeps them in time order).
        order = {id(i): n for n, i in enumerate(found)}
        found.sort(key=lambda i: (-i.importance, -order[id(i)]))
        return found[: limit if limit > 0 else DEFAULT_READ_LIMIT]

    def _matching(
        self,
        *,
        insight_ids: Iterable[str] = (),
        tags: Iterable[str] = (),
        segment: str = "",
        agent_id: str = "",
    ) -> list[Insight]:
        ids = set(insight_ids)
        wanted = set(tags)
        return [
            i
            for i in self._insights.values()
            if (not ids or i.insight_id in ids)
            and wanted.issubset(i.tags)
            and (not segment or i.segment == segment)
            and (not agent_id or i.agent_id == agent_id)
        ]

    async def delete(
        self,
        *,
        insight_ids: Iterable[str] = (),
        tags: Iterable[str] = (),
        segment: str = "",
        agent_id: str = "",
    ) -> int:
        """Removes the insights matching every filter given (at least one); how many."""
        insight_ids, tags = list(insight_ids), list(tags)
        if not (insight_ids or tags or segment or agent_id):
            raise nothing_named()
        self._purge(self._now())
        found = self._matching(
            insight_ids=insight_ids, tags=tags, segment=segment, agent_id=agent_id
        )
        for insight in found:
            del self._insights[insight.insight_id]
        return len(found)

    async def stats(self) -> MemoryStats:
        self._purge(self._now())
        insights = self._insights.values()
        tags: Counter[str] = Counter()
        for insight in insights:
            tags.update(insight.tags)
        return MemoryStats(
            total_insights=len(insights),
            agents_involved=len({i.agent_id for i in insights}),
            tag_distribution=dict(tags),
            segment_distribution=dict(Counter(i.segment for i in insights)),
            capacity=self.capacity,
        )

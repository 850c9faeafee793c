"""The shared memory pool: insights written by agents, read by tags, segment and importance."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
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


def as_stored(insight: Insight, seq: int) -> Insight:
    """An insight as a pool keeps it: its id from ``seq``, its time, its tags once each."""
    return Insight(
        agent_id=insight.agent_id,
        content=insight.content,
        tags=tuple(dict.fromkeys(insight.tags)),
        importance=insight.importance,
        segment=insight.segment or "default",
        metadata=dict(insight.metadata),
        insight_id=f"insight_{seq}",
        created_at=utc_now(),
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


class SharedMemoryPool:
    """Bounded: writes over ``capacity`` are refused (RESOURCE_EXHAUSTED), and each insight's
    content is limited to ``max_content_bytes`` of JSON."""

    def __init__(
        self, *, capacity: int = 10_000, max_content_bytes: int = 64 * 1024, max_tags: int = 32
    ) -> None:
        self.capacity = capacity
        self.max_content_bytes = max_content_bytes
        self.max_tags = max_tags
        self._insights: list[Insight] = []
        self._ids = itertools.count(1)

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
        if problems:
            raise MessageValidationError.from_violations(problems)

    async def write(self, insight: Insight) -> Insight:
        self.check(insight)
        if len(self._insights) >= self.capacity:
            raise pool_full(self.capacity)
        stored = as_stored(insight, next(self._ids))
        self._insights.append(stored)
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
        wanted = set(tags)
        found = [
            i
            for i in self._insights
            if wanted.issubset(i.tags)
            and (not segment or i.segment == segment)
            and i.importance >= min_importance
            and (not agent_id or i.agent_id == agent_id)
        ]
        # Most important first, then newest first (the pool appends in time order).
        order = {id(i): n for n, i in enumerate(found)}
        found.sort(key=lambda i: (-i.importance, -order[id(i)]))
        return found[: limit if limit > 0 else DEFAULT_READ_LIMIT]

    async def stats(self) -> MemoryStats:
        tags: Counter[str] = Counter()
        for insight in self._insights:
            tags.update(insight.tags)
        return MemoryStats(
            total_insights=len(self._insights),
            agents_involved=len({i.agent_id for i in self._insights}),
            tag_distribution=dict(tags),
            segment_distribution=dict(Counter(i.segment for i in self._insights)),
            capacity=self.capacity,
        )

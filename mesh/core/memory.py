"""The shared memory pool: insights written by agents, read by tags, segment and importance,
kept until deleted or until their ttl ends."""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import math
import operator
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from mesh.core.errors import FieldViolation, LimitExceededError, MessageValidationError
from mesh.core.logthrottle import LogThrottle
from mesh.core.model import JSON, utc_now

DEFAULT_READ_LIMIT = 100
_IMPORTANCE = operator.attrgetter("importance")


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


logger = logging.getLogger("mesh.memory")


def insight_evicted(throttle: LogThrottle, key: str, writer: str, capacity: int) -> None:
    """Says (once a minute, counting the rest) that a full pool took an insight out to make
    room for a write."""
    throttle.warning(
        logger,
        "pool",
        "the shared memory pool is full (%d insights): %s, the one with a ttl nearest its"
        " end, was taken out for a write by %s",
        capacity,
        key,
        writer,
        event={"category": "memory_pool", "evicted": key, "capacity": capacity},
    )


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


def insight_number(insight_id: str) -> int:
    """The number in an id :func:`as_stored` gave (0 for another id)."""
    number = insight_id.removeprefix("insight_")
    return int(number) if number.isascii() and number.isdigit() else 0


def insight_record(insight: Insight) -> dict[str, JSON]:
    """An insight as JSON, as a pool that keeps it outside the process writes it."""
    return {
        "insight_id": insight.insight_id,
        "agent_id": insight.agent_id,
        "content": insight.content,
        "tags": list(insight.tags),
        "importance": insight.importance,
        "segment": insight.segment,
        "metadata": insight.metadata,
        "created_at": insight.created_at.isoformat() if insight.created_at else "",
        "ttl": insight.ttl,
        "expires_at": insight.expires_at.isoformat() if insight.expires_at else "",
    }


def insight_from_record(record: dict[str, Any]) -> Insight:
    """The insight :func:`insight_record` wrote."""
    created = record.get("created_at")
    expires = record.get("expires_at")
    return Insight(
        agent_id=record["agent_id"],
        content=record["content"],
        tags=tuple(record["tags"]),
        importance=float(record["importance"]),
        segment=record["segment"],
        metadata=record.get("metadata") or {},
        insight_id=record["insight_id"],
        created_at=datetime.fromisoformat(created) if created else None,
        ttl=float(record.get("ttl") or 0.0),
        expires_at=datetime.fromisoformat(expires) if expires else None,
    )


class PoolJournal(Protocol):
    """Where a pool that outlives its process records its changes (the SQLite store)."""

    def insight_written(self, insight: Insight) -> None: ...

    def insights_gone(self, insight_ids: list[str]) -> None: ...

    async def sync(self) -> None:
        """Returns once what was recorded is on disk."""
        ...


def check_insight_read(min_importance: float, limit: int) -> None:
    """Refuses a read whose filter is not a number (NaN matches no insight, and a pool in
    Redis would read it as no filter at all) or whose limit is negative; every pool asks."""
    problems = []
    if math.isnan(min_importance):
        problems.append(FieldViolation("min_importance", "min_importance must be a number"))
    if limit < 0:
        problems.append(FieldViolation("limit", "limit must not be negative (0 reads the default)"))
    if problems:
        raise MessageValidationError.from_violations(problems)


def check_insight_delete(
    insight_ids: list[str], tags: list[str], segment: str, agent_id: str
) -> None:
    """Refuses a delete that names no insight (it would empty the pool); every pool asks."""
    if not (insight_ids or tags or segment or agent_id):
        raise MessageValidationError.from_violations(
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
    """Bounded: a write to a full pool takes out the insight with a ttl nearest its end, or is
    refused (RESOURCE_EXHAUSTED) when none has a ttl; each insight's
    content and metadata are limited to ``max_content_bytes`` of JSON each, its writer's id,
    tags and segment to ``max_name_length`` characters. Indexed by tag and segment, with
    its statistics kept as insights come and go: a read goes through the insights of its
    rarest tag (or segment), not the whole pool, and the statistics cost no pass at all."""

    def __init__(
        self,
        *,
        capacity: int = 10_000,
        max_content_bytes: int = 64 * 1024,
        max_tags: int = 32,
        max_name_length: int = 256,
        clock: Callable[[], float] | None = None,
        journal: PoolJournal | None = None,
        restored: Iterable[Insight] = (),
    ) -> None:
        """``journal``: where the changes go to outlive the process; ``restored``: the
        insights it kept (oldest first), the pool's to start with."""
        self.capacity = capacity
        self.max_content_bytes = max_content_bytes
        self.max_tags = max_tags
        self.max_name_length = max_name_length
        """Characters of a writer's id, a tag or a segment at most."""
        self._clock = clock
        """Seconds since the epoch (tests drive time with it); the wall clock by default."""
        self._insights: dict[str, Insight] = {}
        """By id, in the order written."""
        self._by_tag: dict[str, dict[str, Insight]] = {}
        self._by_segment: dict[str, dict[str, Insight]] = {}
        self._writers: Counter[str] = Counter()
        self._expiry: list[tuple[float, str]] = []
        """(when it leaves, id) of the insights with a ttl; a deleted one stays until then."""
        self._journal = journal
        self._evictions = LogThrottle(60.0)
        last = 0
        for insight in restored:
            self._add(insight)
            if insight.expires_at is not None:
                heapq.heappush(self._expiry, (insight.expires_at.timestamp(), insight.insight_id))
            last = max(last, insight_number(insight.insight_id))
        self._ids = itertools.count(last + 1)

    def _add(self, insight: Insight) -> None:
        key = insight.insight_id
        self._insights[key] = insight
        for tag in insight.tags:
            self._by_tag.setdefault(tag, {})[key] = insight
        self._by_segment.setdefault(insight.segment, {})[key] = insight
        self._writers[insight.agent_id] += 1

    def _remove(self, key: str) -> None:
        insight = self._insights.pop(key, None)
        if insight is None:
            return
        for tag in insight.tags:
            _discard(self._by_tag, tag, key)
        _discard(self._by_segment, insight.segment, key)
        self._writers[insight.agent_id] -= 1
        if not self._writers[insight.agent_id]:
            del self._writers[insight.agent_id]

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self._clock(), UTC) if self._clock else utc_now()

    def _purge(self, now: datetime) -> None:
        """Removes the insights whose ttl has ended."""
        moment = now.timestamp()
        gone = []
        while self._expiry and self._expiry[0][0] <= moment:
            key = heapq.heappop(self._expiry)[1]
            if key in self._insights:
                self._remove(key)
                gone.append(key)
        if gone and self._journal:
            self._journal.insights_gone(gone)

    def _make_room(self, insight: Insight) -> None:
        """A full pool takes out the insight with a ttl nearest its end (as Redis's
        volatile-ttl: what its writer said may go, the first to go anyway); with none that
        has a ttl, the write is refused."""
        while self._expiry:
            key = heapq.heappop(self._expiry)[1]
            if key in self._insights:
                self._remove(key)
                if self._journal:
                    self._journal.insights_gone([key])
                insight_evicted(self._evictions, key, insight.agent_id, self.capacity)
                return
        raise pool_full(self.capacity)

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
        longest = self.max_name_length
        for part, names in (
            ("agent_id", (insight.agent_id,)),
            ("tags", insight.tags),
            ("segment", (insight.segment,)),
        ):
            if any(len(name) > longest for name in names):
                problems.append(
                    FieldViolation(
                        f"insight.{part}", f"{part} must be at most {longest} characters"
                    )
                )
        if len(json.dumps(insight.metadata, default=str).encode()) > self.max_content_bytes:
            problems.append(
                FieldViolation(
                    "insight.metadata", f"metadata must be at most {self.max_content_bytes} bytes"
                )
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
            self._make_room(insight)
        stored = as_stored(insight, next(self._ids), now)
        self._add(stored)
        if self._journal:
            self._journal.insight_written(stored)
        if stored.expires_at is not None:
            if len(self._expiry) > 2 * len(self._insights) + 1024:  # deleted ones pile up
                self._expiry = [e for e in self._expiry if e[1] in self._insights]
                heapq.heapify(self._expiry)
            heapq.heappush(self._expiry, (stored.expires_at.timestamp(), stored.insight_id))
        if self._journal:
            await self._journal.sync()  # kept before it is said to be
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
        check_insight_read(min_importance, limit)
        self._purge(self._now())
        found: Iterable[Insight] = self._matching(tags=tags, segment=segment, agent_id=agent_id)
        if min_importance > 0:
            found = [i for i in found if i.importance >= min_importance]
        # Most important first, then newest first: the matches come newest first, and
        # nlargest keeps the order of equal keys (it is sorted(..., reverse=True)[:n]) while
        # it sorts only as many as it returns.
        return heapq.nlargest(limit if limit > 0 else DEFAULT_READ_LIMIT, found, key=_IMPORTANCE)

    def _matching(
        self,
        *,
        insight_ids: Iterable[str] = (),
        tags: Iterable[str] = (),
        segment: str = "",
        agent_id: str = "",
    ) -> list[Insight]:
        """The insights matching every filter given: looked for among the named ids (in the
        order named), else among those of the rarest tag or segment named, newest first (the
        other filters are looked up in their indexes), else in the whole pool, newest first."""
        ids = list(insight_ids)
        indexes = [self._by_tag.get(tag, {}) for tag in dict.fromkeys(tags)]
        if segment:
            indexes.append(self._by_segment.get(segment, {}))
        candidates: Iterable[Insight]
        if ids:
            candidates = [self._insights[i] for i in dict.fromkeys(ids) if i in self._insights]
        elif indexes:
            rarest = min(range(len(indexes)), key=lambda k: len(indexes[k]))
            candidates = reversed(indexes.pop(rarest).values())
        else:
            candidates = reversed(self._insights.values())
        if not (indexes or agent_id):
            return list(candidates)
        found = []
        for insight in candidates:
            if agent_id and insight.agent_id != agent_id:
                continue
            key = insight.insight_id
            if not indexes or all(key in index for index in indexes):
                found.append(insight)
        return found

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
        check_insight_delete(insight_ids, tags, segment, agent_id)
        self._purge(self._now())
        found = self._matching(
            insight_ids=insight_ids, tags=tags, segment=segment, agent_id=agent_id
        )
        for insight in found:
            self._remove(insight.insight_id)
        if found and self._journal:
            self._journal.insights_gone([insight.insight_id for insight in found])
            await self._journal.sync()
        return len(found)

    async def stats(self) -> MemoryStats:
        self._purge(self._now())
        return MemoryStats(
            total_insights=len(self._insights),
            agents_involved=len(self._writers),
            tag_distribution={tag: len(held) for tag, held in self._by_tag.items()},
            segment_distribution={seg: len(held) for seg, held in self._by_segment.items()},
            capacity=self.capacity,
        )


def _discard(index: dict[str, dict[str, Insight]], name: str, key: str) -> None:
    held = index.get(name)
    if held is not None:
        held.pop(key, None)
        if not held:
            del index[name]

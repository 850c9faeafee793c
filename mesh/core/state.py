"""Shared state (RT-011 coordination, "shared_state"): named, versioned entries that agents
read and write, with locks for the writes that must not interleave.

- Every write makes a new version of its entry (1 for the first). A write may name the version
  it expects (compare-and-set, 0 for "absent"): the strong path. Without it, the last writer
  wins: the eventual path.
- A writer may lock an entry first; it then writes with its lock's token, and nobody else
  writes (or deletes) the entry until the lock is released or its lease runs out. Acquiring
  waits at most ``lock_timeout`` (RT-011: 1 s), and at most ``max_writers`` agents (RT-011: 5)
  hold locks at once: a sixth waits for one of them to finish.
- Bounded: at most ``capacity`` entries, each value at most ``max_value_bytes`` of JSON. A new
  entry written to a full state takes out the unlocked entry with a ttl nearest its end (a
  lapse, early); with none, it is refused.
- A write may give its entry a ttl: past it the entry is read as absent, its place free (each
  write sets the entry's lifetime anew; one without a ttl keeps it until deleted).
- Entries are listed by key prefix, in key order, a page at a time: a page ends at
  ``page_size`` entries or when its values reach ``PAGE_BYTES`` of JSON, and its token names
  the last key it gave (a listing goes on from there, whatever was written meanwhile).
- Changes are watched by key prefix: each write, deletion and lapse, in the order they were
  made, after the entries there were (optionally) and a SYNCED mark. A watcher holds at most
  ``WATCH_BACKLOG`` changes not yet taken; one that falls further behind is ended (it watches
  again to catch up) rather than holding the state's writers back or growing without bound.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import enum
import heapq
import json
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from mesh.core.errors import (
    BrokerUnavailableError,
    FieldViolation,
    LimitExceededError,
    LockNotHeldError,
    MeshError,
    MessageValidationError,
    NotFoundError,
    StateConflictError,
)
from mesh.core.logthrottle import LogThrottle
from mesh.core.model import JSON, is_number, utc_now

logger = logging.getLogger("mesh.state")

LOCK_TIMEOUT = 1.0
"""RT-011 shared_state lock_timeout: the longest wait for a lock, in seconds."""
MAX_WRITERS = 5
"""RT-011 shared_state max_concurrent_writers: agents holding locks at once."""
DEFAULT_LEASE = 10.0
MAX_LEASE = 60.0
MAX_KEY_LENGTH = 256
MAX_TTL = 365 * 86400.0
"""The longest an entry's ttl may be, in seconds."""
PAGE_SIZE = 100
"""Entries in a page of a listing that does not say how many."""
MAX_PAGE_SIZE = 1000
"""The most entries in one page (a larger page_size counts as this)."""
PAGE_BYTES = 1 << 20
"""A page stops once its values reach this much JSON (it holds at least one entry): a page of
large values stays well within a gRPC message."""
WATCH_BACKLOG = 1000
"""The most changes a watcher holds that it has not taken yet; one more ends the watch."""
MAX_WATCHES = 1000
"""The most watches open at once on one broker."""
INITIAL_BYTES = 64 << 20
"""The most JSON the initial entries of a watch may come to (a wider prefix is refused)."""


@dataclass(frozen=True, slots=True)
class StateEntry:
    key: str
    value: JSON
    version: int
    updated_by: str
    updated_at: datetime
    expires_at: datetime | None = None
    """When it lapses (its last write gave a ttl); None: it stays until deleted."""


@dataclass(frozen=True, slots=True)
class StatePage:
    """One page of a listing: its entries in key order, and the token of the next page ("" when
    this one is the last)."""

    entries: tuple[StateEntry, ...]
    next_page_token: str


class ChangeKind(enum.Enum):
    CURRENT = "current"
    """An entry as it was when the watch began (asked for with the watch)."""
    SYNCED = "synced"
    """The watch is in place: every change after this one is watched (no entry)."""
    PUT = "put"
    """Written: the new version."""
    DELETE = "delete"
    """Deleted: its last version."""
    LAPSE = "lapse"
    """Its ttl ran out: its last version."""


@dataclass(frozen=True, slots=True)
class StateChange:
    kind: ChangeKind
    entry: StateEntry | None = None
    """None only for SYNCED."""


class StateMirror:
    """The entries under a watched prefix as the watcher was last told of them, so that a
    watch begun again (its broker restarted, or it fell behind) tells only what changed while
    there was none: :meth:`catch_up` with the entries there are now."""

    def __init__(self) -> None:
        self.entries: dict[str, StateEntry] = {}

    def note(self, change: StateChange) -> None:
        entry = change.entry
        if entry is None:
            return
        if change.kind is ChangeKind.CURRENT or change.kind is ChangeKind.PUT:
            self.entries[entry.key] = entry
        else:
            self.entries.pop(entry.key, None)

    def catch_up(self, current: Iterable[StateEntry]) -> list[StateChange]:
        """What the watcher missed: a PUT of each entry written meanwhile (its latest version
        only), then a DELETE of each one gone meanwhile (deleted, lapsed, or lost with the
        memory of a broker that restarted; its last version as the watcher saw it), each in
        key order."""
        now = {entry.key: entry for entry in current}
        missed = [
            StateChange(ChangeKind.PUT, entry)
            for key, entry in sorted(now.items())
            if self.entries.get(key) != entry
        ]
        missed += [
            StateChange(ChangeKind.DELETE, entry)
            for key, entry in sorted(self.entries.items())
            if key not in now
        ]
        self.entries = now
        return missed


class StateWatch:
    """One watcher's changes, in the order they were made: ``async for change in watch``.
    Holds at most ``backlog`` changes not yet taken (the initial entries aside); one more
    ends the watch with LimitExceededError (reason WATCH_BEHIND) once those are taken.
    :meth:`close` stops it."""

    def __init__(self, prefix: str, backlog: int = WATCH_BACKLOG) -> None:
        self.prefix = prefix
        self.backlog = backlog
        self._changes: collections.deque[StateChange] = collections.deque()
        self._ready = asyncio.Event()
        self._ended: MeshError | None = None
        self._closed = False
        self.on_close: Callable[[StateWatch], None] | None = None
        """Called once it is closed (its hub forgets it)."""
        self.after = 0
        """Where changes are numbered (a store shared by replicas): the last change before
        the watch began; those up to it are not the watch's."""

    def offer(self, change: StateChange, *, initial: bool = False) -> bool:
        """Queues a change for the watcher (those of other prefixes are the hub's to skip);
        False when this one ends the watch, which is that far behind."""
        if self._ended is not None or self._closed:
            return True
        if not initial and len(self._changes) >= self.backlog:
            self.end(
                LimitExceededError(
                    f"the watch of {self.prefix!r} fell {self.backlog} changes behind: "
                    "watch again (with the initial entries) to catch up",
                    reason="WATCH_BEHIND",
                )
            )
            return False
        self._changes.append(change)
        self._ready.set()
        return True

    def end(self, error: MeshError) -> bool:
        """Ends the watch with ``error``, after the changes it holds; False when it had ended
        (or was closed) already."""
        if self._ended is not None or self._closed:
            return False
        self._ended = error
        self._ready.set()
        return True

    def close(self) -> None:
        self._closed = True
        self._changes.clear()
        self._ready.set()
        if self.on_close is not None:
            self.on_close(self)

    def __aiter__(self) -> StateWatch:
        return self

    async def __anext__(self) -> StateChange:
        while not self._changes:
            if self._closed:
                raise StopAsyncIteration
            if self._ended is not None:
                raise self._ended
            self._ready.clear()
            await self._ready.wait()
        return self._changes.popleft()


class Watchers:
    """The watches of one shared state, at most ``most`` at once: each change goes to those
    whose prefix its key has."""

    def __init__(self, most: int = MAX_WATCHES) -> None:
        self.most = most
        self._watches: list[StateWatch] = []
        self._refusing: MeshError | None = None
        self.ended: collections.Counter[str] = collections.Counter()
        """Watches ended by the state, by reason (WATCH_BEHIND, UNAVAILABLE, SHUTTING_DOWN)."""

    def __len__(self) -> int:
        return len(self._watches)

    def check_room(self, starting: int = 0) -> None:
        """Refuses one more watch when ``most`` are open (``starting``: begun, not yet in), or
        once closed."""
        if self._refusing is not None:
            raise self._refusing
        if len(self._watches) + starting >= self.most:
            raise LimitExceededError(
                f"{self.most} watches of the shared state are open on this broker already",
                reason="TOO_MANY_WATCHES",
            )

    def add(self, prefix: str) -> StateWatch:
        self.check_room()
        return self.adopt(StateWatch(prefix))

    def adopt(self, watch: StateWatch) -> StateWatch:
        watch.on_close = self._remove
        self._watches.append(watch)
        return watch

    def _remove(self, watch: StateWatch) -> None:
        if watch in self._watches:
            self._watches.remove(watch)

    def publish(self, kind: ChangeKind, entry: StateEntry, number: int = 0) -> None:
        """Tells the watches of its key a change (``number``: where changes are numbered)."""
        change = StateChange(kind, entry)
        for watch in self._watches:
            told = entry.key.startswith(watch.prefix) and (not number or number > watch.after)
            if told and not watch.offer(change):
                self.ended["WATCH_BEHIND"] += 1

    def end_all(self, error: MeshError) -> None:
        for watch in list(self._watches):
            if watch.end(error):
                self.ended[error.reason] += 1
            self._remove(watch)

    def close(self, error: MeshError) -> None:
        """Ends every watch with ``error``, and refuses new ones with it."""
        self._refusing = error
        self.end_all(error)


def start_watch(watch: StateWatch, initial: Iterable[tuple[StateEntry, int]] | None) -> None:
    """Queues a new watch's initial entries (when asked for: each with the size of its value's
    JSON, in key order), then its SYNCED mark; a watch whose initial entries pass
    INITIAL_BYTES is refused."""
    if initial is not None:
        size = 0
        for entry, value_bytes in initial:
            size += value_bytes
            if size > INITIAL_BYTES:
                watch.close()
                raise too_wide(watch.prefix)
            watch.offer(StateChange(ChangeKind.CURRENT, entry), initial=True)
    watch.offer(StateChange(ChangeKind.SYNCED), initial=True)


@dataclass(frozen=True, slots=True)
class StateLock:
    key: str
    holder: str
    token: str
    expires_at: datetime


@dataclass(slots=True)
class _Held:
    holder: str
    token: str
    expires: float  # monotonic
    expires_at: datetime


class StateStore(Protocol):
    """What the Memory service needs of a shared state: this module's, or one in Redis."""

    watchers: Watchers
    """Its watches (for the broker's gauges)."""

    async def get(self, key: str) -> StateEntry: ...

    async def entries(
        self, prefix: str = "", *, page_size: int = 0, page_token: str = ""
    ) -> StatePage: ...

    async def watch(self, prefix: str = "", *, send_initial: bool = False) -> StateWatch: ...

    async def close(self) -> None:
        """The broker is stopping: every watch ends, and new ones are refused (UNAVAILABLE,
        SHUTTING_DOWN)."""
        ...

    async def put(
        self,
        key: str,
        value: JSON,
        agent_id: str,
        *,
        expected_version: int | None = None,
        lock_token: str = "",
        ttl: float | None = None,
    ) -> StateEntry: ...

    async def delete(
        self,
        key: str,
        agent_id: str,
        *,
        expected_version: int | None = None,
        lock_token: str = "",
    ) -> StateEntry: ...

    async def lock(
        self, key: str, agent_id: str, *, wait: float | None = None, lease: float | None = None
    ) -> StateLock: ...

    async def unlock(self, key: str, token: str) -> None: ...


class StateJournal(Protocol):
    """Where a shared state that outlives its process records its changes (the SQLite
    store). Locks are not recorded: a lock is a lease, and ends with the broker."""

    def state_written(self, entry: StateEntry) -> None: ...

    def state_gone(self, key: str) -> None: ...

    async def sync(self) -> None:
        """Returns once what was recorded is on disk."""
        ...


def entry_record(entry: StateEntry) -> str:
    """An entry as JSON, as a store that keeps it outside the process writes it."""
    return json.dumps(
        {
            "key": entry.key,
            "value": entry.value,
            "version": entry.version,
            "updated_by": entry.updated_by,
            "updated_at": entry.updated_at.isoformat(),
            "expires_at": entry.expires_at.isoformat() if entry.expires_at else "",
        },
        default=str,
        separators=(",", ":"),
    )


def entry_from_record(record: str) -> StateEntry:
    """The entry :func:`entry_record` wrote."""
    fields = json.loads(record)
    expires = fields.get("expires_at")
    return StateEntry(
        key=fields["key"],
        value=fields["value"],
        version=int(fields["version"]),
        updated_by=fields["updated_by"],
        updated_at=datetime.fromisoformat(fields["updated_at"]),
        expires_at=datetime.fromisoformat(expires) if expires else None,
    )


class SharedState:
    def __init__(
        self,
        *,
        lock_timeout: float = LOCK_TIMEOUT,
        max_writers: int = MAX_WRITERS,
        capacity: int = 10_000,
        max_value_bytes: int = 64 * 1024,
        max_watches: int = MAX_WATCHES,
        journal: StateJournal | None = None,
        restored: Iterable[StateEntry] = (),
    ) -> None:
        """``journal``: where the changes go to outlive the process; ``restored``: the
        entries it kept, the state's to start with (those whose ttl ran out meanwhile
        left out)."""
        self.lock_timeout = lock_timeout
        self.max_writers = max_writers
        self.capacity = capacity
        self.max_value_bytes = max_value_bytes
        self._entries: dict[str, StateEntry] = {}
        self._expiry: dict[str, float] = {}
        """Per entry written with a ttl, when it lapses (monotonic)."""
        self._lapsing: list[tuple[float, str]] = []
        """A heap of those moments (some stale: an entry written again since)."""
        self._locks: dict[str, _Held] = {}
        self._waiting: dict[str, collections.deque[object]] = {}
        """Per key, the lock requests waiting, in their order of arrival."""
        self._changed = asyncio.Condition()
        """Notified whenever a lock is released: waiters look again."""
        self.watchers = Watchers(max_watches)
        self._timer: asyncio.TimerHandle | None = None
        """While anyone watches: set for the next lapse, so that it is told when it happens."""
        self._timer_at = math.inf
        self._journal = journal
        self._evictions = LogThrottle(60.0)
        wall, now = time.time(), time.monotonic()
        for entry in restored:
            if entry.expires_at is None:
                self._entries[entry.key] = entry
                continue
            left = entry.expires_at.timestamp() - wall
            if left > 0:
                self._entries[entry.key] = entry
                self._expiry[entry.key] = now + left
                heapq.heappush(self._lapsing, (now + left, entry.key))

    # -- reading and writing -----------------------------------------------------------------

    async def get(self, key: str) -> StateEntry:
        check_key(key)
        entry = self._live(key)
        if entry is None:
            raise not_found(key)
        return entry

    async def entries(
        self, prefix: str = "", *, page_size: int = 0, page_token: str = ""
    ) -> StatePage:
        after, limit = listing_terms(prefix, page_size, page_token)
        self._purge()
        keys, last = page_keys(self._entries, prefix, after, limit)
        sized = ((e, json_size(e.value)) for e in (self._entries[k] for k in keys))
        return page_of(prefix, sized, last)

    async def watch(self, prefix: str = "", *, send_initial: bool = False) -> StateWatch:
        check_prefix(prefix)
        self._purge()  # (before the watch is in: lapses come after its initial entries)
        watch = self.watchers.add(prefix)
        initial = None
        if send_initial:
            keys = sorted(k for k in self._entries if k.startswith(prefix))
            initial = ((self._entries[k], json_size(self._entries[k].value)) for k in keys)
        start_watch(watch, initial)
        self._schedule_lapses()
        return watch

    def _schedule_lapses(self) -> None:
        """While anyone watches, a timer for the next lapse (a lapse is otherwise noticed only
        when the entry is next read or written)."""
        if not self.watchers or not self._lapsing:
            return
        at = self._lapsing[0][0]
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()
        delay = max(0.0, at - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(delay, self._lapse_due)
        self._timer_at = at

    async def close(self) -> None:
        self.watchers.close(shutting_down())
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf

    def _lapse_due(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._purge()
        self._schedule_lapses()

    def _live(self, key: str) -> StateEntry | None:
        """The entry, unless there is none or its ttl ran out (then it goes)."""
        entry = self._entries.get(key)
        if entry is not None and self._expiry.get(key, math.inf) <= time.monotonic():
            self._lapse(key)
            return None
        return entry

    def _lapse(self, key: str) -> None:
        entry = self._entries.get(key)
        self._drop(key)
        if entry is not None and self.watchers:
            self.watchers.publish(ChangeKind.LAPSE, entry)

    def _drop(self, key: str) -> None:
        if self._entries.pop(key, None) is not None and self._journal:
            self._journal.state_gone(key)
        self._expiry.pop(key, None)

    def _purge(self) -> None:
        """Removes the entries whose ttl ran out."""
        now = time.monotonic()
        while self._lapsing and self._lapsing[0][0] <= now:
            at, key = heapq.heappop(self._lapsing)
            if self._expiry.get(key) == at:
                self._lapse(key)

    def _make_room(self, key: str, agent_id: str) -> None:
        """A full state takes out the entry with a ttl nearest its end that nobody holds a
        lock on (told to watchers as its lapse, which it is, early: as Redis's volatile-ttl,
        what its writer said may go goes first): a workflow's status of a day ago, say,
        before the next workflow's is refused. With none, the write is refused."""
        locked: list[tuple[float, str]] = []
        try:
            while self._lapsing:
                at, nearest = heapq.heappop(self._lapsing)
                if self._expiry.get(nearest) != at:
                    continue  # (written again since)
                if self._lock_of(nearest) is not None:
                    locked.append((at, nearest))
                    continue
                self._lapse(nearest)
                entry_evicted(self._evictions, nearest, key, agent_id, self.capacity)
                return
            raise full(self.capacity)
        finally:
            for item in locked:
                heapq.heappush(self._lapsing, item)

    def _lapse_after(self, key: str, ttl: float | None) -> datetime | None:
        if ttl is None:
            self._expiry.pop(key, None)
            return None
        at = time.monotonic() + ttl
        self._expiry[key] = at
        heapq.heappush(self._lapsing, (at, key))
        if len(self._lapsing) > 2 * len(self._expiry) + 64:  # stale moments of rewrites
            self._lapsing = [(t, k) for k, t in self._expiry.items()]
            heapq.heapify(self._lapsing)
        return datetime.fromtimestamp(time.time() + ttl, tz=UTC)

    async def put(
        self,
        key: str,
        value: JSON,
        agent_id: str,
        *,
        expected_version: int | None = None,
        lock_token: str = "",
        ttl: float | None = None,
    ) -> StateEntry:
        check_write(key, value, agent_id, expected_version, self.max_value_bytes, ttl)
        self._purge()
        current = self._may_write(key, agent_id, expected_version, lock_token)
        if current is None and len(self._entries) >= self.capacity:
            self._make_room(key, agent_id)
        version = (current.version if current else 0) + 1
        expires_at = self._lapse_after(key, ttl)
        entry = StateEntry(key, value, version, agent_id, utc_now(), expires_at)
        self._entries[key] = entry
        if self.watchers:
            self.watchers.publish(ChangeKind.PUT, entry)
            if ttl is not None:
                self._schedule_lapses()
        if self._journal:
            self._journal.state_written(entry)
            await self._journal.sync()  # kept before it is said to be
        return entry

    async def delete(
        self,
        key: str,
        agent_id: str,
        *,
        expected_version: int | None = None,
        lock_token: str = "",
    ) -> StateEntry:
        check_delete(key, agent_id)
        current = self._may_write(key, agent_id, expected_version, lock_token)
        if current is None:
            raise not_found(key)
        self._drop(key)
        if self.watchers:
            self.watchers.publish(ChangeKind.DELETE, current)
        if self._journal:
            await self._journal.sync()
        return current

    def _may_write(
        self, key: str, agent_id: str, expected_version: int | None, lock_token: str
    ) -> StateEntry | None:
        held = self._lock_of(key)
        if lock_token:
            if held is None or held.token != lock_token:
                raise lock_not_held(key)
        elif held is not None:
            raise locked(key, held.holder, held.expires_at)
        current = self._live(key)
        if expected_version is not None:
            found = current.version if current else 0
            if found != expected_version:
                raise version_conflict(key, found, expected_version)
        return current

    # -- locks ---------------------------------------------------------------------------------

    def _lock_of(self, key: str) -> _Held | None:
        held = self._locks.get(key)
        if held is not None and held.expires <= time.monotonic():
            del self._locks[key]  # its lease ran out
            return None
        return held

    def _writers(self) -> set[str]:
        now = time.monotonic()
        for key in [k for k, h in self._locks.items() if h.expires <= now]:
            del self._locks[key]
        return {h.holder for h in self._locks.values()}

    def locks(self) -> list[StateLock]:
        """The locks held now."""
        self._writers()
        return [StateLock(k, h.holder, h.token, h.expires_at) for k, h in self._locks.items()]

    async def lock(
        self, key: str, agent_id: str, *, wait: float | None = None, lease: float | None = None
    ) -> StateLock:
        """Locks an entry (present or not) for ``agent_id``; the holder asking again gets its
        lock back with the lease renewed. Waits at most ``wait`` seconds (``lock_timeout``
        unless less is asked; 0 tries once), then raises StateConflictError (reason
        LOCK_TIMEOUT)."""
        wait, lease = lock_terms(key, agent_id, wait, lease, self.lock_timeout)
        deadline = time.monotonic() + wait
        ticket = object()
        queue = self._waiting.setdefault(key, collections.deque())
        queue.append(ticket)  # first come, first served: a newcomer does not barge ahead
        async with self._changed:
            try:
                while True:
                    held = self._lock_of(key)
                    writers = self._writers()
                    if held is not None and held.holder == agent_id:
                        return self._grant(key, agent_id, lease, held.token)
                    if (
                        held is None
                        and queue[0] is ticket
                        and (agent_id in writers or len(writers) < self.max_writers)
                    ):
                        return self._grant(key, agent_id, lease, secrets.token_urlsafe(18))
                    now = time.monotonic()
                    if now >= deadline:
                        if held is not None:
                            why = f"held by {held.holder}"
                        elif queue[0] is not ticket:
                            why = "other agents were waiting for it first"
                        else:
                            why = f"{self.max_writers} agents hold locks already"
                        raise StateConflictError(
                            f"could not lock {key!r} within {wait:g} s: {why}",
                            reason="LOCK_TIMEOUT",
                        )
                    # Look again when a lock is released, or when the first lease runs out.
                    expiries = [h.expires for h in self._locks.values()]
                    until = min([deadline, *expiries]) - now
                    try:
                        async with asyncio.timeout(max(until, 0.001)):
                            await self._changed.wait()
                    except TimeoutError:
                        pass
            finally:
                was_first = queue[0] is ticket
                queue.remove(ticket)
                if not queue:
                    del self._waiting[key]
                elif was_first:
                    self._changed.notify_all()  # the next in line may take it now

    def _grant(self, key: str, agent_id: str, lease: float, token: str) -> StateLock:
        expires_at = datetime.fromtimestamp(time.time() + lease, tz=UTC)
        self._locks[key] = _Held(agent_id, token, time.monotonic() + lease, expires_at)
        return StateLock(key, agent_id, token, expires_at)

    async def unlock(self, key: str, token: str) -> None:
        check_key(key)
        held = self._lock_of(key)
        if held is None or held.token != token:
            raise lock_not_held(key)
        del self._locks[key]
        async with self._changed:
            self._changed.notify_all()


def check_key(key: str) -> None:
    """A key's validation (a store in Redis shares it)."""
    if not key:
        raise MessageValidationError.for_field("key", "key is required")
    if len(key) > MAX_KEY_LENGTH:
        raise MessageValidationError.for_field(
            "key", f"key must be at most {MAX_KEY_LENGTH} characters"
        )


def listing_terms(prefix: str, page_size: int, page_token: str) -> tuple[str, int]:
    """A listing's validation: the key it goes on after ("" for the first page) and the most
    entries its page may hold."""
    problems = []
    if len(prefix) > MAX_KEY_LENGTH:
        problems.append(prefix_violation())
    if page_size < 0:
        problems.append(FieldViolation("page_size", "page_size must not be negative"))
    after = ""
    if page_token:
        try:
            listed, after = json.loads(base64.urlsafe_b64decode(page_token.encode()))
            if not isinstance(listed, str) or not isinstance(after, str):
                raise ValueError
        except (ValueError, TypeError, binascii.Error):
            problems.append(
                FieldViolation("page_token", "page_token is not one a listing of the state gave")
            )
        else:
            if listed != prefix:
                problems.append(
                    FieldViolation(
                        "page_token",
                        f"page_token continues the listing of prefix {listed!r}, not {prefix!r}",
                    )
                )
    if problems:
        raise MessageValidationError.from_violations(problems)
    return after, min(page_size or PAGE_SIZE, MAX_PAGE_SIZE)


def too_wide(prefix: str) -> LimitExceededError:
    return LimitExceededError(
        f"the entries under {prefix!r} pass {INITIAL_BYTES >> 20} MiB: watch a narrower "
        "prefix, or without the initial entries",
        reason="WATCH_TOO_WIDE",
    )


def shutting_down() -> BrokerUnavailableError:
    return BrokerUnavailableError(
        "the broker is shutting down: watch again through another", reason="SHUTTING_DOWN"
    )


def prefix_violation() -> FieldViolation:
    return FieldViolation("prefix", f"prefix must be at most {MAX_KEY_LENGTH} characters")


def check_prefix(prefix: str) -> None:
    if len(prefix) > MAX_KEY_LENGTH:
        raise MessageValidationError.from_violations([prefix_violation()])


def json_size(value: JSON) -> int:
    """The size of a value's JSON as the state keeps it (ASCII: characters are bytes)."""
    return len(json.dumps(value, default=str, separators=(",", ":")))


def page_keys(
    keys: Iterable[str], prefix: str, after: str, limit: int
) -> tuple[list[str], str | None]:
    """The keys of a page, in order: at most ``limit`` of those under ``prefix`` after
    ``after``; and the last of them when more follow (None when none do)."""
    found = heapq.nsmallest(limit + 1, (k for k in keys if k > after and k.startswith(prefix)))
    return found[:limit], found[limit - 1] if len(found) > limit else None


def page_of(prefix: str, sized: Iterable[tuple[StateEntry, int]], last: str | None) -> StatePage:
    """A page from its candidates in key order (at most a page_size of them, the keys that
    follow the previous page), each with the size of its value's JSON: all of them, or fewer
    once their values reach PAGE_BYTES. ``last``: the last key looked at when more keys
    follow it (None when none do); the next page starts after it."""
    taken: list[StateEntry] = []
    size = 0
    for entry, value_bytes in sized:
        if taken and size + value_bytes > PAGE_BYTES:
            return StatePage(tuple(taken), _page_token(prefix, taken[-1].key))
        taken.append(entry)
        size += value_bytes
    return StatePage(tuple(taken), "" if last is None else _page_token(prefix, last))


def _page_token(prefix: str, last: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([prefix, last]).encode()).decode()


def check_write(
    key: str,
    value: JSON,
    agent_id: str,
    expected_version: int | None,
    max_value_bytes: int,
    ttl: float | None = None,
) -> str:
    """A write's validation; returns the value as JSON (what a store in Redis keeps)."""
    check_key(key)
    problems = []
    encoded = ""
    if not agent_id:
        problems.append(FieldViolation("agent_id", "agent_id is required"))
    if value is None:
        problems.append(FieldViolation("value", "value is required"))
    else:
        encoded = json.dumps(value, default=str, separators=(",", ":"))
        if len(encoded.encode()) > max_value_bytes:
            problems.append(
                FieldViolation("value", f"value must be at most {max_value_bytes} bytes")
            )
    if expected_version is not None and expected_version < 0:
        problems.append(FieldViolation("expected_version", "must not be negative"))
    if ttl is not None and not 0 < ttl <= MAX_TTL:
        problems.append(ttl_violation())
    if problems:
        raise MessageValidationError.from_violations(problems)
    return encoded


def ttl_violation() -> FieldViolation:
    return FieldViolation(
        "ttl", f"ttl must be above 0 and at most {MAX_TTL:.0f} s (365 days), or unset"
    )


def check_ttl(ttl: float) -> None:
    """An entry's ttl, in seconds, as a client checks it before sending."""
    if not is_number(ttl) or not 0 < ttl <= MAX_TTL:
        raise MessageValidationError.from_violations([ttl_violation()])


def lock_terms(
    key: str, agent_id: str, wait: float | None, lease: float | None, lock_timeout: float
) -> tuple[float, float]:
    """A lock request's validation: its wait (``lock_timeout`` unless less is asked) and lease
    (DEFAULT_LEASE unless set), in seconds."""
    check_key(key)
    wait = lock_timeout if wait is None else wait
    lease = DEFAULT_LEASE if lease is None else lease
    problems = []
    if not agent_id:
        problems.append(FieldViolation("agent_id", "agent_id is required"))
    if not is_number(wait) or not 0 <= wait <= lock_timeout:
        problems.append(FieldViolation("wait", f"wait must be within 0 and {lock_timeout:g} s"))
    if not is_number(lease) or not 0 < lease <= MAX_LEASE:
        problems.append(
            FieldViolation("lease", f"lease must be above 0 and at most {MAX_LEASE:g} s")
        )
    if problems:
        raise MessageValidationError.from_violations(problems)
    return wait, lease


def check_delete(key: str, agent_id: str) -> None:
    check_key(key)
    if not agent_id:
        raise MessageValidationError.for_field("agent_id", "agent_id is required")


# -- the refusals, worded once for every store ---------------------------------------------------


def not_found(key: str) -> NotFoundError:
    return NotFoundError(f"no shared state named {key!r}", reason="STATE_NOT_FOUND")


def entry_evicted(
    throttle: LogThrottle, key: str, written: str, writer: str, capacity: int
) -> None:
    """Says (once a minute, counting the rest) that a full shared state took an entry out to
    make room for a write."""
    throttle.warning(
        logger,
        "state",
        "the shared state is full (%d entries): %s, the one with a ttl nearest its end, was"
        " taken out for %s's write of %s",
        capacity,
        key,
        writer,
        written,
        event={"category": "shared_state", "evicted": key, "capacity": capacity},
    )


def full(capacity: int) -> LimitExceededError:
    return LimitExceededError(f"the shared state holds its limit of {capacity} entries")


def lock_not_held(key: str) -> LockNotHeldError:
    return LockNotHeldError(
        f"the lock token does not hold {key!r} (released, expired, or never given)"
    )


def locked(key: str, holder: str, until: datetime) -> StateConflictError:
    return StateConflictError(
        f"{key!r} is locked by {holder} until {until.isoformat()}", reason="STATE_LOCKED"
    )


def version_conflict(key: str, found: int, expected: int | None) -> StateConflictError:
    return StateConflictError(
        f"{key!r} is at version {found}, not {expected}", reason="VERSION_CONFLICT"
    )

"""Per-agent priority queues with TTL, capacity, leases, redelivery and dead-lettering.

The :class:`QueueStore` protocol is what the broker needs from a queue backend; the
in-memory store here is the embedded default. Every method is a coroutine so that durable
and networked stores fit behind the same interface.

Order: HIGH before MEDIUM before LOW, then by message timestamp, then by arrival.
A message lives the seconds :meth:`put` is given (what is left of its ttl: the broker counts
a sender's ttl from the message's timestamp), on the store's monotonic clock; an expired
message is never returned by :meth:`pop` or :meth:`lease`, does not hold capacity and is
reported to the listener. A leased message holds capacity until it is acked; a nack, an
expired lease or the subscriber's departure puts it back in its place, or in the
dead-letter queue once it has been delivered ``max_delivery_attempts`` times.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from mesh.core.errors import MessageQueueFullError, message_id_taken
from mesh.core.model import AgentInfo, DeadLetter, Message, Priority, QueuedState, utc_now

Clock = Callable[[], float]
WallClock = Callable[[], datetime]
_T = TypeVar("_T", bound=tuple[Any, ...])


@dataclass(frozen=True, slots=True)
class Lease:
    """A message handed to a subscriber: who holds it, which attempt, until when."""

    message: Message
    agent_id: str
    subscriber: str
    attempt: int
    lease_expires_at: datetime
    queued_seconds: float
    """Time the message spent in the store between acceptance and this delivery."""


@dataclass(frozen=True, slots=True)
class Popped:
    """A message removed from its queue by :meth:`QueueStore.pop`."""

    message: Message
    queued_seconds: float
    attempts: int = 0
    """Times it was delivered to a subscriber before (and given back)."""


@dataclass(frozen=True, slots=True)
class Released:
    """A lease that ended (ack, nack, expiry or departure), for the subscriber's credit."""

    message_id: str
    agent_id: str
    subscriber: str
    withdrawn: bool = False
    """The message was withdrawn (its requester gave up): its subscriber may stop work."""


@dataclass(frozen=True, slots=True)
class QueueStats:
    agent_id: str
    high: int
    medium: int
    low: int
    in_flight: int
    """Delivered and not yet settled."""
    dead_letters: int
    deferred: int = 0
    """Held until a time: scheduled, or nacked with a delay (in flight no more)."""

    @property
    def depth(self) -> int:
        return self.high + self.medium + self.low

    @property
    def held(self) -> int:
        """Messages held in all: waiting, in flight and deferred."""
        return self.depth + self.in_flight + self.deferred


class StoreListener(Protocol):
    """Receives what happens inside the store without a caller asking."""

    def on_expired(self, message: Message) -> None: ...

    def on_dead_letter(self, dead: DeadLetter) -> None: ...

    def on_redelivery(self, message: Message, attempt: int) -> None: ...

    def on_due(self, message: Message) -> None:
        """A scheduled message (``put`` with a delay) came due: waiting in its place now."""
        ...

    def on_released(self, released: Released) -> None: ...


GIVEN_UP_ROUTE = "given-up"
"""What a route says once its request ended unanswered (see ``QueueStore.give_up_route``)."""

GIVEN_UP_SECONDS = 300.0
"""How long answers to a request or gather that ended unanswered count as late, not lost."""

MAX_FORWARDS = 16
"""How many forwards of one request are remembered, to be withdrawn when it is given up."""


RouteClaim = tuple[tuple[str, str], float]
"""A request's route to record as its message is put: the (requester, correlation id) key
and the seconds it waits (:meth:`QueueStore.claim_route`)."""


class QueueStore(Protocol):
    """What the broker needs from a queue backend."""

    listener: StoreListener | None
    durable: bool
    """Whether what the store holds outlives the process."""
    group_commit: bool
    """Whether :meth:`sync` waits for a commit that every put before it shares (the SQLite
    journal): a caller taking several messages in puts them all, then syncs once."""
    shared: bool
    """Whether several broker replicas share the store (and need the replica methods)."""
    replica_id: str

    async def put(
        self,
        message: Message,
        ttl_seconds: float,
        claim: RouteClaim | None = None,
        delay: float = 0.0,
    ) -> bool:
        """Enqueues a message for ``message.to_agent``.

        Returns False when a message with the same id is already held for that agent (the
        send is then a harmless retry). Raises MessageQueueFullError over capacity.
        ``claim`` (a shared store): the route of the request the message is, recorded as
        :meth:`claim_route` records it and no later than the message is queued (so that the
        answer, from whichever replica, finds it), in the same round trip where it can.
        ``delay`` (seconds, a scheduled message): held as a nack's ``delay`` holds one, by
        nobody, with no attempt used, then in its place once it ends.
        """
        ...

    async def pop(
        self,
        agent_id: str,
        max_messages: int = 0,
        max_bytes: int = 0,
        size_of: Callable[[Message], int] | None = None,
    ) -> list[Popped]:
        """Removes and returns up to ``max_messages`` (0: all) messages, in order; with
        ``max_bytes``, only as many as fit in that many bytes (``size_of``: a message's size;
        a store may measure its own way), the first whatever its size. What does not fit
        stays queued, in its place."""
        ...

    async def lease(self, agent_id: str, subscriber: str, lease_seconds: float) -> Lease | None:
        """Leases the next message to a subscriber, or returns None when none is waiting."""
        ...

    async def lease_many(
        self, agent_id: str, subscriber: str, lease_seconds: float, most: int
    ) -> list[Lease]:
        """Leases up to ``most`` waiting messages, in queue order, in one operation: fewer
        only when no more are waiting (a subscription that gets fewer waits to be woken)."""
        ...

    async def ack(self, agent_id: str, message_ids: Iterable[str]) -> int:
        """Releases leased messages for good; returns how many were leased."""
        ...

    async def nack(
        self,
        agent_id: str,
        message_ids: Iterable[str],
        *,
        dead_letter_reason: str = "",
        delay: float = 0.0,
    ) -> tuple[int, int]:
        """Returns leased messages for redelivery, or, with ``dead_letter_reason``, sends them
        to the dead-letter queue at once with that reason; returns (requeued,
        dead-lettered). With ``delay`` (seconds, no ``dead_letter_reason``) they go back that
        long from now, held by nobody meanwhile (their subscriber's places in flight free, an
        ack still taking them out), except those whose attempts are used up or whose ttl has
        ended, which leave at once as without it; a deferred one counts as requeued."""
        ...

    async def extend_lease(
        self, agent_id: str, message_ids: Iterable[str], lease_seconds: float
    ) -> int:
        """Makes the leases of these messages end ``lease_seconds`` from now (their handler
        still works on them); returns how many were still leased."""
        ...

    async def withdraw(self, agent_id: str, message_ids: Iterable[str]) -> tuple[int, int]:
        """Takes these messages out of the agent's queue for good, waiting or leased (their
        requester gave up: nobody waits for the answer); a leased one's end is reported as
        :class:`Released` with ``withdrawn``, so that its subscriber can be told. Returns
        (withdrawn while waiting, withdrawn while leased)."""
        ...

    async def cancel(self, agent_id: str, sender: str, message_ids: Iterable[str]) -> list[str]:
        """Takes out of the agent's queue for good those of ``message_ids`` that ``sender``
        sent and that are not delivered now: waiting, or deferred (scheduled, or nacked with
        a delay). Returns their ids, in the order given; one in flight stays."""
        ...

    async def still_leased(
        self, agent_id: str, subscriber: str, message_ids: Collection[str]
    ) -> set[str]:
        """Of ``message_ids``, those still leased to ``subscriber``."""
        ...

    async def release_subscriber(
        self, agent_id: str, subscriber: str, *, seen: Collection[str] | None = None
    ) -> int:
        """Returns every message leased to a departed subscriber; returns how many. With
        ``seen``, only those listed count their delivery attempt (the subscriber's
        application had them); the others go back as if never delivered."""
        ...

    async def sweep(self) -> None:
        """Expires messages past their TTL and reclaims leases past their end."""
        ...

    async def stats(self, agent_id: str | None = None) -> list[QueueStats]: ...

    async def held(self) -> int:
        """Messages held in total, waiting and in flight."""
        ...

    async def dead_letters(self, agent_id: str | None = None) -> list[DeadLetter]: ...

    async def remove_dead_letters(self, agent_id: str, message_ids: Collection[str]) -> int:
        """Takes these messages out of the agent's dead letters (they were queued again);
        returns how many dead letters went."""
        ...

    async def depth(self, agent_id: str) -> int:
        """Messages waiting for one agent."""
        ...

    async def listing(self, agent_id: str) -> list[Held]:
        """What the agent's queue holds, left where it is (what is past its ttl and waiting
        leaves first): the messages waiting, in the order they will be delivered, then those
        in flight or deferred, by when their lease or delay ends (then by id)."""
        ...

    async def sync(self) -> None:
        """Returns once every message put so far survives a crash of the process."""
        ...

    async def save_agent(self, info: AgentInfo) -> None:
        """Keeps a registration, so that a restarted broker still knows the agent."""
        ...

    async def forget_agent(self, agent_id: str) -> None: ...

    async def update_agent(
        self, agent_id: str, change: Callable[[AgentInfo | None], AgentInfo | None]
    ) -> AgentInfo | None:
        """Changes one kept registration in one step: ``change`` is given it as kept (as
        :meth:`saved_agent` reads it) and returns the one to keep (None: none), which is kept
        and returned. On a store shared by replicas no change made meanwhile through another
        is lost (``change`` may be called again, on what that one kept)."""
        ...

    async def saved_agents(self) -> list[AgentInfo]:
        """The registrations kept (none for a store that does not outlive its process)."""
        ...

    async def saved_agent(self, agent_id: str) -> AgentInfo | None: ...

    # Replicas sharing the store (``shared``): who waits for which answer, and news of what
    # happened through the other replicas. A store of one process does nothing here.

    async def watch(self, listener: ReplicaListener) -> None:
        """Starts telling ``listener`` what the other replicas do."""
        ...

    async def claim_route(self, key: tuple[str, str], ttl: float) -> None:
        """Records that this replica waits for the answer (requester, correlation id), for
        ``ttl`` seconds and a moment (an answered request's route is left to expire: a second
        answer through another replica still finds its way here, to be dropped as late)."""
        ...

    async def give_up_route(self, key: tuple[str, str]) -> None:
        """The request ended unanswered: its route says so (:data:`GIVEN_UP_ROUTE`) for a
        while, so that every replica knows a late answer."""
        ...

    async def route_of(self, key: tuple[str, str]) -> str | None:
        """The replica waiting for that answer, if any."""
        ...

    async def restore_agent(self, info: AgentInfo) -> bool:
        """Keeps the registration unless the store keeps one under its id already (another
        replica restored it first); whether it did. For a store that came back empty."""
        ...

    async def still_holds(self) -> bool:
        """Whether the store still holds what it held when this replica last looked; when
        not (it lost it), the listener is told (:meth:`ReplicaListener.on_store_emptied`)."""
        ...

    async def forward_answer(self, replica: str, message: Message) -> bool:
        """Hands an answer to the replica waiting for it; False when that replica is gone."""
        ...

    async def remember_forward(
        self, key: tuple[str, str], agent_id: str, message_id: str, ttl: float
    ) -> None:
        """Records, for the replica whose requester waits for that answer, that the request
        was handed on to ``agent_id`` as ``message_id`` (kept ``ttl`` seconds at most)."""
        ...

    async def take_forwards(self, key: tuple[str, str]) -> list[tuple[str, str]]:
        """The forwards recorded for that answer (agent id, message id), forgotten."""
        ...

    async def close(self) -> None:
        """Writes out what is pending and releases the store's resources."""
        ...


class ReplicaListener(StoreListener, Protocol):
    """What a broker learns from the other replicas sharing its store."""

    def on_wake(self, agent_id: str) -> None: ...

    def on_agent_changed(self, agent_id: str, info: AgentInfo | None) -> None: ...

    def on_answer(self, message: Message) -> None: ...

    def on_followed_again(self) -> None:
        """Following the other replicas was interrupted (a lost connection) and has resumed:
        wake-ups sent meanwhile may be lost, so every subscription looks at its queue."""
        ...

    def on_store_emptied(self) -> None:
        """The store lost what it kept, registrations included (a Redis restarted without
        persistence): not news that the agents left."""
        ...

    def on_replicas_gone(self, replica_ids: Sequence[str]) -> None:
        """These replicas stopped beating (told to the one replica that noticed): their
        subscriptions are gone with them."""
        ...


class Journal(Protocol):
    """Records the store's changes so that a durable store can rebuild it after a crash.

    Called synchronously on every change, in order; writing them out is the journal's
    business (see :mod:`mesh.core.durable`).
    """

    def put(self, entry: StoredEntry) -> None: ...

    def attempted(self, entry: StoredEntry) -> None:
        """The entry's delivery attempts changed (leased, or returned to its queue)."""
        ...

    def deferred(self, agent_id: str, message_id: str, until: float) -> None:
        """The message was nacked with a delay: not delivered before ``until`` (wall-clock
        seconds), not even after a restart."""
        ...

    def removed(self, agent_id: str, message_id: str) -> None: ...

    def dead(self, agent_id: str, dead: DeadLetter) -> None: ...

    def undead(self, agent_id: str, message_ids: Collection[str]) -> None: ...

    def agent(self, info: AgentInfo) -> None:
        """An agent registered (or registered again)."""
        ...

    def agent_gone(self, agent_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """What a journal keeps of a message: enough to put it back in its place."""

    message: Message
    agent_id: str
    accepted_at: float
    """Wall-clock seconds (epoch) of acceptance."""
    expires_at: float
    """Wall-clock seconds (epoch) at which the TTL ends."""
    attempts: int
    not_before: float | None = None
    """Wall-clock seconds (epoch) before which it is not delivered again (nacked with a
    delay); None: it waits in its place."""


@dataclass(frozen=True, slots=True)
class Held:
    """A message a queue holds, as a listing of the queue shows it."""

    message: Message
    attempts: int
    accepted_at: float
    """Wall-clock seconds (epoch) of acceptance."""
    expires_at: float
    """Wall-clock seconds (epoch) at which the TTL ends."""
    state: QueuedState
    until: float | None = None
    """Wall-clock seconds (epoch) at which its lease or its delay ends; None while waiting."""


def capacity_limits(
    per_agent: int, total: int, low_priority_share: float
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(per agent, in total) for HIGH and MEDIUM, then for LOW. Priority isolation: LOW may
    fill only a share of a queue and of the broker, so a flood of LOW traffic leaves room for
    HIGH and MEDIUM (which go out first anyway)."""
    low = (max(1, int(per_agent * low_priority_share)), max(1, int(total * low_priority_share)))
    return (per_agent, total), low


class _State(enum.Enum):
    QUEUED = 1
    LEASED = 2
    GONE = 3


@dataclass(slots=True, eq=False)
class _Entry:
    message: Message
    agent_id: str
    rank: int
    sort_time: float
    seq: int
    accepted_at: float
    expires_at: float
    attempts: int = 0
    state: _State = _State.QUEUED
    subscriber: str = ""
    lease_until: float = 0.0
    deferred: bool = False
    """Nacked with a delay: held by nobody until ``lease_until``, then back in its place."""

    def key(self) -> tuple[int, float, int]:
        return (self.rank, self.sort_time, self.seq)


def _compact_at(live: int) -> int:
    """The length past which a heap holding ``live`` current items is rebuilt without the
    others. Heaps drop what is acked, popped or re-leased lazily, when it comes up; without
    this, a broker acking 10,000 messages a second with the default TTL of an hour would keep
    36 million of them in its expiry heap."""
    return 2 * live + 1024


def _live(heap: list[_T], keep: Callable[[_T], bool]) -> list[_T]:
    """The heap rebuilt with the items ``keep`` accepts (linear; the rebuild waits until
    more than half are stale, so each push pays for it a constant amount)."""
    kept = [item for item in heap if keep(item)]
    heapq.heapify(kept)
    return kept


def _lease_is_live(item: tuple[float, int, _Entry]) -> bool:
    until, _, entry = item
    return entry.state is _State.LEASED and entry.lease_until == until


@dataclass(slots=True)
class _AgentQueue:
    heap: list[tuple[int, float, int, _Entry]] = field(default_factory=list)
    by_id: dict[str, _Entry] = field(default_factory=dict)
    leased: dict[str, _Entry] = field(default_factory=dict)
    waiting: list[int] = field(default_factory=lambda: [0, 0, 0])
    dead: int = 0

    @property
    def held(self) -> int:
        return len(self.by_id)


class InMemoryQueueStore:
    """The embedded queue store: bounded heaps in memory, O(log n) per operation."""

    durable = False
    group_commit = False
    shared = False
    replica_id = ""

    def __init__(
        self,
        *,
        max_messages_per_agent: int = 1000,
        max_total_messages: int = 10_000,
        max_delivery_attempts: int = 4,
        max_dead_letters: int = 10_000,
        retry_after_seconds: float = 0.1,
        low_priority_share: float = 0.8,
        fifo: bool = False,
        clock: Clock = time.monotonic,
        wall_clock: WallClock = utc_now,
        listener: StoreListener | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.max_messages_per_agent = max_messages_per_agent
        self.fifo = fifo
        """Queues in arrival order, whatever the priorities (RT-011 queue type fifo)."""
        self.max_total_messages = max_total_messages
        self.max_delivery_attempts = max_delivery_attempts
        self.retry_after_seconds = retry_after_seconds
        self._limits, self._low_limits = capacity_limits(
            max_messages_per_agent, max_total_messages, low_priority_share
        )
        self._clock = clock
        self._wall = wall_clock
        self.listener = listener
        self._queues: dict[str, _AgentQueue] = {}
        self._total = 0
        self._seq = itertools.count()
        self._expiry: list[tuple[float, int, _Entry]] = []
        self._lease_heap: list[tuple[float, int, _Entry]] = []
        self._dead: deque[tuple[str, DeadLetter]] = deque(maxlen=max_dead_letters)
        self._journal = journal

    # -- producing ---------------------------------------------------------------------------

    async def put(
        self,
        message: Message,
        ttl_seconds: float,
        claim: RouteClaim | None = None,
        delay: float = 0.0,
    ) -> bool:
        # (claim: no replica shares this store, so no route is ever looked for)
        agent_id = message.to_agent
        queue = self._queues.get(agent_id)
        if queue is None:
            queue = self._queues[agent_id] = _AgentQueue()
        elif (held := queue.by_id.get(message.message_id)) is not None:
            if held.message.from_agent != message.from_agent:
                raise message_id_taken(agent_id, message.message_id, held.message.from_agent)
            return False  # a retried send of a message the queue already holds
        low = message.priority is Priority.LOW
        per_agent, total = self._low_limits if low else self._limits
        if queue.held >= per_agent or self._total >= total:
            # Expired messages must not hold capacity: drop them before refusing.
            self._expire(self._clock())
            for_low = (
                f" for LOW priority (the last {self.max_messages_per_agent - per_agent} places "
                "are kept for HIGH and MEDIUM)"
                if low
                else ""
            )
            if queue.held >= per_agent:
                raise MessageQueueFullError(
                    f"{agent_id} queue full ({queue.held} of {self.max_messages_per_agent} "
                    f"messages){for_low}",
                    retry_after=self.retry_after_seconds,
                )
            if self._total >= total:
                raise MessageQueueFullError(
                    f"{agent_id} queue full: the broker holds {self._total} of its "
                    f"{self.max_total_messages} messages{for_low}",
                    retry_after=self.retry_after_seconds,
                )
        now = self._clock()
        entry = _Entry(
            message=message,
            agent_id=agent_id,
            rank=message.priority.rank,
            sort_time=message.timestamp.timestamp(),
            seq=next(self._seq),
            accepted_at=now,
            expires_at=now + ttl_seconds,
        )
        self._admit(queue, entry, deferred_until=now + delay if delay > 0 else 0.0)
        if self._journal:
            wall = self._wall().timestamp()
            self._journal.put(
                StoredEntry(
                    message,
                    agent_id,
                    wall,
                    wall + ttl_seconds,
                    0,
                    wall + delay if delay > 0 else None,
                )
            )
        return True

    def _admit(self, queue: _AgentQueue, entry: _Entry, *, deferred_until: float = 0.0) -> None:
        queue.by_id[entry.message.message_id] = entry
        if deferred_until:
            entry.state = _State.LEASED
            queue.leased[entry.message.message_id] = entry
            self._defer(entry, deferred_until)
        else:
            self._push(queue, entry)
        self._total += 1
        heapq.heappush(self._expiry, (entry.expires_at, entry.seq, entry))
        if len(self._expiry) > _compact_at(self._total):
            self._expiry = _live(self._expiry, lambda item: item[2].state is not _State.GONE)

    def restore(self, stored: StoredEntry) -> None:
        """Puts back a message a journal kept, as queued, with its attempts and remaining TTL
        (one nacked with a delay that has not ended waits it out first).

        Capacity is not checked: what was accepted before a restart stays accepted.
        """
        queue = self._queues.get(stored.agent_id)
        if queue is None:
            queue = self._queues[stored.agent_id] = _AgentQueue()
        elif stored.message.message_id in queue.by_id:
            return
        now = self._clock()
        wall = self._wall().timestamp()
        entry = _Entry(
            message=stored.message,
            agent_id=stored.agent_id,
            rank=stored.message.priority.rank,
            sort_time=stored.message.timestamp.timestamp(),
            seq=next(self._seq),
            accepted_at=now - max(0.0, wall - stored.accepted_at),
            expires_at=now + (stored.expires_at - wall),
            attempts=stored.attempts,
        )
        wait = 0.0 if stored.not_before is None else stored.not_before - wall
        self._admit(queue, entry, deferred_until=now + wait if wait > 0 else 0.0)

    def restore_dead_letter(self, agent_id: str, dead: DeadLetter) -> None:
        self._add_dead(agent_id, dead)

    async def sync(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def save_agent(self, info: AgentInfo) -> None:
        if self._journal:
            self._journal.agent(info)

    async def forget_agent(self, agent_id: str) -> None:
        # An agent that left with nothing held and no dead letters leaves no queue behind
        # (agents that come and go under new ids would otherwise pile up empty queues).
        queue = self._queues.get(agent_id)
        if queue is not None and not queue.held and not queue.dead:
            del self._queues[agent_id]
        if self._journal:
            self._journal.agent_gone(agent_id)

    async def update_agent(
        self, agent_id: str, change: Callable[[AgentInfo | None], AgentInfo | None]
    ) -> AgentInfo | None:
        kept = change(await self.saved_agent(agent_id))
        if kept is None:
            await self.forget_agent(agent_id)
        else:
            await self.save_agent(kept)
        return kept

    async def saved_agents(self) -> list[AgentInfo]:
        return []

    async def saved_agent(self, agent_id: str) -> AgentInfo | None:
        return None

    async def watch(self, listener: ReplicaListener) -> None:
        return None

    async def claim_route(self, key: tuple[str, str], ttl: float) -> None:
        return None

    async def give_up_route(self, key: tuple[str, str]) -> None:
        return None

    async def route_of(self, key: tuple[str, str]) -> str | None:
        return None

    async def restore_agent(self, info: AgentInfo) -> bool:
        return False  # (never emptied under its broker: nothing is watched for)

    async def still_holds(self) -> bool:
        return True

    async def forward_answer(self, replica: str, message: Message) -> bool:
        return False

    async def remember_forward(
        self, key: tuple[str, str], agent_id: str, message_id: str, ttl: float
    ) -> None:
        return None

    async def take_forwards(self, key: tuple[str, str]) -> list[tuple[str, str]]:
        return []

    def _push(self, queue: _AgentQueue, entry: _Entry) -> None:
        entry.state = _State.QUEUED
        entry.subscriber = ""
        if self.fifo:
            heapq.heappush(queue.heap, (0, 0.0, entry.seq, entry))
        else:
            heapq.heappush(queue.heap, (entry.rank, entry.sort_time, entry.seq, entry))
        queue.waiting[entry.rank] += 1
        if len(queue.heap) > _compact_at(sum(queue.waiting)):
            queue.heap = _live(queue.heap, lambda item: item[3].state is _State.QUEUED)

    # -- consuming ---------------------------------------------------------------------------

    def _next_queued(self, queue: _AgentQueue, now: float) -> _Entry | None:
        """Pops the next live queued entry off the heap, expiring dead ones on the way."""
        while queue.heap:
            entry = heapq.heappop(queue.heap)[3]
            if entry.state is not _State.QUEUED:
                continue
            queue.waiting[entry.rank] -= 1
            if entry.expires_at <= now:
                self._drop_expired(queue, entry)
                continue
            return entry
        return None

    async def pop(
        self,
        agent_id: str,
        max_messages: int = 0,
        max_bytes: int = 0,
        size_of: Callable[[Message], int] | None = None,
    ) -> list[Popped]:
        queue = self._queues.get(agent_id)
        if queue is None:
            return []
        now = self._clock()
        out: list[Popped] = []
        room = max_bytes if max_bytes > 0 and size_of is not None else -1
        while max_messages <= 0 or len(out) < max_messages:
            entry = self._next_queued(queue, now)
            if entry is None:
                break
            if room >= 0:
                size = size_of(entry.message)  # type: ignore[misc]
                if out and size > room:
                    self._push(queue, entry)  # back in its place: the next pop's first
                    break
                room = max(0, room - size)
            self._forget(queue, entry)
            out.append(Popped(entry.message, now - entry.accepted_at, entry.attempts))
        return out

    async def lease(self, agent_id: str, subscriber: str, lease_seconds: float) -> Lease | None:
        queue = self._queues.get(agent_id)
        if queue is None:
            return None
        expires = self._wall() + timedelta(seconds=lease_seconds)
        return self._lease(queue, subscriber, lease_seconds, self._clock(), expires)

    def _lease(
        self,
        queue: _AgentQueue,
        subscriber: str,
        lease_seconds: float,
        now: float,
        lease_expires_at: datetime,
    ) -> Lease | None:
        entry = self._next_queued(queue, now)
        if entry is None:
            return None
        entry.state = _State.LEASED
        entry.subscriber = subscriber
        entry.deferred = False
        entry.attempts += 1
        entry.lease_until = now + lease_seconds
        queue.leased[entry.message.message_id] = entry
        heapq.heappush(self._lease_heap, (entry.lease_until, entry.seq, entry))
        if len(self._lease_heap) > _compact_at(self._total):
            self._lease_heap = _live(self._lease_heap, _lease_is_live)
        if self._journal:
            self._journal.attempted(self._stored(entry))
        return Lease(
            message=entry.message,
            agent_id=entry.agent_id,
            subscriber=subscriber,
            attempt=entry.attempts,
            lease_expires_at=lease_expires_at,
            queued_seconds=now - entry.accepted_at,
        )

    async def lease_many(
        self, agent_id: str, subscriber: str, lease_seconds: float, most: int
    ) -> list[Lease]:
        """Up to ``most`` leases, taken in one moment: they share one lease deadline."""
        leases: list[Lease] = []
        queue = self._queues.get(agent_id)
        if queue is None:
            return leases
        now = self._clock()
        expires = self._wall() + timedelta(seconds=lease_seconds)
        while len(leases) < most:
            lease = self._lease(queue, subscriber, lease_seconds, now, expires)
            if lease is None:
                break
            leases.append(lease)
        return leases

    async def ack(self, agent_id: str, message_ids: Iterable[str]) -> int:
        queue = self._queues.get(agent_id)
        if queue is None:
            return 0
        count = 0
        for message_id in message_ids:
            entry = queue.leased.get(message_id)
            if entry is None or (entry.deferred and not entry.attempts):
                continue  # (scheduled, never delivered: nothing to acknowledge)
            del queue.leased[message_id]
            self._forget(queue, entry)
            self._released(entry)
            count += 1
        return count

    async def nack(
        self,
        agent_id: str,
        message_ids: Iterable[str],
        *,
        dead_letter_reason: str = "",
        delay: float = 0.0,
    ) -> tuple[int, int]:
        queue = self._queues.get(agent_id)
        if queue is None:
            return (0, 0)
        requeued = dead = 0
        now = self._clock()
        for message_id in message_ids:
            entry = queue.leased.get(message_id)
            if entry is None or entry.deferred:
                continue
            if (
                delay > 0
                and not dead_letter_reason
                and entry.expires_at > now
                and entry.attempts < self.max_delivery_attempts
            ):
                self._defer(entry, now + delay)
                if self._journal:
                    self._journal.deferred(agent_id, message_id, self._wall().timestamp() + delay)
                requeued += 1
                continue
            del queue.leased[message_id]
            outcome = self._return(queue, entry, now, "nacked", final=dead_letter_reason)
            if outcome == "requeued":
                requeued += 1
            elif outcome == "dead":
                dead += 1
        return (requeued, dead)

    def _defer(self, entry: _Entry, until: float) -> None:
        """A nacked delivery held by nobody until ``until``, when the sweep puts it back in
        its place as it does a lease that ended; its subscriber's place in flight is free."""
        self._released(entry)
        entry.subscriber = ""
        entry.deferred = True
        entry.lease_until = until  # (the heap's earlier item for it is now stale)
        heapq.heappush(self._lease_heap, (until, entry.seq, entry))

    async def extend_lease(
        self, agent_id: str, message_ids: Iterable[str], lease_seconds: float
    ) -> int:
        queue = self._queues.get(agent_id)
        if queue is None:
            return 0
        now = self._clock()
        until = now + lease_seconds
        count = 0
        for message_id in message_ids:
            entry = queue.leased.get(message_id)
            if entry is None or entry.lease_until <= now or entry.deferred:
                continue  # (ended, the sweep to come; or nacked, to come back later)
            entry.lease_until = until  # (the heap's earlier item for it is now stale)
            heapq.heappush(self._lease_heap, (until, entry.seq, entry))
            count += 1
        if len(self._lease_heap) > _compact_at(self._total):
            self._lease_heap = _live(self._lease_heap, _lease_is_live)
        return count

    async def withdraw(self, agent_id: str, message_ids: Iterable[str]) -> tuple[int, int]:
        queue = self._queues.get(agent_id)
        if queue is None:
            return (0, 0)
        waiting = leased = 0
        for message_id in message_ids:
            entry = queue.by_id.get(message_id)
            if entry is None:
                continue
            if entry.state is _State.QUEUED:
                queue.waiting[entry.rank] -= 1  # (its heap item goes stale)
                waiting += 1
            else:
                del queue.leased[message_id]
                leased += 1
            self._forget(queue, entry)
            self._released(entry, withdrawn=True)
        return (waiting, leased)

    async def cancel(self, agent_id: str, sender: str, message_ids: Iterable[str]) -> list[str]:
        queue = self._queues.get(agent_id)
        if queue is None:
            return []
        cancelled = []
        for message_id in dict.fromkeys(message_ids):
            entry = queue.by_id.get(message_id)
            if entry is None or entry.message.from_agent != sender:
                continue
            if entry.state is _State.QUEUED:
                queue.waiting[entry.rank] -= 1  # (its heap item goes stale)
            elif entry.deferred:
                del queue.leased[message_id]  # (its lease heap item goes stale)
            else:
                continue  # in flight: its handler has it
            self._forget(queue, entry)
            cancelled.append(message_id)
        return cancelled

    async def still_leased(
        self, agent_id: str, subscriber: str, message_ids: Collection[str]
    ) -> set[str]:
        queue = self._queues.get(agent_id)
        if queue is None:
            return set()
        return {
            message_id
            for message_id in message_ids
            if (entry := queue.leased.get(message_id)) is not None
            and entry.subscriber == subscriber
        }

    async def release_subscriber(
        self, agent_id: str, subscriber: str, *, seen: Collection[str] | None = None
    ) -> int:
        queue = self._queues.get(agent_id)
        if queue is None:
            return 0
        now = self._clock()
        mine = [e for e in queue.leased.values() if e.subscriber == subscriber]
        for entry in mine:
            message_id = entry.message.message_id
            del queue.leased[message_id]
            unseen = seen is not None and message_id not in seen
            self._return(queue, entry, now, "subscriber left", unseen=unseen)
        return len(mine)

    def _return(
        self,
        queue: _AgentQueue,
        entry: _Entry,
        now: float,
        why: str,
        *,
        final: str = "",
        unseen: bool = False,
    ) -> str:
        """Puts a leased entry back in its place: "requeued", "expired" or "dead" (at once
        with the reason ``final``, when given). ``unseen``: its delivery never reached the
        application, and does not count as an attempt."""
        self._released(entry)
        if unseen:
            entry.attempts = max(entry.attempts - 1, 0)
        due = entry.deferred and not entry.attempts  # (scheduled, never delivered yet)
        if entry.expires_at <= now:
            self._drop_expired(queue, entry)
            return "expired"
        if final or entry.attempts >= self.max_delivery_attempts:
            self._forget(queue, entry)
            dead = DeadLetter(
                message=entry.message,
                reason=final or f"{why} after {entry.attempts} delivery attempts",
                attempts=entry.attempts,
                dead_lettered_at=self._wall(),
            )
            self._add_dead(entry.agent_id, dead)
            if self._journal:
                self._journal.dead(entry.agent_id, dead)
            if self.listener:
                self.listener.on_dead_letter(dead)
            return "dead"
        self._push(queue, entry)
        if self._journal:
            self._journal.attempted(self._stored(entry))
        if self.listener:
            if due:
                self.listener.on_due(entry.message)
            else:
                self.listener.on_redelivery(entry.message, entry.attempts + 1)
        return "requeued"

    def _add_dead(self, agent_id: str, dead: DeadLetter) -> None:
        queue = self._queues.get(agent_id)
        if queue is None:
            queue = self._queues[agent_id] = _AgentQueue()
        queue.dead += 1
        if len(self._dead) == self._dead.maxlen:
            evicted_agent = self._dead[0][0]
            if evicted_agent in self._queues:
                self._queues[evicted_agent].dead -= 1
        self._dead.append((agent_id, dead))

    def _stored(self, entry: _Entry) -> StoredEntry:
        now = self._clock()
        wall = self._wall().timestamp()
        return StoredEntry(
            entry.message,
            entry.agent_id,
            wall - (now - entry.accepted_at),
            wall + (entry.expires_at - now),
            entry.attempts,
        )

    def _released(self, entry: _Entry, *, withdrawn: bool = False) -> None:
        if self.listener and entry.subscriber:
            self.listener.on_released(
                Released(entry.message.message_id, entry.agent_id, entry.subscriber, withdrawn)
            )

    def _forget(self, queue: _AgentQueue, entry: _Entry) -> None:
        entry.state = _State.GONE
        if queue.by_id.get(entry.message.message_id) is entry:
            del queue.by_id[entry.message.message_id]
            self._total -= 1
            if self._journal:
                self._journal.removed(entry.agent_id, entry.message.message_id)

    def _drop_expired(self, queue: _AgentQueue, entry: _Entry) -> None:
        self._forget(queue, entry)
        if self.listener:
            self.listener.on_expired(entry.message)

    # -- housekeeping ------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            entry = heapq.heappop(self._expiry)[2]
            if entry.state is not _State.QUEUED:
                continue  # gone, or leased: a lease that ends after the TTL expires then.
            queue = self._queues[entry.agent_id]
            queue.waiting[entry.rank] -= 1
            self._drop_expired(queue, entry)

    async def sweep(self) -> None:
        now = self._clock()
        self._expire(now)
        while self._lease_heap and self._lease_heap[0][0] <= now:
            until, _, entry = heapq.heappop(self._lease_heap)
            if entry.state is not _State.LEASED or entry.lease_until != until:
                continue
            queue = self._queues[entry.agent_id]
            del queue.leased[entry.message.message_id]
            self._return(queue, entry, now, "lease expired")

    # -- reading -----------------------------------------------------------------------------

    async def stats(self, agent_id: str | None = None) -> list[QueueStats]:
        self._expire(self._clock())
        ids = [agent_id] if agent_id is not None else sorted(self._queues)
        out = []
        for aid in ids:
            q = self._queues.get(aid)
            if q is None:
                out.append(QueueStats(aid, 0, 0, 0, 0, 0))
                continue
            deferred = sum(1 for entry in q.leased.values() if entry.deferred)
            out.append(
                QueueStats(
                    aid,
                    q.waiting[0],
                    q.waiting[1],
                    q.waiting[2],
                    len(q.leased) - deferred,
                    q.dead,
                    deferred,
                )
            )
        return out

    async def held(self) -> int:
        return self._total

    async def listing(self, agent_id: str) -> list[Held]:
        queue = self._queues.get(agent_id)
        if queue is None:
            return []
        now = self._clock()
        self._expire(now)
        wall = self._wall().timestamp()
        queued = [e for e in queue.by_id.values() if e.state is _State.QUEUED]
        queued.sort(key=(lambda e: e.seq) if self.fifo else _Entry.key)
        out = [self._held(entry, now, wall, QueuedState.WAITING) for entry in queued]
        out.extend(
            self._held(
                entry,
                now,
                wall,
                QueuedState.DEFERRED if entry.deferred else QueuedState.IN_FLIGHT,
                wall + (entry.lease_until - now),
            )
            for entry in sorted(
                queue.leased.values(), key=lambda e: (e.lease_until, e.message.message_id)
            )
        )
        return out

    @staticmethod
    def _held(
        entry: _Entry, now: float, wall: float, state: QueuedState, until: float | None = None
    ) -> Held:
        return Held(
            entry.message,
            entry.attempts,
            wall - (now - entry.accepted_at),
            wall + (entry.expires_at - now),
            state,
            until,
        )

    async def depth(self, agent_id: str) -> int:
        q = self._queues.get(agent_id)
        return sum(q.waiting) if q else 0

    async def dead_letters(self, agent_id: str | None = None) -> list[DeadLetter]:
        return [d for aid, d in self._dead if agent_id is None or aid == agent_id]

    async def remove_dead_letters(self, agent_id: str, message_ids: Collection[str]) -> int:
        ids = set(message_ids)
        kept = [
            (aid, d) for aid, d in self._dead if aid != agent_id or d.message.message_id not in ids
        ]
        removed = len(self._dead) - len(kept)
        if removed:
            self._dead = deque(kept, maxlen=self._dead.maxlen)
            self._queues[agent_id].dead -= removed
            if self._journal:
                self._journal.undead(agent_id, ids)
        return removed


PRIORITY_BY_RANK = (Priority.HIGH, Priority.MEDIUM, Priority.LOW)

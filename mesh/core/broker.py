"""The broker core: routing, request/response correlation, subscriptions, broadcast, hand-off.

Plain asyncio over a :class:`~mesh.core.queue.QueueStore`; no transport here. The gRPC
servicer translates calls into these methods and errors into statuses.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import math
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Collection, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from mesh.config import BrokerConfig
from mesh.core import workflows
from mesh.core.durable import open_store
from mesh.core.errors import (
    AgentError,
    AgentNotFoundError,
    BrokerUnavailableError,
    FieldViolation,
    HandoffError,
    LimitExceededError,
    MeshError,
    MessageIdTakenError,
    MessageQueueFullError,
    MessageValidationError,
    RequestTimeoutError,
    RoutingError,
    SessionClosedError,
    deregistered,
)
from mesh.core.logthrottle import LogThrottle
from mesh.core.memory import MemoryPool, SharedMemoryPool
from mesh.core.model import (
    ANSWER_TYPES,
    BROADCAST_TARGET,
    MAX_DEAD_LETTER_REASON,
    AgentInfo,
    DeadLetter,
    Delivery,
    Handoff,
    Message,
    MessageType,
    Priority,
    QueuedMessage,
    due_in,
    receipt_of,
    utc_now,
)
from mesh.core.queue import (
    GIVEN_UP_ROUTE,
    GIVEN_UP_SECONDS,
    MAX_FORWARDS,
    QueueStats,
    QueueStore,
    Released,
    RouteClaim,
)
from mesh.core.registry import AgentRegistry, named
from mesh.core.state import SharedState, StateStore
from mesh.core.tasks import cancel_and_wait, stop_if_cancelled
from mesh.core.validation import handoff_violations, missing_fields, validate_message
from mesh.metrics import BrokerMetrics, Totals
from mesh.tracing import extract, headers_for, records_under, tracer, without_trace

logger = logging.getLogger("mesh.broker")
handoff_logger = logging.getLogger("mesh.handoff")

MAX_REFUSAL_TEXT = 2048
"""How much of an answer's refusal the ERROR that takes its place says."""
MAX_TELLING = 1000
"""Dead letters whose requesters, waiting on other replicas, are being told at once (each a
look-up of the replica and a publish on the shared store); past that, such a requester waits
for its deadline."""
_ASKING_TYPES = (MessageType.REQUEST, MessageType.HANDOFF, MessageType.BROADCAST)
_SETTLING_TYPES = (*ANSWER_TYPES, MessageType.ACK)
"""What a draining broker still takes: answers, and acknowledgements of the work it holds."""


@dataclass(frozen=True, slots=True)
class SendOutcome:
    """An accepted message and the agents whose queues (or waiting requesters) received it."""

    message: Message
    recipients: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BroadcastOutcome:
    message: Message
    recipients: tuple[str, ...]
    failures: tuple[tuple[str, MeshError], ...]


@dataclass(frozen=True, slots=True)
class GatherItem:
    """One agent's outcome in a gather: its answer, or why there is none."""

    agent_id: str
    response: Message | None = None
    error: MeshError | None = None

    def answer(self) -> Message:
        """The agent's RESPONSE; raises why there is none: the gather's error for it (no
        answer in time, not registered, ...), or the ERROR it answered with, as AgentError."""
        if self.error is not None:
            raise self.error
        response = self.response
        if response is None or response.message_type is MessageType.ERROR:
            content = (response.content if response is not None else None) or {}
            raise AgentError(str(content.get("error") or "agent error"))
        return response


class _Away(NamedTuple):
    """An instance taking its messages by push whose server the push delivery cannot reach."""

    since: datetime
    refuses: str = ""
    """When its server answers but refuses the agent's messages as a whole, why: "is another
    agent's (...)", "refuses the broker's credentials (...)". Empty: it does not answer."""


class _Gathering:
    """Answers expected from several agents to one correlation id, until its deadline."""

    def __init__(self, expected: Iterable[str]) -> None:
        self.expected = set(expected)
        # One answer per agent, then None when the deadline passes (see time_out).
        self.answers: asyncio.Queue[Message | None] = asyncio.Queue(len(self.expected) + 1)
        self.timed_out = False

    def offer(self, message: Message) -> bool:
        if self.timed_out or message.from_agent not in self.expected:
            return False
        self.expected.discard(message.from_agent)
        self.answers.put_nowait(message)
        return True

    def time_out(self) -> None:
        """The deadline: no answer is taken from now on (those left in ``expected`` did not
        answer in time), and the reader, past the answers that came before, finds None."""
        if not self.timed_out:
            self.timed_out = True
            self.answers.put_nowait(None)


@dataclass(frozen=True, slots=True)
class AgentQueueStats:
    queue: QueueStats
    subscribers: int


STORE_RETRY_SECONDS = 0.5
"""How soon a subscription tries its queue again while the store cannot be reached."""
STOP_WAIT_SECONDS = 5.0
"""How long a stopping broker waits for the subscriptions still ending (their leases handed
back, their instances taken off) before it closes its store."""
CREDIT_CHECK_SECONDS = 10.0
"""How often, with replicas, each subscription's places in flight are checked against the
store's leases: a release another replica published while this one was not listening (its
connection to Redis down a moment) would otherwise keep a place taken."""
LOST_CHECK_SECONDS = 60.0
"""How often the registry is looked through for agents nobody has served for
``forget_lost_after`` (at least four times within that time, when it is shorter)."""


def _expire(waiter: asyncio.Future[Message]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Subscription:
    """A push subscription on one agent's queue, with at most ``max_in_flight`` unacked."""

    _ids = itertools.count(1)

    def __init__(
        self,
        broker: Broker,
        agent_id: str,
        max_in_flight: int,
        lease_seconds: float,
        *,
        withdrawals: bool = False,
        instance: str = "",
    ) -> None:
        self.broker = broker
        self.agent_id = agent_id
        self.instance = instance
        """The address of the agent's instance this subscription serves (its process's own
        server), when it named one: the subscription keeps it among the agent's instances."""
        # Unique across replicas sharing a store: leases name their subscriber.
        self.subscription_id = f"{agent_id}#{broker.instance}-{next(self._ids)}"
        self.max_in_flight = self._or_default(max_in_flight)
        self.lease_seconds = lease_seconds
        self.in_flight: set[str] = set()
        self.leased = 0
        """Leases taken so far (a check of ``in_flight`` against the store that spans a lease
        cannot tell a place freed from one taken again: it waits for another time)."""
        self.withdrawals = withdrawals
        """Whether the subscriber asked to be told of deliveries withdrawn from it."""
        self.withdrawn: list[str] = []
        """Deliveries withdrawn (their requester gave up) that the subscriber is yet to be
        told of: at most what it held in flight (none is leased while any waits here)."""
        self.closed = False
        self.ended_by: MeshError | None = None
        """Why the broker ended the subscription, when it did (its agent was deregistered):
        what :meth:`next_batch` raises then, for the subscriber to be told."""
        self._ending: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._drained = False
        """The last lease took fewer messages than it asked for: every ready one."""
        self._leasing = False

    def wake(self) -> None:
        self._wake.set()

    def resize(self, max_in_flight: int) -> None:
        """Takes another count of deliveries unacked at most (0: the broker's default) at
        once: more leases as soon as there is room; fewer, none until those held are fewer."""
        self.max_in_flight = self._or_default(max_in_flight)
        self.wake()

    def _or_default(self, max_in_flight: int) -> int:
        return max_in_flight or self.broker.config.default_max_in_flight

    async def next(self) -> Delivery:
        """Waits for the next message and leases it to this subscription (withdrawals are
        for callers of :meth:`next_batch`: this passes them by)."""
        while not (batch := await self.next_batch(1)):
            self.take_withdrawn()
        return batch[0]

    async def next_batch(self, most: int) -> list[Delivery]:
        """Waits until a message is ready, then leases it and up to ``most - 1`` more that
        are ready too (within max_in_flight), in queue order; never waits for more. Returns
        an empty list, before leasing anything, when deliveries were withdrawn that the
        subscriber is yet to be told of (see :meth:`take_withdrawn`).

        Whatever makes a message ready for it (a send, a redelivery, another replica's
        queueing) wakes the subscription, and so does a settled delivery while it lacked the
        credit to lease: after a lease that found the queue empty, or took the last ready
        messages, it waits for a wake-up before it asks the store again."""
        while True:
            if self._drained and not self._wake.is_set():
                await self._wake.wait()  # (leasing now would find nothing)
            if self.withdrawn:
                return []
            self._drained = False
            self._wake.clear()
            if self.closed:
                raise self.ended_by or SessionClosedError(
                    f"subscription {self.subscription_id} is closed"
                )
            credit = self.max_in_flight - len(self.in_flight)
            if credit <= 0:
                await self._wake.wait()  # a settled delivery gives a place back
                continue
            asked = min(most, credit)
            try:
                batch = await self._lease(asked)
            except BrokerUnavailableError:
                # The store is away (the sweeper says so): the subscription stays, and
                # looks again at the next wake-up or in a moment.
                await self._pause()
                continue
            except MeshError:
                raise
            except Exception:
                # A failure the store does not name (its client's connection torn down
                # under a call, say): the same, said. Raised, it would end the task that
                # writes this subscription's deliveries, and leave its subscriber waiting
                # for ever; what a lease cut off took comes back when the lease ends.
                if (held := self.broker.lease_failures.admit(self.subscription_id)) is not None:
                    logger.exception(
                        "leasing for subscription %s failed; trying again%s",
                        self.subscription_id,
                        f" ({held} more failures since the last said)" if held else "",
                    )
                await self._pause()
                continue
            self._drained = len(batch) < asked
            if batch:
                return batch

    async def _pause(self) -> None:
        """Until the next wake-up, or :data:`STORE_RETRY_SECONDS` at most."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STORE_RETRY_SECONDS):
                await self._wake.wait()

    async def _lease(self, most: int) -> list[Delivery]:
        """Up to ``most`` ready messages, leased to this subscription (while the store is
        asked, a place given back wakes nothing: see :meth:`credit_freed`)."""
        self._leasing = True
        try:
            return await self.broker._lease_many(self, most)
        finally:
            self._leasing = False

    def take_withdrawn(self) -> list[str]:
        """The deliveries withdrawn since the last call, for the subscriber to hear of."""
        withdrawn, self.withdrawn = self.withdrawn, []
        return withdrawn

    def credit_freed(self) -> None:
        """One of its leases ended (settled, expired, handed back): worth a look at the queue
        unless the subscription had emptied it (a message that comes wakes it anyway), or is
        leasing now: that lease either empties the queue, or takes all it asked for and the
        next looks without waiting (either way with the credit counted as it is then)."""
        if not self._drained and not self._leasing:
            self._wake.set()

    async def close(self, *, seen: Collection[str] | None = None, lost: bool = False) -> None:
        """Ends the subscription; its unacknowledged messages go back to the queue. With
        ``seen`` (the deliveries the subscriber's application had and did not settle), only
        those count their delivery attempt; the others go back as if never delivered.
        ``lost``: the subscriber did not end it (its stream broke: its process died, or its
        connection), so the instance it named is taken off its agent's."""
        await asyncio.shield(self.end(seen=seen, lost=lost))

    def end(self, *, seen: Collection[str] | None = None, lost: bool = False) -> asyncio.Task[None]:
        """Starts ending the subscription (see :meth:`close`) and returns the task that does
        it. The broker keeps that task to its end, whatever becomes of whoever awaits it:
        ended in the handler of a stream whose client went, on a store that must be waited
        on (SQLite, Redis), it was cut short (grpc.aio keeps no hold on a handler it has
        cancelled), and the subscription, half closed, kept its instance named for good."""
        if self._ending is None:
            self.closed = True
            self._wake.set()
            self._ending = self.broker.outlive(
                self.broker._unsubscribe(self, seen, lost=lost),
                f"ending-{self.subscription_id}",
            )
        return self._ending

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Delivery:
        try:
            return await self.next()
        except SessionClosedError:
            raise StopAsyncIteration from None


def _log_fan_out(
    message: Message,
    agent_types: tuple[str, ...],
    recipients: list[str],
    failed: list[str],
    seconds: float,
    *,
    gather: bool = False,
) -> None:
    """The structured event of a broadcast (selective when it names agent types), or of a
    gather's fan-out: who got a copy, who could not."""
    logger.info(
        "%s from %s to %d agents",
        "gather" if gather else "broadcast",
        message.from_agent,
        len(recipients),
        extra={
            "event": {
                "category": "gather" if gather else "broadcast",
                "message_id": message.message_id,
                "message_type": message.message_type.value,
                "from_agent": message.from_agent,
                "agent_types": list(agent_types),
                "recipients": recipients,
                "failed": failed,
                "latency_ms": round(seconds * 1000, 3),
            }
        },
    )


def _replica_of(subscription_id: str) -> str:
    """The replica (broker instance) a subscription id names: ``agent#replica-n``."""
    return subscription_id.rpartition("#")[2].rpartition("-")[0]


EXPIRED_REASON = "REQUEST_EXPIRED"
"""The reason of the ERROR that tells a requester its request expired in the queue."""


def _expired_in_queue(answer: Message) -> RequestTimeoutError | None:
    """The timeout an ERROR answer stands for when it says the request expired in the queue."""
    content = answer.content
    if content is None or content.get("reason") != EXPIRED_REASON:
        return None
    return RequestTimeoutError(str(content.get("error", "")))


def _said_for(
    agent_id: str, requester: str, correlation_id: str, error: str, reason: str
) -> Message:
    """The ERROR the broker gives a requester in the place of an answer that will not come
    (refused, or dead-lettered), as from the agent it asked."""
    return Message(
        from_agent=agent_id,
        to_agent=requester,
        message_type=MessageType.ERROR,
        content={"action": "error", "error": error[:MAX_REFUSAL_TEXT], "reason": reason},
        correlation_id=correlation_id,
        priority=Priority.HIGH,
    )


def _lost_before(info: AgentInfo, cutoff: datetime) -> bool:
    """Whether no instance has served the agent since before ``cutoff``: its last was lost
    then (one that registered or subscribed since would have cleared ``lost_at``)."""
    return not info.instances and info.lost_at is not None and info.lost_at <= cutoff


class Broker:
    """Routes messages between agents (RF-009)."""

    def __init__(
        self,
        config: BrokerConfig | None = None,
        *,
        store: QueueStore | None = None,
        metrics: BrokerMetrics | None = None,
    ) -> None:
        self.config = config or BrokerConfig()
        self.metrics = metrics or BrokerMetrics()
        self.registry = AgentRegistry(
            self.config.max_agents, self.config.max_id_length, self.config.max_in_flight_limit
        )
        self.memory: MemoryPool = SharedMemoryPool(capacity=self.config.max_insights)
        self.state: StateStore = SharedState(capacity=self.config.max_state_entries)
        if store is None:
            store = open_store(
                self.config.store,
                max_messages_per_agent=self.config.max_messages_per_agent,
                max_total_messages=self.config.max_total_messages,
                max_delivery_attempts=self.config.delivery_attempts,
                max_dead_letters=self.config.max_dead_letters,
                retry_after_seconds=self.config.retry_after_seconds,
                low_priority_share=self.config.low_priority_share,
                fifo=self.config.queue_type == "fifo",
            )
        self.store = store
        store.listener = self
        shared = getattr(store, "shared_memory", None)
        if shared is not None:  # a store that keeps these (for every replica, or on disk)
            self.memory, self.state = shared(
                max_insights=self.config.max_insights,
                max_state_entries=self.config.max_state_entries,
            )
        self._pending: dict[tuple[str, str], asyncio.Future[Message] | _Gathering] = {}
        self._ended_at: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        """Requests and gathers that ended (answered, past their deadline, given up) and until
        when they are remembered, most recent last: an answer to one now (late, or a second
        one after a redelivery) is expected, not an error."""
        self._routes: dict[tuple[str, str], float] = {}
        """With replicas (a shared store): until when (``time.monotonic()``) each request and
        gather waiting here waits, so that a store that lost its routes gets them again."""
        self._forwards: dict[tuple[str, str], list[tuple[str, str]]] = {}
        """For a request sent and not yet answered: where its agents handed it on (agent id,
        message id), so that giving it up withdraws the forwards too."""
        self._refusing: set[str] = set()
        """Ids of messages being dead-lettered now by a side that tells their requesters
        itself (a push agent's refusal, in the agent's own words)."""
        self._telling: set[asyncio.Task[None]] = set()
        """Dead letters' ERRORs on their way to requesters waiting on other replicas."""
        self._catching_up: asyncio.Task[None] | None = None
        """Reading the registry again after the news of the other replicas was lost."""
        self._catch_up_again = False
        """Asked to read it again since the reading under way began."""
        self._restoring = False
        """The store came back empty, and this replica has not yet kept its registrations
        there again."""
        self._outliving: set[asyncio.Task[None]] = set()
        """Work that must end even when whoever started it is cancelled (:meth:`outlive`)."""
        self._subscriptions: dict[str, list[Subscription]] = {}
        self._by_subscription: dict[str, Subscription] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.draining = False
        self._stopping = False
        # Names this broker in subscription ids; replicas sharing a store use the store's
        # replica id, so that a lease tells which replica's subscriber holds it.
        self.instance = store.replica_id or secrets.token_hex(4)
        self._queue_full_log = LogThrottle(max_keys=self.config.max_agents)
        self._receipt_log = LogThrottle(max_keys=self.config.max_agents)
        self.lease_failures = LogThrottle(10.0, max_keys=self.config.max_agents)
        """Subscriptions whose leasing failed unforeseen: said once in ten seconds each."""
        self._workflow_log_at = -math.inf
        """When a workflow status that could not be written was last logged."""
        self._credit_checked = time.monotonic()
        self._lost_checked = time.monotonic()
        self._held_before: list[tuple[str, str, str]] = []
        """Instances that subscriptions held before this broker restarted on its durable
        store (agent id, address, subscription): each that no subscription holds again within
        a lease of the start (its process died meanwhile) is taken off."""
        self._held_before_until = 0.0
        self._replicas_gone: set[str] = set()
        """Replicas found dead whose subscriptions' instances are still to be taken off."""
        self._unreachable: dict[str, dict[str, _Away]] = {}
        """Instances of agents taking their messages by push whose server cannot be reached,
        as the push delivery finds them: agent id -> address -> since when, and why."""
        self.registry_watchers: list[Callable[[str], None]] = []
        """Called with an agent's id when it registered, left or changed (here or through
        another replica): what follows the registry (push delivery) looks at it again."""
        self.store_answers = True
        """Whether the queue store answered the last sweep: a store in another process
        (Redis) can be away, and while it is, nothing can be sent or delivered."""
        self.store_watchers: list[Callable[[], None]] = []
        """Called when ``store_answers`` changed (the server's health follows it)."""

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        for info in await self.store.saved_agents():
            if info.agent_id not in self.registry:
                self.registry.register(info, restore=True)
                if not self.store.shared:  # (no subscription outlives its broker)
                    self._held_before.extend((info.agent_id, *h) for h in info.subscribed.items())
        self._held_before_until = time.monotonic() + self.config.lease_seconds
        if self.store.shared:
            await self.store.watch(self)
        gauges = self.metrics.queues  # read from the queues when /metrics is scraped
        gauges.loop, gauges.refresh = asyncio.get_running_loop(), self._read_gauges
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="broker-sweeper")

    async def stop(self) -> None:
        self._stopping = True  # the sweeper ends even if a store call swallows its cancellation
        self.metrics.queues.refresh = None
        await cancel_and_wait(self._sweeper)
        self._sweeper = None
        for subs in list(self._subscriptions.values()):
            for sub in list(subs):
                await sub.close()
        for telling in list(self._telling):
            await cancel_and_wait(telling)
        await cancel_and_wait(self._catching_up)
        if self._outliving:
            await asyncio.wait(set(self._outliving), timeout=STOP_WAIT_SECONDS)
        for future in self._pending.values():
            if isinstance(future, asyncio.Future) and not future.done():
                future.set_exception(SessionClosedError("the broker is shutting down"))
        await self.state.close()
        await self.store.close()

    def outlive(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Runs ``work`` in a task of its own, kept until it ends (stopping waits for it), so
        that cancelling whoever awaits it does not cut it short; a failure is logged."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._outliving.add(task)
        task.add_done_callback(self._outlived)
        return task

    def _outlived(self, task: asyncio.Task[None]) -> None:
        self._outliving.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error("%s failed: %r", task.get_name(), error, exc_info=error)

    def _refuse_new_work(self) -> None:
        raise BrokerUnavailableError(
            "the broker is shutting down: send to another replica or retry later",
            reason="SHUTTING_DOWN",
        )

    async def drain(self, grace: float) -> int | None:
        """Graceful shutdown, first half: refuses new work (UNAVAILABLE) but still takes
        answers and acknowledgements, and waits up to ``grace`` seconds for subscribed agents
        to empty their queues and for requests in flight to be answered.

        Returns how many messages are still held when it ends (they stay in a durable store;
        the in-memory store loses them, which is logged); None when the store cannot be
        reached, which ends the wait (nothing can be delivered meanwhile): what it holds
        stays in it.
        """
        self.draining = True
        await self.state.close()  # (a watch is no work in flight: its watcher goes elsewhere)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        try:
            while loop.time() < deadline and await self._busy():  # noqa: ASYNC110 - polls
                await asyncio.sleep(0.02)
            held = await self.store.held()
        except BrokerUnavailableError as error:
            logger.warning(
                "shutting down without counting the messages held, which stay in the store: %s",
                error,
                extra={"event": {"category": "shutdown", "store": "unavailable"}},
            )
            return None
        if held:
            logger.warning(
                "shutting down with %d messages held (%s)",
                held,
                "kept by the durable store"
                if self.store.durable
                else "lost with the in-memory store: use a durable store to keep them",
                extra={"event": {"category": "shutdown", "held": held}},
            )
        return held

    async def _busy(self) -> bool:
        if any(isinstance(p, asyncio.Future) and not p.done() for p in self._pending.values()):
            return True
        for agent_id, subs in self._subscriptions.items():
            if subs and (any(sub.in_flight for sub in subs) or await self.store.depth(agent_id)):
                return True
        return False

    async def __aenter__(self) -> Broker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _sweep_forever(self) -> None:
        while not self._stopping:
            stop_if_cancelled()
            await asyncio.sleep(self.config.sweep_interval)
            try:
                await self.sweep()
            except BrokerUnavailableError as error:
                if self.store_answers:  # (said once per outage of the store, not every pass)
                    logger.warning("queue sweeps fail until the store is back: %s", error)
                    self._store_answered(False)
                continue
            except Exception:  # the sweeper must outlive any one bad pass
                logger.exception("queue sweep failed")
                continue
            if not self.store_answers:
                logger.info("queue sweeps work again: the store is back")
                self._store_answered(True)

    def _store_answered(self, answers: bool) -> None:
        self.store_answers = answers
        for watcher in self.store_watchers:
            watcher()

    async def sweep(self) -> None:
        """Expires messages and reclaims ended leases (and, with replicas, every
        CREDIT_CHECK_SECONDS, checks the subscriptions' places in flight; every
        LOST_CHECK_SECONDS, forgets the agents nobody has served for long)."""
        await self.store.sweep()
        while self._held_before and time.monotonic() >= self._held_before_until:
            agent_id, address, held_by = self._held_before[-1]
            await self._lose_instance(
                agent_id,
                address,
                held_by,
                "it did not subscribe again within a lease of the broker's restart",
            )
            self._held_before.pop()
        if self._replicas_gone:
            await self._lose_instances_of_replicas()
        if self.store.shared and time.monotonic() - self._credit_checked >= CREDIT_CHECK_SECONDS:
            self._credit_checked = time.monotonic()
            await self._check_credit()
        if (forget_after := self.config.forget_lost_after) and time.monotonic() - (
            self._lost_checked
        ) >= min(LOST_CHECK_SECONDS, forget_after / 4):
            self._lost_checked = time.monotonic()
            await self._forget_long_lost(utc_now() - timedelta(seconds=forget_after))

    async def _forget_long_lost(self, cutoff: datetime) -> None:
        """Takes off the registry every agent whose last instance was lost before ``cutoff``
        and that no instance has served since (``forget_lost_after``); first, every instance
        taking its messages by push whose server has not answered (or has refused the agent's
        messages as a whole) since before ``cutoff`` is lost, as of when it began."""
        for agent_id, away in list(self._unreachable.items()):
            for address, (since, refuses) in list(away.items()):
                if since <= cutoff:
                    how = refuses or "has not answered"
                    await self._lose_instance(
                        agent_id,
                        address,
                        "",
                        f"its server {how} since {since.isoformat(timespec='seconds')}",
                        since=since,
                    )
        known = await self.store.saved_agents() if self.store.shared else list(self.registry)
        for info in known:
            if _lost_before(info, cutoff) and not self._subscriptions.get(info.agent_id):
                await self._forget(info.agent_id, cutoff)

    async def _forget(self, agent_id: str, cutoff: datetime) -> None:
        forgotten: list[AgentInfo] = []
        if self.store.shared:

            def forget(saved: AgentInfo | None) -> AgentInfo | None:
                forgotten.clear()
                if saved is not None and _lost_before(saved, cutoff):
                    forgotten.append(saved)
                    self.registry.discard(agent_id)
                    return None
                self._as_kept(agent_id, saved)
                return saved

            await self.store.update_agent(agent_id, forget)
        else:
            info = self.registry.get(agent_id)
            if info is not None and _lost_before(info, cutoff):
                forgotten.append(self.registry.deregister(agent_id))
                await self.store.forget_agent(agent_id)
        if not forgotten:
            return  # (it came back meanwhile, or another replica forgot it first)
        await self.store.sync()
        self._unreachable.pop(agent_id, None)
        self._registry_changed(agent_id)
        self.metrics.agent_gone(agent_id, forgotten=True)
        lost_at = forgotten[0].lost_at
        assert lost_at is not None
        logger.warning(
            "agent %s forgotten: no instance has served it since %s (forget_lost_after %g s);"
            " what waits in its queue stays until its ttl ends, for one that registers again",
            agent_id,
            lost_at.isoformat(timespec="seconds"),
            self.config.forget_lost_after,
            extra={
                "event": {
                    "category": "registry",
                    "agent_id": agent_id,
                    "forgotten": True,
                    "lost_at": lost_at.isoformat(),
                }
            },
        )

    async def _check_credit(self) -> None:
        """Gives each subscription back the places in flight whose leases ended without this
        replica hearing of it."""
        for subs in list(self._subscriptions.values()):
            for sub in list(subs):
                if not sub.in_flight:
                    continue
                taken, leased = set(sub.in_flight), sub.leased
                held = await self.store.still_leased(sub.agent_id, sub.subscription_id, taken)
                if sub.leased != leased:
                    continue  # (it leased meanwhile, perhaps one of these again: next time)
                if ended := taken - held:
                    sub.in_flight.difference_update(ended)
                    logger.info(
                        "subscription %s: %d leases had ended unheard of; their places are free",
                        sub.subscription_id,
                        len(ended),
                    )
                    sub.credit_freed()

    async def _read_gauges(self) -> None:
        """Reads every queue's depth, and the messages held, into the gauges (as /metrics is
        scraped: in one pass over the store, queues changed through other replicas
        included). Every registered agent has a depth, 0 when nothing waits for it; an
        agent that left has one while messages still wait for it. Every agent taking its
        messages by push has a count of its instances this broker cannot reach."""
        depths = dict.fromkeys(self.registry.ids(), 0)
        held = 0
        for queue in await self.store.stats():
            held += queue.held
            if queue.depth or queue.agent_id in depths:
                depths[queue.agent_id] = queue.depth
        gauges = self.metrics.queues
        gauges.depths, gauges.held = depths, held
        gauges.watches = len(self.state.watchers)
        gauges.watches_ended = dict(self.state.watchers.ended)  # (read by another thread)
        unreachable: dict[str, int] = {}
        for info in self.registry:
            if pushed := info.push_instances:
                away = self._unreachable.get(info.agent_id, {})
                unreachable[info.agent_id] = sum(1 for a in pushed if a in away)
        gauges.unreachable = unreachable

    # -- registry ----------------------------------------------------------------------------

    async def register(self, info: AgentInfo) -> AgentInfo:
        """Registers an agent, or one more instance of it (another process serving the same
        agent id: they share its queue)."""
        if self.draining:
            self._refuse_new_work()
        if self.store.shared:  # (merged with the registration as kept, in one step)
            kept = await self.store.update_agent(
                info.agent_id, lambda saved: self._as_kept(info.agent_id, saved).register(info)
            )
            assert kept is not None
            registered = kept
        else:
            registered = self.registry.register(info)
            await self.store.save_agent(registered)
        await self.store.sync()
        logger.info(
            "agent registered: %s",
            registered.agent_id,
            extra={
                "event": {
                    "category": "registry",
                    "agent_id": registered.agent_id,
                    "agent_types": list(registered.agent_types),
                    "address": registered.address,
                }
            },
        )
        self._registry_changed(registered.agent_id)
        return registered

    async def deregister(self, agent_id: str, address: str = "") -> tuple[str, ...]:
        """Takes an agent off the mesh; with ``address``, only that instance of it leaves,
        and the agent stays while other instances serve it (a rolling update, or one of
        several processes stopping). Taken off whole, returns the addresses of its instances
        that took their messages by push: they hold no subscription whose end would tell
        them (an instance leaving by its address is most often that process, stopping)."""
        remaining: AgentInfo | None = None
        pushed: tuple[str, ...] = ()
        if not address:
            await self._load_registration(agent_id)  # (registered through another replica)
            pushed = self.registry.deregister(agent_id).push_instances
            await self.store.forget_agent(agent_id)
        elif self.store.shared:
            remaining = await self.store.update_agent(
                agent_id, lambda saved: self._as_kept(agent_id, saved).leave(agent_id, address)
            )
        else:
            remaining = self.registry.leave(agent_id, address)
            if remaining is None:
                await self.store.forget_agent(agent_id)
            else:
                await self.store.save_agent(remaining)
        await self.store.sync()
        self._registry_changed(agent_id)
        if remaining is not None:
            logger.info(
                "agent %s: the instance at %s left, %d serve it still",
                agent_id,
                address,
                len(remaining.instances),
                extra={
                    "event": {
                        "category": "registry",
                        "agent_id": agent_id,
                        "left": address,
                        "instances": list(remaining.instances),
                    }
                },
            )
            return pushed
        self.metrics.agent_gone(agent_id)
        logger.info(
            "agent deregistered: %s",
            agent_id,
            extra={"event": {"category": "registry", "agent_id": agent_id}},
        )
        return pushed

    def _as_kept(self, agent_id: str, saved: AgentInfo | None) -> AgentRegistry:
        """The registry, with the agent as the shared store keeps it (registered, changed or
        gone through another replica a moment ago, before this replica heard of it)."""
        if saved is None:
            self.registry.discard(agent_id)
        else:
            with contextlib.suppress(MeshError):  # (this replica's registry is full)
                self.registry.register(saved, restore=True)
        return self.registry

    async def _load_registration(self, agent_id: str) -> bool:
        """With replicas, the agent's registration as the store keeps it: an agent
        registered through another replica a moment ago. False when it keeps none (or there
        are no replicas)."""
        if not self.store.shared:
            return False
        saved = await self.store.saved_agent(agent_id)
        if saved is None:
            return False
        self._as_kept(agent_id, saved)
        return True

    async def _is_registered(self, agent_id: str) -> bool:
        """Whether the agent is registered, through another replica a moment ago included
        (looked up in the store only when this replica does not know it)."""
        return agent_id in self.registry or await self._load_registration(agent_id)

    async def _require_registered(self, agent_id: str) -> AgentInfo:
        """The agent's registration (see :meth:`_is_registered`); AgentNotFoundError when it
        has none."""
        named(agent_id)
        await self._is_registered(agent_id)
        return self.registry.require(agent_id)

    def list_agents(self, agent_type: str = "") -> list[AgentInfo]:
        return self.registry.agents(agent_type)

    # -- sending -----------------------------------------------------------------------------

    def refused_unreadable(self) -> None:
        """Counts a message refused before it became one (it could not be read: an
        undefined enum number, NaN in its JSON, nesting too deep, bytes that are no
        request), with the validation errors."""
        self.metrics.invalid()

    def _require_fields(self, message: Message, required: tuple[str, ...]) -> None:
        """Refuses a message that lacks a content key its agent requires (RF-009 scenario
        18), counted with the validation errors."""
        if found := missing_fields(message, required):
            self.metrics.invalid()
            raise MessageValidationError.from_violations(found)

    def _validate(self, message: Message, size_bytes: int) -> None:
        try:
            validate_message(message, self.config, size_bytes)
        except MessageValidationError:
            self.metrics.invalid()
            raise

    async def send(
        self,
        message: Message,
        *,
        size_bytes: int = 0,
        lifetime: float | None = None,
        claim: RouteClaim | None = None,
    ) -> SendOutcome:
        """Accepts one message: validates, routes an answer to its waiting requester, or enqueues.

        ``to_agent`` "broadcast" fans the message out to every other agent. Returns once the
        message is accepted for good (on disk, with a durable store). A message already past
        its ttl (see :meth:`_lifetime`; ``lifetime`` when the caller worked it out) is accepted
        and expires at once: logged and counted, never delivered. ``claim``: the route of a
        request sent to one agent, claimed as it is queued (:meth:`QueueStore.put`).
        """
        outcome = await self._send(message, size_bytes, lifetime, claim)
        await self.store.sync()
        return outcome

    async def accept(
        self, message: Message, *, size_bytes: int = 0, lifetime: float | None = None
    ) -> SendOutcome:
        """Takes one message in as :meth:`send` does, but returns before a durable store has
        committed it: a caller taking messages in one after another (a session's sends, in
        their order) lets them share one commit, and awaits :meth:`commit` before it tells
        any sender its message was accepted."""
        return await self._send(message, size_bytes, lifetime)

    async def commit(self) -> None:
        """Returns once every message taken in so far outlives a crash (see :meth:`accept`)."""
        await self.store.sync()

    @property
    def pipelines_sends(self) -> bool:
        """Whether :meth:`send_many` takes its messages in together (a store shared over the
        network pipelines their puts, in order), where one by one each would wait for its own
        round trip."""
        return self.store.shared

    @property
    def group_commit(self) -> bool:
        """Whether :meth:`commit` waits for a commit that the messages taken in before it
        share (``QueueStore.group_commit``)."""
        return self.store.group_commit

    async def _send(
        self,
        message: Message,
        size_bytes: int,
        lifetime: float | None = None,
        claim: RouteClaim | None = None,
    ) -> SendOutcome:
        started = time.perf_counter()
        try:
            self._validate(message, size_bytes)
        except MessageValidationError as error:
            if message.message_type in ANSWER_TYPES:
                await self._answer_refused(message, error)
            raise
        if self.draining and message.message_type not in _SETTLING_TYPES:
            self._refuse_new_work()
        if message.to_agent == BROADCAST_TARGET:
            outcome = await self.broadcast(message)
            return SendOutcome(outcome.message, outcome.recipients)
        if message.message_type in ANSWER_TYPES and message.correlation_id:
            # Given to its requester (here, or handed to the replica it waits on) first, then
            # acknowledged: an answer acknowledges the request it answers, when the answering
            # agent holds it leased (its correlation id is the request's id), with no separate
            # ack frame, and the requester need not wait for that write to the store (were the
            # ack lost, the request would come back to the agent, and its second answer be
            # dropped as late).
            taken = self._offer_answer(message)
            # Not taken though its request is still here: its deadline passed a moment ago
            # (the waiter is done, not yet gone), or the gather has this agent's answer.
            given_up = not taken and (message.to_agent, message.correlation_id) in self._pending
            if not taken and not given_up and self.store.shared:
                # The requester may wait on another replica: hand the answer over there.
                key = (message.to_agent, message.correlation_id)
                replica = await self.store.route_of(key)
                given_up = replica == GIVEN_UP_ROUTE
                if replica and not given_up and replica != self.store.replica_id:
                    taken = await self.store.forward_answer(replica, message)
                    # (Not taken: that replica is gone, and its requester with it.)
                    given_up = not taken
            await self.store.ack(message.from_agent, (message.correlation_id,))
            if taken:
                self.metrics.sent(message.message_type.value, time.perf_counter() - started)
                return SendOutcome(message, (message.to_agent,))
            if self._late(message, given_up=given_up):
                return SendOutcome(message, ())
        registered = self.registry.get(message.to_agent)
        if registered is None and await self._load_registration(message.to_agent):
            registered = self.registry.get(message.to_agent)
        if registered is None:
            raise AgentNotFoundError(f"agent {message.to_agent} is not registered")
        if registered.required_fields:
            self._require_fields(message, registered.required_fields)
        if message.reply_to and message.message_type in _ASKING_TYPES:
            await self._note_forward(message, lifetime)
        await self._enqueue(message, lifetime, claim)
        self.metrics.sent(message.message_type.value, time.perf_counter() - started)
        return SendOutcome(message, (message.to_agent,))

    async def refuse_unreadable_answer(
        self, from_agent: str, to_agent: str, correlation_id: str, error: MeshError
    ) -> None:
        """An answer (RESPONSE or ERROR) whose frame could not be read into a message (a
        value JSON cannot hold, an undefined priority, a time out of range: what a client
        that is no SDK may send): its requester hears why at once, as for an answer refused
        by validation, instead of waiting for its deadline. The envelope is what could be
        read of the frame."""
        if not (from_agent and to_agent and correlation_id):
            return
        answer = Message(
            from_agent=from_agent,
            to_agent=to_agent,
            message_type=MessageType.RESPONSE,
            content={},
            correlation_id=correlation_id,
        )
        await self._answer_refused(answer, error)

    async def _answer_refused(self, answer: Message, error: MeshError) -> None:
        """An answer refused (too large, no content, ...) still tells whoever waits for it
        why, at once: an ERROR in its place from the broker, routed as any answer (and
        settling the answering agent's delivery as one), instead of a wait until the
        deadline for an answer that was sent and lost."""
        if not answer.correlation_id or answer.to_agent == BROADCAST_TARGET:
            return
        said = _said_for(
            answer.from_agent,
            answer.to_agent,
            answer.correlation_id,
            f"{answer.from_agent or 'the agent'}'s answer was refused: {error.message}",
            error.reason,
        )
        try:
            validate_message(said, self.config, 0)  # (an envelope that cannot carry it)
        except MeshError:
            return
        with contextlib.suppress(MeshError):
            await self._send(said, 0)

    async def _note_forward(self, message: Message, lifetime: float | None) -> None:
        """An agent handed a request on (its answer goes to the requester, under the request's
        correlation id): remembered while the request waits here, or, with replicas, for the
        replica it waits on (the forward's lifetime at most)."""
        key = (message.reply_to, message.correlation_id)
        places = self._forwards.get(key)
        if places is not None:
            if len(places) < MAX_FORWARDS:
                places.append((message.to_agent, message.message_id))
        elif self.store.shared and message.correlation_id:
            ttl = self._lifetime(message) if lifetime is None else lifetime
            if ttl > 0:
                # Past the forward's own lifetime: its request is given up at about that
                # moment (the forward expires with it), when the record is read.
                place = (message.to_agent, message.message_id)
                await self.store.remember_forward(key, *place, ttl + 30.0)

    def _offer_answer(self, message: Message) -> bool:
        """Gives an answer to the request or gather waiting for it here; False when none is."""
        waiter = self._pending.get((message.to_agent, message.correlation_id))
        if isinstance(waiter, _Gathering):
            return waiter.offer(message)
        if waiter is not None and not waiter.done():
            waiter.set_result(message)
            return True
        return False

    def _lifetime(self, message: Message, cap: float | None = None) -> float:
        """Seconds a message may wait in a queue from now. A ttl its sender gave counts from
        the message's timestamp, when it was made (RF-009 scenario 6: sent at T with ttl 60,
        not delivered at T+65), and never from later than now (a timestamp ahead of this clock
        gains nothing); a message without one has the broker's default from now. ``cap``: the
        deadline of the request or gather that asks it."""
        if message.ttl:
            age = (utc_now() - message.timestamp).total_seconds()
            lifetime = message.ttl - age if age > 0 else float(message.ttl)
        else:
            lifetime = float(self.config.default_ttl)
            if message.deliver_at is not None:  # (the default counts from when it is due)
                lifetime += due_in(message.deliver_at)
        return lifetime if cap is None else min(lifetime, cap)

    def _due_before_deadline(self, message: Message, timeout: float) -> None:
        """A scheduled request or gather must be due before its deadline (it would expire
        unasked): MessageValidationError on deliver_at, before anything is queued."""
        if message.deliver_at is not None and due_in(message.deliver_at) >= timeout:
            self.metrics.invalid()
            raise MessageValidationError.for_field(
                "deliver_at",
                f"deliver_at must come before the deadline of the {message.message_type.value}"
                f" ({timeout:g} s from now)",
            )

    @staticmethod
    def _expired_question(message: Message) -> RequestTimeoutError:
        """A request or gather already past its ttl when it came (logged and counted as
        expired by its send): refused at once, since no answer can come."""
        return RequestTimeoutError(
            f"{message.message_type.value} {message.message_id} to {message.to_agent} expired "
            f"before it was queued: its ttl counts from its timestamp "
            f"{message.timestamp.isoformat()}"
        )

    async def _enqueue(
        self, message: Message, lifetime: float | None = None, claim: RouteClaim | None = None
    ) -> None:
        if lifetime is None:
            lifetime = self._lifetime(message)
        if lifetime <= 0:
            self.on_expired(message)  # accepted, and already past its ttl: never delivered
            return
        delay = 0.0 if message.deliver_at is None else due_in(message.deliver_at)
        try:
            accepted = await self.store.put(message, lifetime, claim, delay)
        except MessageQueueFullError:
            self.metrics.dropped("queue_full")
            self._log_queue_full(message)
            raise
        if not accepted:
            return  # a retried send of a message the queue already holds
        if delay > 0:
            self.metrics.scheduled.inc()  # (its subscribers are woken when it is due)
        else:
            for sub in self._subscriptions.get(message.to_agent, ()):
                sub.wake()
        if message.message_type is MessageType.HANDOFF:
            self._log_handoff(message)
            await self._note_workflow(message)

    async def _enqueue_all(
        self, messages: Sequence[Message], lifetime: float
    ) -> list[MeshError | None]:
        """Queues each message (the copies of a broadcast or a gather); for each, the error
        that refused it, or None. A networked store pipelines what is submitted together:
        one round trip for them all instead of one per copy."""
        refusals: list[MeshError | None] = []
        if self.store.shared:
            done = await asyncio.gather(
                *(self._enqueue(m, lifetime) for m in messages), return_exceptions=True
            )
            for outcome in done:
                if outcome is not None and not isinstance(outcome, MeshError):
                    raise outcome
                refusals.append(outcome)
            return refusals
        for message in messages:
            try:
                await self._enqueue(message, lifetime)
                refusals.append(None)
            except MeshError as error:
                refusals.append(error)
        return refusals

    def _log_queue_full(self, message: Message) -> None:
        """At most one warning per agent per second under overload, counting the refusals
        held back between."""
        self._queue_full_log.warning(
            logger,
            message.to_agent,
            "queue full: %s refused a message from %s",
            message.to_agent,
            message.from_agent,
            event={
                "category": "queue_full",
                "message_id": message.message_id,
                "from_agent": message.from_agent,
                "to_agent": message.to_agent,
            },
        )

    async def send_many(
        self, messages: Sequence[Message | MeshError], sizes: Sequence[int] | None = None
    ) -> list[SendOutcome | MeshError]:
        """Sends each message in order; one refusal does not stop the others. An item that is
        already an error (a message refused while it was read) keeps its place in the results."""
        if len(messages) > self.config.max_batch_size:
            raise MessageValidationError(
                f"a batch holds at most {self.config.max_batch_size} messages",
                field_violations=(FieldViolation("messages", "batch too large"),),
            )
        results: list[SendOutcome | MeshError] = []
        if self.store.shared:
            # A networked store pipelines what is submitted together (in order): one round
            # trip for the batch instead of one per message.
            gathered = await asyncio.gather(
                *(
                    self._send(m, sizes[i] if sizes else 0)
                    for i, m in enumerate(messages)
                    if isinstance(m, Message)
                ),
                return_exceptions=True,
            )
            sent = iter(gathered)
            for message in messages:
                item = message if isinstance(message, MeshError) else next(sent)
                if isinstance(item, MeshError | SendOutcome):
                    results.append(item)
                else:
                    raise item
        else:
            for index, message in enumerate(messages):
                if isinstance(message, MeshError):
                    results.append(message)
                    continue
                try:
                    results.append(await self._send(message, sizes[index] if sizes else 0))
                except MeshError as error:
                    results.append(error)
        await self.store.sync()  # one commit for the batch
        return results

    def _log_handoff(self, message: Message) -> None:
        self.metrics.handoff()
        handoff = Handoff.from_message(message)
        handoff_logger.info(
            "handoff %s -> %s (workflow=%s, step=%d)",
            message.from_agent,
            message.to_agent,
            handoff.workflow_id,
            handoff.step_number,
            extra={
                "event": {
                    "category": "handoff",
                    "message_id": message.message_id,
                    "from_agent": message.from_agent,
                    "to_agent": message.to_agent,
                    "workflow_id": handoff.workflow_id,
                    "step_number": handoff.step_number,
                    "task_description": handoff.task_description,
                    "context_size_kb": handoff.context_size_kb,
                    "constraints": handoff.constraints,
                    "timestamp": message.timestamp.isoformat(),
                }
            },
        )

    async def _note_workflow(self, message: Message) -> None:
        """RT-011's hand-off protocol: the shared state follows each workflow. A hand-off that
        names its workflow writes ``workflow/<workflow_id>`` (mesh.core.workflows), kept
        ``workflow_status_ttl`` after the last. What cannot be written (the shared state full,
        the entry locked) is logged: the hand-off itself is accepted."""
        ttl = self.config.workflow_status_ttl
        handoff = Handoff.from_message(message)
        if not ttl or not handoff.workflow_id:
            return
        try:
            await workflows.record_hand_off(self.state, message, ttl)
        except MeshError as error:
            now = time.monotonic()
            if now - self._workflow_log_at >= 1.0:  # one a second, under a flood
                self._workflow_log_at = now
                logger.warning(
                    "the status of workflow %s was not recorded: %s",
                    handoff.workflow_id,
                    error.message,
                    extra={
                        "event": {
                            "category": "workflow_status",
                            "workflow_id": handoff.workflow_id,
                            "message_id": message.message_id,
                            "error": error.message,
                        }
                    },
                )

    async def broadcast(
        self, message: Message, agent_types: Iterable[str] = (), *, size_bytes: int = 0
    ) -> BroadcastOutcome:
        """A copy to every registered agent but the sender, or to the agents of given types.

        Every copy keeps the message id and differs only in ``to_agent``. ``size_bytes``, as
        for :meth:`send`: the message's size on the wire, for its limit.
        """
        started = time.perf_counter()
        if self.draining:
            self._refuse_new_work()
        types = tuple(agent_types)
        message = message.evolve(message_type=MessageType.BROADCAST)
        if not message.to_agent:
            message = message.evolve(to_agent=BROADCAST_TARGET)
        self._validate(message, size_bytes)
        targets = self.registry.of_types(types) if types else self.registry.agents()
        recipients: list[str] = []
        failures: list[tuple[str, MeshError]] = []
        lifetime = self._lifetime(message)
        copies = [message.copy_to(a.agent_id) for a in targets if a.agent_id != message.from_agent]
        for copy, error in zip(copies, await self._enqueue_all(copies, lifetime), strict=True):
            if error is None:
                recipients.append(copy.to_agent)
            else:
                failures.append((copy.to_agent, error))
        if recipients:
            await self.store.sync()
        elapsed = time.perf_counter() - started
        for _ in recipients:
            self.metrics.sent(MessageType.BROADCAST.value, elapsed / max(len(recipients), 1))
        self.metrics.broadcast(bool(types), elapsed)
        # (logged once the woken subscriptions have had their turn, as for a gather)
        asyncio.get_running_loop().call_soon(
            _log_fan_out, message, types, recipients, [agent for agent, _ in failures], elapsed
        )
        if targets and not recipients and failures:
            raise failures[0][1]
        return BroadcastOutcome(message, tuple(recipients), tuple(failures))

    async def handoff(
        self,
        *,
        from_agent: str,
        to_agent: str,
        handoff: Handoff,
        priority: Priority = Priority.MEDIUM,
        ttl: int = 0,
        headers: dict[str, str] | None = None,
        message_id: str = "",
        size_bytes: int = 0,
    ) -> Message:
        """Sends a HANDOFF message carrying the payload; logged as a structured line."""
        violations = handoff_violations(handoff, max_context_bytes=self.config.max_context_bytes)
        if violations:
            self.metrics.invalid()
            raise HandoffError(
                "; ".join(v.description for v in violations), field_violations=tuple(violations)
            )
        fields: dict[str, object] = {}
        if message_id:
            fields["message_id"] = message_id
        message = Message(
            from_agent=from_agent,
            to_agent=to_agent,
            message_type=MessageType.HANDOFF,
            content=handoff.to_content(),
            metadata=handoff.to_metadata(),
            priority=priority,
            ttl=ttl,
            headers=dict(headers or {}),
            **fields,  # type: ignore[arg-type]
        )
        return (await self.send(message, size_bytes=size_bytes)).message

    # -- request / response ------------------------------------------------------------------

    async def request(
        self, message: Message, timeout: float | None = None, *, size_bytes: int = 0
    ) -> Message:
        """Sends a REQUEST and waits for the RESPONSE (or ERROR) with its correlation id.

        The answer reaches only this caller: waiters are keyed by (requester, correlation id).
        Raises RequestTimeoutError when no answer arrives within ``timeout`` seconds.
        ``size_bytes``, as for :meth:`send`: the message's size on the wire, for its limit.
        """
        timeout = self.config.default_request_timeout if timeout is None else timeout
        if timeout <= 0:
            raise RequestTimeoutError("the request's deadline has already passed")
        self._due_before_deadline(message, timeout)
        correlation_id = message.correlation_id or message.message_id
        # The request must not outlive its caller: it expires from the queue with the deadline.
        ttl_cap = max(1, math.ceil(timeout))
        lifetime = self._lifetime(message, cap=ttl_cap)
        ttl = min(message.ttl or self.config.default_ttl, ttl_cap)
        kind = (
            message.message_type if message.message_type in _ASKING_TYPES else MessageType.REQUEST
        )
        message = message.evolve(message_type=kind, correlation_id=correlation_id, ttl=ttl)
        key = self._reserve(message)
        waiter: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[key] = waiter
        started = time.perf_counter()
        sent = False
        try:
            claim = None
            if self.store.shared:
                self._routes[key] = time.monotonic() + timeout
                if message.to_agent == BROADCAST_TARGET:
                    await self.store.claim_route(key, timeout)
                else:  # (its queue's put claims it, in the same round trip where it can)
                    claim = (key, timeout)
            self._forwards[key] = []
            await self.send(message, size_bytes=size_bytes, lifetime=lifetime, claim=claim)
            sent = True
            if lifetime <= 0:
                raise self._expired_question(message)
            # A timer on the waiter itself: cheaper than asyncio.timeout's cancel-and-uncancel
            # on the path every request takes.
            timer = asyncio.get_running_loop().call_later(timeout, _expire, waiter)
            try:
                answer = await waiter
            except TimeoutError:
                self.metrics.request("timeout")
                raise self._no_response(message.to_agent, timeout) from None
            finally:
                timer.cancel()
            if answer.message_type is MessageType.ERROR and (late := _expired_in_queue(answer)):
                self.metrics.request("timeout")
                raise late
            self.metrics.request(
                "error" if answer.message_type is MessageType.ERROR else "ok",
                time.perf_counter() - started,
            )
            return answer
        finally:
            forwards = self._forwards.pop(key, ())
            if self._pending.get(key) is waiter:
                self._routes.pop(key, None)
                del self._pending[key]
                answered = waiter.done() and not waiter.cancelled() and not waiter.exception()
                self._ended(key)  # a second answer (after a redelivery), or one too late
                if self.store.shared and not answered:
                    await self.store.give_up_route(key)
                # (An answered request's route is left to expire with its deadline: a second
                # answer through another replica still comes here, to be dropped as late.)
                if sent and not answered:
                    if self.store.shared:
                        with contextlib.suppress(MeshError):  # (else they expire)
                            forwards = [*forwards, *await self.store.take_forwards(key)]
                    places = dict.fromkeys([(message.to_agent, message.message_id), *forwards])
                    await self._withdraw(message, list(places))

    def _reserve(self, message: Message) -> tuple[str, str]:
        """The waiter key of a request; refuses a duplicate key or one over the limit."""
        key = (message.reply_target, message.correlation_id)
        if key in self._pending:
            self._validate(message, 0)
            raise MessageValidationError(
                f"a request with correlation_id {message.correlation_id} is already waiting",
                field_violations=(
                    FieldViolation("correlation_id", "correlation_id is already in use"),
                ),
            )
        if len(self._pending) >= self.config.max_pending_requests:
            raise LimitExceededError(
                f"the broker holds {self.config.max_pending_requests} pending requests, its limit",
                retry_after=self.config.retry_after_seconds,
            )
        return key

    async def gather(
        self,
        message: Message,
        *,
        agent_ids: Sequence[str] = (),
        agent_types: Sequence[str] = (),
        timeout: float | None = None,
        all_or_none: bool = False,
        size_bytes: int = 0,
    ) -> AsyncGenerator[GatherItem, None]:
        """Asks several agents at once and yields each one's answer as it arrives.

        Every copy shares the message id; agents that cannot be asked, or do not answer
        within ``timeout`` seconds, are yielded with an error. Scatter-gather for patterns
        such as group chat and collaborative filtering. With ``all_or_none``, an agent of
        ``agent_ids`` that is not registered raises AgentNotFoundError before anyone is asked.
        ``size_bytes``, as for :meth:`send`: the message's size on the wire, for its limit.
        """
        timeout = self.config.default_request_timeout if timeout is None else timeout
        self._due_before_deadline(message, timeout)
        correlation_id = message.correlation_id or message.message_id
        kind = (
            message.message_type if message.message_type in _ASKING_TYPES else MessageType.BROADCAST
        )
        ttl_cap = max(1, math.ceil(timeout))
        lifetime = self._lifetime(message, cap=ttl_cap)
        ttl = min(message.ttl or self.config.default_ttl, ttl_cap)
        message = message.evolve(
            message_type=kind,
            correlation_id=correlation_id,
            ttl=ttl,
            to_agent=message.to_agent or BROADCAST_TARGET,
        )
        self._validate(message, size_bytes)
        if agent_ids:
            targets = list(dict.fromkeys(agent_ids))
            if all_or_none:
                unknown = [a for a in targets if not await self._is_registered(a)]
                if unknown:
                    raise AgentNotFoundError(
                        f"agent {unknown[0]} is not registered"
                        if len(unknown) == 1
                        else f"agents {', '.join(unknown)} are not registered"
                    )
        else:
            infos = self.registry.of_types(agent_types) if agent_types else self.registry.agents()
            targets = [a.agent_id for a in infos if a.agent_id != message.from_agent]
        if self.draining:
            self._refuse_new_work()
        key = self._reserve(message)
        gathering = _Gathering(targets)
        self._pending[key] = gathering
        started = time.perf_counter()
        try:
            if self.store.shared:
                self._routes[key] = time.monotonic() + timeout
                await self.store.claim_route(key, timeout)
            errors: dict[str, MeshError] = {}
            copies = []
            for agent_id in targets:
                try:
                    if not await self._is_registered(agent_id):
                        raise AgentNotFoundError(f"agent {agent_id} is not registered")
                    self._refuse_if_no_instance(agent_id)
                    copies.append(message.copy_to(agent_id))
                except MeshError as error:
                    errors[agent_id] = error
            queued = await self._enqueue_all(copies, lifetime)
            for copy, refusal in zip(copies, queued, strict=True):
                if refusal is None:
                    self.metrics.sent(kind.value, 0.0)
                else:
                    errors[copy.to_agent] = refusal
            refused = [GatherItem(a, error=errors[a]) for a in targets if a in errors]
            gathering.expected.difference_update(errors)
            if lifetime <= 0:
                raise self._expired_question(message)
            await self.store.sync()
            # Logged once the copies are on their way: the subscriptions woken by them run
            # first, so that no agent waits for this line to be written.
            asyncio.get_running_loop().call_soon(
                functools.partial(
                    _log_fan_out,
                    message,
                    tuple(agent_types),
                    [a for a in targets if a in gathering.expected],
                    [item.agent_id for item in refused],
                    time.perf_counter() - started,
                    gather=True,
                )
            )
            for item in refused:
                yield item
            # One timer for the whole gather, not a timeout around every wait for an answer.
            timer = asyncio.get_running_loop().call_later(timeout, gathering.time_out)
            answers = gathering.answers
            try:
                while gathering.expected or not answers.empty():
                    answer = await answers.get()
                    if answer is None:
                        break  # the deadline passed
                    if answer.message_type is MessageType.ERROR and (
                        late := _expired_in_queue(answer)
                    ):
                        yield GatherItem(answer.from_agent, error=late)
                        continue
                    yield GatherItem(answer.from_agent, response=answer)
            finally:
                timer.cancel()
            for agent_id in sorted(gathering.expected):
                yield GatherItem(agent_id, error=self._no_response(agent_id, timeout))
            self.metrics.gathered(time.perf_counter() - started)
        finally:
            if self._pending.get(key) is gathering:
                del self._pending[key]
                self._routes.pop(key, None)
                self._ended(key)
                if self.store.shared and gathering.expected:  # (else left to expire)
                    await self.store.give_up_route(key)
                if gathering.expected:
                    places = [(agent_id, message.message_id) for agent_id in gathering.expected]
                    await self._withdraw(message, sorted(places))

    async def _withdraw(self, message: Message, places: Sequence[tuple[str, str]]) -> None:
        """Takes a request (or a gather's copies, or the forwards of a request its agent
        handed on) that nobody waits for any more out of the queues of the agents that did
        not answer, ``places`` (agent id, message id): one still waiting is never delivered,
        and the subscriber holding one hears of it (when it asked to) so that its handler can
        stop. A broker shutting down leaves them be (a durable store keeps them), and a store
        that cannot be reached leaves them to their TTL."""
        if self._stopping:
            return
        waiting = leased = 0
        try:
            for agent_id, message_id in places:
                queued, held = await self.store.withdraw(agent_id, (message_id,))
                waiting += queued
                leased += held
        except MeshError as error:
            logger.warning(
                "request %s could not be withdrawn (%s): it expires with its ttl",
                message.message_id,
                error.message,
            )
        if not (waiting or leased):
            return
        self.metrics.withdrew(waiting, leased)
        logger.info(
            "%s %s from %s withdrawn: its requester gave up (%d waiting, %d in flight)",
            message.message_type.value,
            message.message_id,
            message.from_agent,
            waiting,
            leased,
            extra={
                "event": {
                    "category": "withdrawn",
                    "message_id": message.message_id,
                    "correlation_id": message.correlation_id,
                    "from_agent": message.from_agent,
                    "agent_ids": [agent_id for agent_id, _ in places],
                    "waiting": waiting,
                    "in_flight": leased,
                }
            },
        )

    def _ended(self, key: tuple[str, str]) -> None:
        """Remembers (for a while, the latest ones first) a request or gather that ended,
        answered or not: an answer to it now is late, or a second one."""
        self._ended_at[key] = time.monotonic() + GIVEN_UP_SECONDS
        self._ended_at.move_to_end(key)
        while len(self._ended_at) > self.config.max_pending_requests:
            self._ended_at.popitem(last=False)

    def _late(self, message: Message, *, given_up: bool = False) -> bool:
        """An answer to a request or gather that ended (here, or on the replica the route
        names: ``given_up``) — given up, past its deadline, or answered already by this agent
        (a redelivered request answered twice): taken in and dropped, counted and logged,
        rather than refused (the answering agent did nothing wrong) or queued to a requester
        that is an agent (nobody waits for it there: its handler would take it for a message
        of its own). Answers to messages that were sent, not asked (a reply_to flow), are
        none of these: they are queued as ever."""
        key = (message.to_agent, message.correlation_id)
        until = self._ended_at.get(key)
        if until is not None and until < time.monotonic():
            del self._ended_at[key]
            until = None
        if until is None and not given_up:
            return False
        self.metrics.late_answer()
        logger.info(
            "late answer from %s to %s dropped: its request had ended",
            message.from_agent,
            message.to_agent,
            extra={
                "event": {
                    "category": "late_answer",
                    "message_id": message.message_id,
                    "correlation_id": message.correlation_id,
                    "from_agent": message.from_agent,
                    "to_agent": message.to_agent,
                }
            },
        )
        return True

    @property
    def pending_requests(self) -> int:
        return len(self._pending)

    # -- receiving ---------------------------------------------------------------------------

    async def receive(
        self,
        agent_id: str,
        max_messages: int = 0,
        *,
        max_bytes: int = 0,
        size_of: Callable[[Message], int] | None = None,
    ) -> list[Message]:
        """Removes and returns the agent's waiting messages, HIGH first, then oldest first:
        up to ``max_messages`` (0: all), and with ``max_bytes`` only as many as fit in it
        (``size_of`` measures a message; the first comes whatever its size), the rest
        staying queued for the next call. AgentNotFoundError for an agent that is not
        registered and has nothing queued (a misspelt id is not an empty queue)."""
        named(agent_id)
        if max_messages < 0:
            raise MessageValidationError.for_field(
                "max_messages", "max_messages must not be negative"
            )
        started = time.perf_counter()
        popped = await self.store.pop(agent_id, max_messages, max_bytes, size_of)
        if not popped and not await self._is_registered(agent_id):
            raise AgentNotFoundError(f"agent {agent_id} is not registered")
        if popped:
            self.metrics.delivered("receive", len(popped))
        messages = [self._observe_delivery(item.message, item.queued_seconds) for item in popped]
        self.metrics.receive_served(time.perf_counter() - started)
        receipts = [i.message for i in popped if i.message.ack_required and not i.attempts]
        if receipts:
            await self._acknowledge_receipt(receipts)
        return messages

    async def _acknowledge_receipt(self, messages: Iterable[Message]) -> None:
        """Sends each message's sender the ACK it asked for (``ack_required``) as the message
        first reaches its agent: the broker sends it for the agent, whatever the agent's client
        (an SDK, plain gRPC in any language). One that cannot be delivered (the sender is not
        registered, its queue is full) is logged; the delivery goes on, whatever went wrong
        (the messages are already out of their queue)."""
        for message in messages:
            try:
                await self.send(receipt_of(message))
            except MeshError as error:
                self._receipt_log.warning(
                    logger,
                    message.from_agent,
                    "receipt of %s not acknowledged to %s: %s",
                    message.message_id,
                    message.from_agent,
                    error.message,
                    event={
                        "category": "ack_undelivered",
                        "message_id": message.message_id,
                        "from_agent": message.to_agent,
                        "to_agent": message.from_agent,
                        "reason": error.reason,
                    },
                )
            except Exception:
                logger.exception("receipt of %s not acknowledged", message.message_id)

    def _observe_delivery(self, message: Message, queued_seconds: float) -> Message:
        """Counts a delivery; a message whose trace this process records gets a span for its
        time in the queue, and is delivered as that span's child so the receiver's work hangs
        below it."""
        self.metrics.queue_wait.observe(queued_seconds)
        if message.message_type is MessageType.HANDOFF:
            self.metrics.handoff_delivered(queued_seconds)
        parent = extract(message.headers)
        if parent is None or not records_under(parent):
            return message  # (its trace context travels on as it came)
        end = time.time_ns()
        span = tracer().start_span(
            "broker.queue",
            context=parent,
            start_time=end - int(queued_seconds * 1e9),
            attributes={
                "agent": message.to_agent,
                "from_agent": message.from_agent,
                "message_id": message.message_id,
                "message_type": message.message_type.value,
                "priority": message.priority.value,
                "queue_wait_ms": round(queued_seconds * 1000, 3),
            },
        )
        headers = headers_for(span, without_trace(message.headers))
        span.end(end_time=end)
        return message.evolve(headers=headers)

    async def subscribe(
        self,
        agent_id: str,
        *,
        max_in_flight: int = 0,
        lease_seconds: float = 0,
        withdrawals: bool = False,
        instance: str = "",
    ) -> Subscription:
        """Opens a push subscription; the agent must be registered. With ``withdrawals``, the
        subscription also reports the deliveries withdrawn from it (their requester gave
        up: see :meth:`Subscription.take_withdrawn`). With ``instance`` (the address of the
        subscriber's own server, as it registered it), the subscription holds that instance
        among the agent's instances: if it ends while the broker still runs and the instance
        has not left (its process died, its connection was lost), the instance is taken off."""
        await self._require_registered(agent_id)
        if max_in_flight < 0 or max_in_flight > self.config.max_in_flight_limit:
            raise MessageValidationError(
                f"max_in_flight must be within 0..{self.config.max_in_flight_limit}",
                field_violations=(FieldViolation("max_in_flight", "out of range"),),
            )
        if lease_seconds < 0 or lease_seconds > self.config.max_ttl:
            raise MessageValidationError(
                f"lease must be within 0..{self.config.max_ttl} seconds",
                field_violations=(FieldViolation("lease", "out of range"),),
            )
        sub = Subscription(
            self,
            agent_id,
            max_in_flight,
            lease_seconds or self.config.lease_seconds,
            withdrawals=withdrawals,
            instance=instance,
        )
        if instance:
            await self._hold_instance(sub)
        self._subscriptions.setdefault(agent_id, []).append(sub)
        self._by_subscription[sub.subscription_id] = sub
        return sub

    async def _hold_instance(self, sub: Subscription) -> None:
        agent_id, address, held_by = sub.agent_id, sub.instance, sub.subscription_id
        if self.store.shared:
            await self.store.update_agent(
                agent_id,
                lambda saved: self._as_kept(agent_id, saved).hold(agent_id, address, held_by),
            )
        else:
            await self.store.save_agent(self.registry.hold(agent_id, address, held_by))
        await self.store.sync()

    def instance_unreachable(self, agent_id: str, address: str, refuses: str = "") -> None:
        """The push delivery cannot reach the server of this instance (see :meth:`_no_instance`):
        it does not answer, or it refuses the agent's messages as a whole (``refuses``, why:
        "is another agent's (...)")."""
        away = self._unreachable.setdefault(agent_id, {})
        since = away[address].since if address in away else utc_now()
        away[address] = _Away(since, refuses)

    def instance_reachable(self, agent_id: str, address: str) -> None:
        """The instance's server answers again (or is pushed to no more)."""
        found = self._unreachable.get(agent_id)
        if found is not None:
            found.pop(address, None)
            if not found:
                del self._unreachable[agent_id]

    def _no_instance(self, agent_id: str) -> str:
        """Why nobody can answer, when the broker knows: the agent left the registry, every
        instance of it died (none came back since), or the server of every instance of an
        agent taking its messages by push cannot be reached. Empty otherwise."""
        info = self.registry.get(agent_id)
        if info is None:
            return f"{agent_id} is not registered: deregistered, or forgotten, since it was asked"
        if info.lost_at is not None and not info.instances:
            lost_at = info.lost_at.isoformat(timespec="seconds")
            return f"no instance of {agent_id} is serving: its last was lost at {lost_at}"
        away = self._unreachable.get(agent_id, {})
        if info.instances and all(address in away for address in info.instances):
            since = min(away[address].since for address in info.instances)
            silent = [address for address in info.instances if not away[address].refuses]
            why = [f"no answer from {', '.join(silent)}"] if silent else []
            why.extend(
                f"the server at {address} {away[address].refuses}"
                for address in info.instances
                if away[address].refuses
            )
            return (
                f"no instance of {agent_id} can be reached: {'; '.join(why)}"
                f" since {since.isoformat(timespec='seconds')}"
            )
        return ""

    def _no_response(self, agent_id: str, timeout: float) -> RequestTimeoutError:
        """A request's (or a gather's copy's) timeout, with why nobody answered when the
        broker knows."""
        why = self._no_instance(agent_id)
        # (Two digits: the time left of a requester's 1 s when the request came is 0.998 s;
        # said as the 1 s the requester asked for.)
        return RequestTimeoutError(
            f"no response from {agent_id} within {timeout:.2g} s" + (f" ({why})" if why else "")
        )

    def _refuse_if_no_instance(self, agent_id: str) -> None:
        """A gather does not wait for an agent whose every instance died: it has nobody to
        answer within the gather's time, and is left out at once."""
        if why := self._no_instance(agent_id):
            raise RoutingError(why, reason="NO_INSTANCE")

    async def _lose_instances_of_replicas(self) -> None:
        """Takes off the instances held by subscriptions of replicas found dead: the
        processes of those instances did not subscribe again through another replica (that
        would have made a subscription of its own hold them)."""
        gone = set(self._replicas_gone)
        for info in await self.store.saved_agents():
            for address, held_by in info.subscribed.items():
                replica = _replica_of(held_by)
                if replica in gone:
                    await self._lose_instance(
                        info.agent_id, address, held_by, f"its broker replica {replica} is gone"
                    )
        self._replicas_gone -= gone

    async def _lose_instance(
        self, agent_id: str, address: str, held_by: str, why: str, *, since: datetime | None = None
    ) -> None:
        """The subscription that held an instance ended: the instance goes (see
        :meth:`AgentRegistry.lose`) unless it left already or another subscription holds it.
        With ``since`` (and no ``held_by``), a push instance nobody could reach since then
        goes (:meth:`AgentRegistry.lose_unreachable`)."""

        def take_off(registry: AgentRegistry) -> AgentInfo | None:
            if since is not None:
                return registry.lose_unreachable(agent_id, address, since)
            return registry.lose(agent_id, address, held_by)

        lost: AgentInfo | None
        if self.store.shared:
            changed: list[AgentInfo] = []

            def lose(saved: AgentInfo | None) -> AgentInfo | None:
                changed.clear()
                if saved is None:
                    return None
                remaining = take_off(self._as_kept(agent_id, saved))
                if remaining is not None:
                    changed.append(remaining)
                return remaining or saved

            await self.store.update_agent(agent_id, lose)
            lost = changed[0] if changed else None
        else:
            lost = take_off(self.registry)
            if lost is not None:
                await self.store.save_agent(lost)
        if lost is None:
            return
        await self.store.sync()
        self._registry_changed(agent_id)  # (a push instance taken off is pushed to no more)
        self.metrics.instances_lost.labels(agent_id).inc()
        logger.warning(
            "agent %s: the instance at %s is gone (%s); %d serve it still",
            agent_id,
            address,
            why,
            len(lost.instances),
            extra={
                "event": {
                    "category": "registry",
                    "agent_id": agent_id,
                    "lost": address,
                    "instances": list(lost.instances),
                }
            },
        )

    async def _lease_many(self, sub: Subscription, most: int) -> list[Delivery]:
        leases = await self.store.lease_many(
            sub.agent_id, sub.subscription_id, sub.lease_seconds, most
        )
        if not leases:
            return []
        self.metrics.delivered("subscription", len(leases))
        deliveries = []
        receipts = []
        attempts = self.config.delivery_attempts
        for lease in leases:
            sub.in_flight.add(lease.message.message_id)
            sub.leased += 1
            message = self._observe_delivery(lease.message, lease.queued_seconds)
            deliveries.append(Delivery(message, lease.attempt, lease.lease_expires_at, attempts))
            if message.ack_required and lease.attempt == 1:
                receipts.append(message)
        if receipts:
            await self._acknowledge_receipt(receipts)
        return deliveries

    async def _unsubscribe(
        self, sub: Subscription, seen: Collection[str] | None, *, lost: bool = False
    ) -> None:
        subs = self._subscriptions.get(sub.agent_id, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self._subscriptions.pop(sub.agent_id, None)
        self._by_subscription.pop(sub.subscription_id, None)
        returned = await self.store.release_subscriber(sub.agent_id, sub.subscription_id, seen=seen)
        sub.in_flight.clear()
        if lost and sub.instance and not (self.draining or self._stopping):
            try:
                await self._lose_instance(
                    sub.agent_id,
                    sub.instance,
                    sub.subscription_id,
                    "its subscription ended without it leaving",
                )
            except MeshError as error:  # (the store is out of reach: the instance stays named)
                logger.warning(
                    "agent %s: the instance at %s could not be taken off: %s",
                    sub.agent_id,
                    sub.instance,
                    error.message,
                )
        if returned:
            unseen = "" if seen is None else " (an attempt counted for those its application had)"
            logger.info(
                "subscription %s closed; %d unacknowledged messages returned to the queue%s",
                sub.subscription_id,
                returned,
                unseen,
            )

    async def ack(self, agent_id: str, message_ids: Iterable[str]) -> int:
        named(agent_id)
        return await self.store.ack(agent_id, message_ids)

    async def extend_lease(
        self, agent_id: str, message_ids: Iterable[str], lease_seconds: float = 0
    ) -> int:
        """Keeps deliveries leased for ``lease_seconds`` from now (0: the default lease)
        while their handler still works on them; returns how many were still leased."""
        named(agent_id)
        if lease_seconds < 0 or lease_seconds > self.config.max_ttl:
            raise MessageValidationError.for_field(
                "lease", f"lease must be within 0..{self.config.max_ttl} seconds"
            )
        extended = await self.store.extend_lease(
            agent_id, message_ids, lease_seconds or self.config.lease_seconds
        )
        self.metrics.leases_extended.inc(extended)
        return extended

    async def nack(
        self,
        agent_id: str,
        message_ids: Iterable[str],
        *,
        dead_letter_reason: str = "",
        tell_requester: bool = True,
        redeliver_after: float = 0.0,
    ) -> tuple[int, int]:
        """Hands deliveries back for another attempt (``redeliver_after`` seconds from now,
        held by nobody meanwhile, when given); with ``dead_letter_reason`` (a message its
        agent can never process) they are dead-lettered at once with that reason. A
        dead-lettered message's requester, waiting here, is told so at once, unless
        ``tell_requester`` is False (the refusing side tells it in its own words)."""
        named(agent_id)
        if len(dead_letter_reason) > MAX_DEAD_LETTER_REASON:
            raise MessageValidationError.for_field(
                "dead_letter_reason",
                f"dead_letter_reason must be at most {MAX_DEAD_LETTER_REASON} characters",
            )
        if not 0 <= redeliver_after <= self.config.max_ttl:
            raise MessageValidationError.for_field(
                "redeliver_after",
                f"redeliver_after must be within 0..{self.config.max_ttl} seconds",
            )
        if redeliver_after and dead_letter_reason:
            raise MessageValidationError.for_field(
                "redeliver_after",
                "redeliver_after is for messages handed back for another attempt; a"
                " dead_letter_reason sends them to the dead-letter queue: give one or the other",
            )
        if not dead_letter_reason or tell_requester:
            requeued, dead = await self.store.nack(
                agent_id,
                message_ids,
                dead_letter_reason=dead_letter_reason,
                delay=redeliver_after,
            )
            if redeliver_after:
                self.metrics.deferred.inc(requeued)
            return requeued, dead
        ids = list(message_ids)
        marked = [i for i in ids if i not in self._refusing]
        self._refusing.update(marked)
        try:
            return await self.store.nack(agent_id, ids, dead_letter_reason=dead_letter_reason)
        finally:
            self._refusing.difference_update(marked)

    # -- store listener ----------------------------------------------------------------------

    def on_expired(self, message: Message) -> None:
        self.metrics.expired()
        if message.message_type in _ASKING_TYPES and message.correlation_id:
            # A request (or a gather's copy) whose ttl ended before its agent took it: its
            # requester, waiting here or on another replica, hears so now, not at its
            # deadline (a request is then timed out: DEADLINE_EXCEEDED).
            why = self._no_instance(message.to_agent)
            said = _said_for(
                message.to_agent,
                message.reply_target,
                message.correlation_id,
                f"{message.to_agent} did not take {message.message_type.value.lower()}"
                f" {message.message_id} within its ttl of"
                f" {message.ttl or self.config.default_ttl} s: it expired in the queue"
                + (f" ({why})" if why else ""),
                EXPIRED_REASON,
            )
            if not self._offer_answer(said) and self.store.shared:
                self._tell_elsewhere(said)
        logger.warning(
            "message %s to %s expired (ttl %s s)",
            message.message_id,
            message.to_agent,
            message.ttl or self.config.default_ttl,
            extra={
                "event": {
                    "category": "expired",
                    "message_id": message.message_id,
                    "from_agent": message.from_agent,
                    "to_agent": message.to_agent,
                    "ttl": message.ttl or self.config.default_ttl,
                }
            },
        )

    def on_dead_letter(self, dead: DeadLetter) -> None:
        self.metrics.dead_letter()
        logger.warning(
            "message %s to %s dead-lettered: %s",
            dead.message.message_id,
            dead.message.to_agent,
            dead.reason,
            extra={
                "event": {
                    "category": "dead_letter",
                    "message_id": dead.message.message_id,
                    "to_agent": dead.message.to_agent,
                    "reason": dead.reason,
                }
            },
        )
        message = dead.message
        if message.message_type in _ASKING_TYPES and message.message_id not in self._refusing:
            # Its agent took it and will not answer (it refused it, failed every attempt, or
            # its subscriber left): whoever waits for the answer, here or on another replica,
            # hears so now, not at its deadline.
            said = _said_for(
                message.to_agent,
                message.reply_target,
                message.correlation_id or message.message_id,
                f"{message.to_agent} did not answer: the message was dead-lettered ({dead.reason})",
                "DEAD_LETTERED",
            )
            if not self._offer_answer(said) and self.store.shared:
                self._tell_elsewhere(said)

    def _tell_elsewhere(self, said: Message) -> None:
        """Hands ``said`` to the replica whose requester waits for it, if one does."""
        if len(self._telling) >= MAX_TELLING or self._stopping:
            return
        task = asyncio.get_running_loop().create_task(
            self._forward_to_waiter(said), name=f"tell-{said.to_agent}"
        )
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def _forward_to_waiter(self, said: Message) -> None:
        with contextlib.suppress(MeshError):
            replica = await self.store.route_of((said.to_agent, said.correlation_id))
            if replica and replica not in (GIVEN_UP_ROUTE, self.store.replica_id):
                await self.store.forward_answer(replica, said)

    def on_redelivery(self, message: Message, attempt: int) -> None:
        self.metrics.redelivery()
        for sub in self._subscriptions.get(message.to_agent, ()):
            sub.wake()

    def on_due(self, message: Message) -> None:
        for sub in self._subscriptions.get(message.to_agent, ()):
            sub.wake()

    def on_wake(self, agent_id: str) -> None:
        """Another replica queued a message for this agent."""
        for sub in self._subscriptions.get(agent_id, ()):
            sub.wake()

    def on_agent_changed(self, agent_id: str, info: AgentInfo | None) -> None:
        """An agent registered or left through another replica."""
        if info is None and self._restoring:
            return  # (missing from a store that lost it, not deregistered: being put back)
        with contextlib.suppress(MeshError):
            if info is None:
                if agent_id in self.registry:
                    self.registry.deregister(agent_id)
            else:
                self.registry.register(info, restore=True)
        self._registry_changed(agent_id)

    def _registry_changed(self, agent_id: str) -> None:
        if agent_id not in self.registry:
            self._end_subscriptions(agent_id)
        for watcher in self.registry_watchers:
            watcher(agent_id)

    def _end_subscriptions(self, agent_id: str) -> None:
        """The agent left the registry (deregistered here or through another replica, or
        forgotten): the subscriptions still open on it here end, each telling its subscriber
        why, and what they held unacknowledged goes back to its queue. Left open, they would
        hold a subscriber that believes it serves an agent nobody can send to."""
        subs = self._subscriptions.get(agent_id)
        if not subs:
            return
        error, ended = deregistered(agent_id), list(subs)
        for sub in ended:
            sub.ended_by = error
            sub.end()
        logger.info(
            "agent %s left the registry: the subscriptions open on it here ended (%d)",
            agent_id,
            len(ended),
            extra={"event": {"category": "registry", "agent_id": agent_id, "ended": len(ended)}},
        )

    def on_answer(self, message: Message) -> None:
        """An answer another replica forwarded to a request waiting here (or that waited
        here: a second answer, or one too late, is dropped as late)."""
        if not self._offer_answer(message):
            self._late(message)

    def on_followed_again(self) -> None:
        """Back in touch with the other replicas after losing them: what they said meanwhile
        was not heard. Every subscription looks at its queue, the next sweep checks their
        places in flight, and the registry is read again."""
        for subs in self._subscriptions.values():
            for sub in subs:
                sub.wake()
        self._credit_checked = -CREDIT_CHECK_SECONDS
        self._catch_up()

    def on_store_emptied(self) -> None:
        """The store lost every registration: the registry is put back in it (what another
        replica put back first stays), then read again, rather than every agent taken as
        deregistered; the next sweep checks the subscriptions' places in flight."""
        self._credit_checked = -CREDIT_CHECK_SECONDS
        self._restoring = True  # (until done: a catch-up cut off puts it back next time)
        self._catch_up()

    def _catch_up(self) -> None:
        """Reads the registry again; once more after the reading under way, if there is one
        (it may be of before what calls for this). One at a time: a reading is not cancelled
        for the next, as a cancellation can be lost inside a store's call (see
        :mod:`mesh.core.tasks`), and two side by side would each put back and read as if
        alone."""
        if self._stopping:
            return
        self._catch_up_again = True
        if self._catching_up is None or self._catching_up.done():
            self._catching_up = asyncio.create_task(
                self._catch_up_while_asked(), name="registry-catch-up"
            )

    async def _catch_up_while_asked(self) -> None:
        while self._catch_up_again and not self._stopping:
            self._catch_up_again = False
            await self._catch_up_registry()

    async def _catch_up_registry(self) -> None:
        """The agents registered, changed or deregistered through other replicas while this
        one did not hear them: each that the store keeps otherwise than this replica's
        registry is read again and taken as news of it (as the news would have been), so
        that broadcasts, listings and subscriptions here follow the mesh again.

        A store that came back empty lost every registration, not news of deregistrations:
        this replica first keeps again those it knows that no other replica has put back,
        and its agents stay registered (with their subscriptions open)."""
        try:
            if self._restoring:
                restored = [i.agent_id for i in self.registry if await self.store.restore_agent(i)]
                routes = await self._claim_routes_again()
                self._restoring = False
                logger.info(
                    "registrations put back in the store: %d (any others, another replica "
                    "put back first); routes of requests waiting here: %d",
                    len(restored),
                    routes,
                    extra={
                        "event": {
                            "category": "registry",
                            "restored": restored[:100],
                            "routes": routes,
                        }
                    },
                )
            saved = {info.agent_id: info.to_dict() for info in await self.store.saved_agents()}
            if not await self.store.still_holds():
                return  # (emptied before that reading: put back, then read again)
            here = {info.agent_id: info.to_dict() for info in self.registry}
            stale = sorted(a for a in here.keys() | saved.keys() if here.get(a) != saved.get(a))
            for agent_id in stale:
                self.on_agent_changed(agent_id, await self.store.saved_agent(agent_id))
        except MeshError as error:  # (cut off again: the next time it follows, it reads again)
            logger.warning("could not read the registry again: %s", error.message)
            return
        if stale:
            logger.info(
                "registry caught up with the other replicas: %d agents changed meanwhile",
                len(stale),
                extra={"event": {"category": "registry", "caught_up": stale[:100]}},
            )

    async def _claim_routes_again(self) -> int:
        """The store lost the routes of the requests and gathers waiting here: each is claimed
        again for the rest of its wait, so that an answer given through another replica (by
        an agent that had its request before the loss) still comes here. How many."""
        claimed = 0
        for key, until in list(self._routes.items()):
            left = until - time.monotonic()
            if left > 0 and key in self._pending:
                await self.store.claim_route(key, left)
                claimed += 1
        return claimed

    def on_replicas_gone(self, replica_ids: Sequence[str]) -> None:
        """Replicas that died: the instances their subscriptions held go in the next sweep
        (unless those processes subscribed again elsewhere meanwhile)."""
        self._replicas_gone.update(replica_ids)

    def on_released(self, released: Released) -> None:
        sub = self._by_subscription.get(released.subscriber)
        if sub is not None:
            if released.withdrawn and sub.withdrawals and released.message_id in sub.in_flight:
                sub.withdrawn.append(released.message_id)
                sub.wake()
            sub.in_flight.discard(released.message_id)
            sub.credit_freed()

    # -- reading -----------------------------------------------------------------------------

    async def queue_stats(self, agent_id: str = "") -> tuple[list[AgentQueueStats], Totals]:
        if agent_id and not await self._is_registered(agent_id):
            stats = [s for s in await self.store.stats(agent_id) if s.held]
            if not stats:
                raise AgentNotFoundError(f"agent {agent_id} is not registered")
        known = {s.agent_id: s for s in await self.store.stats(agent_id or None)}
        ids = (
            [agent_id]
            if agent_id
            else sorted(set(known) | {a.agent_id for a in self.list_agents()})
        )
        out = [
            AgentQueueStats(
                known.get(aid) or QueueStats(aid, 0, 0, 0, 0, 0),
                len(self._subscriptions.get(aid, ())),
            )
            for aid in ids
        ]
        return out, self.metrics.totals

    async def held(self) -> int:
        return await self.store.held()

    async def dead_letters(self, agent_id: str = "") -> list[DeadLetter]:
        return await self.store.dead_letters(agent_id or None)

    async def queued(self, agent_id: str) -> list[QueuedMessage]:
        """What the agent's queue holds, left there: the messages waiting, in the order they
        will be delivered, then those in flight or deferred, by when their lease or delay
        ends (what is stuck, where, and since when). AgentNotFoundError for an agent that is
        not registered and has none."""
        named(agent_id)
        held = await self.store.listing(agent_id)
        if not held and not await self._is_registered(agent_id):
            raise AgentNotFoundError(f"agent {agent_id} is not registered")
        return [
            QueuedMessage(
                message=h.message,
                attempts=h.attempts,
                accepted_at=datetime.fromtimestamp(h.accepted_at, UTC),
                expires_at=datetime.fromtimestamp(h.expires_at, UTC),
                state=h.state,
                until=None if h.until is None else datetime.fromtimestamp(h.until, UTC),
            )
            for h in held
        ]

    async def cancel(self, from_agent: str, to_agent: str, message_ids: Sequence[str]) -> list[str]:
        """Takes back messages ``from_agent`` sent to ``to_agent`` that are not delivered now
        (waiting, or held until a time); returns their ids. One in flight, another sender's,
        or one no longer held stays as it is. A request taken back this way leaves its
        requester waiting until its deadline (a session's ``cancel`` gives one up)."""
        for field, value in (("from_agent", from_agent), ("to_agent", to_agent)):
            if not value:
                raise MessageValidationError.for_field(field, f"{field} is required")
        if not message_ids:
            raise MessageValidationError.for_field(
                "message_ids", "message_ids must name at least one message"
            )
        cancelled = await self.store.cancel(to_agent, from_agent, message_ids)
        await self.store.sync()
        self.metrics.cancelled.inc(len(cancelled))
        logger.info(
            "%d of %d messages from %s to %s cancelled",
            len(cancelled),
            len(set(message_ids)),
            from_agent,
            to_agent,
            extra={
                "event": {
                    "category": "cancelled",
                    "from_agent": from_agent,
                    "to_agent": to_agent,
                    "cancelled": len(cancelled),
                    "message_ids": cancelled[:100],
                }
            },
        )
        return cancelled

    async def requeue_dead_letters(
        self, agent_id: str, message_ids: Collection[str] = ()
    ) -> tuple[int, int]:
        """Puts the agent's dead letters (all, or those of ``message_ids``) back in its
        queue, oldest first, each with its delivery attempts from zero and its ttl (or the
        default) from now; returns (requeued, left because the queue was full)."""
        named(agent_id)
        wanted = set(message_ids)
        chosen: dict[str, Message] = {}
        for dead in await self.store.dead_letters(agent_id):
            message = dead.message
            if (not wanted or message.message_id in wanted) and message.message_id not in chosen:
                chosen[message.message_id] = message
        requeued: list[str] = []
        for message in chosen.values():
            try:
                await self._enqueue(message, float(message.ttl or self.config.default_ttl))
            except MessageQueueFullError:
                break
            except MessageIdTakenError:
                continue  # (another sender's message has its id now: it stays a dead letter)
            requeued.append(message.message_id)
        await self.store.sync()  # queued for good before they stop being dead letters
        if requeued:
            await self.store.remove_dead_letters(agent_id, requeued)
        left = len(chosen) - len(requeued)
        self.metrics.dead_letters_requeued.inc(len(requeued))
        logger.info(
            "%d dead letters of %s requeued%s",
            len(requeued),
            agent_id,
            f", {left} left (the queue is full, or another sender's message has its id)"
            if left
            else "",
            extra={
                "event": {
                    "category": "dead_letters_requeued",
                    "agent_id": agent_id,
                    "requeued": len(requeued),
                    "left": left,
                    "message_ids": requeued[:100],
                }
            },
        )
        return len(requeued), left

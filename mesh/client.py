"""The Python SDK: ``async with connect(target) as client`` and talk to the mesh.

Hot paths (send, request, deliveries, acks) travel as frames on one long-lived Connect stream
per client; the rest are unary calls. Sends are retried with exponential backoff on
RESOURCE_EXHAUSTED and UNAVAILABLE (100 ms, 500 ms, 2000 ms by default); after the last retry
the caller gets a typed exception from :mod:`mesh.core.errors`, never a raw gRPC error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import reprlib
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind, get_current_span

from mesh import codec
from mesh._status import PeerStatus, from_rpc_error, has_rich_status, stream_error
from mesh.config import (
    DEFAULT_LEASE_SECONDS,
    MAX_TTL,
    RETRY_BACKOFF_SECONDS,
    SecurityConfig,
    retry_wait,
)
from mesh.core import negotiation, workflows
from mesh.core.errors import (
    AgentError,
    AgentNotFoundError,
    BrokerUnavailableError,
    LockNotHeldError,
    MeshError,
    MessageValidationError,
    NotFoundError,
    RequestTimeoutError,
    SessionClosedError,
)
from mesh.core.memory import Insight, MemoryStats
from mesh.core.model import (
    ANSWER_TYPES,
    BROADCAST_TARGET,
    JSON,
    MAX_DEAD_LETTER_REASON,
    AgentCard,
    AgentInfo,
    DeadLetter,
    Delivery,
    DeliveryMode,
    Handoff,
    Message,
    MessageType,
    Priority,
    QueuedMessage,
    is_number,
    new_message_id,
    utc_now,
)
from mesh.core.state import (
    ChangeKind,
    StateChange,
    StateEntry,
    StateLock,
    StateMirror,
    StatePage,
    check_ttl,
    not_found,
)
from mesh.core.tasks import cancel_and_wait
from mesh.loop import AsyncOnly
from mesh.metrics import RT011_FIGURES
from mesh.security import check_target, open_channel
from mesh.serving import ANSWER_BYTES, GRPC_OPTIONS
from mesh.streams import BATCH_HEADER, FrameWriter
from mesh.tracing import current_span, inject, without_trace
from mesh.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    broker_pb2,
    broker_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
    tools_pb2,
    tools_pb2_grpc,
)

logger = logging.getLogger("mesh.client")

BROKER_SERVICE = broker_pb2.DESCRIPTOR.services_by_name["BrokerService"].full_name
T = TypeVar("T")
R = TypeVar("R")
E = TypeVar("E", MessageType, Priority, DeliveryMode)

_CLOSED = object()


class _Ended:
    """What a subscription's queue ends with when the broker ended it: why."""

    __slots__ = ("error",)

    def __init__(self, error: MeshError) -> None:
        self.error = error


_RECONNECT_DELAYS = (0.1, 0.25, 0.5, 1.0, 2.0)


LONGEST_RECONNECT_DELAY = _RECONNECT_DELAYS[-1]


def reconnect_delay(attempt: int) -> float:
    """How long to wait before try ``attempt`` + 1 to reach what went away (counted from 0):
    0.1 s growing to 2 s, for every reconnecting part of the SDK alike."""
    return _RECONNECT_DELAYS[min(attempt, len(_RECONNECT_DELAYS) - 1)]


async def until_reachable(attempt: Callable[[], Awaitable[T]], seconds: float, waiting: str) -> T:
    """What ``attempt()`` returns, tried again after 0.1 s growing to 2 s while what it needs
    cannot be reached yet (:class:`BrokerUnavailableError`), for up to ``seconds``; then its
    failure is raised. ``waiting`` says who waits for what, for the log ("PaymentAgent at
    host:port waits for its broker"): a warning the first time, then each try at INFO."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + seconds
    tried = 0
    while True:
        try:
            return await attempt()
        except BrokerUnavailableError as error:
            delay = reconnect_delay(tried)
            left = give_up - loop.time()
            if left < delay:
                raise
            logger.log(
                logging.WARNING if tried == 0 else logging.INFO,
                "%s (%s): trying again in %.1f s, for %.0f s more",
                waiting,
                error.message,
                delay,
                left,
            )
            tried += 1
            await asyncio.sleep(delay)


ACK_LINGER = 0.002
"""Seconds an ack or nack waits for others to share its frame, when the one before it came less
than half that ago (a steady trickle of messages, each acked on its own, costs both ends a
frame per message without it) and the broker's window for its subscription is less than half
used; otherwise it goes at once."""

# Reconnect quickly after a broker restart: the retry policy, not the channel, sets the pace.
# Each client keeps its connection to itself: in gRPC's process-wide pool a new client shares
# the connection of any other client of the process to the same address, and with it that
# one's reconnect backoff, so its first call failed at once with "connection refused" though
# the server was back up.
CLIENT_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.use_local_subchannel_pool", 1),
]


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Waits between attempts (RT-011 retry_backoff_ms) and the status codes worth retrying.
    A refusal that asks for a longer wait (its RetryInfo) gets it, up to a minute."""

    delays: tuple[float, ...] = RETRY_BACKOFF_SECONDS
    retry_on: frozenset[str] = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})

    def __post_init__(self) -> None:
        if any(d < 0 for d in self.delays):
            raise ValueError("retry delays must not be negative")

    @property
    def max_retries(self) -> int:
        return len(self.delays)


NO_RETRY = RetryPolicy(delays=())


async def with_retries(
    operation: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    counted: dict[str, int] | None = None,
    log: logging.Logger | None = None,
) -> T:
    """Runs ``operation``, and again after each of ``policy``'s delays while it is refused
    with a code worth retrying (or the longer wait the refusal asks for); each retry logged,
    and counted by code in ``counted``. The last refusal is raised as a MeshError."""
    delays = policy.delays
    for attempt in itertools.count():
        try:
            return await operation()
        except grpc.RpcError as error:
            failure = from_rpc_error(error)
        except MeshError as error:
            failure = error
        if failure.code not in policy.retry_on or attempt >= len(delays):
            raise failure
        if counted is not None:
            counted[failure.code] = counted.get(failure.code, 0) + 1
        wait = retry_wait(delays[attempt], failure.retry_after)
        (log or logger).info(
            "retry %d/%d in %.0f ms after %s: %s",
            attempt + 1,
            len(delays),
            wait * 1000,
            failure.code,
            failure.message,
            extra={
                "event": {
                    "category": "retry",
                    "attempt": attempt + 1,
                    "code": failure.code,
                    "delay_ms": wait * 1000,
                }
            },
        )
        await sleep(wait)
    raise AssertionError("unreachable")


@dataclass(slots=True)
class ClientStats:
    """What a client did: retries by status code, and messages it sent."""

    sent: int = 0
    retries: dict[str, int] = field(default_factory=dict)
    settle_frames: int = 0
    """Ack and nack frames written to the broker (each carries every id settled meanwhile)."""

    @property
    def total_retries(self) -> int:
        return sum(self.retries.values())


@dataclass(frozen=True, slots=True)
class BroadcastResult:
    message_id: str
    recipients: tuple[str, ...]
    failures: tuple[tuple[str, MeshError], ...]


@dataclass(frozen=True, slots=True)
class RequeueResult:
    """What :meth:`MeshClient.requeue_dead_letters` did."""

    requeued: int
    """Dead letters back in the queue, for a new round of delivery attempts."""
    left: int
    """Dead letters left as they were because the queue was full."""


@dataclass(frozen=True, slots=True)
class GatherResult:
    """One agent's outcome of :meth:`MeshClient.gather`."""

    agent_id: str
    response: Message | None
    error: MeshError | None


@dataclass(frozen=True, slots=True)
class QueueStatsView:
    agent_id: str
    depth: int
    high: int
    medium: int
    low: int
    in_flight: int
    dead_letters: int
    subscribers: int
    deferred: int = 0
    """Held until a time: scheduled (``deliver_at``), or nacked with a delay."""


@dataclass(frozen=True, slots=True)
class QueueStatsReport:
    agents: tuple[QueueStatsView, ...]
    totals: dict[str, float]

    def for_agent(self, agent_id: str) -> QueueStatsView | None:
        return next((a for a in self.agents if a.agent_id == agent_id), None)

    @property
    def metrics(self) -> dict[str, float]:
        """The broker's figures under the names RT-011 and RF-009 give them: latencies in
        milliseconds over the most recent operations (``multi_agent.message.send_latency_p95``,
        ...), counts since the broker started, the drop rate from 0 to 1 and the messages
        held as ``multi_agent.message.queue_depth``."""
        t = self.totals
        figures = {name: t[field] for name, field in RT011_FIGURES.items()}
        figures["multi_agent.message.queue_depth"] = t["held"]
        return figures


def with_trace(message: Message) -> Message:
    """The message carrying the current trace context in its headers, when there is one and
    it carries none yet."""
    headers = message.headers
    if type(headers) is not dict and not isinstance(headers, Mapping):
        return message  # (wrong: the codec says so)
    if "traceparent" in headers or not get_current_span().get_span_context().is_valid:
        return message  # (carries one already, or there is none to carry)
    return message.evolve(headers=inject(headers))


def wait_seconds(timeout: float | None, default: float, field: str = "timeout") -> float:
    """How long a call waits: ``timeout`` seconds, or ``default`` when it is None. A negative
    one, or one that is not a finite number, is the caller's mistake (MessageValidationError
    on ``field``) before anything is sent."""
    seconds = default if timeout is None else timeout
    if not is_number(seconds) or not 0 <= seconds < math.inf:  # NaN too
        raise MessageValidationError.for_field(
            field, f"{field} must be a finite number of seconds, not negative (got {seconds!r})"
        )
    return seconds


def delay_of(delay: float | timedelta) -> timedelta:
    """A scheduled message's ``delay``: seconds or a timedelta, finite and not negative;
    MessageValidationError on ``delay`` otherwise, before anything is sent."""
    if isinstance(delay, timedelta):
        if delay < timedelta(0):
            raise MessageValidationError.for_field(
                "delay", f"delay must not be negative (got {delay})"
            )
        return delay
    return timedelta(seconds=wait_seconds(delay, 0.0, "delay"))


def object_of(value: Mapping[str, Any] | None, field: str) -> dict[str, Any]:
    """A JSON object a caller gives (a message's ``metadata``, its ``headers``) as a dict;
    anything but a mapping (or None: empty) is a MessageValidationError on ``field``."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    raise MessageValidationError.for_field(
        field, f"{field} must be an object (a dict), not {reprlib.repr(value)}"
    )


def in_flight_count(value: int, field: str = "max_in_flight") -> int:
    """A count of messages in flight a caller gives: a whole number from 0 (the broker's
    default) within what the contract's uint32 carries (the broker says how many it allows);
    MessageValidationError on ``field`` otherwise, before anything is sent."""
    if not isinstance(value, int) or not 0 <= value < 2**32:
        raise MessageValidationError.for_field(
            field, f"{field} must be a whole number, not negative (got {value!r})"
        )
    return value


_KINDS = {
    FieldDescriptor.CPPTYPE_STRING: "a string",
    FieldDescriptor.CPPTYPE_BOOL: "true or false",
    FieldDescriptor.CPPTYPE_DOUBLE: "a number",
    FieldDescriptor.CPPTYPE_FLOAT: "a number",
}
"""What a field of a request holds, as a refusal says it (the rest: whole numbers)."""


def _request(kind: Callable[..., R], **fields: Any) -> R:
    """``kind(**fields)``, a request made of what a caller gave; a value of the wrong type is
    a MessageValidationError naming its field (protobuf's own TypeError names none: "bad
    argument type for built-in operation"). Nothing is checked before: a request made right
    costs what it did."""
    try:
        return kind(**fields)
    except (TypeError, ValueError):
        descriptor = getattr(kind, "DESCRIPTOR", None)
        for name, value in fields.items():
            try:
                kind(**{name: value})
            except (TypeError, ValueError):
                field = descriptor.fields_by_name[name] if descriptor is not None else None
                held = (
                    "a list"
                    if field is not None and field.is_repeated
                    else _KINDS.get(field.cpp_type, "a whole number")
                    if field is not None
                    else "something else"
                )
                raise MessageValidationError.for_field(
                    name, f"{name} must be {held}, not {type(value).__name__} {reprlib.repr(value)}"
                ) from None
        raise


def _text(value: str, field: str) -> str:
    """A name a caller gives (an agent id) for a frame's field: anything but a string is a
    MessageValidationError naming the field."""
    if isinstance(value, str):
        return value
    raise MessageValidationError.for_field(
        field, f"{field} must be a string, not {type(value).__name__} {reprlib.repr(value)}"
    )


def response_to(message: Message, agent_id: str, content: Mapping[str, JSON]) -> Message:
    """The RESPONSE to ``message`` from ``agent_id`` carrying ``content`` (its action, unless
    it names one, the message's): to the message's reply target, under its correlation id,
    at its priority, with its headers (the trace this one's)."""
    body = dict(content)
    body.setdefault("action", message.action or "response")
    return Message(
        from_agent=agent_id,
        to_agent=message.reply_target,
        message_type=MessageType.RESPONSE,
        content=body,
        correlation_id=message.correlation_id or message.message_id,
        priority=message.priority,
        headers=inject(without_trace(message.headers)),
    )


def _not_a_message(call: str, given: object) -> TypeError:
    return TypeError(
        f"{call} takes Message objects (mesh.Message), not {type(given).__name__} "
        f"{reprlib.repr(given)}"
    )


def _messages_only(call: str, messages: Iterable[object]) -> None:
    """TypeError (:func:`_not_a_message`) for the first of ``messages`` that is no Message."""
    if stray := next((m for m in messages if not isinstance(m, Message)), None):
        raise _not_a_message(call, stray)


def names_of(values: Iterable[str], field: str, what: str) -> tuple[str, ...]:
    """The names a caller lists (agent ids or types, tags, message ids...); a bare string,
    which would read as a list of its letters (an agent of the types "h", "o", "t"...), is a
    MessageValidationError on ``field``, before anything is sent."""
    if isinstance(values, str):
        name = field.rpartition(".")[2]
        raise MessageValidationError.for_field(
            field, f"{name} is a list of {what}, not one string: write [{values!r}]"
        )
    return tuple(values)


def content_keys(values: Iterable[str], field: str = "agent.required_fields") -> tuple[str, ...]:
    """The content keys a caller names (an agent's ``required_fields``), as :func:`names_of`."""
    return names_of(values, field, "content keys")


def member_named(kind: type[E], value: str, field: str) -> E:
    """The member of ``kind`` a caller names (in any case); MessageValidationError on
    ``field`` naming the known ones otherwise, before anything is sent."""
    try:
        return kind(value)
    except ValueError:
        known = ", ".join(kind.__members__)
        raise MessageValidationError.for_field(
            field, f"{field} {value!r} is not one of {known}"
        ) from None


def _prepared_alone(content: object, options: dict[str, Any]) -> None:
    """A prepared message is sent as it is: content or options beside it would be lost."""
    if content is not None or options:
        given = ["content"] if content is not None else []
        raise TypeError(
            f"a prepared message takes no content or options: {', '.join([*given, *options])}"
        )


def _time_out(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


def _request_batch(frames: list[broker_pb2.ConnectRequest]) -> broker_pb2.ConnectRequest:
    out = broker_pb2.ConnectRequest()
    out.batch.frames.extend(frames)
    return out


class _Session:
    """One Connect stream: numbered frames out, answers matched back by seq, deliveries to
    the queue of the subscribed agent their message is for."""

    def __init__(self, stub: broker_pb2_grpc.BrokerServiceStub) -> None:
        # With the batch header the broker may answer with `batch` frames; frames this side
        # has ready while a write is in flight go out together as one `batch` frame too.
        call: Any = stub.Connect(metadata=((BATCH_HEADER, "1"),))  # type: ignore[call-arg]
        self._call = call
        self._status = PeerStatus(call)
        self._writer: FrameWriter[broker_pb2.ConnectRequest] = FrameWriter(
            call.write,
            _request_batch,
            size=broker_pb2.ConnectRequest.ByteSize,
            most_bytes=ANSWER_BYTES,
        )
        self._seq = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[broker_pb2.ConnectResponse]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self.deliveries: dict[str, asyncio.Queue[Any]] = {}
        self.withdrawals: dict[str, Callable[[Iterable[str]], None]] = {}
        """By subscribed agent, who hears of the deliveries withdrawn from it."""
        self.closed = False
        self.failure: MeshError | None = None
        self._reader = asyncio.create_task(self._read(), name="mesh-session-reader")

    async def _read(self) -> None:
        failure: MeshError = SessionClosedError("the session was closed")
        try:
            while True:
                frame = await self._call.read()
                if frame is grpc.aio.EOF:
                    failure = BrokerUnavailableError("the broker ended the session")
                    break
                if frame.WhichOneof("frame") == "batch":
                    for inner in frame.batch.frames:
                        await self._take(inner)
                else:
                    await self._take(frame)
        except grpc.RpcError as raised:
            failure = stream_error(self._status.of(raised))  # (broken: a new session)
            if failure.code == "CANCELLED" and self.closed:
                failure = SessionClosedError("the session was closed")
        except asyncio.CancelledError:
            pass
        finally:
            self._fail(failure)

    async def _take(self, frame: broker_pb2.ConnectResponse) -> None:
        if frame.seq:
            stream = self._streams.get(frame.seq)
            if stream is not None:
                stream.put_nowait(frame)
                return
            waiter = self._waiting.pop(frame.seq, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(frame)
        elif frame.HasField("delivery"):
            await self._deliver(codec.delivery_from_pb(frame.delivery))
        elif frame.HasField("deliveries"):
            for delivery in frame.deliveries.deliveries:
                await self._deliver(codec.delivery_from_pb(delivery))
        elif frame.HasField("withdrawn"):
            withdrawn = self.withdrawals.get(frame.withdrawn.agent_id)
            if withdrawn is not None:
                withdrawn(frame.withdrawn.message_ids)
        elif frame.HasField("ended"):
            self._end_subscription(frame.ended.agent_id, codec.error_from_pb(frame.ended.error))
        elif frame.HasField("error"):
            error = codec.error_from_pb(frame.error)
            logger.warning("the broker refused a frame: %s: %s", error.code, error.message)

    async def _deliver(self, delivery: Delivery) -> None:
        # The broker keeps at most max_in_flight unacknowledged per subscription, the size
        # of its queue: this put does not wait. A delivery for a subscription ended meanwhile
        # is dropped: the broker took its lease back when it ended.
        queue = self.deliveries.get(delivery.message.to_agent)
        if queue is not None:
            await queue.put(delivery)

    def _end_subscription(self, agent_id: str, error: MeshError) -> None:
        """The broker ended the subscription of ``agent_id`` (its agent was deregistered):
        what is buffered for it goes (the broker took its leases back), and its iteration
        ends with ``error``; the session goes on."""
        queue = self.deliveries.pop(agent_id, None)
        self.withdrawals.pop(agent_id, None)
        if queue is None:
            return
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(_Ended(error))

    def _fail(self, failure: MeshError) -> None:
        self.closed = True
        self.failure = self.failure or failure  # the first reason the session ended
        self._writer.close(self.failure)
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(failure)
        self._waiting.clear()
        for stream in self._streams.values():
            stream.put_nowait(failure)
        for queue in self.deliveries.values():
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(_CLOSED)

    async def write(self, frame: broker_pb2.ConnectRequest) -> None:
        if self.closed:
            raise self.failure or SessionClosedError("the session is closed")
        try:
            await self._writer.write(frame)
        except grpc.RpcError as error:
            raise from_rpc_error(self._status.of(error)) from None
        except asyncio.InvalidStateError:
            await asyncio.sleep(0)  # let the reader record why the stream ended
            raise self.failure or BrokerUnavailableError("the session ended") from None

    async def call(
        self, frame: broker_pb2.ConnectRequest, timeout: float | None = None
    ) -> broker_pb2.ConnectResponse:
        seq = next(self._seq)
        frame.seq = seq
        waiter: asyncio.Future[broker_pb2.ConnectResponse] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[seq] = waiter
        timer: asyncio.TimerHandle | None = None
        try:
            await self.write(frame)
            if timeout is not None:
                # A timer on the waiter itself: cheaper than asyncio.timeout's
                # cancel-and-uncancel, on the path of every call.
                timer = asyncio.get_running_loop().call_later(timeout, _time_out, waiter)
            answer = await waiter
        except (TimeoutError, asyncio.CancelledError):
            self._give_up(seq)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._waiting.pop(seq, None)
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # (the session failed while the frame was being written)
        if answer.HasField("error"):
            raise codec.error_from_pb(answer.error)
        return answer

    async def stream(
        self, frame: broker_pb2.ConnectRequest, timeout: float
    ) -> AsyncGenerator[broker_pb2.ConnectResponse, None]:
        """Frames answering one request frame, until `accepted` or `error` ends them."""
        seq = next(self._seq)
        frame.seq = seq
        # Bounded by the frames the broker sends for one request (one per agent asked, + 1).
        answers: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[seq] = answers
        ended = False
        try:
            await self.write(frame)
            async with asyncio.timeout(timeout):
                while True:
                    answer = await answers.get()
                    if isinstance(answer, MeshError):
                        ended = True
                        raise answer
                    if answer.HasField("error"):
                        ended = True
                        raise codec.error_from_pb(answer.error)
                    if answer.HasField("accepted"):
                        ended = True
                        return
                    yield answer
        finally:
            self._streams.pop(seq, None)
            if not ended:  # the caller stopped reading (or waiting) first
                self._give_up(seq)

    def _give_up(self, seq: int) -> None:
        """Tells the broker the request or gather ``seq`` is no longer awaited, so that it
        frees what it holds for it now rather than at its deadline. Not waited for."""
        if self.closed:
            return
        frame = broker_pb2.ConnectRequest()
        frame.cancel.seq = seq
        self._writer.post(frame)

    def abandon(self) -> None:
        """Gives the stream up at once (the broker stopped answering on it): what waits on it
        fails, and the client's next call opens a new one."""
        if not self.closed:
            self._fail(BrokerUnavailableError("the session stopped answering"))
            self._call.cancel()

    async def close(self, grace: float = 1.0) -> None:
        """Half-closes the stream so that frames already written (acks) are processed, waits
        up to ``grace`` seconds for the broker to end it, then cancels."""
        if not self.closed:
            with contextlib.suppress(Exception):
                await self._writer.finish(self._call.done_writing)
            await asyncio.wait({self._reader}, timeout=grace)
            self.closed = True
            self._call.cancel()
        await cancel_and_wait(self._reader)


class Received:
    """A message delivered by a subscription; ack it when done, or nack it to have it again."""

    __slots__ = (
        "_subscription",
        "attempt",
        "done",
        "lease_expires_at",
        "max_attempts",
        "message",
        "withdrawn",
    )

    def __init__(self, subscription: ClientSubscription, delivery: Delivery) -> None:
        self._subscription = subscription
        self.message = delivery.message
        self.attempt = delivery.attempt
        self.max_attempts = delivery.max_attempts
        """The broker's number of deliveries in all: after the one whose ``attempt`` this is,
        a failure goes to the dead-letter queue (0: the broker did not say)."""
        self.lease_expires_at = delivery.lease_expires_at
        self.done = False
        self.withdrawn = False
        """The broker took the message back: its requester gave up (cancelled, or past its
        deadline), nobody waits for the answer, and no ack is due."""

    async def ack(self) -> None:
        """Acknowledges the message. The ack goes out with the others of this moment in one
        frame, without waiting for it; closing the subscription sends what is pending."""
        if not self.done:
            self.done = True
            self._subscription._settle("ack", self.message.message_id)

    async def nack(self, redeliver_after: float | None = None) -> None:
        """Hands the message back for redelivery (sent like acks): at once, or
        ``redeliver_after`` seconds from now, this subscription's place in flight free
        meanwhile (one whose attempts are used up goes to the dead-letter queue at once)."""
        delay = wait_seconds(redeliver_after, 0.0, "redeliver_after")
        if not self.done:
            self.done = True
            self._subscription._settle("nack", self.message.message_id, delay=delay)

    async def reject(self, reason: str) -> None:
        """Sends the message to the dead-letter queue at once, with ``reason`` (cut to the
        1024 characters the broker takes), for a message this agent can never process
        (redelivering it would fail the same way)."""
        if not self.done:
            self.done = True
            reason = reason[:MAX_DEAD_LETTER_REASON] or "rejected"
            self._subscription._settle("nack", self.message.message_id, reason)

    @property
    def subscription(self) -> ClientSubscription:
        """The subscription that delivered it."""
        return self._subscription

    async def extend_lease(self, seconds: float | None = None) -> None:
        """Keeps the message leased ``seconds`` from now (the subscription's lease when None)
        while it is still being worked on, so that the broker does not deliver it again
        meanwhile; sent like acks, and a message whose lease had already ended stays where
        it is (the agent runtime does this by itself for a handler that runs long)."""
        if not self.done:
            await self._subscription.extend_leases([self.message.message_id], seconds)

    async def answer(self, answer: Message | Mapping[str, JSON]) -> None:
        """Sends the answer to this request on the subscription's own stream, fire-and-forget;
        the broker takes it as the acknowledgement (when it answers this message's id), and
        it arrives before the stream ends, so closing the subscription right after loses
        nothing. Falls back to the client's session when the subscription's is gone.
        ``answer`` is a :class:`Message`, or the content of the RESPONSE to make, as a
        handler's return value is (this message's correlation, priority and sender)."""
        if not isinstance(answer, Message):
            answer = self._response(answer)
        codec.check_depth(answer.content)  # (a frame too deep to read would tell nobody)
        frame = broker_pb2.ConnectRequest()
        codec.message_to_pb(with_trace(answer), frame.send)
        session = self._subscription._session
        if session is not None and not session.closed:
            with contextlib.suppress(MeshError):
                await session.write(frame)
                answers = answer.message_type in ANSWER_TYPES
                if answers and answer.correlation_id == self.message.message_id:
                    self.done = True
                    self._subscription._taken.pop(self.message.message_id, None)
                return
        await self._subscription.client.send_nowait(answer)

    def _response(self, content: Mapping[str, JSON]) -> Message:
        if not isinstance(content, Mapping):
            raise TypeError(
                "answer takes a Message or the answer's content (a dict), not "
                f"{type(content).__name__} {reprlib.repr(content)}"
            )
        return response_to(self.message, self._subscription.agent_id, content)

    def __repr__(self) -> str:
        return f"Received({self.message.message_id}, attempt={self.attempt})"


class ClientSubscription(AsyncOnly):
    """An async iterator over an agent's deliveries. The subscriptions of one client share
    its Connect stream (one per agent; a second subscription of the same agent gets a stream
    of its own), so that the broker writes what is ready for several of them at once in one
    frame."""

    def __init__(
        self,
        client: MeshClient,
        agent_id: str,
        max_in_flight: int,
        lease_seconds: float,
        *,
        reconnect: bool = True,
        ack_linger: float = ACK_LINGER,
        on_withdrawn: Callable[[Received], None] | None = None,
        instance: str | None = None,
    ) -> None:
        self.client = client
        self.agent_id = agent_id
        self.instance = instance
        """The address of the agent's instance this subscription serves; None: the one this
        client registered the agent with, if any (see ``SubscribeRequest.instance``)."""
        self.on_withdrawn = on_withdrawn
        """Called with a delivery the application has (handed on, not settled) when the
        broker withdraws it: its requester gave up, so the work on it may stop."""
        self.max_in_flight = in_flight_count(max_in_flight)
        self.lease_seconds = wait_seconds(lease_seconds, 0, "lease_seconds")
        self.reconnect = reconnect
        self.ack_linger = wait_seconds(ack_linger, 0, "ack_linger")
        """Seconds an ack or nack of a steady flow waits for company while few deliveries
        are outstanding (see :meth:`_settle`); 0: none waits."""
        self.reconnects = 0
        self._session: _Session | None = None
        self._queue: asyncio.Queue[Any] | None = None
        self._own_session = False
        """The session is this subscription's alone (closed with it), not the client's."""
        self._closed = False
        self._settled: dict[tuple[str, str, float], list[str]] = {}
        """Acks and nacks to send, by kind, dead-letter reason and redelivery delay."""
        self._settling: asyncio.Task[None] | None = None
        self._settlers: set[asyncio.Task[None]] = set()
        self._lingering: asyncio.Future[None] | None = None
        """What the settling task awaits while it lingers; set to write at once."""
        self._last_settle_at = -math.inf
        """When (loop time) the application last acked or nacked."""
        self._taken: dict[str, Received] = {}
        """The deliveries handed on to the application and not settled yet: when the
        subscription closes, only these count a delivery attempt at the broker (those still
        buffered here, or on their way, go back as if never delivered)."""
        self._withdrawn: dict[str, None] = {}
        """Deliveries withdrawn while still buffered here: never handed on. (One settled
        as its withdrawal crossed the ack is listed too, and never met: the oldest go past
        twice the buffer's size.)"""

    async def start(self) -> ClientSubscription:
        session = await self.client._open_session()
        own = self.agent_id in session.deliveries
        if own:  # this client already subscribed this agent on its stream
            session = _Session(self.client._stub)
        # Deliveries are bounded by max_in_flight at the broker; the extra slot is for the
        # end-of-session marker.
        queue: asyncio.Queue[Any] = asyncio.Queue(self.max_in_flight + 1)
        session.deliveries[self.agent_id] = queue
        session.withdrawals[self.agent_id] = self._withdraw
        self._withdrawn.clear()
        frame = broker_pb2.ConnectRequest()
        frame.subscribe.agent_id = self.agent_id
        frame.subscribe.max_in_flight = self.max_in_flight
        frame.subscribe.max_batch = self.max_in_flight  # whatever is ready comes in one frame
        frame.subscribe.withdrawals = True
        frame.subscribe.instance = self._instance()
        codec.seconds_to_duration(self.lease_seconds, frame.subscribe.lease)
        try:
            await session.call(frame, timeout=self.client.default_timeout)
        except BaseException as error:
            if session.deliveries.get(self.agent_id) is queue:
                del session.deliveries[self.agent_id]
                session.withdrawals.pop(self.agent_id, None)
            if own:
                await session.close()
            if isinstance(error, TimeoutError):
                # A stream the broker does not answer on is of no more use: the next call
                # opens another, and this subscription is one to try again (it reconnects).
                session.abandon()
                raise BrokerUnavailableError(
                    f"the broker did not answer the subscription of {self.agent_id} within "
                    f"{self.client.default_timeout:g} s"
                ) from None
            raise
        self._session, self._queue, self._own_session = session, queue, own
        return self

    async def __aenter__(self) -> ClientSubscription:
        if self._session is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __aiter__(self) -> AsyncIterator[Received]:
        return self

    async def __anext__(self) -> Received:
        while True:
            if self._session is None:
                await self.start()
            assert self._session is not None and self._queue is not None
            item = await self._queue.get()
            if type(item) is _Ended:
                await self._ended()
                raise item.error
            if item is _CLOSED:
                pass
            elif item.message.message_id in self._withdrawn:
                del self._withdrawn[item.message.message_id]  # (given up meanwhile)
                continue
            else:
                break
            failure = None if self._closed else self._session.failure
            if self._closed or failure is None or isinstance(failure, SessionClosedError):
                raise StopAsyncIteration
            if not (self.reconnect and failure.code == "UNAVAILABLE"):
                raise failure
            await self._resubscribe(failure)
        received = Received(self, item)
        taken = self._taken
        taken[received.message.message_id] = received
        if len(taken) > 2 * self.max_in_flight + 16:
            # Beyond what the broker leases at once: the oldest are long settled by lease
            # expiry (their application never acked them), not held.
            del taken[next(iter(taken))]
        return received

    async def _ended(self) -> None:
        """The broker ended this subscription: iterating again subscribes anew (refused while
        the agent is not registered); acks of what the application still has go nowhere (the
        broker took those leases back as it ended it)."""
        session, self._session, self._queue = self._session, None, None
        self._taken.clear()
        if self._own_session and session is not None:
            await session.close()

    def _withdraw(self, message_ids: Iterable[str]) -> None:
        """The broker withdrew these deliveries: those handed on are marked (and reported to
        ``on_withdrawn``), those still buffered are passed by."""
        for message_id in message_ids:
            received = self._taken.pop(message_id, None)
            if received is None:
                self._withdrawn[message_id] = None
                if len(self._withdrawn) > 2 * (self.max_in_flight + 1):
                    del self._withdrawn[next(iter(self._withdrawn))]
                continue
            received.withdrawn = received.done = True
            if self.on_withdrawn is not None:
                try:
                    self.on_withdrawn(received)
                except Exception:  # (the session's reader calls it: it must go on reading)
                    logger.exception("on_withdrawn failed on %s", message_id)

    async def _resubscribe(self, failure: MeshError) -> None:
        """Subscribes again after the broker went away, with backoff; what this subscription
        held and had not acknowledged is redelivered by the broker."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.client.reconnect_timeout
        for attempt in itertools.count():
            delay = reconnect_delay(attempt)
            logger.warning(
                "subscription of %s lost the broker (%s); subscribing again in %.1f s",
                self.agent_id,
                failure.message,
                delay,
            )
            await asyncio.sleep(delay)
            if self._closed:
                raise StopAsyncIteration
            try:
                await self.start()
                self.reconnects += 1
                return
            except AgentNotFoundError as error:
                failure = error
                known = self.client._registered.get(self.agent_id)
                if known is None:
                    raise
                with contextlib.suppress(MeshError):
                    await self.client.register(
                        known.agent_id,
                        agent_types=known.agent_types,
                        address=known.address,
                        capabilities=known.capabilities,
                        required_fields=known.required_fields,
                    )
            except MeshError as error:
                if error.code != "UNAVAILABLE":
                    raise
                failure = error
            if loop.time() >= give_up:
                raise failure

    def _instance(self) -> str:
        if self.instance is not None:
            return self.instance
        registered = self.client._registered.get(self.agent_id)
        return registered.address if registered is not None else ""

    def _settle(
        self, kind: str, message_id: str, dead_letter_reason: str = "", *, delay: float = 0.0
    ) -> None:
        """Queues an ack or nack; one task writes all of those queued in the meantime as one
        frame each (AckRequest and NackRequest carry many ids). In a steady flow (the one
        before came less than half ``ack_linger`` ago) the task lingers that long for more,
        while less than half of the broker's window for this subscription is outstanding here
        (buffered, with the application, or settled and unsent); past half, or as the
        subscription closes, it writes at once, so that the broker never waits on a lingering
        ack to deliver more. One that comes after a pause goes at once: lingering would cost a
        wake-up of its own and join nothing."""
        self._settled.setdefault((kind, dead_letter_reason, delay), []).append(message_id)
        self._taken.pop(message_id, None)
        loop = asyncio.get_running_loop()
        now = loop.time()
        steady = now - self._last_settle_at < self.ack_linger / 2
        self._last_settle_at = now
        if self._settling is None:
            self._settling = loop.create_task(self._write_settled(steady))
            self._settlers.add(self._settling)
            self._settling.add_done_callback(self._settlers.discard)
        elif self._lingering is not None and self._pressed():
            self._stop_lingering()

    def _pressed(self) -> bool:
        """Half the broker's window or more is outstanding on this side."""
        buffered = self._queue.qsize() if self._queue is not None else 0
        unsent = sum(len(ids) for ids in self._settled.values())
        return 2 * (unsent + len(self._taken) + buffered) >= self.max_in_flight

    def _settle_now(self) -> list[asyncio.Task[None]]:
        """Ends the lingering of what is settled; the tasks that write it."""
        self._stop_lingering()
        return list(self._settlers)

    def _stop_lingering(self) -> None:
        lingering, self._lingering = self._lingering, None
        if lingering is not None and not lingering.done():
            lingering.set_result(None)

    async def _write_settled(self, steady: bool) -> None:
        if steady and not self._closed and not self._pressed():
            loop = asyncio.get_running_loop()
            self._lingering = lingering = loop.create_future()
            timer = loop.call_later(self.ack_linger, self._stop_lingering)
            try:
                await lingering
            finally:
                timer.cancel()
        else:
            await asyncio.sleep(0)  # the acks of this moment join
        session = self._session
        settled, self._settled = self._settled, {}
        self._settling = None
        if session is None or session.closed:
            return  # the broker returns the leases by itself when the session ends
        for (kind, reason, delay), message_ids in settled.items():
            frame = broker_pb2.ConnectRequest()
            if kind == "ack":
                frame.ack.agent_id = self.agent_id
                frame.ack.message_ids.extend(message_ids)
            else:
                frame.nack.agent_id = self.agent_id
                frame.nack.message_ids.extend(message_ids)
                frame.nack.dead_letter_reason = reason
                if delay:
                    codec.seconds_to_duration(delay, frame.nack.redeliver_after)
            with contextlib.suppress(MeshError):
                await session.write(frame)
                self.client.stats.settle_frames += 1

    async def extend_leases(self, message_ids: Iterable[str], seconds: float | None = None) -> None:
        """Keeps these deliveries leased ``seconds`` from now (this subscription's lease when
        None), in one frame that is not answered; nothing when the stream is gone (the broker
        has put them back already)."""
        seconds = wait_seconds(seconds, self.lease_seconds, "lease")
        session = self._session
        if session is None or session.closed:
            return
        frame = broker_pb2.ConnectRequest()
        frame.extend_lease.agent_id = self.agent_id
        frame.extend_lease.message_ids.extend(names_of(message_ids, "message_ids", "message ids"))
        codec.seconds_to_duration(seconds, frame.extend_lease.lease)
        with contextlib.suppress(MeshError):
            await session.write(frame)

    async def close(self) -> None:
        """Ends the subscription, after sending the acks and nacks still queued (and what
        was sent on its stream) and once the broker has put its unacknowledged messages back
        in the queue."""
        self._closed = True
        self.client._subscriptions.discard(self)
        self._stop_lingering()  # what is settled goes now
        if self._settlers:
            await asyncio.gather(*list(self._settlers), return_exceptions=True)
        session, queue = self._session, self._queue
        if session is None or queue is None:
            return
        if session.deliveries.get(self.agent_id) is queue:
            frame = broker_pb2.ConnectRequest()
            frame.unsubscribe.agent_id = self.agent_id
            # What the application had and did not settle counts a delivery attempt; what
            # is still buffered here, or on its way, goes back as if never delivered.
            frame.unsubscribe.release_unseen = True
            frame.unsubscribe.seen_message_ids.extend(self._taken)
            try:
                await session.call(frame, timeout=self.client.default_timeout)
            except MeshError:
                pass  # (a session that ended took the subscription with it)
            except TimeoutError:
                session.abandon()  # not answering: the broker returns the leases when it ends
            if session.deliveries.get(self.agent_id) is queue:
                del session.deliveries[self.agent_id]
                session.withdrawals.pop(self.agent_id, None)
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(_CLOSED)  # an iteration waiting now ends
        if self._own_session:
            await session.close()


CLOSED_CLIENT = "this client is closed: connect again (or keep it open while it is used)"


class ChannelOnFirstUse(AsyncOnly):
    """A client's gRPC channel to ``target``, made on first use, so in the event loop that
    uses it: a client made before ``asyncio.run(main())`` (at a module's top) works in the
    loop that runs main, where a grpc.aio channel made outside any loop is tied to another
    one ("attached to a different loop"). Its address is checked as the client is made."""

    def __init__(
        self,
        target: str,
        security: SecurityConfig | None,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self.target = target
        # TLS and credentials from ``security``, else from AGENTMESH_TLS_CA, AGENTMESH_TOKEN...
        self.security = security if security is not None else SecurityConfig.from_env()
        self._given_channel = channel
        self._channel_closed = False
        self._channel_loop: asyncio.AbstractEventLoop | None = None
        if channel is None:
            check_target(target)

    @functools.cached_property
    def _channel(self) -> grpc.aio.Channel:
        with contextlib.suppress(RuntimeError):  # (no loop runs: none to tell apart)
            self._channel_loop = asyncio.get_running_loop()
        if self._given_channel is not None:
            return self._given_channel
        if self._channel_closed:  # (closed before its first use: no channel to make now)
            raise SessionClosedError(CLOSED_CLIENT)
        return open_channel(self.target, self.security, CLIENT_OPTIONS)

    def _check_loop(self) -> None:
        """RuntimeError, saying what to do, for a call from another event loop than the one
        the channel was made in (a second ``asyncio.run()``, a test's own loop): gRPC would
        fail it with "Event loop is closed" or "attached to a different loop"."""
        loop = self._channel_loop
        if loop is not None and loop is not asyncio.get_running_loop():
            raise RuntimeError(
                f"this {type(self).__name__} was first used in another event loop, and its "
                "connection belongs to that one: make a client in each event loop (connect "
                "inside the coroutine, or the fixture of the same loop scope, that uses it)"
            )

    async def _close_channel(self) -> None:
        """Closes the channel the client made, if it made one (one it was given is not its
        own to close)."""
        self._channel_closed = True
        if self._given_channel is None and "_channel" in self.__dict__:
            await self._channel.close()


class MeshClient(ChannelOnFirstUse):
    """A connection to the broker. Use :func:`connect` to make one."""

    def __init__(
        self,
        target: str,
        *,
        agent_id: str = "",
        retry: RetryPolicy | None = None,
        default_timeout: float = 30.0,
        reconnect_timeout: float = 60.0,
        ack_linger: float = ACK_LINGER,
        security: SecurityConfig | None = None,
        channel: grpc.aio.Channel | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        super().__init__(target, security, channel)
        self.agent_id = agent_id
        self.retry = retry or RetryPolicy()
        self.default_timeout = default_timeout
        self.reconnect_timeout = reconnect_timeout
        self.ack_linger = ack_linger
        """The subscriptions' default :attr:`ClientSubscription.ack_linger` (0: none)."""
        self.stats = ClientStats()
        self._registered: dict[str, AgentInfo] = {}
        self._sleep = sleep
        self._session: _Session | None = None
        self._session_lock = asyncio.Lock()
        self._subscriptions: set[ClientSubscription] = set()
        self._closed = False

    @functools.cached_property
    def _stub(self) -> broker_pb2_grpc.BrokerServiceAsyncStub:
        return broker_pb2_grpc.BrokerServiceStub(self._channel)

    @functools.cached_property
    def _memory(self) -> memory_pb2_grpc.MemoryServiceAsyncStub:
        return memory_pb2_grpc.MemoryServiceStub(self._channel)

    @functools.cached_property
    def _tools(self) -> tools_pb2_grpc.ToolServiceAsyncStub:
        return tools_pb2_grpc.ToolServiceStub(self._channel)

    async def __aenter__(self) -> MeshClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: the client sends nothing more."""
        return self._closed

    async def broker_serving(self, service: str = BROKER_SERVICE) -> AsyncIterator[bool]:
        """Whether the broker serves: yielded once it answers (or cannot be reached), then at
        each change. Follows the broker's health (``grpc.health.v1`` Watch of ``service``):
        False while it cannot be reached or says anything but SERVING (it is draining to
        stop), True again when it serves. Runs until closed or cancelled."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        request = _request(health_pb2.HealthCheckRequest, service=service)
        said: bool | None = None
        attempt = 0
        while not self._closed:
            try:
                # Once it was lost, the watch waits for the connection to come back (at the
                # channel's own reconnect pace), so SERVING is heard as soon as it can be.
                async for reply in stub.Watch(request, wait_for_ready=said is not None):
                    attempt = 0
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    if serving is not said:
                        said = serving
                        yield serving
            except grpc.RpcError:
                pass  # (away: watched again below)
            if said is not False:
                said = False
                yield False
            await self._sleep(reconnect_delay(attempt))
            attempt += 1

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SessionClosedError(CLOSED_CLIENT)
        self._check_loop()

    async def close(self) -> None:
        self._closed = True
        for sub in list(self._subscriptions):
            await sub.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self._close_channel()

    # -- plumbing ----------------------------------------------------------------------------

    async def _open_session(self) -> _Session:
        session = self._session
        if session is not None and not session.closed:
            return session
        self._refuse_if_closed()
        async with self._session_lock:
            if self._session is None or self._session.closed:
                self._session = _Session(self._stub)
            return self._session

    async def _with_retry(self, operation: Callable[[], Awaitable[T]]) -> T:
        self._refuse_if_closed()
        return await with_retries(
            operation, self.retry, sleep=self._sleep, counted=self.stats.retries
        )

    def _unary(
        self, method: Callable[..., Any], request: Any, timeout: float | None = None
    ) -> Callable[[], Awaitable[Any]]:
        async def call() -> Any:
            await self._settle_lingering()
            return await method(request, timeout=timeout or self.default_timeout)

        return call

    async def _settle_lingering(self) -> None:
        """Writes the acks and nacks this client's subscriptions hold back for company before
        it asks the broker something (a unary call, a receive), so that the answer sees them."""
        settling = [task for sub in self._subscriptions for task in sub._settle_now()]
        if settling:
            await asyncio.gather(*settling, return_exceptions=True)

    def build(
        self,
        to_agent: str,
        content: dict[str, JSON] | None = None,
        *,
        message_type: MessageType | None = None,
        priority: Priority = Priority.MEDIUM,
        ttl: int = 0,
        correlation_id: str = "",
        reply_to: str = "",
        ack_required: bool = False,
        metadata: dict[str, JSON] | None = None,
        headers: dict[str, str] | None = None,
        from_agent: str | None = None,
        message_id: str = "",
        deliver_at: datetime | None = None,
        delay: float | timedelta | None = None,
    ) -> Message:
        """A message from this client (``agent_id``) with a fresh id (unless one is given: a
        re-sent id is accepted once) and timestamp: a REQUEST, or a BROADCAST when it goes to
        "broadcast", unless ``message_type`` says otherwise. A type or priority may be given
        by name ("REQUEST", "high"); one that is not known, or a ttl that is not a whole
        number of seconds, raises MessageValidationError naming it. ``deliver_at`` (a time),
        or ``delay`` (seconds or a timedelta from now), schedules it: the broker holds it
        until then."""
        if type(ttl) is not int:
            raise MessageValidationError.for_field(
                "ttl", f"ttl must be a whole number of seconds (got {ttl!r})"
            )
        if not -(2**31) <= ttl < 2**31:  # (what the wire carries; the broker says the rest)
            raise MessageValidationError.for_field(
                "ttl", f"ttl must be within 0 and {MAX_TTL} seconds (got {ttl})"
            )
        if delay is not None:
            if deliver_at is not None:
                raise TypeError("give deliver_at or delay, not both")
            try:
                deliver_at = utc_now() + delay_of(delay)
            except OverflowError:
                raise MessageValidationError.for_field(
                    "delay", f"delay must be at most {MAX_TTL} seconds (got {delay!r:.60})"
                ) from None
        elif deliver_at is not None and not isinstance(deliver_at, datetime):
            raise MessageValidationError.for_field(
                "deliver_at", f"deliver_at must be a datetime (got {deliver_at!r:.60})"
            )
        sender = self.agent_id if from_agent is None else from_agent
        if not sender:
            raise MessageValidationError.for_field(
                "from_agent",
                "from_agent is required: connect(..., agent_id=...) names the agent this client"
                " sends as (or pass from_agent=...)",
            )
        return Message(
            message_id=message_id or new_message_id(),
            from_agent=sender,
            to_agent=to_agent,
            content=content,
            message_type=(
                member_named(MessageType, message_type, "message_type")
                if message_type is not None
                else MessageType.BROADCAST
                if to_agent == BROADCAST_TARGET
                else MessageType.REQUEST
            ),
            priority=member_named(Priority, priority, "priority"),
            ttl=ttl,
            correlation_id=correlation_id,
            reply_to=reply_to,
            ack_required=ack_required,
            metadata=object_of(metadata, "metadata"),
            headers=object_of(headers, "headers"),
            deliver_at=deliver_at,
        )

    # -- sending -----------------------------------------------------------------------------

    async def send(
        self, to_agent: str | Message, content: dict[str, JSON] | None = None, **options: Any
    ) -> Message:
        """Sends a message to ``to_agent`` (or "broadcast"); returns it as accepted. A
        prepared :class:`Message` in place of ``to_agent`` is sent as it is
        (:meth:`send_message`)."""
        if isinstance(to_agent, Message):
            _prepared_alone(content, options)
            return await self.send_message(to_agent)
        return await self.send_message(self.build(to_agent, content, **options))

    async def send_message(self, message: Message | None = None, **fields: Any) -> Message:
        """Sends a prepared message, retrying on backpressure and unavailability. Without one,
        the message is built from ``fields`` as RF-009 writes it: ``send_message(to_agent=...,
        message_type="REQUEST", content={...})`` (and any option of :meth:`build`)."""
        if message is None:
            to_agent = fields.pop("to_agent", "")
            if not to_agent:
                raise TypeError("send_message needs a message, or to_agent= and its fields")
            message = self.build(to_agent, fields.pop("content", None), **fields)
        elif fields:
            raise TypeError(f"a prepared message takes no fields: {', '.join(fields)}")
        elif not isinstance(message, Message):
            raise _not_a_message("send_message", message)
        if not message.from_agent and self.agent_id:
            message = message.evolve(from_agent=self.agent_id)
        message = with_trace(message)

        async def attempt() -> Message:
            session = await self._open_session()
            frame = broker_pb2.ConnectRequest()
            codec.message_to_pb(message, frame.send)
            await session.call(frame, timeout=self.default_timeout)
            return message

        sent = await self._with_retry(attempt)
        self.stats.sent += 1
        return sent

    async def send_nowait(self, message: Message) -> None:
        """Sends without waiting for the broker's acceptance (one frame, no answer): for
        answers, whose sender has nothing to do if they fail. A failure is logged."""
        if not message.from_agent and self.agent_id:
            message = message.evolve(from_agent=self.agent_id)
        session = await self._open_session()
        frame = broker_pb2.ConnectRequest()
        codec.message_to_pb(with_trace(message), frame.send)
        await session.write(frame)
        self.stats.sent += 1

    async def send_parallel(
        self, messages: Sequence[Message], *, return_exceptions: bool = False
    ) -> list[Any]:
        """Sends all messages concurrently in one call; results in the order given."""
        _messages_only("send_parallel", messages)  # (before any of them is sent)
        started = time.perf_counter()
        results = await asyncio.gather(
            *(self.send_message(m) for m in messages), return_exceptions=return_exceptions
        )
        elapsed_ms = (time.perf_counter() - started) * 1000
        logger.info(
            "parallel send of %d messages in %.2f ms",
            len(messages),
            elapsed_ms,
            extra={
                "event": {
                    "category": "parallel_send",
                    "count": len(messages),
                    "to_agents": [m.to_agent for m in messages],
                    "latency_ms": round(elapsed_ms, 3),
                }
            },
        )
        return list(results)

    async def send_messages_parallel(
        self, messages: Sequence[Message], *, return_exceptions: bool = False
    ) -> list[Any]:
        """:meth:`send_parallel` under RF-009's name."""
        return await self.send_parallel(messages, return_exceptions=return_exceptions)

    async def send_batch(self, messages: Sequence[Message]) -> list[Message | MeshError]:
        """Sends messages in one SendMessages call; each gets its own result."""
        _messages_only("send_batch", messages)
        prepared = [
            m if m.from_agent or not self.agent_id else m.evolve(from_agent=self.agent_id)
            for m in messages
        ]
        request = broker_pb2.SendMessagesRequest()
        for m in prepared:
            codec.message_to_pb(m, request.messages.add())
        response = await self._with_retry(self._unary(self._stub.SendMessages, request))
        out: list[Message | MeshError] = []
        for m, result in zip(prepared, response.results, strict=True):
            out.append(codec.error_from_pb(result.error) if result.HasField("error") else m)
        return out

    async def request(
        self,
        to_agent: str | Message,
        content: dict[str, JSON] | None = None,
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> Message:
        """Sends a REQUEST and returns the correlated RESPONSE.

        Raises AgentError when the agent answers with an ERROR, RequestTimeoutError when no
        answer arrives within ``timeout`` seconds. A prepared :class:`Message` in place of
        ``to_agent`` is sent as it is (:meth:`request_message`).
        """
        if isinstance(to_agent, Message):
            _prepared_alone(content, options)
            return await self.request_message(to_agent, timeout=timeout)
        options.setdefault("message_type", MessageType.REQUEST)
        message_id = options.pop("message_id", "") or new_message_id()
        options.setdefault("correlation_id", message_id)
        message = self.build(to_agent, content, message_id=message_id, **options)
        return await self.request_message(message, timeout=timeout)

    async def request_message(
        self, message: Message, *, timeout: float | None = None, raise_on_error: bool = True
    ) -> Message:
        timeout = wait_seconds(timeout, self.default_timeout)
        if not message.from_agent and self.agent_id:
            message = message.evolve(from_agent=self.agent_id)
        if not message.correlation_id:
            message = message.evolve(correlation_id=message.message_id)
        deadline = time.monotonic() + timeout

        async def attempt() -> Message:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeoutError(
                    f"no response from {message.to_agent} within {timeout:.3g} s"
                )
            session = await self._open_session()
            frame = broker_pb2.ConnectRequest()
            codec.message_to_pb(message, frame.request.message)
            codec.seconds_to_duration(remaining, frame.request.timeout)
            try:
                # The broker answers DEADLINE_EXCEEDED at the deadline; the margin covers transit.
                answer = await session.call(frame, timeout=remaining + 1.0)
            except TimeoutError:
                raise RequestTimeoutError(
                    f"no response from {message.to_agent} within {timeout:.3g} s"
                ) from None
            return codec.message_from_pb(answer.response)

        with current_span(
            f"request {message.to_agent}",
            kind=SpanKind.CLIENT,
            attributes=lambda: {"agent": message.to_agent, "message_id": message.message_id},
        ):
            message = with_trace(message)
            response = await self._with_retry(attempt)
        if raise_on_error and response.message_type is MessageType.ERROR:
            content = response.content or {}
            raise AgentError(
                str(content.get("error") or f"{response.from_agent} answered with an error"),
                reason=str(content.get("reason") or "AGENT_ERROR"),
            )
        return response

    async def gather(
        self,
        content: dict[str, JSON] | Message,
        *,
        agent_ids: Iterable[str] = (),
        agent_types: Iterable[str] = (),
        timeout: float | None = None,
        all_or_none: bool = False,
        **options: Any,
    ) -> AsyncGenerator[GatherResult, None]:
        """Asks several agents at once; yields each agent's answer (or error) as it arrives.

        The copies are BROADCAST messages sharing one id (REQUEST or HANDOFF when a prepared
        message of that type is given); agents that do not answer within ``timeout`` seconds
        come last, with RequestTimeoutError. An agent of ``agent_ids`` that is not registered
        comes with AgentNotFoundError; with ``all_or_none`` it raises that, and nobody is
        asked.
        """
        timeout = wait_seconds(timeout, self.default_timeout)
        if isinstance(content, Message):
            message = content
        else:
            options.setdefault("message_type", MessageType.BROADCAST)
            message = self.build("broadcast", content, **options)
        frame = broker_pb2.ConnectRequest()
        request = frame.gather
        request.agent_ids.extend(names_of(agent_ids, "agent_ids", "agent ids"))
        request.agent_types.extend(names_of(agent_types, "agent_types", "agent types"))
        request.all_or_none = all_or_none
        codec.message_to_pb(with_trace(message), request.message)
        codec.seconds_to_duration(timeout, request.timeout)
        session = await self._open_session()
        # Closed with this generator, however early: the broker is told to give the gather
        # up, instead of holding it until its deadline.
        answers = session.stream(frame, timeout + 5.0)
        async with contextlib.aclosing(answers):
            async for answer in answers:
                item = answer.gathered
                if item.HasField("response"):
                    yield GatherResult(item.agent_id, codec.message_from_pb(item.response), None)
                else:
                    yield GatherResult(item.agent_id, None, codec.error_from_pb(item.error))

    async def negotiate(
        self,
        peers: Sequence[str],
        proposal: dict[str, JSON],
        *,
        topic: str = "",
        rounds: int = negotiation.MAX_ROUNDS,
        timeout: float = negotiation.MAX_SECONDS,
        revise: negotiation.Revise = negotiation.adopt_counters,
        from_agent: str = "",
    ) -> negotiation.Outcome:
        """Negotiates terms with peers directly (RT-011 peer-to-peer coordination).

        Each round asks every peer at once (a REQUEST with content.action "negotiate" and
        parameters negotiation_id, topic, round, proposal); each answers accept, reject or
        counter (``negotiation.accept()``, ``.reject(why)``, ``.counter(terms)``; ``from mesh
        import negotiation``). All accept: AGREED. A rejection (or an ERROR answer): REJECTED
        at once. Counters: ``revise`` makes the next round's terms from them (by default the
        counters' terms are taken over the proposal's), for at most ``rounds`` rounds (3),
        then NO_AGREEMENT. A peer that has not answered when ``timeout`` (5 s, for the whole
        negotiation) is up: TIMED_OUT. At most 10 peers. A peer that is not registered raises
        AgentNotFoundError before any peer is asked.
        """
        proposer = from_agent or self.agent_id
        peers = list(names_of(peers, "peers", "agent ids"))
        negotiation.check(peers, rounds, timeout, proposer)
        negotiation_id = new_message_id()
        deadline = time.monotonic() + timeout
        history: list[negotiation.Round] = []
        status: negotiation.Status | None = None
        terms = dict(proposal)
        for number in range(1, rounds + 1):
            content = negotiation.proposal_content(negotiation_id, number, terms, topic)
            message = self.build(
                "broadcast",
                content,
                message_type=MessageType.REQUEST,
                from_agent=proposer,
                metadata={"negotiation_id": negotiation_id, "round": number},
            )
            replies: dict[str, negotiation.Reply] = {}
            missing = []
            remaining = max(deadline - time.monotonic(), 0.001)
            # All or none: a peer that is not registered ends it before anyone is asked.
            gathered = self.gather(message, agent_ids=peers, timeout=remaining, all_or_none=True)
            async for result in gathered:
                if result.response is not None:
                    answer = result.response
                    if answer.message_type is MessageType.ERROR:
                        why = (answer.content or {}).get("error") or "the peer failed"
                        reply = negotiation.Reply(
                            result.agent_id, negotiation.Decision.REJECT, reason=str(why)
                        )
                    else:
                        reply = negotiation.read_reply(result.agent_id, answer.content)
                    replies[result.agent_id] = reply
                elif isinstance(result.error, RequestTimeoutError):
                    missing.append(result.agent_id)
                elif isinstance(result.error, AgentNotFoundError):
                    raise result.error
                else:
                    reason = result.error.message if result.error else "no answer"
                    replies[result.agent_id] = negotiation.Reply(
                        result.agent_id, negotiation.Decision.REJECT, reason=reason
                    )
            ordered = tuple(replies[p] for p in peers if p in replies)
            history.append(negotiation.Round(number, terms, ordered, tuple(missing)))
            status, terms = negotiation.conclude(number, rounds, terms, ordered, missing, revise)
            if status is not None:
                break
        assert status is not None  # the last round always concludes
        logger.info(
            "negotiation %s by %s with %s: %s after %d round(s)",
            negotiation_id,
            proposer,
            ", ".join(peers),
            status.value,
            len(history),
            extra={
                "event": {
                    "category": "negotiation",
                    "negotiation_id": negotiation_id,
                    "from_agent": proposer,
                    "peers": peers,
                    "topic": topic,
                    "rounds": len(history),
                    "status": status.value,
                }
            },
        )
        return negotiation.Outcome(status, terms, tuple(history), negotiation_id)

    async def broadcast(
        self,
        content: dict[str, JSON] | Message,
        *,
        agent_types: Iterable[str] = (),
        **options: Any,
    ) -> BroadcastResult:
        """A copy to every other registered agent, or only to agents of ``agent_types``.

        ``content`` is the message's content, or a prepared :class:`Message` (RF-009's
        ``broadcast(message)``: sent as a BROADCAST whatever its to_agent and type)."""
        if isinstance(content, Message):
            if options:
                raise TypeError(f"a prepared message takes no options: {', '.join(options)}")
            message = content.evolve(
                to_agent=BROADCAST_TARGET,
                message_type=MessageType.BROADCAST,
                from_agent=content.from_agent or self.agent_id,
            )
        else:
            options["message_type"] = MessageType.BROADCAST
            message = self.build(BROADCAST_TARGET, content, **options)
        message = with_trace(message)
        types = names_of(agent_types, "agent_types", "agent types")

        async def attempt() -> broker_pb2.BroadcastResponse:
            session = await self._open_session()  # the session's stream: no call per broadcast
            frame = broker_pb2.ConnectRequest()
            frame.broadcast.agent_types.extend(types)
            codec.message_to_pb(message, frame.broadcast.message)
            answer = await session.call(frame, timeout=self.default_timeout)
            return answer.broadcasted

        response = await self._with_retry(attempt)
        return BroadcastResult(
            response.message_id,
            tuple(response.recipients),
            tuple((f.agent_id, codec.error_from_pb(f.error)) for f in response.failures),
        )

    async def broadcast_to_types(
        self, agent_types: Iterable[str], content: dict[str, JSON], **options: Any
    ) -> BroadcastResult:
        """Selective broadcast: only agents of the given types receive the message."""
        types = names_of(agent_types, "agent_types", "agent types")
        if not types:
            raise MessageValidationError.for_field(
                "agent_types", "broadcast_to_types needs at least one agent type"
            )
        return await self.broadcast(content, agent_types=types, **options)

    async def handoff(
        self,
        to_agent: str,
        task_description: str,
        *,
        context: dict[str, JSON] | None = None,
        previous_result: JSON = None,
        constraints: dict[str, JSON] | None = None,
        workflow_id: str = "",
        step_number: int = 1,
        priority: Priority = Priority.MEDIUM,
        ttl: int = 0,
        headers: dict[str, str] | None = None,
        from_agent: str | None = None,
    ) -> Message:
        """Transfers a task to ``to_agent`` with its context, as a HANDOFF message."""
        if not isinstance(task_description, str):
            raise MessageValidationError.for_field(
                "task_description",
                f"task_description must be a string, not {reprlib.repr(task_description)}",
            )
        if isinstance(step_number, bool) or not isinstance(step_number, int) or step_number < 0:
            raise MessageValidationError.for_field(
                "step_number",
                f"step_number must be a whole number, not negative (got {step_number!r})",
            )
        handoff = Handoff(
            task_description=task_description,
            context=object_of(context, "context"),
            previous_result=previous_result,
            constraints=object_of(constraints, "constraints"),
            workflow_id=workflow_id,
            step_number=step_number,
        )
        message = self.build(
            to_agent,
            handoff.to_content(),
            message_type=MessageType.HANDOFF,
            metadata=handoff.to_metadata(),
            priority=priority,
            ttl=ttl,
            headers=headers,
            from_agent=from_agent,
        )
        return await self.send_message(message)

    async def end_workflow(
        self,
        workflow_id: str,
        status: str = "COMPLETED",
        *,
        failed_at_step: int | None = None,
        error_reason: str = "",
        agent_id: str | None = None,
    ) -> StateEntry | None:
        """Adds a workflow's ending to the status its hand-offs keep in the shared state
        (``workflow/<workflow_id>``): ``status`` COMPLETED, or FAILED with ``failed_at_step``
        (by default the step the status is at) and ``error_reason`` (RF-010 scenario 10),
        and ``finished_at``; the status keeps the time it has left. What the last agent of a
        workflow run by its agents alone does (the gateway does it for the workflows it runs).
        Returns the status written; None, and nothing written, when none is recorded (no
        hand-off named the workflow)."""
        if not workflow_id:
            raise MessageValidationError.for_field("workflow_id", "workflow_id is required")
        if status not in workflows.ENDED:
            raise MessageValidationError.for_field(
                "status", f"a workflow ends COMPLETED or FAILED, not {status!r}"
            )
        return await workflows.record_ending(
            _StateThroughClient(self),
            workflow_id,
            status,
            agent_id or self.agent_id,
            utc_now(),
            failed_at_step=failed_at_step,
            error_reason=error_reason,
        )

    # -- receiving ---------------------------------------------------------------------------

    async def receive(self, agent_id: str | None = None, max_messages: int = 0) -> list[Message]:
        """Removes and returns the agent's waiting messages, HIGH first, then oldest first:
        up to ``max_messages`` (0: all) and 3 MiB an answer, the rest waiting for the next
        call (an empty list: the queue is empty).

        Messages sent with ack_required are acknowledged to their senders (by the broker, as
        it hands them over).
        """

        async def attempt() -> broker_pb2.ReceiveMessagesResponse:
            await self._settle_lingering()  # (as a unary call does: it asks, so it writes first)
            session = await self._open_session()
            frame = broker_pb2.ConnectRequest()
            frame.receive.agent_id = _text(agent_id or self.agent_id, "agent_id")
            frame.receive.max_messages = max_messages
            answer = await session.call(frame, timeout=self.default_timeout)
            return answer.received

        response = await self._with_retry(attempt)
        return [codec.message_from_pb(pb) for pb in response.messages]

    async def receive_messages(
        self, agent_id: str | None = None, max_messages: int = 0
    ) -> list[Message]:
        """:meth:`receive` under RF-009's name."""
        return await self.receive(agent_id, max_messages)

    def subscribe(
        self,
        agent_id: str | None = None,
        *,
        max_in_flight: int = 64,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        reconnect: bool = True,
        ack_linger: float | None = None,
        on_withdrawn: Callable[[Received], None] | None = None,
        instance: str | None = None,
    ) -> ClientSubscription:
        """Deliveries of the agent's messages as they arrive: ``async for r in sub`` then
        ``await r.ack()``. Unacknowledged messages are redelivered. Acks and nacks go out
        together: in a steady flow, and while less than half of ``max_in_flight`` is
        outstanding, they wait up to ``ack_linger`` seconds (the client's, 2 ms by default)
        for company.

        The subscription holds the agent's instance at ``instance`` (by default the address
        this client registered the agent with): should it be lost without the instance
        deregistering (the process dies), the broker takes that instance off the agent's.

        With ``reconnect`` (the default) a subscription that loses the broker subscribes again
        with backoff (registering the agent again when this client registered it and the
        broker forgot it), for up to ``reconnect_timeout`` seconds.

        A request whose requester gives up (cancels it, or its deadline passes) is withdrawn
        by the broker: one still buffered here is never handed on; one handed on is marked
        ``withdrawn`` (its ack is no longer due) and given to ``on_withdrawn``, which may stop
        the work on it (the agent runtime cancels its handler)."""
        self._refuse_if_closed()
        sub = ClientSubscription(
            self,
            _text(agent_id or self.agent_id, "agent_id"),
            max_in_flight,
            lease_seconds,
            reconnect=reconnect,
            ack_linger=self.ack_linger if ack_linger is None else ack_linger,
            on_withdrawn=on_withdrawn,
            instance=instance,
        )
        self._subscriptions.add(sub)
        return sub

    async def ack(self, message_ids: Iterable[str], agent_id: str | None = None) -> int:
        request = _request(
            broker_pb2.AckRequest,
            agent_id=agent_id or self.agent_id,
            message_ids=names_of(message_ids, "message_ids", "message ids"),
        )
        response = await self._with_retry(self._unary(self._stub.Ack, request))
        return int(response.acknowledged)

    async def nack(
        self,
        message_ids: Iterable[str],
        agent_id: str | None = None,
        *,
        dead_letter_reason: str = "",
        redeliver_after: float | None = None,
    ) -> tuple[int, int]:
        """Hands deliveries back for redelivery (``redeliver_after`` seconds from now, held
        by nobody meanwhile, when given); with ``dead_letter_reason`` they go to the
        dead-letter queue at once. Returns (requeued, dead-lettered)."""
        request = _request(
            broker_pb2.NackRequest,
            agent_id=agent_id or self.agent_id,
            message_ids=names_of(message_ids, "message_ids", "message ids"),
            dead_letter_reason=dead_letter_reason,
        )
        if delay := wait_seconds(redeliver_after, 0.0, "redeliver_after"):
            codec.seconds_to_duration(delay, request.redeliver_after)
        response = await self._with_retry(self._unary(self._stub.Nack, request))
        return int(response.requeued), int(response.dead_lettered)

    # -- registry and statistics -------------------------------------------------------------

    async def register(
        self,
        agent_id: str | None = None,
        *,
        agent_types: Iterable[str] = (),
        address: str = "",
        capabilities: Iterable[str] = (),
        delivery_mode: DeliveryMode | str = DeliveryMode.PULL,
        max_in_flight: int = 0,
        required_fields: Iterable[str] = (),
    ) -> AgentInfo:
        """Registers an agent (or one more instance of it, at ``address``). With
        ``delivery_mode="PUSH"`` the broker calls ``HandleMessage`` on the server at
        ``address`` with each message queued for the agent (any gRPC server of the Agent
        service: no subscription needed), at most ``max_in_flight`` calls at once (0: the
        broker's default); by default the agent takes its messages itself.
        ``required_fields``: content keys every REQUEST and HANDOFF sent to the agent must
        carry (e.g. ``["action", "parameters"]``); the broker refuses one that lacks any
        with :class:`MessageValidationError`."""
        info = AgentInfo(
            agent_id=_text(agent_id or self.agent_id, "agent.agent_id"),
            agent_types=names_of(agent_types, "agent.agent_types", "agent types"),
            address=address,
            capabilities=names_of(capabilities, "agent.capabilities", "capabilities"),
            delivery_mode=member_named(DeliveryMode, delivery_mode, "delivery_mode"),
            max_in_flight=in_flight_count(max_in_flight),
            required_fields=content_keys(required_fields),
        )
        request = broker_pb2.RegisterAgentRequest()
        codec.agent_to_pb(info, request.agent)
        response = await self._with_retry(self._unary(self._stub.RegisterAgent, request))
        if not self.agent_id:
            self.agent_id = info.agent_id
        self._registered[info.agent_id] = info
        return codec.agent_from_pb(response.agent)

    async def deregister(self, agent_id: str | None = None, *, address: str = "") -> None:
        """Takes the agent off the mesh; with ``address``, only the instance serving there
        leaves (the agent stays while other processes serve it: what an agent does as it
        stops). Taken off whole, its processes hear of it: those that pull as their
        subscriptions end, those pushed to through the broker's NotifyDeregistered call."""
        request = _request(
            broker_pb2.DeregisterAgentRequest, agent_id=agent_id or self.agent_id, address=address
        )
        self._registered.pop(request.agent_id, None)
        await self._with_retry(self._unary(self._stub.DeregisterAgent, request))

    async def list_agents(self, agent_type: str = "") -> list[AgentInfo]:
        """Every registered agent (of ``agent_type`` when given), by id: the broker answers
        a page of up to 3 MiB at a time, and this reads them all."""
        request = _request(broker_pb2.ListAgentsRequest, agent_type=agent_type)
        pages = await self._every_page(self._stub.ListAgents, request, "agents")
        return [codec.agent_from_pb(a) for a in pages]

    async def _every_page(self, method: Callable[..., Any], request: Any, field: str) -> list[Any]:
        """Every item of a paged listing: ``method`` asked page after page (each tried again
        as any call) while its answer has a ``next_page_token``."""
        items: list[Any] = []
        while True:
            response = await self._with_retry(self._unary(method, request))
            items.extend(getattr(response, field))
            if not response.next_page_token:
                return items
            request.page_token = response.next_page_token

    async def queue_stats(self, agent_id: str = "") -> QueueStatsReport:
        request = _request(broker_pb2.GetQueueStatsRequest, agent_id=agent_id)
        response = await self._with_retry(self._unary(self._stub.GetQueueStats, request))
        t = response.totals
        return QueueStatsReport(
            tuple(
                QueueStatsView(
                    a.agent_id,
                    a.depth,
                    a.high,
                    a.medium,
                    a.low,
                    a.in_flight,
                    a.dead_letters,
                    a.subscribers,
                    a.deferred,
                )
                for a in response.agents
            ),
            {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields},
        )

    # -- tools -------------------------------------------------------------------------------

    async def call_tool(
        self,
        tool: str,
        arguments: dict[str, JSON] | None = None,
        *,
        timeout: float = 10.0,
        agent_id: str | None = None,
    ) -> JSON:
        """Runs a tool through the mesh as this agent; the mesh enforces the agent's allow-list
        (ToolPermissionError). No retries here: a caller tells a ToolTimeoutError (worth
        retrying) from a ToolFailedError (not worth it) and decides."""
        from mesh.core.tools import (
            ToolFailedError,
            ToolPermissionError,
            ToolTimeoutError,
            UnknownToolError,
        )

        timeout = wait_seconds(timeout, 10.0)
        request = _request(
            tools_pb2.InvokeToolRequest, agent_id=agent_id or self.agent_id, tool=tool
        )
        codec.encode_struct(object_of(arguments, "arguments"), request.arguments, "arguments")
        codec.seconds_to_duration(timeout, request.timeout)
        self._refuse_if_closed()
        try:
            response = await self._tools.InvokeTool(request, timeout=timeout + 5.0)
        except grpc.RpcError as error:
            failure = from_rpc_error(error)
            kind = {
                "TOOL_NOT_ALLOWED": ToolPermissionError,
                "UNKNOWN_TOOL": UnknownToolError,
                "TOOL_TIMEOUT": ToolTimeoutError,
                "TOOL_FAILED": ToolFailedError,
            }.get(failure.reason)
            if kind is None and failure.code == "DEADLINE_EXCEEDED":
                kind = ToolTimeoutError
            if failure.code == "UNIMPLEMENTED" and not has_rich_status(error):
                # gRPC's own "Method not found!": the broker serves no Tool service at all.
                raise UnknownToolError(
                    f"no tool {tool!r}: the broker runs no tools (it is started with --tools"
                    " to host them)"
                ) from None
            raise (kind(failure.message) if kind else failure) from None
        return codec.value_to_python(response.result)

    # -- shared memory pool ------------------------------------------------------------------

    async def write_insight(
        self,
        content: JSON,
        *,
        tags: Iterable[str] = (),
        importance: float = 0.5,
        segment: str = "default",
        metadata: dict[str, JSON] | None = None,
        agent_id: str | None = None,
        ttl: float = 0.0,
    ) -> Insight:
        """Writes an insight to the mesh's shared memory pool; with ``ttl``, the pool keeps it
        that many seconds (else until it is deleted)."""
        from mesh.memory_server import insight_from_pb, insight_to_pb

        if not is_number(importance) or not 0 <= importance <= 1:  # (NaN too)
            raise MessageValidationError.for_field(
                "insight.importance", f"importance must be within 0 and 1, not {importance!r}"
            )
        request = memory_pb2.WriteInsightRequest()
        insight_to_pb(
            Insight(
                agent_id=agent_id or self.agent_id,
                content=content,
                tags=names_of(tags, "insight.tags", "tags"),
                importance=importance,
                segment=segment,
                metadata=object_of(metadata, "insight.metadata"),
                ttl=wait_seconds(ttl, 0, "ttl"),
            ),
            request.insight,
        )
        response = await self._with_retry(self._unary(self._memory.WriteInsight, request))
        return insight_from_pb(response.insight)

    async def delete_insights(
        self,
        *,
        insight_ids: Iterable[str] = (),
        tags: Iterable[str] = (),
        segment: str = "",
        agent_id: str = "",
    ) -> int:
        """Removes the insights that match every filter given (at least one is required);
        returns how many left the pool."""
        request = _request(
            memory_pb2.DeleteInsightsRequest,
            insight_ids=names_of(insight_ids, "insight_ids", "insight ids"),
            tags=names_of(tags, "tags", "tags"),
            segment=segment,
            agent_id=agent_id,
        )
        response = await self._with_retry(self._unary(self._memory.DeleteInsights, request))
        return int(response.deleted)

    async def read_insights(
        self,
        *,
        tags: Iterable[str] = (),
        segment: str = "",
        min_importance: float = 0.0,
        limit: int = 0,
        agent_id: str = "",
    ) -> list[Insight]:
        """Insights with all of ``tags``, most important first, then newest first: up to
        ``limit`` (0: 100), read 3 MiB at a time."""
        from mesh.memory_server import insight_from_pb

        request = _request(
            memory_pb2.ReadInsightsRequest,
            tags=names_of(tags, "tags", "tags"),
            segment=segment,
            min_importance=min_importance,
            limit=limit,
            agent_id=agent_id,
        )
        pages = await self._every_page(self._memory.ReadInsights, request, "insights")
        return [insight_from_pb(pb) for pb in pages]

    # -- shared state ----------------------------------------------------------------------

    async def get_state(self, key: str) -> StateEntry | None:
        """The shared state's entry ``key`` at its latest version (None when there is none)."""
        from mesh.memory_server import entry_from_pb

        request = _request(memory_pb2.GetStateRequest, key=key)
        try:
            response = await self._with_retry(self._unary(self._memory.GetState, request))
        except NotFoundError:
            return None
        return entry_from_pb(response.entry)

    async def list_state(
        self, prefix: str = "", *, page_size: int = 0, page_token: str = ""
    ) -> StatePage:
        """One page of the entries whose keys start with ``prefix`` (every entry, without
        one), in key order: at most ``page_size`` (100 by default, 1000 at most), fewer when
        their values are large; pass its ``next_page_token`` for the next ("" after the last).
        :meth:`state_entries` walks every page."""
        from mesh.memory_server import entry_from_pb

        request = _request(
            memory_pb2.ListStateRequest, prefix=prefix, page_size=page_size, page_token=page_token
        )
        response = await self._with_retry(self._unary(self._memory.ListState, request))
        return StatePage(
            tuple(entry_from_pb(pb) for pb in response.entries), response.next_page_token
        )

    async def state_entries(self, prefix: str = "") -> AsyncIterator[StateEntry]:
        """``async for entry in client.state_entries("workflow/"):`` every entry whose key
        starts with ``prefix``, in key order, a page read at a time."""
        token = ""
        while True:
            page = await self.list_state(prefix, page_token=token)
            for entry in page.entries:
                yield entry
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def watch_state(
        self, prefix: str = "", *, send_initial: bool = False, resume: bool = False
    ) -> AsyncGenerator[StateChange, None]:
        """``async for change in client.watch_state("workflow/"):`` each change to the entries
        whose keys start with ``prefix`` as it is made (``change.kind``: PUT, DELETE or LAPSE;
        ``change.entry``: the new or the last version), in order. With ``send_initial`` the
        entries there are come first (CURRENT); a SYNCED change (no entry) says the watch is
        in place. Runs until closed (leave the loop); one that fell 1000 changes behind ends
        with LimitExceededError (reason WATCH_BEHIND), one whose broker missed changes with
        BrokerUnavailableError: watch again with ``send_initial`` to catch up.

        With ``resume`` it catches up by itself: a watch in place that ends because its
        broker went away (restarted, shutting down, cut off from Redis) or because it fell
        behind is begun again, with backoff, for up to ``reconnect_timeout`` seconds, and
        tells what changed meanwhile (a PUT of each entry written, its latest version; a
        DELETE of each one gone: deleted, lapsed, or lost with the memory of a broker that
        restarted), then SYNCED again. For that it keeps the entries under ``prefix``."""
        if not resume:
            async with contextlib.aclosing(self._watch_state(prefix, send_initial)) as changes:
                async for change in changes:
                    yield change
            return
        mirror, loop = StateMirror(), asyncio.get_running_loop()
        failure: MeshError | None = None
        synced, give_up, attempt = False, 0.0, 0
        while True:
            caught_up: list[StateEntry] | None = None if failure is None else []
            try:
                async with contextlib.aclosing(self._watch_state(prefix, True)) as changes:
                    async for change in changes:
                        if caught_up is None:  # (in place: as it comes)
                            mirror.note(change)
                            synced = synced or change.kind is ChangeKind.SYNCED
                            if send_initial or change.kind is not ChangeKind.CURRENT:
                                yield change
                        elif change.entry is not None:  # (CURRENT: the entries now)
                            caught_up.append(change.entry)
                        else:  # SYNCED: in place again
                            for missed in mirror.catch_up(caught_up):
                                yield missed
                            caught_up, failure, attempt = None, None, 0
                            yield change
                return  # (ended without an error: closed)
            except MeshError as error:
                if not (error.code == "UNAVAILABLE" or error.reason == "WATCH_BEHIND"):
                    raise
                if failure is None:
                    if not synced:
                        raise  # (never in place: nothing to resume)
                    give_up = loop.time() + self.reconnect_timeout
                elif loop.time() >= give_up:
                    raise
                failure = error
            delay = reconnect_delay(attempt)
            attempt += 1
            logger.warning(
                "watch of %r: %s; watching again in %.1f s", prefix, failure.message, delay
            )
            await asyncio.sleep(delay)
            self._refuse_if_closed()

    async def _watch_state(
        self, prefix: str, send_initial: bool
    ) -> AsyncGenerator[StateChange, None]:
        from mesh.memory_server import KINDS_OF_CHANGES, entry_from_pb

        self._refuse_if_closed()
        request = _request(memory_pb2.WatchStateRequest, prefix=prefix, send_initial=send_initial)
        call = self._memory.WatchState(request)
        try:
            async for pb in call:
                kind = KINDS_OF_CHANGES.get(pb.kind)
                if kind is None:  # (a kind of change a newer broker tells of)
                    continue
                entry = entry_from_pb(pb.entry) if pb.HasField("entry") else None
                yield StateChange(kind, entry)
        except grpc.RpcError as error:
            raise stream_error(error) from None  # (broken: watched again, with resume)
        finally:
            call.cancel()

    async def put_state(
        self,
        key: str,
        value: JSON,
        *,
        expected_version: int | None = None,
        lock: StateLock | None = None,
        agent_id: str | None = None,
        ttl: float | None = None,
    ) -> StateEntry:
        """Writes a new version of ``key``. With ``expected_version`` (0: "there is none
        yet") it is a compare-and-set, refused with StateConflictError (VERSION_CONFLICT) when
        another write came first; an entry locked by another agent refuses it too
        (STATE_LOCKED) unless this write carries that ``lock``. With ``ttl`` (seconds) the
        entry lapses that long after this write (it is then read as absent); without, it
        stays until deleted."""
        from mesh.memory_server import entry_from_pb

        request = _request(
            memory_pb2.PutStateRequest,
            key=key,
            agent_id=agent_id or self.agent_id,
            lock_token=lock.token if lock else "",
        )
        codec.encode_value(value, request.value, "value")
        if expected_version is not None:
            request.expected_version = expected_version
        if ttl is not None:
            check_ttl(ttl)
            codec.seconds_to_duration(ttl, request.ttl)
        response = await self._with_retry(self._unary(self._memory.PutState, request))
        return entry_from_pb(response.entry)

    async def delete_state(
        self,
        key: str,
        *,
        expected_version: int | None = None,
        lock: StateLock | None = None,
        agent_id: str | None = None,
    ) -> StateEntry:
        """Removes ``key`` (under the rules of :meth:`put_state`); returns its last version."""
        from mesh.memory_server import entry_from_pb

        request = _request(
            memory_pb2.DeleteStateRequest,
            key=key,
            agent_id=agent_id or self.agent_id,
            lock_token=lock.token if lock else "",
        )
        if expected_version is not None:
            request.expected_version = expected_version
        response = await self._with_retry(self._unary(self._memory.DeleteState, request))
        return entry_from_pb(response.entry)

    async def lock_state(
        self,
        key: str,
        *,
        wait: float | None = None,
        lease: float | None = None,
        agent_id: str | None = None,
    ) -> StateLock:
        """Locks ``key`` for this agent, waiting at most ``wait`` seconds (1 s, RT-011's
        lock_timeout, is the default and the most); StateConflictError (LOCK_TIMEOUT) if
        another agent still holds it, or 5 agents hold locks. The lock lapses after ``lease``
        seconds (10 by default) unless released or asked for again."""
        holder = agent_id or self.agent_id
        request = _request(memory_pb2.LockStateRequest, key=key, agent_id=holder)
        if wait is not None:
            codec.seconds_to_duration(wait_seconds(wait, 0, "wait"), request.wait)
        if lease is not None:
            codec.seconds_to_duration(wait_seconds(lease, 0, "lease"), request.lease)
        response = await self._with_retry(self._unary(self._memory.LockState, request))
        expires_at = codec.timestamp_to_datetime(response.expires_at)
        return StateLock(key, holder, response.lock_token, expires_at)

    async def unlock_state(self, lock: StateLock) -> None:
        request = _request(memory_pb2.UnlockStateRequest, key=lock.key, lock_token=lock.token)
        await self._with_retry(self._unary(self._memory.UnlockState, request))

    @contextlib.asynccontextmanager
    async def locked(
        self, key: str, *, wait: float | None = None, lease: float | None = None
    ) -> AsyncIterator[StateLock]:
        """``async with client.locked("budget") as lock:`` read, decide, ``put_state(...,
        lock=lock)``; the lock is released on the way out (if its lease has not run out)."""
        lock = await self.lock_state(key, wait=wait, lease=lease)
        try:
            yield lock
        finally:
            with contextlib.suppress(LockNotHeldError):
                await self.unlock_state(lock)

    async def memory_stats(self) -> MemoryStats:
        response = await self._with_retry(
            self._unary(self._memory.GetMemoryStats, memory_pb2.GetMemoryStatsRequest())
        )
        return MemoryStats(
            response.total_insights,
            response.agents_involved,
            dict(response.tag_distribution),
            dict(response.segment_distribution),
            response.capacity,
        )

    async def dead_letters(self, agent_id: str = "") -> list[DeadLetter]:
        """Every dead letter (of ``agent_id``, when given), oldest first, page by page."""
        request = _request(broker_pb2.ListDeadLettersRequest, agent_id=agent_id)
        pages = await self._every_page(self._stub.ListDeadLetters, request, "dead_letters")
        return [codec.dead_letter_from_pb(d) for d in pages]

    async def list_messages(self, agent_id: str | None = None) -> list[QueuedMessage]:
        """What the queue of ``agent_id`` (this client's agent when None) holds, page by page,
        left where it is: the messages waiting, in the order they will be delivered, then
        those in flight or deferred (``state``, ``until``): what is stuck, where, and since
        when."""
        request = _request(broker_pb2.ListMessagesRequest, agent_id=agent_id or self.agent_id)
        pages = await self._every_page(self._stub.ListMessages, request, "messages")
        return [codec.queued_from_pb(q) for q in pages]

    async def cancel_messages(
        self,
        to_agent: str,
        messages: Iterable[str | Message],
        *,
        from_agent: str | None = None,
    ) -> list[str]:
        """Takes back messages this client's agent (or ``from_agent``) sent to ``to_agent``
        that are not delivered yet: waiting, or scheduled for later (``delay``). ``messages``
        are their ids, or the messages as :meth:`send` returned them. Returns the ids taken
        back; one in flight, another sender's, or one no longer held stays as it is."""
        if isinstance(messages, str):  # (a bare id would read as its letters)
            names_of(messages, "message_ids", "message ids or messages")
        ids = tuple(m.message_id if isinstance(m, Message) else m for m in messages)
        request = _request(
            broker_pb2.CancelMessagesRequest,
            from_agent=self.agent_id if from_agent is None else from_agent,
            to_agent=to_agent,
            message_ids=ids,
        )
        response = await self._with_retry(self._unary(self._stub.CancelMessages, request))
        return list(response.message_ids)

    async def requeue_dead_letters(
        self, agent_id: str, message_ids: Iterable[str] = ()
    ) -> RequeueResult:
        """Puts ``agent_id``'s dead letters (all, or those of ``message_ids``) back in its
        queue once what failed them is fixed: oldest first, each with its delivery attempts
        from zero and its ttl from now. Those the full queue cannot take stay dead letters
        (``left``)."""
        request = _request(
            broker_pb2.RequeueDeadLettersRequest,
            agent_id=agent_id,
            message_ids=names_of(message_ids, "message_ids", "message ids"),
        )
        response = await self._with_retry(self._unary(self._stub.RequeueDeadLetters, request))
        return RequeueResult(response.requeued, response.left)


class _StateThroughClient:
    """The shared state through a client, as mesh.core.workflows reads and writes it."""

    def __init__(self, client: MeshClient) -> None:
        self.client = client

    async def get(self, key: str) -> StateEntry:
        entry = await self.client.get_state(key)
        if entry is None:
            raise not_found(key)
        return entry

    async def put(
        self,
        key: str,
        value: JSON,
        agent_id: str,
        *,
        expected_version: int | None = None,
        ttl: float | None = None,
    ) -> StateEntry:
        return await self.client.put_state(
            key, value, expected_version=expected_version, agent_id=agent_id, ttl=ttl
        )


def connect(
    target: str,
    *,
    agent_id: str = "",
    retry: RetryPolicy | None = None,
    default_timeout: float = 30.0,
    **options: Any,
) -> MeshClient:
    """A client of the broker at ``target`` (host:port); use as ``async with connect(...)``."""
    return MeshClient(
        target,
        agent_id=agent_id,
        retry=retry,
        default_timeout=default_timeout,
        **options,
    )


class AgentClient(ChannelOnFirstUse):
    """Calls an agent's own gRPC server directly (the Agent service)."""

    def __init__(
        self,
        target: str,
        *,
        default_timeout: float = 30.0,
        security: SecurityConfig | None = None,
    ) -> None:
        super().__init__(target, security)
        self.default_timeout = default_timeout

    @functools.cached_property
    def _stub(self) -> agent_pb2_grpc.AgentServiceAsyncStub:
        return agent_pb2_grpc.AgentServiceStub(self._channel)

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._close_channel()

    async def handle(self, message: Message, *, timeout: float | None = None) -> Message | None:
        """Calls the agent's own server with ``message`` (no broker between): its answer, or
        None when it gives none."""
        if not isinstance(message, Message):
            raise _not_a_message("handle", message)
        request = agent_pb2.HandleMessageRequest()
        codec.message_to_pb(message, request.message)
        self._check_loop()
        try:
            response = await self._stub.HandleMessage(
                request, timeout=wait_seconds(timeout, self.default_timeout)
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return codec.message_from_pb(response.response) if response.HasField("response") else None

    async def describe(self, *, timeout: float | None = None) -> AgentCard:
        self._check_loop()
        try:
            response = await self._stub.DescribeAgent(
                agent_pb2.DescribeAgentRequest(),
                timeout=wait_seconds(timeout, self.default_timeout),
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return codec.card_from_pb(response.card)

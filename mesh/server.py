"""The Broker gRPC service: a thin translation of mesh.v1 calls into the broker core."""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from operator import attrgetter
from typing import Any

import grpc

from mesh import codec
from mesh._status import abort
from mesh.client import BROKER_SERVICE, until_reachable
from mesh.config import BrokerConfig, SecurityConfig, ServerConfig
from mesh.core.auth import Principal
from mesh.core.broker import Broker, SendOutcome, Subscription
from mesh.core.errors import (
    BrokerUnavailableError,
    LimitExceededError,
    MeshError,
    MessageValidationError,
    SessionClosedError,
)
from mesh.core.model import Message
from mesh.core.tasks import cancel_and_wait
from mesh.core.tools import ToolHost
from mesh.headroom import wire_fields
from mesh.push import Pusher
from mesh.security import check_frame, current_principal
from mesh.serving import (
    ANSWER_BYTES,
    Malformed,
    MeshServer,
    fill_page,
    lenient,
    offset_page,
    page_offset,
    start_server,
)
from mesh.streams import BATCH_HEADER, FrameWriter
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2

logger = logging.getLogger("mesh.server")

MAX_SESSION_REQUESTS = 10_000
MAX_SESSION_SUBSCRIPTIONS = 1_000
MAX_BATCH = 256
"""Deliveries per `deliveries` frame at most, whatever a subscriber asks for."""
MAX_POSTED = 256
"""Answers waiting to be written on one session at most; beyond that, whoever posts one (the
session's reader, a gather) waits for it to be written."""
BATCH_BYTES = 1024 * 1024
"""A `deliveries` frame stops growing past this size (gRPC refuses frames over 4 MiB by
default; one message may be up to max_message_bytes, 1 MiB by default)."""

_invalid = MessageValidationError.for_field


class BrokerServicer(broker_pb2_grpc.BrokerServiceServicer):
    """Translates BrokerService calls; all state and logic live in :class:`Broker`."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.pusher: Pusher | None = None
        """Tells the pushed instances of an agent deregistered here (set as push starts)."""

    async def RegisterAgent(
        self, request: broker_pb2.RegisterAgentRequest, context: Any
    ) -> broker_pb2.RegisterAgentResponse:
        registered = await self.broker.register(codec.agent_from_pb(request.agent))
        response = broker_pb2.RegisterAgentResponse()
        codec.agent_to_pb(registered, response.agent)
        return response

    async def DeregisterAgent(
        self, request: broker_pb2.DeregisterAgentRequest, context: Any
    ) -> broker_pb2.DeregisterAgentResponse:
        pushed = await self.broker.deregister(request.agent_id, request.address)
        if pushed and self.pusher is not None:
            self.pusher.notify_deregistered(request.agent_id, pushed)
        return broker_pb2.DeregisterAgentResponse()

    async def ListAgents(
        self, request: broker_pb2.ListAgentsRequest, context: Any
    ) -> broker_pb2.ListAgentsResponse:
        agents = self.broker.list_agents(request.agent_type)
        # A page goes on after the last agent of the one before, by id (they come sorted):
        # one registering or leaving between pages moves no other across the boundary.
        start = bisect.bisect_right(agents, request.page_token, key=attrgetter("agent_id"))
        response = broker_pb2.ListAgentsResponse()
        end = fill_page(response.agents, agents, start, request.page_size, codec.agent_to_pb)
        if end < len(agents):
            response.next_page_token = agents[end - 1].agent_id
        return response

    async def SendMessage(
        self, request: broker_pb2.SendMessageRequest, context: Any
    ) -> broker_pb2.SendMessageResponse:
        if isinstance(request, Malformed):
            raise await _unreadable_sends(
                self.broker, request, SEND_MESSAGE_FIELD, current_principal.get()
            )
        if not request.HasField("message"):
            raise _invalid("message", "message is required")
        outcome = await self.broker.send(
            await _inbound_sent(self.broker, request.message),
            size_bytes=request.message.ByteSize(),
        )
        response = broker_pb2.SendMessageResponse(recipients=outcome.recipients)
        codec.message_to_pb(outcome.message, response.message)
        return response

    async def SendMessages(
        self, request: broker_pb2.SendMessagesRequest, context: Any
    ) -> broker_pb2.SendMessagesResponse:
        if isinstance(request, Malformed):
            raise await _unreadable_sends(
                self.broker, request, SEND_MESSAGES_FIELD, current_principal.get()
            )
        messages = [await _decoded(self.broker, pb) for pb in request.messages]
        sizes = [pb.ByteSize() for pb in request.messages]
        results = await self.broker.send_many(messages, sizes)
        response = broker_pb2.SendMessagesResponse()
        for pb, message, result in zip(request.messages, messages, results, strict=True):
            message_id = message.message_id if isinstance(message, Message) else pb.message_id
            item = response.results.add(message_id=message_id)
            if isinstance(result, MeshError):
                codec.error_to_pb(result, item.error)
        return response

    async def ReceiveMessages(
        self, request: broker_pb2.ReceiveMessagesRequest, context: Any
    ) -> broker_pb2.ReceiveMessagesResponse:
        messages = await self.broker.receive(
            request.agent_id,
            request.max_messages,
            max_bytes=ANSWER_BYTES,
            size_of=codec.message_size,
        )
        response = broker_pb2.ReceiveMessagesResponse()
        for message in messages:
            codec.message_to_pb(message, response.messages.add())
        return response

    async def Subscribe(
        self, request: broker_pb2.SubscribeRequest, context: Any
    ) -> AsyncIterator[broker_pb2.SubscribeResponse]:
        try:
            sub = await self.broker.subscribe(
                request.agent_id,
                max_in_flight=request.max_in_flight,
                lease_seconds=codec.duration_seconds(request.lease),
                withdrawals=request.withdrawals,
                instance=request.instance,
            )
        except MeshError as error:
            await abort(context, error)
        # A fault of the broker's own as it delivers (a bug: no MeshError) is logged with its
        # traceback and ends the stream UNAVAILABLE, as a session's subscription ends: what it
        # held goes back to the queue, its attempt counted, and the subscriber subscribes again.
        failed: BrokerUnavailableError | None = None
        try:
            while True:
                try:
                    # Every ready one at once (within max_in_flight), written one by one.
                    batch = await sub.next_batch(MAX_BATCH)
                except SessionClosedError:
                    return
                except MeshError as error:  # the broker ended it: the agent was deregistered
                    await abort(context, error)
                if sub.withdrawn:
                    response = broker_pb2.SubscribeResponse()
                    _withdrawn_to_pb(sub, response.withdrawn)
                    yield response
                for delivery in batch:
                    response = broker_pb2.SubscribeResponse()
                    codec.delivery_to_pb(delivery, response.delivery)
                    yield response
        except (MeshError, grpc.aio.AbortError):
            raise
        except Exception:
            logger.exception("the deliveries to %s failed", request.agent_id)
            failed = BrokerUnavailableError(
                f"the broker failed to deliver {request.agent_id}'s messages: subscribe again"
            )
        finally:
            # (A subscriber ends this stream only by cancelling it, or by going away.)
            await sub.close(lost=True)
        if failed is not None:
            await abort(context, failed)

    async def Ack(self, request: broker_pb2.AckRequest, context: Any) -> broker_pb2.AckResponse:
        return broker_pb2.AckResponse(
            acknowledged=await self.broker.ack(request.agent_id, request.message_ids)
        )

    async def Nack(self, request: broker_pb2.NackRequest, context: Any) -> broker_pb2.NackResponse:
        requeued, dead = await self.broker.nack(
            request.agent_id,
            request.message_ids,
            dead_letter_reason=request.dead_letter_reason,
            redeliver_after=codec.duration_seconds(request.redeliver_after),
        )
        return broker_pb2.NackResponse(requeued=requeued, dead_lettered=dead)

    async def ExtendLease(
        self, request: broker_pb2.ExtendLeaseRequest, context: Any
    ) -> broker_pb2.ExtendLeaseResponse:
        extended = await self.broker.extend_lease(
            request.agent_id, request.message_ids, codec.duration_seconds(request.lease)
        )
        return broker_pb2.ExtendLeaseResponse(extended=extended)

    async def Broadcast(
        self, request: broker_pb2.BroadcastRequest, context: Any
    ) -> broker_pb2.BroadcastResponse:
        response = broker_pb2.BroadcastResponse()
        await _broadcast(self.broker, request, response)
        return response

    async def SendRequest(
        self, request: broker_pb2.SendRequestRequest, context: Any
    ) -> broker_pb2.SendRequestResponse:
        if not request.HasField("message"):
            raise _invalid("message", "message is required")
        answer = await self.broker.request(
            _inbound(self.broker, request.message),
            context.time_remaining(),
            size_bytes=request.message.ByteSize(),
        )
        response = broker_pb2.SendRequestResponse()
        codec.message_to_pb(answer, response.response)
        return response

    async def Gather(
        self, request: broker_pb2.GatherRequest, context: Any
    ) -> AsyncIterator[broker_pb2.GatherResponse]:
        if not request.HasField("message"):
            await abort(context, _invalid("message", "message is required"))
        remaining = context.time_remaining()
        try:
            timeout = codec.timeout_seconds(request)
            message = _inbound(self.broker, request.message, gather=True)
        except MeshError as error:
            await abort(context, error)
        if timeout is None or (remaining is not None and remaining < timeout):
            timeout = remaining
        items = self.broker.gather(
            message,
            agent_ids=list(request.agent_ids),
            agent_types=list(request.agent_types),
            timeout=timeout,
            all_or_none=request.all_or_none,
            size_bytes=request.message.ByteSize(),
        )
        try:
            async for item in items:
                response = broker_pb2.GatherResponse(agent_id=item.agent_id)
                if item.response is not None:
                    codec.message_to_pb(item.response, response.response)
                elif item.error is not None:
                    codec.error_to_pb(item.error, response.error)
                yield response
        except MeshError as error:
            await abort(context, error)
        finally:
            await items.aclose()

    async def Handoff(
        self, request: broker_pb2.HandoffRequest, context: Any
    ) -> broker_pb2.HandoffResponse:
        message = await self.broker.handoff(
            from_agent=request.from_agent,
            to_agent=request.to_agent,
            handoff=codec.handoff_from_pb(request.handoff),
            priority=codec.priority_from_pb(request.priority),
            ttl=request.ttl,
            headers=dict(request.headers),
            message_id=request.message_id,
            size_bytes=request.ByteSize(),
        )
        response = broker_pb2.HandoffResponse()
        codec.message_to_pb(message, response.message)
        return response

    async def GetQueueStats(
        self, request: broker_pb2.GetQueueStatsRequest, context: Any
    ) -> broker_pb2.GetQueueStatsResponse:
        agents, _ = await self.broker.queue_stats(request.agent_id)
        response = broker_pb2.GetQueueStatsResponse()
        for item in agents:
            q = item.queue
            response.agents.add(
                agent_id=q.agent_id,
                depth=q.depth,
                high=q.high,
                medium=q.medium,
                low=q.low,
                in_flight=q.in_flight,
                dead_letters=q.dead_letters,
                subscribers=item.subscribers,
                deferred=q.deferred,
            )
        t = response.totals
        t.held = await self.broker.held()
        t.max_messages_per_agent = self.broker.config.max_messages_per_agent
        t.max_total_messages = self.broker.config.max_total_messages
        for field, value in self.broker.metrics.figures().items():
            setattr(t, field, value)  # the counts, latency percentiles and drop rate
        return response

    async def ListDeadLetters(
        self, request: broker_pb2.ListDeadLettersRequest, context: Any
    ) -> broker_pb2.ListDeadLettersResponse:
        start = page_offset(request.page_token)
        letters = await self.broker.dead_letters(request.agent_id)
        response = broker_pb2.ListDeadLettersResponse()
        response.next_page_token = offset_page(
            response.dead_letters, letters, start, request.page_size, codec.dead_letter_to_pb
        )
        return response

    async def ListMessages(
        self, request: broker_pb2.ListMessagesRequest, context: Any
    ) -> broker_pb2.ListMessagesResponse:
        start = page_offset(request.page_token)
        queued = await self.broker.queued(request.agent_id)
        response = broker_pb2.ListMessagesResponse()
        response.next_page_token = offset_page(
            response.messages, queued, start, request.page_size, codec.queued_to_pb
        )
        return response

    async def CancelMessages(
        self, request: broker_pb2.CancelMessagesRequest, context: Any
    ) -> broker_pb2.CancelMessagesResponse:
        cancelled = await self.broker.cancel(
            request.from_agent, request.to_agent, list(request.message_ids)
        )
        return broker_pb2.CancelMessagesResponse(cancelled=len(cancelled), message_ids=cancelled)

    async def RequeueDeadLetters(
        self, request: broker_pb2.RequeueDeadLettersRequest, context: Any
    ) -> broker_pb2.RequeueDeadLettersResponse:
        requeued, left = await self.broker.requeue_dead_letters(
            request.agent_id, request.message_ids
        )
        return broker_pb2.RequeueDeadLettersResponse(requeued=requeued, left=left)

    async def Connect(  # type: ignore[override]
        self, request_iterator: AsyncIterator[broker_pb2.ConnectRequest], context: Any
    ) -> None:
        await _Session(self.broker, context).run(request_iterator)


class _Session:
    """One Connect stream. Frames are read and dispatched in the handler's own task; answers
    and deliveries are handed to the stream's writer (grpc.aio allows one write in flight),
    which writes those of one moment together. Backpressure is the write itself: a slow
    client slows the reading of its own frames and, through max_in_flight, its deliveries."""

    def __init__(self, broker: Broker, context: Any) -> None:
        self.broker = broker
        self.context = context
        # Frames ready while a write is in flight go out together: as one `batch` frame to
        # a client that opened the session with the header agentmesh-batch: 1.
        self.writer: FrameWriter[broker_pb2.ConnectResponse] = FrameWriter(
            context.write,
            _response_batch if _takes_batches(context) else None,
            size=broker_pb2.ConnectResponse.ByteSize,
            most_bytes=ANSWER_BYTES,
        )
        # The session's subscriptions (one per agent) and the tasks writing their deliveries.
        self.subscriptions: dict[str, tuple[Subscription, asyncio.Task[None]]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.by_seq: dict[int, asyncio.Task[None]] = {}
        """The requests and gathers in flight, by the seq of their frame (to cancel them)."""
        self.principal = current_principal.get()
        self.in_batch = False
        """The reader is handling the frames of a batch frame."""
        self.reader: asyncio.Task[Any] | None = None
        """The task reading the stream (the handler's own)."""
        self.unconfirmed: list[tuple[int, SendOutcome]] = []
        """Sends taken in and not yet committed by a store that commits them in groups (their
        seq, their outcome): confirmed together, after the commit they share."""
        self.confirming: asyncio.Task[None] | None = None
        """The task confirming them (one at a time, in the order they came)."""

    async def write(self, frame: broker_pb2.ConnectResponse) -> None:
        await self.writer.write(frame)

    async def _answer(self, frame: broker_pb2.ConnectResponse) -> None:
        """Answers a frame. A lone frame's answer is written by the reader itself when the
        stream is idle (no hand-over to the writer's task: the `accepted` of a send goes
        before the delivery it set off); within a batch frame, or while a write is in
        flight, the answer is posted and the reader goes on, so that the answers of one batch
        (or of frames read meanwhile) share one write; it waits only while MAX_POSTED answers
        are still to be written (a client that pipelines more is read no faster than it
        reads its answers)."""
        if not (self.in_batch or self.writer.busy) and asyncio.current_task() is self.reader:
            # (the reader is cancelled only as the stream ends: it may write in person)
            await self.writer.write_now(frame)
            return
        posted = self.writer.post(frame)
        if self.writer.backlog >= MAX_POSTED:
            await posted

    async def run(self, frames: AsyncIterator[broker_pb2.ConnectRequest]) -> None:
        self.reader = asyncio.current_task()
        try:
            async for frame in frames:
                await self._dispatch(frame)
            # The client finished sending: let requests in flight answer, then end the stream.
            if self.confirming is not None:
                await self.confirming
            if self.tasks:
                await asyncio.gather(*list(self.tasks), return_exceptions=True)
            await self.writer.flush()  # answers posted and not yet written
        finally:
            for task in self.tasks:
                task.cancel()
            if self.confirming is not None:
                self.confirming.cancel()  # (committed all the same; their sender sends again)
            # Those not unsubscribed are lost: the client died, lost its connection, or ended
            # the stream while still subscribed (a handler of grpc.aio sees a client's cancel
            # as the end of its frames too, as it sees a half-close: they are one here).
            for _, pump in self.subscriptions.values():
                pump.cancel()
            # Each ends in a task the broker keeps (Subscription.end), not in this handler.
            ending = {sub.end(lost=True) for sub, _ in self.subscriptions.values()}
            try:
                if ending:
                    await asyncio.wait(ending)
            finally:
                self.writer.close()

    async def _error(self, seq: int, error: MeshError) -> None:
        frame = broker_pb2.ConnectResponse(seq=seq)
        codec.error_to_pb(error, frame.error)
        await self._answer(frame)

    async def _unreadable(self, seq: int, frame: Malformed) -> None:
        """Refuses a frame that does not decode; one that, as far as it can be read, sends
        an answer the session may send also tells the answer's requester why, at once."""
        error = await _unreadable_sends(self.broker, frame, SEND_FIELD, self.principal)
        await self._error(seq, error)

    async def _dispatch(self, frame: broker_pb2.ConnectRequest | Malformed) -> None:
        if isinstance(frame, Malformed):
            # Refused under its own seq, so that whoever waits on it hears at once; a
            # batch's frames are read one by one, and only those that do not decode refused.
            seq, frames = _frame_parts(frame.data)
            if frames:
                await self._batch([_read_frame(raw) for raw in frames])
            else:
                await self._unreadable(seq, frame)
            return
        kind = frame.WhichOneof("frame")
        seq = frame.seq
        if kind == "batch":
            await self._batch(frame.batch.frames)
            return
        try:
            self._check(frame)
            if kind == "send":
                outcome = await self.broker.accept(
                    await _inbound_sent(self.broker, frame.send),
                    size_bytes=frame.send.ByteSize(),
                )
                if self.broker.group_commit:
                    # The next frames are read meanwhile: the sends of a moment share a commit.
                    await self._confirm_later(seq, outcome)
                    return
                await self.broker.commit()
                if seq:  # (seq 0: fire-and-forget, nobody waits for `accepted`)
                    await self._answer(_accepted(seq, outcome))
            elif kind == "request":
                self._spawn(seq, self._request(seq, frame.request))
            elif kind == "broadcast":
                out = broker_pb2.ConnectResponse(seq=seq)
                await _broadcast(self.broker, frame.broadcast, out.broadcasted, "broadcast.")
                if seq:
                    await self._answer(out)
            elif kind == "ack":
                await self.broker.ack(self._agent(frame.ack.agent_id), frame.ack.message_ids)
            elif kind == "nack":
                nack = frame.nack
                await self.broker.nack(
                    self._agent(nack.agent_id),
                    nack.message_ids,
                    dead_letter_reason=nack.dead_letter_reason,
                    redeliver_after=codec.duration_seconds(nack.redeliver_after),
                )
            elif kind == "extend_lease":
                extend = frame.extend_lease
                await self.broker.extend_lease(
                    self._agent(extend.agent_id),
                    extend.message_ids,
                    codec.duration_seconds(extend.lease),
                )
            elif kind == "subscribe":
                await self._subscribe(seq, frame.subscribe)
            elif kind == "unsubscribe":
                await self._unsubscribe(seq, frame.unsubscribe)
            elif kind == "gather":
                self._spawn(seq, self._gather(seq, frame.gather))
            elif kind == "cancel":
                task = self.by_seq.get(frame.cancel.seq)
                if task is not None:
                    task.cancel()  # its finally blocks free what the broker held for it
            elif kind == "receive":
                messages = await self.broker.receive(
                    frame.receive.agent_id,
                    frame.receive.max_messages,
                    max_bytes=ANSWER_BYTES,
                    size_of=codec.message_size,
                )
                out = broker_pb2.ConnectResponse(seq=seq)
                out.received.SetInParent()
                for message in messages:
                    codec.message_to_pb(message, out.received.messages.add())
                await self._answer(out)
            else:
                raise _invalid("frame", "the frame carries nothing")
        except MeshError as error:
            await self._error(seq, error)
        except Exception as error:
            await self._internal(seq, kind, error)

    async def _internal(self, seq: int, kind: str | None, error: Exception) -> None:
        """A fault of the broker's own as it served a frame (a bug): logged with its
        traceback, and that frame answered INTERNAL "internal error", nothing more said; the
        session, and every subscription and request it carries, goes on."""
        logger.error("a session's %s frame failed", kind or "empty", exc_info=error)
        await self._error(seq, MeshError("internal error", code="INTERNAL", reason="INTERNAL"))

    async def _confirm_later(self, seq: int, outcome: SendOutcome) -> None:
        """Confirms a send once the store has committed it, with the sends taken in before
        the commit; the reader waits only while MAX_POSTED are still to be confirmed."""
        self.unconfirmed.append((seq, outcome))
        if self.confirming is None:
            self.confirming = asyncio.create_task(self._confirm())
        elif len(self.unconfirmed) >= MAX_POSTED:
            await self.confirming

    async def _confirm(self) -> None:
        try:
            while self.unconfirmed:
                sends, self.unconfirmed = self.unconfirmed, []
                try:
                    await self.broker.commit()
                except MeshError as error:  # not accepted: each sender hears it
                    for seq, _ in sends:
                        await self._error(seq, error)
                    continue
                for seq, outcome in sends:
                    if seq:
                        await self._answer(_accepted(seq, outcome))
        finally:
            self.confirming = None

    async def _batch(self, frames: Iterable[broker_pb2.ConnectRequest | Malformed]) -> None:
        self.in_batch = True
        # Consecutive sends, taken in together on a store shared over the network.
        sends: list[broker_pb2.ConnectRequest] = []
        try:
            for inner in frames:
                if (
                    self.broker.pipelines_sends
                    and not isinstance(inner, Malformed)
                    and inner.WhichOneof("frame") == "send"
                ):
                    sends.append(inner)
                    continue
                if sends:
                    await self._sends(sends)
                    sends = []
                if isinstance(inner, Malformed):
                    await self._unreadable(_frame_parts(inner.data)[0], inner)
                elif inner.WhichOneof("frame") == "batch":
                    await self._error(inner.seq, _invalid("batch", "a batch cannot hold a batch"))
                else:
                    await self._dispatch(inner)
            if sends:
                await self._sends(sends)
        finally:
            self.in_batch = False

    def _check(self, frame: broker_pb2.ConnectRequest) -> None:
        """Refuses a frame that acts as an agent the session's principal may not (counted
        with the calls refused for their credential)."""
        if self.principal.admin:
            return
        try:
            check_frame(self.principal, frame)
        except MeshError as error:
            self.broker.metrics.refused_call(error.code)
            raise

    async def _sends(self, frames: list[broker_pb2.ConnectRequest]) -> None:
        """The send frames of a batch in one go (``Broker.send_many``: on a store shared over
        the network, their puts travel together, in order, where one after another each
        would wait for its own round trip); each is answered as it would be alone."""
        for start in range(0, len(frames), self.broker.config.max_batch_size):
            part = frames[start : start + self.broker.config.max_batch_size]
            messages: list[Message | MeshError] = []
            for frame in part:
                try:
                    self._check(frame)
                    messages.append(await _inbound_sent(self.broker, frame.send))
                except MeshError as error:
                    messages.append(error)
            outcomes = await self.broker.send_many(
                messages, [frame.send.ByteSize() for frame in part]
            )
            for frame, outcome in zip(part, outcomes, strict=True):
                if isinstance(outcome, MeshError):
                    await self._error(frame.seq, outcome)
                elif frame.seq:
                    await self._answer(_accepted(frame.seq, outcome))

    def _spawn(self, seq: int, work: Any) -> None:
        if len(self.tasks) >= MAX_SESSION_REQUESTS:
            work.close()
            raise LimitExceededError(
                f"a session holds at most {MAX_SESSION_REQUESTS} pending requests"
            )
        task = asyncio.create_task(work)
        self.tasks.add(task)
        if seq:
            self.by_seq[seq] = task
        task.add_done_callback(lambda _: self._forget(seq, task))

    def _forget(self, seq: int, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if self.by_seq.get(seq) is task:
            del self.by_seq[seq]

    async def _gather(self, seq: int, request: broker_pb2.GatherRequest) -> None:
        try:
            timeout = codec.timeout_seconds(request)
            message = _inbound(self.broker, request.message, gather=True)
        except MeshError as error:
            await self._error(seq, error)
            return
        except Exception as error:
            await self._internal(seq, "gather", error)
            return
        items = self.broker.gather(
            message,
            agent_ids=list(request.agent_ids),
            agent_types=list(request.agent_types),
            timeout=timeout,
            all_or_none=request.all_or_none,
            size_bytes=request.message.ByteSize(),
        )
        # Answers are posted, not awaited one by one: those that come while a write is in
        # flight go in the next one. At most MAX_POSTED wait to be written.
        posted: collections.deque[asyncio.Future[None]] = collections.deque()
        try:
            async for item in items:
                frame = broker_pb2.ConnectResponse(seq=seq)
                frame.gathered.agent_id = item.agent_id
                if item.response is not None:
                    codec.message_to_pb(item.response, frame.gathered.response)
                elif item.error is not None:
                    codec.error_to_pb(item.error, frame.gathered.error)
                posted.append(self.writer.post(frame))
                if len(posted) > MAX_POSTED:
                    await posted.popleft()
        except MeshError as error:
            await self._error(seq, error)
            return
        except Exception as error:
            await self._internal(seq, "gather", error)
            return
        finally:
            await items.aclose()
        done = broker_pb2.ConnectResponse(seq=seq)
        done.accepted.SetInParent()
        await self.write(done)

    def _agent(self, agent_id: str) -> str:
        if agent_id:
            return agent_id
        if len(self.subscriptions) == 1:
            return next(iter(self.subscriptions))
        raise _invalid("agent_id", "agent_id is required (unless the session has one subscription)")

    async def _subscribe(self, seq: int, request: broker_pb2.SubscribeRequest) -> None:
        held = self.subscriptions.get(request.agent_id)
        if held is not None and not held[0].closed:  # (closed: ended by the broker)
            raise _invalid(
                "subscribe.agent_id", f"the session is already subscribed to {request.agent_id}"
            )
        if len(self.subscriptions) >= MAX_SESSION_SUBSCRIPTIONS:
            raise LimitExceededError(
                f"a session carries at most {MAX_SESSION_SUBSCRIPTIONS} subscriptions"
            )
        sub = await self.broker.subscribe(
            request.agent_id,
            max_in_flight=request.max_in_flight,
            lease_seconds=codec.duration_seconds(request.lease),
            withdrawals=request.withdrawals,
            instance=request.instance,
        )
        out = broker_pb2.ConnectResponse(seq=seq)
        out.accepted.SetInParent()
        try:
            await self.write(out)  # `accepted` goes before the first delivery
        except BaseException:
            await sub.close(lost=True)
            raise
        batch = min(max(request.max_batch, 1), MAX_BATCH)
        pump = asyncio.create_task(self._pump(sub, batch), name=f"session-pump-{sub.agent_id}")
        self.subscriptions[sub.agent_id] = (sub, pump)

    async def _unsubscribe(self, seq: int, request: broker_pb2.UnsubscribeRequest) -> None:
        agent_id = request.agent_id
        found = self.subscriptions.pop(agent_id, None)
        if found is None:
            raise _invalid("unsubscribe.agent_id", f"the session is not subscribed to {agent_id!r}")
        sub, pump = found
        await cancel_and_wait(pump)
        # Its unacknowledged deliveries go back to the queue (those the client never handed
        # on uncounted, when it says which it did).
        await sub.close(seen=set(request.seen_message_ids) if request.release_unseen else None)
        out = broker_pb2.ConnectResponse(seq=seq)
        out.accepted.SetInParent()
        await self._answer(out)

    async def _pump(self, sub: Subscription, max_batch: int) -> None:
        """Delivers the subscription's messages (:meth:`_deliver`) until it ends. A fault of
        the broker's own as it does (a bug: no MeshError) is logged with its traceback and
        ends the subscription as a lost one: what it held goes back to the queue, its
        attempt counted (a message that cannot be delivered ends in the dead-letter queue),
        and the subscriber is told UNAVAILABLE, so that it subscribes again. An error the
        broker names ends it the same way, telling that error (without a word in the log,
        and, when the broker itself ended the subscription, with nothing left to close).
        Never a subscription left open that delivers nothing."""
        try:
            await self._deliver(sub, max_batch)
        except SessionClosedError:
            return
        except MeshError as error:
            if sub.ended_by is None:  # (else the broker ended it: its agent was deregistered)
                await sub.close(lost=True)
            await self._ended(sub, error)
        except Exception:
            logger.exception("the session's deliveries to %s failed", sub.agent_id)
            await sub.close(lost=True)
            failed = f"the broker failed to deliver {sub.agent_id}'s messages: subscribe again"
            await self._ended(sub, BrokerUnavailableError(failed))

    async def _ended(self, sub: Subscription, error: MeshError) -> None:
        """Tells the subscriber that the broker ended ``sub``, and why."""
        frame = broker_pb2.ConnectResponse()
        frame.ended.agent_id = sub.agent_id
        codec.error_to_pb(error, frame.ended.error)
        if self.subscriptions.get(sub.agent_id, (None,))[0] is sub:
            del self.subscriptions[sub.agent_id]
        with contextlib.suppress(Exception):  # (a stream ended meanwhile: nobody to tell)
            await self.write(frame)

    async def _deliver(self, sub: Subscription, max_batch: int) -> None:
        """Writes deliveries as they become ready: one per frame, or, when the subscriber
        asked for batches, every ready one (up to max_batch and BATCH_BYTES) in one frame.
        Either way every ready one is leased at once (within max_in_flight): leased one at a
        time, the subscription could not tell that it had emptied the queue, and would look
        at it once more after each delivery."""
        while True:
            batch = await sub.next_batch(max_batch if max_batch > 1 else MAX_BATCH)
            if sub.withdrawn:  # (after the deliveries it names, as this writes them all)
                frame = broker_pb2.ConnectResponse()
                _withdrawn_to_pb(sub, frame.withdrawn)
                await self._put(frame)
            if not batch:
                continue
            if max_batch == 1 or len(batch) == 1:
                for delivery in batch:
                    frame = broker_pb2.ConnectResponse()
                    codec.delivery_to_pb(delivery, frame.delivery)
                    await self._put(frame)
                continue
            frame = broker_pb2.ConnectResponse()
            out, size, stamps = frame.deliveries.deliveries, 0, codec.LeaseStamps()
            for delivery in batch:
                added = codec.delivery_to_pb(delivery, out.add(), stamps).ByteSize()
                if size and size + added > BATCH_BYTES:
                    del out[-1]  # full: this one starts the next frame
                    await self._put(frame)
                    frame = broker_pb2.ConnectResponse()
                    out, size = frame.deliveries.deliveries, 0
                    codec.delivery_to_pb(delivery, out.add(), stamps)
                size += added
            await self._put(frame)

    async def _put(self, frame: broker_pb2.ConnectResponse) -> None:
        """Writes a frame of deliveries; a write that fails is the stream's end (its client
        went), no fault of the broker's."""
        try:
            await self.write(frame)
        except Exception as error:
            raise SessionClosedError("the session's stream ended") from error

    async def _request(self, seq: int, request: broker_pb2.SessionRequest) -> None:
        try:
            timeout = codec.timeout_seconds(request)
            answer = await self.broker.request(
                _inbound(self.broker, request.message),
                timeout,
                size_bytes=request.message.ByteSize(),
            )
        except MeshError as error:
            await self._error(seq, error)
            return
        except Exception as error:
            await self._internal(seq, "request", error)
            return
        frame = broker_pb2.ConnectResponse(seq=seq)
        codec.message_to_pb(answer, frame.response)
        await self.write(frame)


_read_frame = lenient(broker_pb2.ConnectRequest.FromString)


def _withdrawn_to_pb(sub: Subscription, out: broker_pb2.Withdrawn) -> None:
    out.agent_id = sub.agent_id
    out.message_ids.extend(sub.take_withdrawn())


def _frame_parts(data: bytes) -> tuple[int, list[bytes] | None]:
    """What can be read of a session frame that does not decode: its seq (0 when none can
    be), and, for a batch, the bytes of each of its frames."""
    seq, frames = 0, None
    for number, value in wire_fields(data):
        if number == SEQ_FIELD and isinstance(value, int):
            seq = value
        elif number == BATCH_FIELD and isinstance(value, bytes):
            frames = [v for n, v in wire_fields(value) if n == 1 and isinstance(v, bytes)]
    return seq, frames


SEQ_FIELD = broker_pb2.ConnectRequest.DESCRIPTOR.fields_by_name["seq"].number
BATCH_FIELD = broker_pb2.ConnectRequest.DESCRIPTOR.fields_by_name["batch"].number
SEND_FIELD = broker_pb2.ConnectRequest.DESCRIPTOR.fields_by_name["send"].number
ANSWER_TYPE_NUMBERS = (message_pb2.MESSAGE_TYPE_RESPONSE, message_pb2.MESSAGE_TYPE_ERROR)
_ENVELOPE = {
    message_pb2.Message.DESCRIPTOR.fields_by_name[name].number: name
    for name in ("from_agent", "to_agent", "message_type", "correlation_id")
}


SEND_MESSAGE_FIELD = broker_pb2.SendMessageRequest.DESCRIPTOR.fields_by_name["message"].number
SEND_MESSAGES_FIELD = broker_pb2.SendMessagesRequest.DESCRIPTOR.fields_by_name["messages"].number
READS_MALFORMED = (
    "/mesh.v1.BrokerService/SendMessage",
    "/mesh.v1.BrokerService/SendMessages",
)
"""The unary methods that refuse a call that does not decode themselves: it may carry an
agent's answer, whose requester should hear why it will not come (see _unreadable_sends)."""


async def _unreadable_sends(
    broker: Broker, request: Malformed, field: int, principal: Principal
) -> MeshError:
    """The refusal of a request (a Connect frame, a SendMessage or SendMessages call) that does
    not decode, counted with the validation errors. Each answer (RESPONSE or ERROR) it sends,
    as far as its bytes (in ``field``) can be read, tells its requester why at once, when the
    caller (``principal``) may send as its agent: no answer from it would come before the
    deadline."""
    broker.refused_unreadable()
    error = request.to_error()
    for number, sent in wire_fields(request.data):
        if number != field or not isinstance(sent, bytes):
            continue
        answer = _answer_envelope(sent)
        if answer is not None and _may_send_as(principal, answer[0]):
            await broker.refuse_unreadable_answer(*answer, error)
    return error


def _may_send_as(principal: Principal, agent_id: str) -> bool:
    if principal.admin:
        return True
    try:
        principal.require_agent(agent_id, "send")
    except MeshError:
        return False
    return True


def _answer_envelope(sent: bytes) -> tuple[str, str, str] | None:
    """(from_agent, to_agent, correlation_id) of a message's bytes that do not decode, when
    what can be read of them is an answer (a RESPONSE or an ERROR); None otherwise."""
    envelope: dict[str, Any] = {}
    for number, value in wire_fields(sent):
        name = _ENVELOPE.get(number)
        if name == "message_type":
            envelope[name] = value
        elif name is not None and isinstance(value, bytes):
            try:
                envelope[name] = value.decode()
            except UnicodeDecodeError:
                return None
    if envelope.get("message_type") not in ANSWER_TYPE_NUMBERS:
        return None
    return (
        envelope.get("from_agent", ""),
        envelope.get("to_agent", ""),
        envelope.get("correlation_id", ""),
    )


def _inbound(broker: Broker, pb: message_pb2.Message, *, gather: bool = False) -> Message:
    """A message a client sends in, as the broker keeps it; one that names an undefined
    type or priority is refused, and counted with the validation errors."""
    try:
        if gather:
            return codec.gather_message_from_pb(pb, in_place=True, strict=True)
        return codec.message_from_pb(pb, in_place=True, strict=True)
    except MessageValidationError:
        broker.refused_unreadable()
        raise


async def _broadcast(
    broker: Broker,
    request: broker_pb2.BroadcastRequest,
    out: broker_pb2.BroadcastResponse,
    where: str = "",
) -> None:
    """Runs a broadcast (a `Broadcast` call, or a session's `broadcast` frame: its fields are
    named ``where`` + field in a refusal) into ``out``."""
    if not request.HasField("message"):
        raise _invalid(f"{where}message", "message is required")
    outcome = await broker.broadcast(
        _inbound(broker, request.message),
        request.agent_types,
        size_bytes=request.message.ByteSize(),
    )
    out.message_id = outcome.message.message_id
    out.recipients.extend(outcome.recipients)
    for agent_id, error in outcome.failures:
        codec.error_to_pb(error, out.failures.add(agent_id=agent_id).error)


async def _inbound_sent(broker: Broker, pb: message_pb2.Message) -> Message:
    """:func:`_inbound` for a message sent (not a request or a gather): an answer refused
    here (an undefined priority, a time out of range) also tells its requester why."""
    try:
        return _inbound(broker, pb)
    except MessageValidationError as error:
        if pb.message_type in ANSWER_TYPE_NUMBERS:
            await broker.refuse_unreadable_answer(
                pb.from_agent, pb.to_agent, pb.correlation_id, error
            )
        raise


async def _decoded(broker: Broker, pb: message_pb2.Message) -> Message | MeshError:
    """A message of a batch, or why it cannot be read (the others go on)."""
    try:
        return await _inbound_sent(broker, pb)
    except MeshError as error:
        return error


def _takes_batches(context: Any) -> bool:
    return any(
        key == BATCH_HEADER and value == "1" for key, value in context.invocation_metadata() or ()
    )


def _accepted(seq: int, outcome: SendOutcome) -> broker_pb2.ConnectResponse:
    out = broker_pb2.ConnectResponse(seq=seq)
    accepted = out.accepted
    accepted.message_id = outcome.message.message_id
    accepted.recipients.extend(outcome.recipients)
    return out


def _response_batch(frames: list[broker_pb2.ConnectResponse]) -> broker_pb2.ConnectResponse:
    out = broker_pb2.ConnectResponse()
    out.batch.frames.extend(frames)
    return out


async def serve_broker(
    broker: Broker | None = None,
    server_config: ServerConfig | None = None,
    broker_config: BrokerConfig | None = None,
    tool_host: ToolHost | None = None,
    security: SecurityConfig | None = None,
    wait_for_store: float = 0.0,
) -> tuple[Broker, MeshServer]:
    """Starts a broker and its gRPC server (health, reflection, optional /metrics), with the
    shared memory pool and shared state and, when a tool host is given, the Tool service.
    A queue store that cannot be reached yet (Redis started beside the broker, as a
    deployment does) is waited for up to ``wait_for_store`` seconds, before the server
    starts; 0: the start fails at once."""
    from mesh.memory_server import MEMORY_SERVICE, MemoryServicer
    from mesh.v1 import memory_pb2_grpc

    config = server_config or ServerConfig(port=0)
    broker = broker or Broker(broker_config)
    await until_reachable(broker.start, wait_for_store, "the broker waits for its queue store")
    servicer = BrokerServicer(broker)
    memory = MemoryServicer(broker.memory, broker.state)

    services = [BROKER_SERVICE, MEMORY_SERVICE]
    if tool_host is not None:
        from mesh.tools_server import TOOL_SERVICE

        services.append(TOOL_SERVICE)

    def register(s: grpc.aio.Server) -> None:
        broker_pb2_grpc.add_BrokerServiceServicer_to_server(servicer, s)
        memory_pb2_grpc.add_MemoryServiceServicer_to_server(memory, s)
        if tool_host is not None:
            from mesh.tools_server import ToolServicer
            from mesh.v1 import tools_pb2_grpc

            tools_pb2_grpc.add_ToolServiceServicer_to_server(ToolServicer(tool_host), s)

    try:
        server = await start_server(
            register,
            services,
            host=config.host,
            port=config.port,
            metrics_registry=broker.metrics.registry,
            metrics_port=config.metrics_port,
            health_port=config.health_port,
            security=security,
            on_malformed=broker.refused_unreadable,
            reads_malformed=READS_MALFORMED,
            on_refused=broker.metrics.refused_call,
        )
    except BaseException:
        await broker.stop()  # (its sweeper and store, started above)
        raise
    # Agents that take their messages by push are called from here on, until the broker
    # stops (after its drain: a push is one more subscriber that empties its queue).
    pusher = servicer.pusher = Pusher(broker, security)
    pusher.start()
    # While the queue store cannot be reached (Redis away), the broker's services say
    # NOT_SERVING, so readiness takes it out of rotation and gateways follow; the server as a
    # whole (liveness) still serves.
    broker.store_watchers.append(
        server.follow([BROKER_SERVICE, MEMORY_SERVICE], lambda: broker.store_answers)
    )
    server._on_drain.append(broker.drain)
    server._on_stop.append(pusher.stop)
    server._on_stop.append(broker.stop)
    return broker, server

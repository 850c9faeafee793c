"""Push delivery: the broker takes their messages to the agents registered with
``DeliveryMode.PUSH``, calling ``AgentService.HandleMessage`` on each instance's server.

An agent in any language is then a plain gRPC server of one unary method and a registration;
it needs no stream of its own, no leases and no acknowledgements. Each instance is served by
a subscription of its own on the agent's queue (the instances share the queue, as pulling
ones do), with at-least-once delivery as any subscription has it:

- a call answered OK acknowledges its delivery; the message it returns answers a REQUEST (the
  requester's correlation id and address filled in when the agent left them out), and a
  REQUEST answered with nothing gets an empty RESPONSE, as the SDK's agents do;
- a transient status (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, CANCELLED,
  INTERNAL, UNKNOWN) hands the delivery back for another attempt after the RT-011 backoff
  (100 ms, 500 ms, 2 s) or the longer wait the status asks for (google.rpc.RetryInfo, up to
  a minute), the dead-letter queue after the last; UNAVAILABLE with the reason
  ``RETRY_LATER`` (what an SDK agent answers when its handler raises ``RetryLater``) is the
  handler asking for the message later: it goes back to the broker at once, to come again
  after the RetryInfo's wait (a nack's ``redeliver_after``), the instance's place in flight
  free meanwhile; any other status (the
  agent refused the message: INVALID_ARGUMENT, UNIMPLEMENTED, ...) dead-letters it at once,
  its requester told why with an ERROR;
- two refusals are of the instance, not of the message: a server that refuses a message as
  not for the agent it serves (INVALID_ARGUMENT on ``to_agent``, as the SDKs' servers
  answer: the address the instance registered with went to another agent, a pod's address
  given to another pod, a port to another process), and one that refuses the broker's own
  credentials (UNAUTHENTICATED: its token or certificate is not the one the server knows).
  Nothing is dead-lettered and no attempt counted: what the subscription held goes back to
  the queue for an instance of the agent, and this one is out of reach until the server at its
  address takes the agent's messages again (tried after the backoff below);
- while an instance's server cannot be reached, its subscription is closed (what it held goes
  back to the queue, counting no attempt the agent never saw) and opened again once the
  server answers, after the RT-011 backoff (100 ms, 500 ms, then 2 s).

While a call runs, its delivery's lease is extended every third of a lease (a handler may
take minutes), for up to an hour: past that the call is given up (DEADLINE_EXCEEDED) and the
message delivered again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from mesh import codec
from mesh._status import from_rpc_error
from mesh.agent import answer_to, asked_broadcast, error_to, forward_of, forwards
from mesh.client import CLIENT_OPTIONS
from mesh.config import SecurityConfig, retry_backoff, retry_wait
from mesh.core.broker import Broker, Subscription
from mesh.core.errors import AgentError, MeshError, MessageValidationError, RetryLater
from mesh.core.model import (
    ANSWER_TYPES,
    MAX_DEAD_LETTER_REASON,
    AgentInfo,
    Delivery,
    Message,
    MessageType,
)
from mesh.core.tasks import cancel_and_wait, stop_if_cancelled
from mesh.headroom import NonFiniteError, non_finite_value
from mesh.security import open_channel
from mesh.tracing import (
    TRACE_HEADERS,
    extract,
    headers_for,
    records_under,
    tracer,
    without_trace,
)
from mesh.v1 import agent_pb2, agent_pb2_grpc, message_pb2

logger = logging.getLogger("mesh.push")

RECONCILE_SECONDS = 1.0
"""How often the instances pushed to are checked against the registry besides its changes
(an instance lost, a registration restored from the store)."""
CONNECT_PATIENCE = 1.0
"""Seconds a server has to accept the broker's connection before its instance is said to be
out of reach (as long as it stays so)."""
MAX_CALL_SECONDS = 3600.0
"""How long a call may run (its delivery's lease extended meanwhile, as the SDKs' agents
extend theirs while a handler works, for up to an hour); past it the call is given up
(DEADLINE_EXCEEDED) and the message delivered again."""
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)
"""Statuses after which a delivery is tried again; any other refuses the message for good."""
NOTICE_SECONDS = 5.0
"""How long a server has to take the notice that its agent was deregistered."""
NOTICE_RETRY_SECONDS = (0.5, 2.0, 5.0)
"""The waits before the notice is given again to a server that did not take it for now (out
of reach, busy, too slow), while its agent stays off."""
NOTICE_RETRY_ON = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
HANDLE_MESSAGE = "mesh.v1.AgentService/HandleMessage"
"""The call's span name, as OpenTelemetry's gRPC instrumentation names a call's span."""


def client_security(config: SecurityConfig | None) -> SecurityConfig:
    """How the broker calls the agents' servers: as a client of the mesh with its own
    settings. TLS when it has a CA (``AGENTMESH_TLS_CA``, the one that signs the mesh's
    certificates), presenting its client certificate (``AGENTMESH_TLS_CLIENT_CERT`` and
    ``_KEY``) to agents that require mutual TLS, and its token (``AGENTMESH_TOKEN`` or
    ``AGENTMESH_TOKEN_FILE``) to those that require one."""
    if config is None:
        return SecurityConfig()
    return SecurityConfig(
        tls_ca=config.tls_ca,
        tls_client_cert=config.tls_client_cert,
        tls_client_key=config.tls_client_key,
        tls_server_name=config.tls_server_name,
        token=config.token,
        token_file=config.token_file,
    )


class Pusher:
    """Runs one :class:`InstancePush` per instance of every agent that takes its messages by
    push, following the registry: started with the broker's server, stopped before its
    broker."""

    def __init__(self, broker: Broker, security: SecurityConfig | None = None) -> None:
        self.broker = broker
        self.security = client_security(security)
        self._pushes: dict[tuple[str, str], InstancePush] = {}
        """By agent id and instance address."""
        self._changed: set[str] = set()
        """Agents registered, left or changed since the last look (a look at each alone: an
        agent registering costs no walk through the registry)."""
        self._woken = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._notices: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.broker.registry_watchers.append(self._agent_changed)
        self._task = asyncio.create_task(self._follow(), name="push-delivery")

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            self.broker.registry_watchers.remove(self._agent_changed)
        await cancel_and_wait(self._task)
        self._task = None
        await asyncio.gather(*(push.stop() for push in self._pushes.values()))
        self._pushes.clear()
        await asyncio.gather(*(cancel_and_wait(notice) for notice in list(self._notices)))

    def notify_deregistered(self, agent_id: str, instances: Iterable[str]) -> None:
        """Tells each of the agent's ``instances`` (pushed to until the agent was
        deregistered) that it was taken off the mesh, once, best effort, in the background:
        a deregistration does not wait for its agent's servers."""
        for instance in instances:
            notice = asyncio.create_task(
                self._notify(agent_id, instance), name=f"push-notice-{agent_id}"
            )
            self._notices.add(notice)
            notice.add_done_callback(self._notices.discard)

    async def _notify(self, agent_id: str, instance: str) -> None:
        request = agent_pb2.NotifyDeregisteredRequest(agent_id=agent_id)
        for wait in (*NOTICE_RETRY_SECONDS, None):  # (None: the last try)
            try:
                async with open_channel(instance, self.security, CLIENT_OPTIONS) as channel:
                    stub = agent_pb2_grpc.AgentServiceStub(channel)
                    await stub.NotifyDeregistered(request, timeout=NOTICE_SECONDS)
            except grpc.aio.AioRpcError as error:
                if error.code() is grpc.StatusCode.UNIMPLEMENTED:  # (a server without it)
                    logger.debug("push: %s at %s takes no notices", agent_id, instance)
                    return
                if wait is None or error.code() not in NOTICE_RETRY_ON:
                    logger.info(
                        "push: could not tell %s at %s it was deregistered: %s",
                        agent_id,
                        instance,
                        from_rpc_error(error).message,
                    )
                    return
            except MeshError as error:  # (an address no channel can be opened to)
                logger.info("push: could not tell %s at %s: %s", agent_id, instance, error.message)
                return
            else:
                logger.info("push: told %s at %s it was deregistered", agent_id, instance)
                return
            await asyncio.sleep(wait)
            if agent_id in self.broker.registry:  # (registered again meanwhile: not off now)
                return

    def _agent_changed(self, agent_id: str) -> None:
        self._changed.add(agent_id)
        self._woken.set()

    async def _follow(self) -> None:
        """Looks at each agent that changed as it changes, and at the whole registry every
        RECONCILE_SECONDS (an instance lost, a registration restored from the store)."""
        loop = asyncio.get_running_loop()
        next_walk = 0.0
        while True:
            stop_if_cancelled()
            self._woken.clear()
            changed, self._changed = self._changed, set()
            if loop.time() >= next_walk:
                await self._reconcile(_pushed_instances(self.broker.registry))
                next_walk = loop.time() + RECONCILE_SECONDS
            elif changed:
                await self._reconcile(
                    _pushed_instances(
                        info for a in changed if (info := self.broker.registry.get(a)) is not None
                    ),
                    of=changed,
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_walk - loop.time())):
                    await self._woken.wait()

    async def _reconcile(
        self, pushed: Iterable[tuple[str, str, int]], of: Collection[str] | None = None
    ) -> None:
        """Starts the pushes ``pushed`` names and stops the others: of every agent, or of the
        agents ``of`` alone. A push whose calls in flight at most changed goes on with the new
        count (the calls running are not cancelled)."""
        wanted = {(agent_id, address): most for agent_id, address, most in pushed}
        gone = [key for key in self._pushes if key not in wanted and (of is None or key[0] in of)]
        await asyncio.gather(*(self._pushes.pop(key).stop() for key in gone))
        for key, most in wanted.items():
            if (push := self._pushes.get(key)) is not None:
                push.resize(most)
            else:
                push = self._pushes[key] = InstancePush(self.broker, *key, most, self.security)
                push.start()


def _pushed_instances(agents: Iterable[AgentInfo]) -> Iterator[tuple[str, str, int]]:
    """Agent id, instance address and calls in flight at most, for each instance registered
    to take its messages by push."""
    for info in agents:
        for address in info.push_instances:
            yield info.agent_id, address, info.pushed[address]


class InstancePush:
    """Takes one agent's messages to one instance's server, as a subscription of its own."""

    def __init__(
        self,
        broker: Broker,
        agent_id: str,
        address: str,
        max_in_flight: int,
        security: SecurityConfig,
    ) -> None:
        self.broker = broker
        self.agent_id = agent_id
        self.address = address
        self.max_in_flight = max_in_flight
        self.security = security
        self._calls: dict[str, asyncio.Task[None]] = {}
        self._unreachable = asyncio.Event()
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None
        """The subscription open, while one is."""
        self._pushed = broker.metrics.pushes
        self.reached = False
        """Whether a call reached the server since the subscription opened."""
        self.refusing: str | None = None
        """While the server at the address refuses the agent's messages as a whole, why."""
        self._stopping = asyncio.Event()
        self._ending: asyncio.Task[None] | None = None
        """The end of the latest subscription's serving (see :meth:`_give_back`)."""

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"push-{self.agent_id}@{self.address}")

    def resize(self, max_in_flight: int) -> None:
        """The instance registered again with another count of calls in flight at most: the
        subscription takes it at once (fewer: no new call until those running are fewer)."""
        if max_in_flight == self.max_in_flight:
            return
        self.max_in_flight = max_in_flight
        if (sub := self._sub) is not None and not sub.closed:
            sub.resize(max_in_flight)

    async def stop(self) -> None:
        self._stopping.set()
        await cancel_and_wait(self._task)
        if (ending := self._ending) is not None:
            await asyncio.wait({ending})
            if not ending.cancelled() and (error := ending.exception()) is not None:
                logger.warning("push to %s at %s: %r", self.agent_id, self.address, error)

    async def _run(self) -> None:
        channel = self._channel = open_channel(self.address, self.security, CLIENT_OPTIONS)
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        failures = 0
        try:
            while True:
                await self._until_connected(channel)
                try:
                    sub = await self.broker.subscribe(
                        self.agent_id, max_in_flight=self.max_in_flight, withdrawals=True
                    )
                except MeshError as error:  # (left a moment ago: the reconcile stops this)
                    logger.debug("push to %s: %s", self.agent_id, error.message)
                    await asyncio.sleep(RECONCILE_SECONDS)
                    continue
                self._sub = sub
                try:
                    reached = await self._serve(sub, stub, channel)
                finally:
                    self._sub = None
                if sub.ended_by is not None:
                    return  # (the agent left the registry: the reconcile forgets this push)
                self.broker.instance_unreachable(self.agent_id, self.address, self.refusing or "")
                failures = 0 if reached and self.refusing is None else failures + 1
                await asyncio.sleep(retry_backoff(failures))
        finally:
            self.broker.instance_reachable(self.agent_id, self.address)  # (pushed no more)
            await channel.close()

    async def _until_connected(self, channel: grpc.aio.Channel) -> None:
        """Waits until the server answers; one that does not within CONNECT_PATIENCE is said
        to be out of reach (gathers leave the agent out, a request's timeout says why) until
        it does."""
        try:
            async with asyncio.timeout(CONNECT_PATIENCE):
                await channel.channel_ready()
        except TimeoutError:
            self.broker.instance_unreachable(self.agent_id, self.address)
            logger.warning(
                "push to %s: its server at %s cannot be reached", self.agent_id, self.address
            )
            await channel.channel_ready()
        if self.refusing is None:  # (otherwise, once it takes this agent's messages again)
            self.broker.instance_reachable(self.agent_id, self.address)

    async def _serve(
        self,
        sub: Subscription,
        stub: agent_pb2_grpc.AgentServiceAsyncStub,
        channel: grpc.aio.Channel,
    ) -> bool:
        """Calls the instance with each delivery until its server cannot be reached (a call
        finds it gone, or the connection fails while no call is in flight; returns whether any
        call reached it) or this push is stopped."""
        self._unreachable.clear()
        self.reached = False
        pump = asyncio.create_task(self._pump(sub, stub))
        unreachable = asyncio.create_task(self._unreachable.wait())
        watch = asyncio.create_task(_until_failed(channel))
        keeper = asyncio.create_task(self._keep_leases(sub))
        try:
            await asyncio.wait({pump, unreachable, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                logger.warning(
                    "push to %s at %s stopped: %s", self.agent_id, self.address, pump.exception()
                )
        finally:
            unreachable.cancel()
            watch.cancel()
            keeper.cancel()
            # Runs to its end even when this push is stopped meanwhile (its stop cancels this
            # task again and again until it ends): the subscription must close.
            self._ending = asyncio.create_task(self._give_back(sub, pump))
            await asyncio.shield(self._ending)
        return self.reached

    async def _give_back(self, sub: Subscription, pump: asyncio.Task[None]) -> None:
        """Ends serving ``sub``: no more calls, those in flight ended, the subscription closed
        with what it held given back to the queue."""
        await cancel_and_wait(pump)
        if self.refusing is not None and self._calls:
            # The server refuses the agent's messages as a whole: it refuses the calls in
            # flight at once, and each goes back counting no attempt.
            stopped = asyncio.create_task(self._stopping.wait())
            waits: set[asyncio.Future[Any]] = {
                asyncio.gather(*self._calls.values(), return_exceptions=True),
                stopped,
            }
            await asyncio.wait(waits, timeout=CONNECT_PATIENCE, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
        # The calls in flight may have reached the agent: each counts its attempt. The
        # others (refused UNAVAILABLE, or leased as the server went away) go back as if
        # never delivered.
        seen = set(self._calls)
        running = list(self._calls.values())
        for call in running:
            call.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        self._calls.clear()
        await sub.close(seen=seen)

    async def _keep_leases(self, sub: Subscription) -> None:
        """Every third of a lease, extends the leases of the deliveries whose call still runs
        (or waits to be made again), so that a slow handler is not run twice."""
        while True:
            stop_if_cancelled()
            await asyncio.sleep(sub.lease_seconds / 3)
            if self._calls:
                with contextlib.suppress(MeshError):
                    await self.broker.extend_lease(
                        self.agent_id, list(self._calls), sub.lease_seconds
                    )

    async def _pump(self, sub: Subscription, stub: agent_pb2_grpc.AgentServiceAsyncStub) -> None:
        while True:
            try:
                batch = await sub.next_batch(sub.max_in_flight)
            except MeshError:
                if sub.ended_by is not None:
                    return
                raise
            for message_id in sub.take_withdrawn():
                if (call := self._calls.get(message_id)) is not None:
                    call.cancel()  # its requester gave up: the agent's call is cancelled too
            for delivery in batch:
                message_id = delivery.message.message_id
                call = asyncio.create_task(self._push(delivery, stub))
                self._calls[message_id] = call
                call.add_done_callback(functools.partial(self._forget, message_id))

    def _connected(self) -> bool:
        """Whether the connection to the server is up: an UNAVAILABLE then is the server's
        own answer (busy a moment), a transient failure of that one message."""
        channel = self._channel
        return channel is not None and (channel.get_state() is grpc.ChannelConnectivity.READY)

    def _forget(self, message_id: str, call: asyncio.Task[None]) -> None:
        if self._calls.get(message_id) is call:
            del self._calls[message_id]

    async def _push(self, delivery: Delivery, stub: agent_pb2_grpc.AgentServiceAsyncStub) -> None:
        message = delivery.message
        span = self._call_span(message)
        sent = (
            message
            if span is None
            else message.evolve(headers=headers_for(span, without_trace(message.headers)))
        )
        request = agent_pb2.HandleMessageRequest(
            delivery_attempt=delivery.attempt, max_delivery_attempts=delivery.max_attempts
        )
        codec.message_to_pb(sent, request.message)
        # The trace context travels in the call's metadata too, where a server's own gRPC
        # instrumentation (OpenTelemetry's, any language's) looks for it.
        metadata = tuple((k, v) for k, v in sent.headers.items() if k in TRACE_HEADERS)
        try:
            response = await stub.HandleMessage(
                request, timeout=MAX_CALL_SECONDS, metadata=metadata
            )
        except grpc.aio.AioRpcError as error:
            _end_call(span, error.code(), error.details())
            self._pushed.labels(error.code().name).inc()
            if error.code() is grpc.StatusCode.UNAVAILABLE and not self._connected():
                # The server cannot be reached: the subscription ends (the other calls would
                # fail too), and this delivery goes back without counting an attempt.
                self._calls.pop(message.message_id, None)
                self._unreachable.set()
                return
            refused = from_rpc_error(error)
            if refused.reason == RetryLater.reason and refused.retry_after:
                # The handler asked for the message later: back then, its place free now.
                self._reached_it()
                with contextlib.suppress(MeshError):
                    await self.broker.nack(
                        self.agent_id,
                        (message.message_id,),
                        redeliver_after=min(refused.retry_after, self.broker.config.max_ttl),
                    )
                return
            if error.code() in TRANSIENT:
                self._reached_it()
                await self._retry_later(delivery, refused.retry_after)
                return
            if why := _refusal_of_instance(refused):
                self._calls.pop(message.message_id, None)  # (back counting no attempt)
                self._refused_whole(why)
                return
            self._reached_it()
            await self._refused(message, refused)
            return
        except asyncio.CancelledError:  # withdrawn by its requester, or the push stopped
            _end_call(span, grpc.StatusCode.CANCELLED, "the call was cancelled")
            raise
        _end_call(span, grpc.StatusCode.OK)
        self._pushed.labels("OK").inc()
        self._reached_it()
        try:
            reply = _reply_from_pb(response)
        except MeshError as error:
            refused = AgentError(f"{self.agent_id}'s answer could not be read: {error.message}")
            await self._refused(message, refused)
            return
        await self._settle(message, reply, response.ByteSize() if response is not None else 0)

    def _reached_it(self) -> None:
        """A call reached the agent's server (whatever it answered)."""
        self.reached = True
        if self.refusing is not None:
            self.refusing = None
            self.broker.instance_reachable(self.agent_id, self.address)
            logger.info("push to %s: the server at %s serves it again", self.agent_id, self.address)

    def _refused_whole(self, why: str) -> None:
        """The server at the address refuses the agent's messages as a whole (``why``, see
        :func:`_refusal_of_instance`)."""
        if self.refusing is None:
            logger.warning(
                "push to %s: the server at %s %s: the agent's messages wait in its queue",
                self.agent_id,
                self.address,
                why,
            )
        self.refusing = why
        self._unreachable.set()

    def _call_span(self, message: Message) -> trace.Span | None:
        """A client span for the call when this process records the message's trace (its
        ``broker.queue`` span the parent): the hop to the agent's server shows in the trace,
        and the agent's own spans hang below it."""
        parent = extract(message.headers)
        if parent is None or not records_under(parent):
            return None
        return tracer().start_span(
            HANDLE_MESSAGE,
            context=parent,
            kind=SpanKind.CLIENT,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": "mesh.v1.AgentService",
                "rpc.method": "HandleMessage",
                "agent": self.agent_id,
                "address": self.address,
                "message_id": message.message_id,
            },
        )

    async def _settle(self, message: Message, reply: Message | None, size_bytes: int = 0) -> None:
        """What the SDK's agents do with a handler's return value (mesh.agent): a forward is
        sent on, an answer is sent back (which acknowledges the delivery), and the delivery
        is acknowledged. ``size_bytes``: the answer's size as it came, for the message limit
        (an answer too large reaches its requester as the broker's ERROR, as on a session)."""
        if reply is not None and forwards(message, reply):
            outgoing: Message | None = forward_of(message, self.agent_id, reply)
        elif reply is not None and reply.message_type in ANSWER_TYPES and _awaited(message):
            # An answer to this message, whatever the agent wrote in its envelope (its own
            # request ids, another agent's name): the requester matches it by this.
            outgoing = reply.evolve(
                from_agent=self.agent_id,
                to_agent=message.reply_target,
                correlation_id=message.correlation_id or message.message_id,
            )
        else:
            outgoing = answer_to(message, self.agent_id, reply)
        if outgoing is not None:
            try:
                await self.broker.send(outgoing, size_bytes=size_bytes)
            except MeshError as error:
                logger.warning(
                    "%s's answer to %s was not taken: %s",
                    self.agent_id,
                    message.message_id,
                    error.message,
                )
                if outgoing.message_type is not MessageType.ERROR and _awaited(message):
                    said = AgentError(f"{self.agent_id}'s answer was not taken: {error.message}")
                    with contextlib.suppress(MeshError):
                        await self.broker.send(error_to(message, self.agent_id, said))
        with contextlib.suppress(MeshError):
            await self.broker.ack(self.agent_id, (message.message_id,))

    async def _retry_later(self, delivery: Delivery, asked: float | None = None) -> None:
        """A transient failure: the delivery goes back for another attempt after RT-011's
        backoff (100 ms, 500 ms, 2 s), or after the wait the server asked for when longer
        (``asked``: its status's google.rpc.RetryInfo, up to MAX_RETRY_DELAY); held meanwhile,
        its lease kept, its place in flight taken, so that a server busy a moment is not
        called again at once. To the dead-letter queue at once after the last attempt."""
        if delivery.attempt < self.broker.config.delivery_attempts:
            await asyncio.sleep(retry_wait(retry_backoff(delivery.attempt - 1), asked))
        with contextlib.suppress(MeshError):
            await self.broker.nack(self.agent_id, (delivery.message.message_id,))

    async def _refused(self, message: Message, error: MeshError) -> None:
        """The agent refused the message: dead-lettered at once, its requester told why."""
        reason = f"{self.agent_id} refused it: {error.code}: {error.message}"
        with contextlib.suppress(MeshError):
            await self.broker.nack(
                self.agent_id,
                (message.message_id,),
                dead_letter_reason=reason[:MAX_DEAD_LETTER_REASON],
                tell_requester=False,
            )
            if _awaited(message):  # (after: an answer would settle the delivery as handled)
                await self.broker.send(error_to(message, self.agent_id, error))


async def _until_failed(channel: grpc.aio.Channel) -> None:
    """Keeps the channel connected (an idle one connects again at once) and returns when a
    connection attempt fails: the server is gone, though no call was there to find it."""
    state = channel.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)


def _end_call(span: trace.Span | None, code: grpc.StatusCode, details: str | None = None) -> None:
    """Ends a call's span with its status (any other than OK an error, as OpenTelemetry's gRPC
    conventions have it for a client)."""
    if span is None:
        return
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}".rstrip(": ")))
    span.end()


def _reply_from_pb(response: agent_pb2.HandleMessageResponse | None) -> Message | None:
    """The message an agent's server answered with (None for none); one that names no type
    is a RESPONSE. MessageValidationError for one the mesh cannot carry: bytes gRPC could not
    parse (nested past protobuf's limit), an undefined type, NaN or Infinity in its JSON."""
    if response is None:  # (grpc.aio's answer when the bytes do not parse)
        raise MessageValidationError.for_field(
            "response", "the answer is not a mesh.v1.HandleMessageResponse (nested too deep?)"
        )
    if not response.HasField("response"):
        return None
    pb = response.response
    if where := non_finite_value(pb):
        raise MessageValidationError.for_field(where, str(NonFiniteError(where)))
    if pb.message_type == message_pb2.MESSAGE_TYPE_UNSPECIFIED:
        pb.message_type = message_pb2.MESSAGE_TYPE_RESPONSE
    return codec.message_from_pb(pb, strict=True)


def _refusal_of_instance(error: MeshError) -> str:
    """Why a server's refusal is of every message of the agent rather than of this one, if it
    is: the message is not for the agent it serves, or the broker is not a caller it knows.
    Empty otherwise."""
    if error.code == "INVALID_ARGUMENT" and any(
        violation.field == "to_agent" for violation in error.field_violations
    ):
        return f"is another agent's ({error.message})"
    if error.code == "UNAUTHENTICATED":
        return f"refuses the broker's credentials ({error.message})"
    return ""


def _awaited(message: Message) -> bool:
    """Whether somebody waits for an answer to the message."""
    return message.message_type in (MessageType.REQUEST, MessageType.HANDOFF) or asked_broadcast(
        message
    )

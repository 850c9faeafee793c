"""The agent runtime: an agent is a class or a decorated function; :func:`serve` runs it.

``serve(agent, broker)`` starts the agent's own gRPC server (Agent service, health,
reflection), registers the agent with the broker, takes its deliveries from a subscription,
calls the handler, sends responses (and ACKs when asked), and shuts down gracefully: health
NOT_SERVING first, no new deliveries, work in flight finished (or returned to the queue),
deregistered, server stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, TypeVar, cast

import grpc

from mesh import codec
from mesh._status import abort
from mesh.client import (
    LONGEST_RECONNECT_DELAY,
    NO_RETRY,
    BroadcastResult,
    ClientSubscription,
    GatherResult,
    MeshClient,
    Received,
    RetryPolicy,
    content_keys,
    member_named,
    names_of,
    reconnect_delay,
    response_to,
    until_reachable,
    wait_seconds,
)
from mesh.config import (
    DEFAULT_BROKER,
    DEFAULT_LEASE_SECONDS,
    BrokerConfig,
    SecurityConfig,
    retry_backoff,
)
from mesh.core import negotiation
from mesh.core.errors import (
    DEREGISTERED,
    AgentError,
    BrokerUnavailableError,
    MeshError,
    MessageValidationError,
    RetryLater,
    SessionClosedError,
    UnhandledActionError,
)
from mesh.core.model import (
    BROADCAST_TARGET,
    JSON,
    AgentCard,
    DeliveryMode,
    Handoff,
    Message,
    MessageType,
    Tool,
)
from mesh.core.state import StateEntry
from mesh.core.tasks import cancel_and_wait
from mesh.core.validation import missing_fields, validate_message
from mesh.loop import AsyncOnly, started_before, stop_on_signals
from mesh.loop import run as run_loop
from mesh.serving import MeshServer, start_server
from mesh.tracing import current_span, extract, inject, span_name, without_trace
from mesh.v1 import agent_pb2, agent_pb2_grpc

logger = logging.getLogger("mesh.agent")

AGENT_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name
AGENTS_SERVICE = "agentmesh.agents"
"""The health name, on every agent server of a process, that says SERVING while every agent
the process serves takes its messages: the readiness of a process (a pod) serving several
(:func:`serve_all`, `agentmesh agent` with a list), where each agent's own
``mesh.v1.AgentService`` speaks for that agent alone."""
Reply = dict[str, JSON] | Message | JSON | None
HandlerFn = Callable[[Message, "AgentContext"], Awaitable[Reply] | Reply]

DIRECT_LIMITS = BrokerConfig()
"""The limits a message called to an agent's own server is held to: the broker's defaults,
RT-011's (the broker in between, when there is one, may hold its own)."""
DELIVERY_ATTEMPTS = DIRECT_LIMITS.max_delivery_attempts
"""RT-011's deliveries of a message (max_retries = 3, a broker's default): after the last, one
whose handler failed goes to the dead-letter queue without waiting out a backoff."""
MAX_LEASE_EXTENSION = 3600.0
"""How long a runtime keeps a delivery leased while its handler still works on it (it extends
the lease every third of a lease): past that, the broker delivers the message again."""


def _as_coroutine(fn: Callable[..., Any]) -> Callable[..., Awaitable[Reply]]:
    """A handler as a coroutine function: an ``async def`` as it is; a plain function runs in a
    worker thread, so that its work (a blocking library, a long computation) does not hold
    the event loop, and an awaitable it returns is awaited."""
    if inspect.iscoroutinefunction(fn):
        return fn

    async def threaded(*args: Any) -> Reply:
        result = await asyncio.to_thread(fn, *args)
        if inspect.isawaitable(result):
            return cast(Reply, await result)
        return cast(Reply, result)

    return threaded


HandlerT = TypeVar("HandlerT", bound=Callable[..., Any])


def _check_handler(fn: Callable[..., Any], name: str) -> None:
    """TypeError, as the agent is made, for a handler that cannot be called with a message and
    its context: else each message would fail on it, one by one."""
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise TypeError(f"the handler {name} must take (message, ctx)") from None
    except ValueError:  # (a callable with no signature to read: it is tried as it is)
        pass


def _check_agent(agent: object) -> None:
    """TypeError for what is served as an agent and is none (before any server starts)."""
    if not isinstance(agent, Agent):
        made = isinstance(agent, type) and issubclass(agent, Agent)
        raise TypeError(
            f"an agent to serve is an Agent object, not {agent!r}"
            + (f": make one, {getattr(agent, '__name__', '')}()" if made else "")
        )
    if "_actions" not in vars(agent):  # (Agent.__init__ finds the handlers: it never ran)
        raise TypeError(
            f"{type(agent).__name__}.__init__ does not call super().__init__(), where an "
            "Agent finds its handlers and checks its fields: call it first"
        )


def on(action: str) -> Callable[[HandlerT], HandlerT]:
    """Marks an Agent method as the handler of one content.action (``async def``, or a plain
    method, which runs in a worker thread)."""
    if not isinstance(action, str) or not action:
        raise TypeError(
            f'@on takes the name of the action it handles, as in @on("book"), not {action!r}'
        )

    def mark(method: HandlerT) -> HandlerT:
        method.__mesh_action__ = action  # type: ignore[attr-defined]
        return method

    return mark


class AgentContext:
    """What a handler can do besides answering: send, request and hand off, as this agent."""

    def __init__(
        self,
        agent: Agent,
        client: MeshClient,
        message: Message,
        received: Received | None = None,
        attempt: int = 1,
        max_attempts: int = 0,
    ) -> None:
        self.agent = agent
        self.client = client
        self.message = message
        self._received = received
        self.attempt = received.attempt if received is not None else max(attempt, 1)
        """Which delivery of the message this is: 1 the first, more after a failure or a
        :class:`RetryLater` (1 for a direct call to the agent's server)."""
        self.max_attempts = received.max_attempts if received is not None else max_attempts
        """How many deliveries the broker makes in all: after the one whose ``attempt`` this
        is, a failure (or a RetryLater) sends the message to the dead-letter queue. 0 when
        the broker does not say, and for a direct call to the agent's server."""

    @property
    def agent_id(self) -> str:
        return self.agent.agent_id

    @property
    def withdrawn(self) -> bool:
        """Whether the broker withdrew the message: its requester gave up (its timeout
        passed, or it cancelled), and nobody waits for the answer. An ``async def`` handler is
        cancelled then; a plain function, running in its worker thread, may look here to
        stop early."""
        return self._received is not None and self._received.withdrawn

    def forward(
        self, to_agent: str, content: dict[str, JSON] | None = None, **options: Any
    ) -> Message:
        """The request handed on to ``to_agent``, who answers the requester in this agent's
        place: return it from the handler (``return ctx.forward("Billing")``). It carries this
        message's content (or ``content``), metadata and priority, expires with the request,
        and its answer reaches the requester under the request's correlation id; given up,
        the request is withdrawn from ``to_agent`` too. ``options`` are further
        :class:`Message` fields."""
        message = self.message
        if message.message_type is not MessageType.REQUEST:
            raise ValueError(
                f"only a REQUEST can be forwarded, not a {message.message_type.value}: "
                "send or hand off a new message instead"
            )
        fields: dict[str, Any] = {
            "content": dict(message.content or {}) if content is None else content,
            "metadata": dict(message.metadata),
            "priority": message.priority,
            "headers": inject(without_trace(message.headers)),
        }
        fields.update(options)
        return Message(from_agent=self.agent_id, to_agent=to_agent, **fields)

    async def send(self, to_agent: str, content: dict[str, JSON], **options: Any) -> Message:
        options.setdefault("headers", without_trace(self.message.headers))
        return await self.client.send(to_agent, content, from_agent=self.agent_id, **options)

    async def request(self, to_agent: str, content: dict[str, JSON], **options: Any) -> Message:
        options.setdefault("headers", without_trace(self.message.headers))
        return await self.client.request(to_agent, content, from_agent=self.agent_id, **options)

    async def broadcast(
        self, content: dict[str, JSON], *, agent_types: Iterable[str] = (), **options: Any
    ) -> BroadcastResult:
        """A copy to every other agent, or to the agents of ``agent_types``, from this agent
        (see :meth:`MeshClient.broadcast`)."""
        options.setdefault("headers", without_trace(self.message.headers))
        return await self.client.broadcast(
            content, agent_types=agent_types, from_agent=self.agent_id, **options
        )

    def gather(
        self, content: dict[str, JSON], **options: Any
    ) -> AsyncGenerator[GatherResult, None]:
        """Asks several agents at once as this agent; each answer (or error) as it arrives
        (see :meth:`MeshClient.gather`: ``agent_ids``, ``agent_types``, ``timeout``)."""
        options.setdefault("headers", without_trace(self.message.headers))
        return self.client.gather(content, from_agent=self.agent_id, **options)

    async def handoff(
        self,
        to_agent: str,
        task_description: str,
        *,
        context: dict[str, JSON] | None = None,
        previous_result: JSON = None,
        constraints: dict[str, JSON] | None = None,
        **options: Any,
    ) -> Message:
        """Hands the task on; workflow_id carries over and step_number is incremented."""
        incoming = (
            Handoff.from_message(self.message)
            if self.message.message_type is MessageType.HANDOFF
            else None
        )
        options.setdefault("workflow_id", incoming.workflow_id if incoming else "")
        options.setdefault("step_number", (incoming.step_number + 1) if incoming else 1)
        options.setdefault("headers", without_trace(self.message.headers))
        return await self.client.handoff(
            to_agent,
            task_description,
            context=context,
            previous_result=previous_result,
            constraints=constraints,
            from_agent=self.agent_id,
            **options,
        )

    async def end_workflow(self, *, error_reason: str | None = None) -> StateEntry | None:
        """Ends the workflow this HANDOFF belongs to, as its last agent (one its agents run by
        themselves: the gateway ends those it runs): COMPLETED, or with ``error_reason``
        FAILED at this step; see :meth:`MeshClient.end_workflow`."""
        handoff = self.message.handoff
        if handoff is None or not handoff.workflow_id:
            raise ValueError("only a HANDOFF that names its workflow has a workflow to end")
        if error_reason is None:
            return await self.client.end_workflow(handoff.workflow_id, agent_id=self.agent_id)
        return await self.client.end_workflow(
            handoff.workflow_id,
            "FAILED",
            failed_at_step=handoff.step_number,
            error_reason=error_reason,
            agent_id=self.agent_id,
        )

    async def negotiate(
        self, peers: Sequence[str], proposal: dict[str, JSON], **options: Any
    ) -> negotiation.Outcome:
        """Negotiates with peers as this agent (see :meth:`MeshClient.negotiate`)."""
        return await self.client.negotiate(peers, proposal, from_agent=self.agent_id, **options)


class Agent:
    """Base class of agents. Override :meth:`handle`, or mark methods with ``@on("action")``.

    A handler returns the response content (a dict, or any other mapping), a whole
    :class:`Message`, any other JSON value (sent as ``{"result": value}``) or None. REQUEST
    messages always get a RESPONSE; BROADCAST and HANDOFF messages get one when the handler
    returns something.
    A handler that raises answers a REQUEST with an ERROR message. A REQUEST's handler may
    hand it on instead (``return ctx.forward("OtherAgent")``): the other agent answers.
    """

    agent_id: str = ""
    agent_types: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    tools: tuple[Tool, ...] = ()
    description: str = ""
    required_fields: tuple[str, ...] = ()
    """Content keys every REQUEST and HANDOFF sent to the agent must carry, e.g.
    ``("action", "parameters")``: the broker refuses, to its sender, a message that lacks one
    (RF-009 scenario 18), so that the handler never sees it."""

    def __init__(
        self,
        agent_id: str | None = None,
        *,
        agent_types: Iterable[str] | None = None,
        capabilities: Iterable[str] | None = None,
        tools: Iterable[Tool] | None = None,
        description: str | None = None,
        required_fields: Iterable[str] | None = None,
    ) -> None:
        if agent_id is not None:
            self.agent_id = agent_id
        if not self.agent_id:
            raise ValueError("an agent needs an agent_id")
        # (Given here or as the class's own: ``agent_types = ("voter")`` is a string.)
        self.agent_types = names_of(
            self.agent_types if agent_types is None else agent_types,
            "agent.agent_types",
            "agent types",
        )
        self.capabilities = names_of(
            self.capabilities if capabilities is None else capabilities,
            "agent.capabilities",
            "capabilities",
        )
        if tools is not None:
            self.tools = tuple(tools)
        if description is not None:
            self.description = description
        self.required_fields = content_keys(
            self.required_fields if required_fields is None else required_fields
        )
        self._actions: dict[str, Callable[..., Awaitable[Reply]]] = {}
        handlers: dict[str, str] = {}
        for name, member in inspect.getmembers(self, inspect.ismethod):
            action = getattr(member, "__mesh_action__", None)
            if action:
                where = f"{type(self).__name__}.{name}"
                _check_handler(member, where)
                if action in handlers:  # (else one of them would be dropped unsaid)
                    raise TypeError(
                        f"{handlers[action]} and {where} both handle {action!r}: an action "
                        "has one handler"
                    )
                handlers[action] = where
                self._actions[action] = _as_coroutine(member)
        _check_handler(self.handle, f"{type(self).__name__}.handle")
        if not inspect.iscoroutinefunction(self.handle):  # a plain `def handle` overridden
            self.handle = _as_coroutine(self.handle)  # type: ignore[method-assign,assignment]

    @property
    def actions(self) -> tuple[str, ...]:
        return tuple(sorted(self._actions))

    def card(self) -> AgentCard:
        return AgentCard(
            agent_id=self.agent_id,
            agent_types=tuple(self.agent_types),
            capabilities=tuple(self.capabilities) or self.actions,
            tools=tuple(self.tools),
            description=self.description or (inspect.getdoc(self) or "").split("\n")[0],
            actions=self.actions,
        )

    async def handle(self, message: Message, ctx: AgentContext) -> Reply:
        """Handles one message; the default dispatches on content.action."""
        handler = self._actions.get(message.action)
        if handler is None:
            raise UnhandledActionError(f"{self.agent_id} does not handle action {message.action!r}")
        return await handler(message, ctx)

    async def on_ack(self, message: Message, ctx: AgentContext) -> None:
        """Called for ACK messages addressed to this agent; the default only logs them."""
        logger.debug("%s received ACK for %s", self.agent_id, message.correlation_id)


class FunctionAgent(Agent):
    """An agent whose handler is one coroutine function."""

    def __init__(self, fn: HandlerFn, agent_id: str, **kwargs: Any) -> None:
        kwargs.setdefault("description", (inspect.getdoc(fn) or "").split("\n")[0])
        _check_handler(fn, getattr(fn, "__qualname__", repr(fn)))
        super().__init__(agent_id, **kwargs)
        self._fn = _as_coroutine(fn)

    async def handle(self, message: Message, ctx: AgentContext) -> Reply:
        return await self._fn(message, ctx)


def agent(
    agent_id: str,
    *,
    agent_types: Iterable[str] = (),
    capabilities: Iterable[str] = (),
    tools: Iterable[Tool] = (),
    description: str | None = None,
    required_fields: Iterable[str] = (),
) -> Callable[[HandlerFn], FunctionAgent]:
    """Turns ``async def fn(message, ctx)`` into an agent::

    @agent("PaymentAgent", agent_types=["payment"])
    async def payment(message, ctx):
        return {"status": "PAID"}
    """
    if not isinstance(agent_id, str) or not agent_id:
        raise TypeError(
            f'@agent takes the agent\'s id, as in @agent("PaymentAgent"), not {agent_id!r}'
        )

    def wrap(fn: HandlerFn) -> FunctionAgent:
        return FunctionAgent(
            fn,
            agent_id,
            agent_types=agent_types,
            capabilities=capabilities,
            tools=tools,
            description=description,
            required_fields=required_fields,
        )

    return wrap


def asked_broadcast(message: Message) -> bool:
    """A broadcast whose sender waits for answers: a gather's copy (every one carries a
    correlation_id) or one naming where answers go (reply_to). A plain broadcast, an alert
    to every agent, is told, not asked."""
    return message.message_type is MessageType.BROADCAST and bool(
        message.correlation_id or message.reply_to
    )


def answer_to(message: Message, agent_id: str, reply: Reply) -> Message | None:
    """The RESPONSE a handler's return value makes, or None when no answer is due: a REQUEST
    is always answered, other messages when the handler returns something, except a
    broadcast that nobody asked: an alert sent to every agent does not bring every agent's
    answer back."""
    expects = message.message_type is MessageType.REQUEST
    if reply is None and not expects:
        return None
    if message.message_type is MessageType.BROADCAST and not asked_broadcast(message):
        return None
    if isinstance(reply, Message) and forwards(message, reply):
        return forward_of(message, agent_id, reply)
    if isinstance(reply, Message):
        return reply.evolve(
            from_agent=reply.from_agent or agent_id,
            to_agent=reply.to_agent or message.reply_target,
            correlation_id=reply.correlation_id or message.correlation_id or message.message_id,
        )
    if isinstance(reply, Mapping):  # (a dict, or any other mapping: a read-only view...)
        return response_to(message, agent_id, reply)
    return response_to(message, agent_id, {} if reply is None else {"result": reply})


def forwards(message: Message, reply: Message) -> bool:
    """Whether a handler's returned message hands a REQUEST on to another agent rather than
    answering it: it asks (a REQUEST or HANDOFF) and is addressed to an agent other than the
    requester."""
    return (
        message.message_type is MessageType.REQUEST
        and reply.message_type in (MessageType.REQUEST, MessageType.HANDOFF)
        and reply.to_agent not in ("", BROADCAST_TARGET, message.reply_target)
    )


def forward_of(message: Message, agent_id: str, reply: Message) -> Message:
    """A REQUEST handed on: the next agent answers the requester (``reply_to``) under the
    request's correlation id, and the forward expires with the request (its ttl, counted from
    the request's timestamp) unless the handler gave it a ttl of its own."""
    expiry: dict[str, Any] = {}
    if not reply.ttl and message.ttl:
        expiry = {"ttl": message.ttl, "timestamp": message.timestamp}
    return reply.evolve(
        from_agent=reply.from_agent or agent_id,
        reply_to=reply.reply_to or message.reply_target,
        correlation_id=reply.correlation_id or message.correlation_id or message.message_id,
        **expiry,
    )


def error_to(message: Message, agent_id: str, error: BaseException) -> Message:
    reason = error.reason if isinstance(error, MeshError) else type(error).__name__
    return Message(
        from_agent=agent_id,
        to_agent=message.reply_target,
        message_type=MessageType.ERROR,
        content={"action": "error", "error": str(error) or type(error).__name__, "reason": reason},
        correlation_id=message.correlation_id or message.message_id,
        priority=message.priority,
        headers=inject(without_trace(message.headers)),
    )


class AgentRuntime:
    """Runs one agent against the broker: subscription, handlers, answers, shutdown."""

    def __init__(
        self,
        agent: Agent,
        client: MeshClient,
        *,
        max_in_flight: int = 16,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        address: str = "",
        max_lease_extension: float = MAX_LEASE_EXTENSION,
        delivery_mode: DeliveryMode = DeliveryMode.PULL,
    ) -> None:
        self.agent = agent
        self.client = client
        self.delivery_mode = delivery_mode
        """PULL: the runtime subscribes to the agent's queue; PUSH: the broker calls the
        agent's server (HandleMessage) with each message, and the runtime only registers."""
        self.max_in_flight = max_in_flight
        # 0 means the default lease, asked for explicitly: the runtime extends leases by a
        # length it knows (on a broker configured with a shorter default, leases would end
        # before the first extension).
        self.lease_seconds = (
            wait_seconds(lease_seconds, 0, "lease_seconds") or DEFAULT_LEASE_SECONDS
        )
        if not max_lease_extension >= 0:  # (NaN too; infinity: for as long as it runs)
            raise MessageValidationError.for_field(
                "max_lease_extension", "max_lease_extension must not be negative"
            )
        self.max_lease_extension = max_lease_extension
        self.address = address
        self.handled = 0
        self.failed = 0
        self.postponed = 0
        """Deliveries whose handler raised RetryLater (handed back for later)."""
        self._consumer: asyncio.Task[None] | None = None
        self._in_flight: dict[Received, asyncio.Task[None]] = {}
        """The deliveries being handled, with the task that handles each."""
        self.withdrawn = 0
        """Handlers stopped because their requester gave up."""
        self._subscription: ClientSubscription | None = None
        self._working: dict[Received, float] = {}
        """The deliveries whose handler runs, with when (loop time) it started."""
        self._settling: set[Received] = set()
        """The deliveries whose handler is over, being answered and acked: a withdrawal that
        comes now stops nothing (cancelled in its write, an answer would be lost, or the
        session's stream closed under the agent's other deliveries)."""
        self._keeper: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped = asyncio.Event()
        """Set as the agent stops: a failed delivery waiting out its backoff goes back now."""
        self.subscribed = asyncio.Event()
        """Set while the agent takes its messages: subscribed to its queue (pull), or
        registered for the broker's calls (push)."""
        self.subscribed_watchers: list[Callable[[], None]] = []
        """Called when ``subscribed`` changed (the agent's health follows it)."""

    async def register(self) -> None:
        await self.client.register(
            self.agent.agent_id,
            agent_types=self.agent.agent_types,
            address=self.address,
            capabilities=self.agent.card().capabilities,
            required_fields=self.agent.required_fields,
            delivery_mode=self.delivery_mode,
            # (pushed: the broker's calls to this server at once, as many as it would handle)
            max_in_flight=self.max_in_flight if self.delivery_mode is DeliveryMode.PUSH else 0,
        )

    async def start(self, wait_for_broker: float = 0.0) -> None:
        """Registers the agent and starts taking its messages. A broker that cannot be
        reached yet is waited for, up to ``wait_for_broker`` seconds (tried again after
        0.1 s growing to 2 s, beyond the client's own retries): agents and their broker
        started side by side (a deployment) need no order."""
        await until_reachable(
            self.register,
            wait_for_broker,
            f"{self.agent.agent_id} at {self.address} waits for its broker",
        )
        if self.delivery_mode is DeliveryMode.PUSH:
            self._mark_subscribed(True)  # (the broker holds the queue's end: it calls us)
            self._consumer = asyncio.create_task(
                self._keep_registered(), name=f"agent-{self.agent.agent_id}-registration"
            )
            return
        self._consumer = asyncio.create_task(self._consume(), name=f"agent-{self.agent.agent_id}")
        self._keeper = asyncio.create_task(
            self._keep_leases(), name=f"agent-{self.agent.agent_id}-leases"
        )

    async def _keep_leases(self) -> None:
        """Every third of a lease, extends the leases of the deliveries whose handler still
        runs (one frame for them all), so that a handler that takes longer than a lease (a
        model's answer, a long search) is not run again meanwhile, up to
        ``max_lease_extension`` after it started."""
        period = self.lease_seconds / 3
        loop = asyncio.get_running_loop()
        given_up: set[Received] = set()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            due: dict[ClientSubscription, list[str]] = {}
            for received, started in list(self._working.items()):
                if received.done or received in given_up:
                    continue
                if now - started > self.max_lease_extension:
                    given_up.add(received)
                    logger.warning(
                        "%s has worked on %s for over %g s: its lease is no longer extended,"
                        " and the broker delivers it again when the lease ends",
                        self.agent.agent_id,
                        received.message.message_id,
                        self.max_lease_extension,
                    )
                    continue
                due.setdefault(received.subscription, []).append(received.message.message_id)
            given_up.intersection_update(self._working)
            for subscription, message_ids in due.items():
                await subscription.extend_leases(message_ids, self.lease_seconds)

    async def _consume(self) -> None:
        attempt = 0
        while not self._stopping:
            try:
                if attempt:
                    await self.register()  # the broker may have restarted and forgotten us
                sub = self.client.subscribe(
                    self.agent.agent_id,
                    max_in_flight=self.max_in_flight,
                    lease_seconds=self.lease_seconds,
                    reconnect=False,  # this loop reconnects, registering again first
                    on_withdrawn=self._stop_work,
                    instance=self.address,  # (its death takes this instance off the agent's)
                )
                await sub.start()
                self._subscription = sub
                self._mark_subscribed(True)
                attempt = 0
                async for received in sub:
                    # (taken as the agent stops: handled with the work in flight, within
                    # the grace; what is still buffered goes back unseen as it closes)
                    task = asyncio.create_task(self._process(received))
                    self._in_flight[received] = task
                    task.add_done_callback(functools.partial(self._done, received))
                    if self._stopping:
                        break
                if self._stopping:
                    return
            except (BrokerUnavailableError, SessionClosedError) as error:
                if self._stopping:
                    return
                delay = reconnect_delay(attempt)
                logger.warning(
                    "%s lost the broker (%s); reconnecting in %.1f s",
                    self.agent.agent_id,
                    error.message,
                    delay,
                )
                self._mark_subscribed(False)
                attempt += 1
                await asyncio.sleep(delay)
            except MeshError as error:
                if error.reason == DEREGISTERED:
                    self._taken_off()
                    return
                logger.error("%s cannot subscribe: %s", self.agent.agent_id, error.message)
                self._mark_subscribed(False)
                attempt += 1
                await asyncio.sleep(LONGEST_RECONNECT_DELAY)

    def _taken_off(self) -> None:
        """Taken off the mesh on purpose (`agentmesh deregister`): not registered again behind
        the back of whoever did it. The process stays (its server answers, its readiness says
        it takes no messages) until it is stopped."""
        logger.warning(
            "%s was deregistered: it takes no more messages (start it again to register it again)",
            self.agent.agent_id,
        )
        self._mark_subscribed(False)

    def deregistered(self, agent_id: str) -> None:
        """The broker says the agent was deregistered (NotifyDeregistered). An instance
        taking its messages by push stops registering again when the broker comes back and
        says it takes no messages, as a pulling one does when its subscription ends (which
        is what tells a pulling one: to it, this changes nothing)."""
        self._require_served("agent_id", agent_id)
        if self._stopping or self.delivery_mode is not DeliveryMode.PUSH:
            return
        if self._consumer is not None:
            self._consumer.cancel()  # (registers no more)
        self._taken_off()

    def _mark_subscribed(self, subscribed: bool) -> None:
        if subscribed is self.subscribed.is_set():
            return
        if subscribed:
            self.subscribed.set()
        else:
            self.subscribed.clear()
        for watcher in self.subscribed_watchers:
            watcher()

    async def _keep_registered(self) -> None:
        """Push: no stream of this process's reaches the broker, the broker's calls come to
        its server; when the broker is back after it was lost (a restart forgets every agent
        on the memory store), the agent registers again. Meanwhile it is not subscribed."""
        async for serving in self.client.broker_serving():
            if not serving:
                self._mark_subscribed(False)
                continue
            if self.subscribed.is_set():
                continue  # (the first answer: registered as it started)
            try:
                await self.register()
            except MeshError as error:
                logger.warning(
                    "%s could not register again: %s", self.agent.agent_id, error.message
                )
            else:
                self._mark_subscribed(True)
                logger.info("%s registered again for push delivery", self.agent.agent_id)

    def _done(self, received: Received, _: asyncio.Task[None]) -> None:
        del self._in_flight[received]

    def _stop_work(self, received: Received) -> None:
        """The broker withdrew a delivery whose handler runs: its requester gave up
        (cancelled, or past its deadline), so the handler is cancelled (a plain function
        running in a worker thread goes on there, unless it looks at ``ctx.withdrawn``; its
        result is unused)."""
        task = self._in_flight.get(received)
        if task is None or task.done() or received in self._settling:
            return
        self.withdrawn += 1
        logger.info(
            "%s stops work on %s %s from %s: its requester gave up",
            self.agent.agent_id,
            received.message.message_type.value,
            received.message.message_id,
            received.message.from_agent,
        )
        task.cancel()

    async def _process(self, received: Received) -> None:
        self._working[received] = asyncio.get_running_loop().time()
        try:
            await self._settle(received)
        finally:
            del self._working[received]
            self._settling.discard(received)

    async def _handle(self, received: Received) -> Message | None:
        """:meth:`run_handler` on a delivery; however it ends, what follows is settling."""
        try:
            return await self.run_handler(received.message, received)
        finally:
            self._settling.add(received)

    async def _settle(self, received: Received) -> None:
        """Runs the handler on a delivery, answers it when due, and settles the delivery."""
        message = received.message
        try:
            answer = await self._handle(received)
        except UnhandledActionError as error:
            # Not answerable (not a REQUEST), and no attempt would go otherwise. A broadcast
            # is for whoever cares for it; anything else was meant for this agent.
            if message.message_type is MessageType.BROADCAST:
                logger.debug("%s: broadcast %s left aside", error.message, message.message_id)
                await received.ack()
                return
            logger.warning(
                "%s: %s %s from %s goes to the dead-letter queue",
                error.message,
                message.message_type.value,
                message.message_id,
                message.from_agent,
            )
            await received.reject(error.message)
            return
        except RetryLater as later:
            logger.info(
                "%s: %s %s from %s comes back in %s s: %s",
                self.agent.agent_id,
                message.message_type.value,
                message.message_id,
                message.from_agent,
                f"{later.retry_after:g}",
                later.message,
            )
            await received.nack(redeliver_after=later.retry_after)
            return
        except Exception:
            # Not answerable (not a REQUEST): handed back for another attempt, then
            # dead-lettered by the broker once its attempts are used up.
            await self._back_off(received)
            await received.nack()
            return
        if answer is not None and forwards(message, answer):
            await self._hand_on(received, answer)
            return
        if answer is not None:
            try:
                await received.answer(answer)
            except MeshError as error:
                logger.warning(
                    "%s could not answer %s: %s",
                    self.agent.agent_id,
                    message.message_id,
                    error.message,
                )
                if (
                    error.code == "INVALID_ARGUMENT"
                    and answer.message_type is not MessageType.ERROR
                ):
                    # The answer itself was refused (too large, too deep, a NaN): whoever
                    # waits for it hears why now, not at its deadline.
                    refused = AgentError(f"{self.agent.agent_id}'s answer was refused: {error}")
                    with contextlib.suppress(MeshError):
                        await received.answer(error_to(message, self.agent.agent_id, refused))
        await received.ack()  # nothing to do when the answer acknowledged it

    async def _back_off(self, received: Received) -> None:
        """Before a delivery whose handler failed goes back: RT-011's backoff (100 ms after
        the first attempt, 500 ms after the second, 2 s after each later one), as a push
        agent's failures wait, so that a failure that lasts a moment (a service away, a
        lock held) is not met again at once, four times in a few milliseconds. The delivery
        stays leased meanwhile (its place in flight taken, its lease kept as a running
        handler's is). None after the last attempt the broker makes (it goes to the
        dead-letter queue; RT-011's fourth from a broker that does not say), nor once the
        agent stops."""
        if received.attempt >= (received.max_attempts or DELIVERY_ATTEMPTS) or self._stopping:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(retry_backoff(received.attempt - 1)):
                await self._stopped.wait()

    async def _hand_on(self, received: Received, forward: Message) -> None:
        """Sends a forward and waits for the broker to take it (tried again under backpressure,
        as any send): one it refuses (the next agent unknown, its queue full) is said to the
        requester as an ERROR at once, instead of its waiting for an answer that cannot come."""
        message = received.message
        try:
            await self.client.send_message(forward)
        except MeshError as error:
            logger.warning(
                "%s could not hand %s on to %s: %s",
                self.agent.agent_id,
                message.message_id,
                forward.to_agent,
                error.message,
            )
            failed = MeshError(
                f"{self.agent.agent_id} could not hand the request on to {forward.to_agent}: "
                f"{error.message}",
                code=error.code,
                reason=error.reason,
            )
            with contextlib.suppress(MeshError):
                await received.answer(error_to(message, self.agent.agent_id, failed))
        await received.ack()

    def _require_served(self, field: str, agent_id: str) -> None:
        """MessageValidationError on ``field`` unless ``agent_id`` is this server's agent (a
        server serving another agent says so, and the broker reads that as its address
        having gone to another agent's server)."""
        if agent_id != self.agent.agent_id:
            raise MessageValidationError.for_field(
                field, f"this server serves {self.agent.agent_id}, not {agent_id}"
            )

    def check_direct(self, message: Message, size_bytes: int) -> None:
        """A message called to the agent's own server directly is held to the format the
        broker holds every message to (RT-011's limits) and to the content fields the agent
        requires, and must be for this agent: raises MessageValidationError otherwise, before
        any handler runs."""
        validate_message(message, DIRECT_LIMITS, size_bytes)
        self._require_served("to_agent", message.to_agent)
        if self.agent.required_fields and (
            found := missing_fields(message, self.agent.required_fields)
        ):
            raise MessageValidationError.from_violations(found)

    async def run_handler(
        self,
        message: Message,
        received: Received | None = None,
        *,
        attempt: int = 1,
        max_attempts: int = 0,
    ) -> Message | None:
        """Calls the handler (on ``received``, a delivery, or a message handed to the agent's
        own server, ``attempt`` of ``max_attempts`` its delivery when the broker pushed it);
        returns the answer (RESPONSE or ERROR) that is due, if any."""
        ctx = AgentContext(self.agent, self.client, message, received, attempt, max_attempts)
        if message.message_type is MessageType.ACK:
            await self.agent.on_ack(message, ctx)
            return None
        operation = "analyze" if message.message_type is MessageType.BROADCAST else "handle"

        def attributes() -> dict[str, Any]:
            found: dict[str, Any] = {
                "agent": self.agent.agent_id,
                "action": message.action,
                "message_type": message.message_type.value,
                "message_id": message.message_id,
                "priority": message.priority.value,
            }
            for key in ("workflow_id", "group_id", "run_id"):
                if message.metadata.get(key):
                    found[key] = str(message.metadata[key])
            return found

        with current_span(
            span_name(self.agent.agent_id, operation),
            context=extract(message.headers),
            attributes=attributes,
        ) as span:
            try:
                reply = await self._handled(message, ctx)
                if inspect.iscoroutine(reply):  # `return other(...)` without its await
                    reply.close()
                    raise TypeError(
                        f"the handler of {message.action!r} returned a coroutine, not its"
                        " result: an await is missing"
                    )
                if isinstance(reply, asyncio.Future):  # a task or future, not awaited
                    raise TypeError(
                        f"the handler of {message.action!r} returned a"
                        f" {type(reply).__name__}, not its result: an await is missing"
                    )
                if inspect.isgenerator(reply) or inspect.isasyncgen(reply):
                    # (its text, "<generator object ...>", would have gone as the answer)
                    raise TypeError(
                        f"the handler of {message.action!r} is a generator: it returns one"
                        " answer (a list, for many values), not a yield per value"
                    )
            except asyncio.CancelledError:
                raise
            except RetryLater as later:
                span.set_attribute("retry_after", later.retry_after or 0.0)
                self.postponed += 1
                raise  # (its delivery goes back for later: nothing is answered now)
            except Exception as error:
                self.failed += 1
                span.set_attribute("error", str(error))
                # A gather waits for every agent it asked: an ERROR tells it at once.
                asked = message.message_type is MessageType.REQUEST or asked_broadcast(message)
                if not isinstance(error, UnhandledActionError):
                    logger.exception(
                        "%s failed on %s (%s)",
                        self.agent.agent_id,
                        message.action,
                        message.message_id,
                    )
                elif message.message_type is MessageType.REQUEST:
                    # (anything else is the caller's to log: it decides what follows)
                    logger.warning(
                        "%s: answered REQUEST %s from %s with an ERROR",
                        error,
                        message.message_id,
                        message.from_agent,
                    )
                if asked:
                    return error_to(message, self.agent.agent_id, error)
                raise
            self.handled += 1
            return answer_to(message, self.agent.agent_id, reply)

    async def _handled(self, message: Message, ctx: AgentContext) -> Reply:
        """The handler's reply. A cancellation that comes from inside the handler (a task it
        awaited was cancelled by someone else), not to it, is a failure like any other: its
        requester hears of it, rather than waiting for a delivery left to its lease's end."""
        try:
            return await self.agent.handle(message, ctx)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is None or current.cancelling():
                raise  # its own: a withdrawal, the runtime stopping, a direct caller gone
            raise AgentError(
                f"the handler of {message.action!r} was cancelled from within"
                " (a task it awaited was cancelled)",
                reason="HANDLER_CANCELLED",
            ) from None

    async def stop(self, grace: float = 5.0) -> None:
        """No new deliveries; in-flight work finishes within ``grace`` or goes back to the queue."""
        self._stopping = True
        self._stopped.set()
        if self._consumer is not None:
            self._consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._consumer
        if self._in_flight:
            _, pending = await asyncio.wait(list(self._in_flight.values()), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._keeper is not None:
            await cancel_and_wait(self._keeper)
        if self._subscription is not None:
            await self._subscription.close()
        # Best effort, once: a broker that is gone forgets its agents anyway.
        retry, self.client.retry = self.client.retry, NO_RETRY
        try:
            with contextlib.suppress(MeshError):
                await self.client.deregister(self.agent.agent_id, address=self.address)
        finally:
            self.client.retry = retry


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    """The Agent service: direct calls to the handler, and the agent's card."""

    def __init__(self, runtime: AgentRuntime) -> None:
        self.runtime = runtime

    async def HandleMessage(
        self, request: agent_pb2.HandleMessageRequest, context: Any
    ) -> agent_pb2.HandleMessageResponse:
        try:
            message = codec.message_from_pb(request.message, strict=True)
            self.runtime.check_direct(message, request.message.ByteSize())
            answer = await self.runtime.run_handler(
                message,
                attempt=request.delivery_attempt,
                max_attempts=request.max_delivery_attempts,
            )
            if answer is not None and forwards(message, answer):
                answer = await self._forward(message, answer, context.time_remaining())
        except MeshError as error:
            await abort(context, error)
        except Exception:
            await context.abort(grpc.StatusCode.INTERNAL, "the handler failed")
        response = agent_pb2.HandleMessageResponse()
        if answer is not None:
            codec.message_to_pb(answer, response.response)
        return response

    async def _forward(
        self, message: Message, forward: Message, remaining: float | None
    ) -> Message:
        """A direct call's request handed on: asked through the broker (the caller is not
        one of its agents), the next agent's answer returned to the caller."""
        answer = await self.runtime.client.request_message(
            forward.evolve(reply_to=""), timeout=remaining, raise_on_error=False
        )
        return answer.evolve(to_agent=message.reply_target)

    async def DescribeAgent(
        self, request: agent_pb2.DescribeAgentRequest, context: Any
    ) -> agent_pb2.DescribeAgentResponse:
        response = agent_pb2.DescribeAgentResponse()
        codec.card_to_pb(self.runtime.agent.card(), response.card)
        return response

    async def NotifyDeregistered(
        self, request: agent_pb2.NotifyDeregisteredRequest, context: Any
    ) -> agent_pb2.NotifyDeregisteredResponse:
        try:
            self.runtime.deregistered(request.agent_id)
        except MeshError as error:
            await abort(context, error)
        return agent_pb2.NotifyDeregisteredResponse()


class AgentServer(AsyncOnly):
    """A served agent: its gRPC server, its broker client and its runtime."""

    def __init__(
        self,
        agent: Agent,
        server: MeshServer,
        runtime: AgentRuntime,
        client: MeshClient,
        *,
        owns_client: bool = True,
        together: _Together | None = None,
    ) -> None:
        self.agent = agent
        self.server = server
        self.runtime = runtime
        self.client = client
        self.owns_client = owns_client
        """False when the client was given to :func:`serve` (shared with other agents)."""
        self._together = together

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self, grace: float = 5.0) -> None:
        """Graceful shutdown: NOT_SERVING, finish or return work, deregister, stop."""
        await self.server.health.enter_graceful_shutdown()  # (for good: no watcher undoes it)
        if self._together is not None:
            self._together.leave(self.runtime)  # (the others' readiness is theirs alone now)
        await self.runtime.stop(grace)
        await self.server.stop(grace)
        if self.owns_client:
            await self.client.close()

    async def __aenter__(self) -> AgentServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class _Together:
    """The agents one process serves (``size`` of them): each of their servers says SERVING
    for :data:`AGENTS_SERVICE` while every one of them takes its messages."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.runtimes: list[AgentRuntime] = []
        self.followers: list[Callable[[], None]] = []

    def serving(self) -> bool:
        return len(self.runtimes) == self.size and all(
            runtime.subscribed.is_set() for runtime in self.runtimes
        )

    def changed(self) -> None:
        for follower in self.followers:
            follower()

    def join(self, runtime: AgentRuntime, server: MeshServer) -> None:
        self.runtimes.append(runtime)
        self.followers.append(server.follow([AGENTS_SERVICE], self.serving))
        runtime.subscribed_watchers.append(self.changed)
        self.changed()

    def leave(self, runtime: AgentRuntime) -> None:
        """An agent stopping: no longer one the process serves."""
        if runtime in self.runtimes:
            self.runtimes.remove(runtime)
            self.size -= 1
            self.changed()

    async def say(self, server: MeshServer) -> None:
        """Says it on ``server`` now (its follower says it too, a moment later)."""
        await server.set_service_serving(AGENTS_SERVICE, self.serving())


async def serve(
    agent: Agent,
    broker: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_in_flight: int = 16,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    max_lease_extension: float = MAX_LEASE_EXTENSION,
    retry: RetryPolicy | None = None,
    advertise: str | None = None,
    security: SecurityConfig | None = None,
    client: MeshClient | None = None,
    delivery_mode: DeliveryMode | str = DeliveryMode.PULL,
    health_port: int = -1,
    wait_for_broker: float = 0.0,
    _together: _Together | None = None,
) -> AgentServer:
    """Serves ``agent``: its own gRPC server on host:port (0 picks one), registered with the
    broker at ``broker`` and subscribed to its queue. Returns once it is ready. With
    ``delivery_mode="push"`` it does not subscribe: the broker calls the agent's server with
    each message queued for it (the server must be reachable from the broker: ``advertise``).
    ``health_port`` (-1: none, 0: any free one) serves its health alone in plaintext beside a
    TLS server, for probes that cannot speak TLS.

    A broker that cannot be reached yet is waited for up to ``wait_for_broker`` seconds, the
    agent's server up meanwhile and its readiness NOT_SERVING; 0 (the default): the start
    fails once the client's retries are spent (`agentmesh agent` waits 60 s).

    Agents of one process given one ``client`` (see :func:`serve_all`) share its stream to
    the broker: what is ready for several of them at once (a broadcast) travels in one
    frame. The caller closes a client it gave, after stopping the agents.

    Its server's health says SERVING for ``mesh.v1.AgentService`` (and ``agentmesh.agents``,
    :data:`AGENTS_SERVICE`) only while the agent takes its messages: readiness.

    A delivery stays leased ``lease_seconds`` unless acknowledged; while a handler still
    works on one, its lease is extended every third of that, for up to
    ``max_lease_extension`` seconds, so that a slow handler is not run twice."""
    _check_agent(agent)
    owns_client = client is None
    if client is None:
        client = MeshClient(broker, agent_id=agent.agent_id, retry=retry, security=security)
    try:
        runtime = AgentRuntime(
            agent,
            client,
            max_in_flight=max_in_flight,
            lease_seconds=lease_seconds,
            max_lease_extension=max_lease_extension,
            delivery_mode=member_named(DeliveryMode, delivery_mode, "delivery_mode"),
        )
        servicer = AgentServicer(runtime)
        server = await start_server(
            lambda s: agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, s),
            [AGENT_SERVICE],
            host=host,
            port=port,
            security=security,
            health_port=health_port,
        )
    except BaseException:  # (a lease that is no time; a port in use)
        if owns_client:
            await client.close()
        raise
    runtime.address = advertise or server.address
    # Its service says SERVING only while the agent takes its messages: from its first
    # subscription (or registration, for push) on, and NOT_SERVING while it has lost its queue
    # (the broker cannot be reached, or forgot it). Readiness takes it out of rotation then
    # (and a rolling update waits for it); its server as a whole, which liveness asks, serves.
    await server.set_service_serving(AGENT_SERVICE, False)
    await server.set_service_serving(AGENTS_SERVICE, False)
    runtime.subscribed_watchers.append(server.follow([AGENT_SERVICE], runtime.subscribed.is_set))
    together = _together or _Together(1)
    together.join(runtime, server)
    try:
        await runtime.start(wait_for_broker)
        async with asyncio.timeout(client.default_timeout):
            await runtime.subscribed.wait()
        # (said here too, not only by the follower task: ready as this returns)
        await server.set_service_serving(AGENT_SERVICE, runtime.subscribed.is_set())
        await together.say(server)
    except BaseException:
        await server.stop(0)
        with contextlib.suppress(Exception):
            await runtime.stop(0)
        if owns_client:
            await client.close()
        raise
    # Not a structured event: the broker logs the registration (category "registry").
    logger.info("agent %s serving on %s", agent.agent_id, server.address)
    return AgentServer(agent, server, runtime, client, owns_client=owns_client, together=together)


class ServedAgents(AsyncOnly):
    """Agents served together by :func:`serve_all`, on one client."""

    def __init__(self, servers: list[AgentServer], client: MeshClient) -> None:
        self.servers = servers
        self.client = client

    def __iter__(self) -> Iterator[AgentServer]:
        return iter(self.servers)

    def __len__(self) -> int:
        return len(self.servers)

    async def stop(self, grace: float = 5.0) -> None:
        """Stops every agent (side by side), then closes their client; the first failure of
        a stop, if any, is raised once all have ended."""
        try:
            outcomes = await asyncio.gather(
                *(server.stop(grace) for server in self.servers), return_exceptions=True
            )
        finally:
            await self.client.close()
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def __aenter__(self) -> ServedAgents:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def serve_all(
    agents: Sequence[Agent],
    broker: str,
    *,
    retry: RetryPolicy | None = None,
    security: SecurityConfig | None = None,
    ports: Sequence[int] = (),
    advertise: Sequence[str | None] = (),
    health_ports: Sequence[int] = (),
    **options: Any,
) -> ServedAgents:
    """Serves several agents in this process, each on its own gRPC server (``ports[i]``, 0
    or missing picks one; ``health_ports[i]``, the port of its plaintext health server, -1 or
    missing none), sharing one client and so one stream to the broker. ``options``
    are those of :func:`serve` (host, max_in_flight, lease_seconds, max_lease_extension,
    delivery_mode, wait_for_broker).

    They start side by side: every server is up (alive, not ready) while the broker is
    waited for. Each says SERVING for ``mesh.v1.AgentService`` while its own agent takes its
    messages, and for ``agentmesh.agents`` (:data:`AGENTS_SERVICE`) while all of them do:
    the readiness of the process. Returns once all are ready; if one cannot start, the
    others are stopped and its error raised."""
    for agent in agents:
        _check_agent(agent)
    client = MeshClient(broker, retry=retry, security=security)
    together = _Together(len(agents))
    # Side by side: each server up at once, each agent waiting for the broker on its own.
    starting = [
        asyncio.create_task(
            serve(
                agent,
                broker,
                port=ports[i] if i < len(ports) else 0,
                advertise=advertise[i] if i < len(advertise) else None,
                health_port=health_ports[i] if i < len(health_ports) else -1,
                security=security,
                client=client,
                _together=together,
                **options,
            ),
            name=f"serve-{agent.agent_id}",
        )
        for i, agent in enumerate(agents)
    ]
    try:
        servers = list(await asyncio.gather(*starting))
    except BaseException:
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        started = [t.result() for t in starting if not t.cancelled() and t.exception() is None]
        await ServedAgents(started, client).stop(0)
        raise
    for server in servers:
        await together.say(server.server)  # (every one ready as this returns)
    return ServedAgents(servers, client)


def run_agents(*agents: Agent, broker: str = "", **options: Any) -> None:
    """Serves ``agents`` (as :func:`serve_all` does, with its options) until Ctrl-C or
    SIGTERM, then stops them gracefully (their servers NOT_SERVING, work in flight finished or
    handed back, deregistered): the whole main of a script that is one or more agents, as
    ``agentmesh agent`` runs them::

        if __name__ == "__main__":
            run_agents(Payment(), broker="127.0.0.1:50051")

    ``broker`` defaults to AGENTMESH_BROKER, else 127.0.0.1:50051. A signal while the broker
    is still waited for (``wait_for_broker``) ends it at once. Runs its own event loop: from
    a coroutine, ``await serve_all(...)`` instead."""
    if not agents:
        raise TypeError("run_agents serves at least one agent: run_agents(MyAgent(), ...)")
    for agent in agents:
        _check_agent(agent)
    target = broker or os.environ.get("AGENTMESH_BROKER") or DEFAULT_BROKER

    async def main() -> None:
        stop = stop_on_signals()
        starting = asyncio.create_task(serve_all(agents, target, **options))
        if not await started_before(starting, stop):
            return
        served = starting.result()
        try:
            await stop.wait()
        finally:
            await served.stop()

    run_loop(main())

"""The message envelope, hand-off payload and agent descriptions (RT-011), as plain data."""

from __future__ import annotations

import abc
import enum
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any

JSON = Any
"""A JSON-compatible value: dict, list, str, int, float, bool or None."""

BROADCAST_TARGET = "broadcast"
"""The to_agent that sends a copy of a message to every other registered agent."""
MAX_DEAD_LETTER_REASON = 1024
"""Characters at most in the reason an agent gives for dead-lettering a delivery."""

HANDOFF_ACTION = "execute_handoff"


class _Named(enum.StrEnum):
    """An enum of names that also takes them in lower or mixed case ("high" is HIGH)."""

    @classmethod
    def _missing_(cls, value: object) -> Any:
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        return None


class MessageType(_Named):
    """What a message is for."""

    REQUEST = "REQUEST"
    RESPONSE = "RESPONSE"
    BROADCAST = "BROADCAST"
    HANDOFF = "HANDOFF"
    ERROR = "ERROR"
    ACK = "ACK"


ANSWER_TYPES = (MessageType.RESPONSE, MessageType.ERROR)
"""The types that answer a message (under its id as their correlation_id): one that answers a
delivery settles it, as its acknowledgement."""


class DeliveryMode(_Named):
    """How an agent takes the messages queued for it."""

    PULL = "PULL"
    """It takes them: a subscription (Subscribe, a Connect session) or ReceiveMessages."""
    PUSH = "PUSH"
    """The broker takes them to it, calling the Agent service of each instance's server."""


class Priority(_Named):
    """Queue priority: HIGH is delivered before MEDIUM, MEDIUM before LOW."""

    HIGH = "HIGH"
    MEDIUM = "MEDIUM"
    LOW = "LOW"

    @property
    def rank(self) -> int:
        """0 for HIGH, 1 for MEDIUM, 2 for LOW (RT-011 priority_levels)."""
        return _PRIORITY_RANK[self]


_PRIORITY_RANK = {Priority.HIGH: 0, Priority.MEDIUM: 1, Priority.LOW: 2}


class EncodedContent(Mapping[str, JSON]):
    """A message's content still in the form it arrived in, read as a mapping and decoded only
    as far as it is read. The broker routes most messages reading no more than
    ``content.action``; it keeps their contents this way and writes them out as they came in.
    The codec supplies the concrete form (:class:`mesh.codec.WireContent`)."""

    __slots__ = ()

    @abc.abstractmethod
    def value_kind(self, key: str) -> str | None:
        """The JSON kind of content[key] ("object", "array", "string", "number", "boolean"
        or "null") without decoding it; None when the key is absent."""

    @abc.abstractmethod
    def to_dict(self) -> dict[str, JSON]:
        """The content decoded in full, as plain JSON values."""

    def __repr__(self) -> str:
        return repr(self.to_dict())


def plain_content(content: Mapping[str, JSON] | None) -> dict[str, JSON] | None:
    """Content as a plain dict (for JSON), whatever form it is held in."""
    if content is None or isinstance(content, dict):
        return content
    if isinstance(content, EncodedContent):
        return content.to_dict()
    return dict(content)


def is_number(value: object) -> bool:
    """Whether a caller's ``value`` is a number (seconds, a share, a step) at all: an int or
    a float, not a bool, and not a "5"."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def new_message_id() -> str:
    """A fresh message id: a random UUID (version 4) in its usual text form, made without
    building a uuid.UUID (half the cost, and every message needs one)."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def utc_now() -> datetime:
    return datetime.now(UTC)


def due_in(deliver_at: datetime) -> float:
    """Seconds from now until ``deliver_at`` (a naive time taken as UTC); 0 once it is past."""
    if deliver_at.tzinfo is None:
        deliver_at = deliver_at.replace(tzinfo=UTC)
    return max(0.0, (deliver_at - utc_now()).total_seconds())


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """The envelope every agent exchange travels in.

    ``content`` is a dict with ``action`` (required except on BROADCAST), ``parameters``,
    ``context`` and ``previous_result``; ``None`` means the content is missing, which the broker
    refuses. (Inside the broker it may be an :class:`EncodedContent`, a mapping read in place.)
    ``ttl`` is in seconds; 0 means the broker's default. ``deliver_at`` (aware UTC): not
    delivered before then (a scheduled message); None means at once.
    """

    from_agent: str
    to_agent: str
    content: Mapping[str, JSON] | None
    message_type: MessageType = MessageType.REQUEST
    message_id: str = field(default_factory=new_message_id)
    timestamp: datetime = field(default_factory=utc_now)
    metadata: dict[str, JSON] = field(default_factory=dict)
    correlation_id: str = ""
    priority: Priority = Priority.MEDIUM
    ttl: int = 0
    reply_to: str = ""
    ack_required: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    deliver_at: datetime | None = None
    encoded: object = field(default=None, init=False, repr=False, compare=False)
    """The message in the form it arrived in, when the codec kept it (the broker does): passed
    on unchanged, it is written out in one copy. A copy (:meth:`evolve`, :meth:`copy_to`)
    that changes only the envelope's scalar fields (:data:`RESTAMPED`) keeps it, as
    :class:`EncodedBefore`: one copy, those fields written over it; one that changes anything
    else has none and is encoded field by field."""

    @property
    def action(self) -> str:
        """content["action"], or "" when absent."""
        if self.content is None:
            return ""
        action = self.content.get("action", "")
        return action if isinstance(action, str) else ""

    @property
    def parameters(self) -> dict[str, JSON]:
        """content["parameters"], or an empty dict."""
        return _as_dict((self.content or {}).get("parameters"))

    @property
    def handoff(self) -> Handoff | None:
        """The hand-off payload of a HANDOFF message, else None."""
        if self.message_type is not MessageType.HANDOFF:
            return None
        return Handoff.from_message(self)

    @property
    def reply_target(self) -> str:
        """Where answers to this message go: reply_to when set, else the sender."""
        return self.reply_to or self.from_agent

    def copy_to(self, to_agent: str, **changes: Any) -> Message:
        """The same message addressed to another agent (broadcast copies keep the id)."""
        changes["to_agent"] = to_agent
        return self.evolve(**changes)

    def evolve(self, **changes: Any) -> Message:
        """A copy with some fields changed (a field the message does not have is a
        TypeError). On the broker's path for every request and every broadcast copy: built
        slot by slot, not through dataclasses.replace and __init__ (half the time)."""
        if not changes.keys() <= _INIT_FIELDS:
            return replace(self, **changes)  # (which says what is wrong)
        copy = _new_message(Message)
        for name, get, put in _SLOTS:
            put(copy, changes[name] if name in changes else get(self))
        encoded = self.encoded
        if encoded is not None:
            if not changes.keys() <= RESTAMPED:
                encoded = None
            elif encoded.__class__ is not EncodedBefore:
                encoded = EncodedBefore(encoded)
        _put_encoded(copy, encoded)
        return copy

    def to_dict(self) -> dict[str, JSON]:
        """The JSON form of RT-011, with the timestamp in ISO 8601."""
        return {
            "message_id": self.message_id,
            "from_agent": self.from_agent,
            "to_agent": self.to_agent,
            "message_type": self.message_type.value,
            "content": plain_content(self.content),
            "timestamp": self.timestamp.isoformat(),
            "metadata": self.metadata,
            "correlation_id": self.correlation_id or None,
            "priority": self.priority.value,
            "ttl": self.ttl or None,
            "reply_to": self.reply_to or None,
            "ack_required": self.ack_required,
            "headers": self.headers,
            **({"deliver_at": self.deliver_at.isoformat()} if self.deliver_at else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, JSON]) -> Message:
        """Reads the JSON form back; missing optional fields take their defaults."""
        timestamp = data.get("timestamp")
        deliver_at = data.get("deliver_at")
        return cls(
            message_id=str(data.get("message_id") or new_message_id()),
            from_agent=str(data.get("from_agent") or ""),
            to_agent=str(data.get("to_agent") or ""),
            message_type=MessageType(data.get("message_type") or "REQUEST"),
            content=data.get("content"),
            timestamp=datetime.fromisoformat(timestamp) if timestamp else utc_now(),
            metadata=dict(data.get("metadata") or {}),
            correlation_id=str(data.get("correlation_id") or ""),
            priority=Priority(data.get("priority") or "MEDIUM"),
            ttl=int(data.get("ttl") or 0),
            reply_to=str(data.get("reply_to") or ""),
            ack_required=bool(data.get("ack_required", False)),
            headers={str(k): str(v) for k, v in dict(data.get("headers") or {}).items()},
            deliver_at=datetime.fromisoformat(str(deliver_at)) if deliver_at else None,
        )


RESTAMPED = frozenset(
    {
        "message_id",
        "from_agent",
        "to_agent",
        "message_type",
        "correlation_id",
        "priority",
        "ttl",
        "reply_to",
        "ack_required",
    }
)
"""The envelope's scalar fields: a copy that changes only these keeps the encoded form of the
message it was made from (as :class:`EncodedBefore`), and the codec writes them from the
message over it."""


@dataclass(frozen=True, slots=True)
class EncodedBefore:
    """:attr:`Message.encoded` of a copy: the encoded form of the message it was made from,
    right in every field but the :data:`RESTAMPED` ones."""

    encoded: object


_INIT_FIELD_ORDER = tuple(f.name for f in fields(Message) if f.init)
_INIT_FIELDS = frozenset(_INIT_FIELD_ORDER)
_new_message = object.__new__
# Each field's slot, read and written through its descriptor: what a frozen dataclass's
# __init__ does with object.__setattr__ by name, at under half the cost.
_SLOTS = tuple(
    (name, getattr(Message, name).__get__, getattr(Message, name).__set__)
    for name in _INIT_FIELD_ORDER
)
(
    _put_from,
    _put_to,
    _put_content,
    _put_type,
    _put_id,
    _put_time,
    _put_metadata,
    _put_correlation,
    _put_priority,
    _put_ttl,
    _put_reply_to,
    _put_ack,
    _put_headers,
    _put_deliver_at,
    _put_encoded,
) = (
    getattr(Message, name).__set__
    for name in (
        "from_agent",
        "to_agent",
        "content",
        "message_type",
        "message_id",
        "timestamp",
        "metadata",
        "correlation_id",
        "priority",
        "ttl",
        "reply_to",
        "ack_required",
        "headers",
        "deliver_at",
        "encoded",
    )
)


def assemble_message(
    from_agent: str,
    to_agent: str,
    content: Mapping[str, JSON] | None,
    message_type: MessageType,
    message_id: str,
    timestamp: datetime,
    metadata: dict[str, JSON],
    correlation_id: str,
    priority: Priority,
    ttl: int,
    reply_to: str,
    ack_required: bool,
    headers: dict[str, str],
    deliver_at: datetime | None = None,
    encoded: object = None,
) -> Message:
    """A Message from every one of its fields, as a decoder has them: what ``Message(...)``
    builds, without resolving defaults and keywords (a third of the cost, on the path of every
    message the broker takes in)."""
    message = _new_message(Message)
    _put_from(message, from_agent)
    _put_to(message, to_agent)
    _put_content(message, content)
    _put_type(message, message_type)
    _put_id(message, message_id)
    _put_time(message, timestamp)
    _put_metadata(message, metadata)
    _put_correlation(message, correlation_id)
    _put_priority(message, priority)
    _put_ttl(message, ttl)
    _put_reply_to(message, reply_to)
    _put_ack(message, ack_required)
    _put_headers(message, headers)
    _put_deliver_at(message, deliver_at)
    _put_encoded(message, encoded)
    return message


def receipt_of(message: Message) -> Message:
    """RF-009's acknowledgement of receipt: the ACK a message sent with ``ack_required`` brings
    its sender when it first reaches its agent, from that agent, under the message's id."""
    return Message(
        from_agent=message.to_agent,
        to_agent=message.from_agent,
        message_type=MessageType.ACK,
        content={"action": "ack", "acknowledged_message_id": message.message_id},
        correlation_id=message.message_id,
        priority=Priority.HIGH,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Handoff:
    """The hand-off payload (RT-011 hand-off protocol)."""

    task_description: str
    context: dict[str, JSON] = field(default_factory=dict)
    previous_result: JSON = None
    constraints: dict[str, JSON] = field(default_factory=dict)
    workflow_id: str = ""
    step_number: int = 0

    @property
    def context_size_kb(self) -> float:
        """Size of the context as UTF-8 JSON, in KiB (logged with every hand-off)."""
        return context_size_kb(self.context)

    def to_content(self) -> dict[str, JSON]:
        """The content of the HANDOFF message that carries this payload."""
        return {
            "action": HANDOFF_ACTION,
            "parameters": {
                "task_description": self.task_description,
                "context": self.context,
                "previous_result": self.previous_result,
                "constraints": self.constraints,
            },
        }

    def to_metadata(self) -> dict[str, JSON]:
        return {"workflow_id": self.workflow_id, "step_number": self.step_number}

    @classmethod
    def from_message(cls, message: Message) -> Handoff:
        params = message.parameters
        meta = message.metadata
        step = meta.get("step_number", meta.get("handoff_step", 0))
        return cls(
            task_description=str(params.get("task_description") or ""),
            context=_as_dict(params.get("context")),
            previous_result=params.get("previous_result"),
            constraints=_as_dict(params.get("constraints")),
            workflow_id=str(meta.get("workflow_id") or ""),
            step_number=int(step) if isinstance(step, int | float) else 0,
        )


def _as_dict(value: JSON | Mapping[str, JSON]) -> dict[str, JSON]:
    """An object as a dict (any other mapping copied into one); {} for anything else."""
    if isinstance(value, dict):
        return value
    return dict(value) if isinstance(value, Mapping) else {}


def context_size_kb(context: JSON) -> float:
    """Size of a JSON value encoded as UTF-8, in KiB."""
    encoded = json.dumps(context, separators=(",", ":"), default=str).encode("utf-8")
    return round(len(encoded) / 1024, 3)


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentInfo:
    """A registered agent: id, types (for selective broadcast), address and capabilities."""

    agent_id: str
    agent_types: tuple[str, ...] = ()
    address: str = ""
    capabilities: tuple[str, ...] = ()
    registered_at: datetime | None = None
    instances: tuple[str, ...] = ()
    """The addresses of the processes serving the agent (sharing its queue), the latest
    registered last: kept by the registry, so that one leaving does not take the agent off
    the mesh while the others serve it."""
    subscribed: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Instance address -> the subscription that names it as its subscriber (the latest
    opened): when that subscription's stream is lost, the instance is taken off. Kept by the
    broker and its stores; not part of the contract's AgentInfo."""
    lost_at: datetime | None = field(default=None, compare=False)
    """When its last instance was lost (its process died without deregistering), while no
    instance serves it since; None otherwise (also for an agent that never named one)."""
    delivery_mode: DeliveryMode = DeliveryMode.PULL
    """The latest registration's: PUSH, the broker calls ``HandleMessage`` on the server of
    the instance it registered (each instance keeps its own: ``pushed``)."""
    max_in_flight: int = 0
    """PUSH: the calls in flight to one instance at most (0: a subscription's default)."""
    pushed: Mapping[str, int] = field(default_factory=dict)
    """Instance address -> its calls in flight at most (0: a subscription's default), for
    each instance registered with PUSH: the broker calls their servers, the other instances
    pull. Kept by the registry (an instance registering to pull does not stop the pushes to
    the others); the contract shows the addresses (``push_instances``)."""
    required_fields: tuple[str, ...] = ()
    """Content keys every REQUEST and HANDOFF sent to the agent must carry (besides
    ``action``): the broker refuses one that lacks any (RF-009 scenario 18)."""

    @property
    def push_instances(self) -> tuple[str, ...]:
        """The instances the broker pushes to, in the order of ``instances``."""
        return tuple(a for a in self.instances if a in self.pushed)

    def to_dict(self) -> dict[str, JSON]:
        """The JSON form (the durable and Redis stores keep registrations this way)."""
        return {
            "agent_id": self.agent_id,
            "agent_types": list(self.agent_types),
            "address": self.address,
            "capabilities": list(self.capabilities),
            "registered_at": self.registered_at.isoformat() if self.registered_at else None,
            "instances": list(self.instances),
            "subscribed": dict(self.subscribed),
            "lost_at": self.lost_at.isoformat() if self.lost_at else None,
            "delivery_mode": self.delivery_mode.value,
            "max_in_flight": self.max_in_flight,
            "pushed": dict(self.pushed),
            "required_fields": list(self.required_fields),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, JSON]) -> AgentInfo:
        when = data.get("registered_at")
        instances = tuple(str(i) for i in data.get("instances") or ())
        mode = DeliveryMode(data.get("delivery_mode") or DeliveryMode.PULL)
        most = int(str(data.get("max_in_flight") or 0))
        if isinstance(kept := data.get("pushed"), dict):
            pushed = {str(a): int(str(n)) for a, n in kept.items()}
        else:  # (kept before each instance had its own delivery: the agent's, for all)
            pushed = dict.fromkeys(instances, most) if mode is DeliveryMode.PUSH else {}
        return cls(
            agent_id=str(data["agent_id"]),
            agent_types=tuple(str(t) for t in data.get("agent_types") or ()),
            address=str(data.get("address") or ""),
            capabilities=tuple(str(c) for c in data.get("capabilities") or ()),
            registered_at=datetime.fromisoformat(str(when)) if when else None,
            instances=instances,
            subscribed={str(a): str(s) for a, s in subscribed.items()}
            if isinstance(subscribed := data.get("subscribed"), dict)
            else {},
            lost_at=datetime.fromisoformat(str(lost)) if (lost := data.get("lost_at")) else None,
            delivery_mode=mode,
            max_in_flight=most,
            pushed=pushed,
            required_fields=tuple(str(f) for f in data.get("required_fields") or ()),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Tool:
    """A tool an agent may use."""

    name: str
    description: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentCard:
    """What an agent says about itself."""

    agent_id: str
    agent_types: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    tools: tuple[Tool, ...] = ()
    description: str = ""
    actions: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Delivery:
    """A message pushed to a subscriber, leased until acked."""

    message: Message
    attempt: int
    lease_expires_at: datetime | None = None
    max_attempts: int = 0
    """How many deliveries the broker makes in all (the one whose attempt this is, failing,
    goes to the dead-letter queue); 0 when the broker did not say."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that exhausted its delivery attempts."""

    message: Message
    reason: str
    attempts: int
    dead_lettered_at: datetime


class QueuedState(_Named):
    """Where a message its queue holds is."""

    WAITING = "WAITING"
    """Waiting for its delivery (or for another, after it was given back)."""
    IN_FLIGHT = "IN_FLIGHT"
    """Delivered, not acknowledged yet: back in the queue when its lease ends."""
    DEFERRED = "DEFERRED"
    """Nacked with a delay (a handler's RetryLater): held by nobody until it comes back."""


@dataclass(frozen=True, slots=True)
class QueuedMessage:
    """A message its agent's queue holds, as a listing of the queue shows it."""

    message: Message
    attempts: int
    """How many times it was delivered (the one in flight included); 0: never."""
    accepted_at: datetime
    expires_at: datetime
    """When its ttl ends: it is never delivered after that."""
    state: QueuedState = QueuedState.WAITING
    until: datetime | None = None
    """In flight: when its lease ends; deferred: when it comes back; None while waiting."""

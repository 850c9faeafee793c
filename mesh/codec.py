"""Protobuf <-> domain conversion for the mesh.v1 contract; the only place that does it."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, date, datetime, timedelta
from datetime import time as dt_time
from decimal import Decimal
from typing import Any, TypeVar, cast

from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2

from mesh.core.errors import FieldViolation, MeshError, MessageValidationError, error_class_for
from mesh.core.model import (
    BROADCAST_TARGET,
    JSON,
    AgentCard,
    AgentInfo,
    DeadLetter,
    Delivery,
    DeliveryMode,
    EncodedBefore,
    EncodedContent,
    Handoff,
    Message,
    MessageType,
    Priority,
    QueuedMessage,
    QueuedState,
    Tool,
    assemble_message,
    new_message_id,
    utc_now,
)
from mesh.v1 import broker_pb2, message_pb2

# gRPC status codes by name, as numbers; kept here so that the codec needs no grpc import.
STATUS_CODES = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5, "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9, "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12,
    "INTERNAL": 13, "UNAVAILABLE": 14, "DATA_LOSS": 15, "UNAUTHENTICATED": 16,
}  # fmt: skip
STATUS_NAMES = {number: name for name, number in STATUS_CODES.items()}

_TYPE_TO_PB: dict[MessageType, Any] = {
    MessageType.REQUEST: message_pb2.MESSAGE_TYPE_REQUEST,
    MessageType.RESPONSE: message_pb2.MESSAGE_TYPE_RESPONSE,
    MessageType.BROADCAST: message_pb2.MESSAGE_TYPE_BROADCAST,
    MessageType.HANDOFF: message_pb2.MESSAGE_TYPE_HANDOFF,
    MessageType.ERROR: message_pb2.MESSAGE_TYPE_ERROR,
    MessageType.ACK: message_pb2.MESSAGE_TYPE_ACK,
}
_TYPE_FROM_PB: dict[int, MessageType] = {v: k for k, v in _TYPE_TO_PB.items()}
_PRIORITY_TO_PB: dict[Priority, Any] = {
    Priority.HIGH: message_pb2.PRIORITY_HIGH,
    Priority.MEDIUM: message_pb2.PRIORITY_MEDIUM,
    Priority.LOW: message_pb2.PRIORITY_LOW,
}
_PRIORITY_FROM_PB: dict[int, Priority] = {v: k for k, v in _PRIORITY_TO_PB.items()}
_DELIVERY_TO_PB: dict[DeliveryMode, Any] = {
    DeliveryMode.PULL: message_pb2.DELIVERY_MODE_PULL,
    DeliveryMode.PUSH: message_pb2.DELIVERY_MODE_PUSH,
}
_DELIVERY_FROM_PB: dict[int, DeliveryMode] = {v: k for k, v in _DELIVERY_TO_PB.items()}

K = TypeVar("K")

_MAX_SAFE_INT = 2**53


# -- JSON values ---------------------------------------------------------------------------


def value_to_python(value: struct_pb2.Value) -> JSON:
    """A protobuf Value as plain Python; whole numbers come back as int, as JSON would."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":  # (the kinds most often met first)
        return value.string_value
    if kind == "number_value":
        number = value.number_value
        if number.is_integer() and -_MAX_SAFE_INT < number < _MAX_SAFE_INT:
            return int(number)
        return number  # (also what is not finite: is_integer() is False for those)
    if kind == "struct_value":
        return struct_to_dict(value.struct_value)
    if kind == "list_value":
        return [value_to_python(v) for v in value.list_value.values]
    if kind == "bool_value":
        return value.bool_value
    return None


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, JSON]:
    # Keys, then lookups: both in C. (The map's items() is the Python mixin's, a generator.)
    fields = struct.fields
    return {key: value_to_python(fields[key]) for key in fields}


def encode_value(data: JSON, out: struct_pb2.Value, field: str) -> None:
    """:func:`python_to_value` for a JSON value a caller gives (a state entry's value): text
    UTF-8 cannot write is a MessageValidationError that says where."""
    try:
        python_to_value(data, out)
    except UnicodeEncodeError:
        raise _not_text(_not_text_within(data, field) or field) from None


def encode_struct(data: Mapping[str, JSON], out: struct_pb2.Struct, field: str) -> None:
    """:func:`dict_to_struct` for a JSON object a caller gives (a tool's arguments), as
    :func:`encode_value`."""
    try:
        dict_to_struct(data, out)
    except UnicodeEncodeError:
        raise _not_text(_not_text_within(data, field) or field) from None


def _not_json(number: float | Decimal) -> MessageValidationError:
    return MessageValidationError.for_field(
        "content", f"{number!r} is not a number JSON can write (NaN and Infinity are not)"
    )


def _not_exact(number: int) -> MessageValidationError:
    digits = len(str(abs(number)))
    told = str(number) if digits <= 30 else f"of {digits} digits"
    return MessageValidationError.for_field(
        "content",
        f"the integer {told} is beyond what a JSON number carries exactly "
        "(+/-(2**53 - 1)): send it as a string",
    )


MAX_ANSWER_DEPTH = 25
"""How deep an agent's answer may nest (objects and lists in one another). The broker reads a
frame to 84 of protobuf's levels and an object takes three: deeper content is a frame it
cannot read, and an answer it cannot read reaches nobody. The SDK refuses it first, so that
the requester is told why (the Node.js client keeps the same limit)."""


_SCALARS = frozenset({str, int, float, bool, type(None)})


def check_depth(content: JSON, field: str = "content", limit: int = MAX_ANSWER_DEPTH) -> None:
    """MessageValidationError when ``content`` nests more than ``limit`` levels (a circular
    one does too): objects (any mapping, a dataclass) and lists count, whatever they hold."""
    level = [content]
    for _ in range(limit):
        below: list[Any] = []
        for value in level:
            kind = type(value)
            if kind is dict or (kind is not list and isinstance(value, Mapping)):
                items: Any = value.values()
            elif kind is list or isinstance(value, tuple):
                items = value
            elif (fields := _dataclass_fields(value)) is not None:
                items = [getattr(value, name) for name in fields]
            else:
                continue
            for item in items:
                kind = type(item)
                if (kind is dict or kind is list) or (
                    kind not in _SCALARS
                    and (
                        isinstance(item, Mapping | list | tuple)
                        or hasattr(kind, "__dataclass_fields__")
                    )
                ):
                    below.append(item)
        if not below:
            return
        level = below
    raise MessageValidationError.for_field(
        field, f"{field} nests more than {limit} levels deep (is it circular?)"
    )


def python_to_value(data: JSON, out: struct_pb2.Value) -> None:
    # The exact types JSON decodes to are told apart by identity (one test each, bool apart
    # from int); subclasses and other sequences take the general path. NaN and Infinity are
    # refused here, where a JSON value is made: protobuf would carry them, but no client
    # reading JSON could read what holds one; and so is an integer a double (what a JSON
    # number is, in protobuf and in JavaScript) would round: it would arrive changed.
    kind = type(data)
    if kind is str:
        out.string_value = data
    elif kind is int:
        if not -_MAX_SAFE_INT < data < _MAX_SAFE_INT:
            raise _not_exact(data)
        out.number_value = data
    elif kind is float:
        if data - data != 0.0:  # (NaN or an infinity; a call to isfinite costs more)
            raise _not_json(data)
        out.number_value = data
    elif kind is bool:
        out.bool_value = data
    elif kind is dict:
        dict_to_struct(data, out.struct_value)
    elif data is None:
        out.null_value = struct_pb2.NULL_VALUE
    elif isinstance(data, int):  # (an IntEnum; bool has no subclasses: it was told above)
        if not -_MAX_SAFE_INT < data < _MAX_SAFE_INT:
            raise _not_exact(int(data))
        out.number_value = int(data)
    elif isinstance(data, float):
        if not math.isfinite(data):
            raise _not_json(float(data))
        out.number_value = float(data)
    elif isinstance(data, str):
        out.string_value = data
    elif isinstance(data, Mapping):  # (a dict subclass, a read-only view, a WireContent)
        dict_to_struct(data, out.struct_value)
    elif isinstance(data, list | tuple):
        values = out.list_value.values
        out.list_value.SetInParent()
        for item in data:
            python_to_value(item, values.add())
    elif isinstance(data, datetime | date | dt_time):
        out.string_value = data.isoformat()  # ISO 8601, as the message's own timestamp
    elif isinstance(data, Decimal):
        number = float(data)  # (a finite Decimal past a double's range is an infinity)
        if not math.isfinite(number):
            raise _not_json(data)
        out.number_value = number
    elif isinstance(data, bytes | bytearray | memoryview | set | frozenset):
        raise MessageValidationError.for_field(
            "content",
            f"{type(data).__name__} is not a JSON value: send "
            + ("a list" if isinstance(data, set | frozenset) else "its base64 text"),
        )
    elif isinstance(data, enum.Enum):
        python_to_value(data.value, out)  # (as orjson and FastAPI write one: its value)
    elif (fields := _dataclass_fields(data)) is not None:
        dict_to_struct({name: getattr(data, name) for name in fields}, out.struct_value)
    elif callable(dump := getattr(data, "model_dump", None)):
        python_to_value(dump(mode="json"), out)  # (a pydantic model: its JSON, as it says it)
    else:
        out.string_value = str(data)  # (a UUID, a path: their text)


def _dataclass_fields(data: object) -> Iterable[str] | None:
    """The field names of a dataclass instance (an object, as orjson and FastAPI write one,
    not its repr; its ClassVar and InitVar pseudo-fields are none), else None."""
    if isinstance(data, type) or not hasattr(type(data), "__dataclass_fields__"):
        return None
    return [f.name for f in dataclasses.fields(data)]  # type: ignore[arg-type]


def dict_to_struct(data: Mapping[str, JSON], out: struct_pb2.Struct) -> None:
    if isinstance(data, WireContent):
        out.CopyFrom(data.struct)  # as it came in: one copy, not one call per value
        return
    out.SetInParent()
    fields = out.fields
    for key, item in data.items():
        name = key if type(key) is str else str(key)
        kind = type(item)  # strings and numbers, the most met, set here without a call
        if kind is str:
            fields[name].string_value = item
        elif (kind is int and -_MAX_SAFE_INT < item < _MAX_SAFE_INT) or (
            kind is float and item - item == 0.0
        ):
            fields[name].number_value = item
        else:
            python_to_value(item, fields[name])


_JSON_KINDS: dict[str | None, str] = {
    "struct_value": "object",
    "list_value": "array",
    "string_value": "string",
    "number_value": "number",
    "bool_value": "boolean",
    "null_value": "null",
    None: "null",  # (a Value with no kind set reads as null)
}


class WireContent(EncodedContent):
    """Content as it came off the wire: a copy of its Struct (so that a queued message keeps
    no frame alive), read key by key in place. A scalar read (``action``) decodes that value
    alone; reading an object or list decodes the whole content once and keeps it; written
    out again, the Struct is copied back in one call."""

    __slots__ = ("_decoded", "_fields", "struct")

    def __init__(self, struct: struct_pb2.Struct, *, copy: bool = True) -> None:
        if copy:
            self.struct = struct_pb2.Struct()
            self.struct.CopyFrom(struct)
        else:  # a Struct of a message the caller copied already
            self.struct = struct
        self._fields = self.struct.fields  # (read once: each .fields costs a lookup)
        self._decoded: dict[str, JSON] | None = None

    def value_kind(self, key: str) -> str | None:
        value = self._fields.get(key)
        return None if value is None else _JSON_KINDS[value.WhichOneof("kind")]

    def to_dict(self) -> dict[str, JSON]:
        if self._decoded is None:
            self._decoded = struct_to_dict(self.struct)
        return self._decoded

    def __getitem__(self, key: str) -> JSON:
        if self._decoded is not None:
            return self._decoded[key]
        fields = self._fields
        if key not in fields:
            raise KeyError(key)
        value = fields[key]
        if value.WhichOneof("kind") in ("struct_value", "list_value"):
            return self.to_dict()[key]
        return value_to_python(value)

    def get(self, key: str, default: JSON = None) -> JSON:
        if self._decoded is not None:
            return self._decoded.get(key, default)
        fields = self._fields
        if key not in fields:
            return default
        value = fields[key]
        kind = value.WhichOneof("kind")
        if kind == "string_value":
            return value.string_value
        if kind in ("struct_value", "list_value"):
            return self.to_dict()[key]
        return value_to_python(value)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


# -- time ----------------------------------------------------------------------------------


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


TIMESTAMP_SECONDS = (-62_135_596_800, 253_402_300_799)
"""What a Timestamp may hold (google/protobuf/timestamp.proto): 0001-01-01T00:00:00Z to
9999-12-31T23:59:59Z, nanos from 0 to 999,999,999."""


def timestamp_to_datetime(ts: timestamp_pb2.Timestamp, field: str = "timestamp") -> datetime:
    """Exact to the microsecond, and cheaper than Timestamp.ToDatetime on the hot path. One
    out of a Timestamp's range is the sender's mistake: MessageValidationError on ``field``."""
    seconds, nanos = ts.seconds, ts.nanos
    if not (TIMESTAMP_SECONDS[0] <= seconds <= TIMESTAMP_SECONDS[1] and 0 <= nanos <= 999_999_999):
        raise MessageValidationError.for_field(
            field,
            f"{field} must be from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999999Z"
            f" (seconds {seconds}, nanos {nanos})",
        )
    # (days, seconds, microseconds) by position: keywords cost twice as much here.
    return EPOCH + timedelta(0, seconds, nanos // 1000)


def datetime_to_timestamp(dt: datetime, out: timestamp_pb2.Timestamp) -> None:
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)  # naive times are taken as UTC
    delta = dt - EPOCH
    out.seconds = delta.days * 86_400 + delta.seconds
    out.nanos = delta.microseconds * 1000


def duration_seconds(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


def timeout_seconds(pb: Any, field: str = "timeout") -> float | None:
    """The optional Duration a caller gives as how long to wait, in seconds (None when
    unset); a negative one is the caller's mistake: MessageValidationError on ``field``."""
    if not pb.HasField(field):
        return None
    seconds = duration_seconds(getattr(pb, field))
    if seconds < 0:
        raise MessageValidationError.for_field(field, f"{field} must not be negative")
    return seconds


def seconds_to_duration(seconds: float, out: duration_pb2.Duration) -> None:
    whole = math.floor(seconds)
    out.seconds = whole
    out.nanos = round((seconds - whole) * 1e9)


# -- messages ------------------------------------------------------------------------------


def message_from_pb(
    pb: message_pb2.Message, *, in_place: bool = False, strict: bool = False
) -> Message:
    """Decodes an envelope; an empty message_id or timestamp is assigned here. ``in_place``
    keeps a copy of the envelope as it came in (:attr:`Message.encoded`, content read in place
    through :class:`WireContent`): for the broker, which passes messages on without reading
    more than their action, and so writes them out again in one copy. ``strict``, for
    servers taking messages in, refuses a message_type or priority number the contract does
    not define; a client reading what a (newer) broker delivers takes it as unset instead."""
    known_type = _TYPE_FROM_PB.get(pb.message_type)
    known_priority = _PRIORITY_FROM_PB.get(pb.priority)
    named = known_type is not None and known_priority is not None
    if known_type is None or known_priority is None:
        message_type, priority = _known_enums(pb, strict)
    else:
        message_type, priority = known_type, known_priority
    if in_place:
        wire = message_pb2.Message()
        wire.CopyFrom(pb)  # so that a queued message keeps no frame alive
        message = _message_from_pb(pb, message_type, priority, wire)
        # The copy says what the message says: assigned id and time, unset enums named.
        if not pb.message_id:
            wire.message_id = message.message_id
        if not pb.HasField("timestamp"):
            datetime_to_timestamp(message.timestamp, wire.timestamp)
        if not named:
            wire.message_type = _TYPE_TO_PB[message_type]
            wire.priority = _PRIORITY_TO_PB[priority]
        return message
    return _message_from_pb(pb, message_type, priority, None)


def _message_from_pb(
    pb: message_pb2.Message,
    message_type: MessageType,
    priority: Priority,
    wire: message_pb2.Message | None,
) -> Message:
    if not pb.HasField("content"):
        content: Mapping[str, JSON] | None = None
    elif wire is not None:
        content = WireContent(wire.content, copy=False)
    else:
        content = struct_to_dict(pb.content)
    headers = pb.headers  # (read key by key: a third of what dict() of the map costs)
    return assemble_message(
        pb.from_agent,
        pb.to_agent,
        content,
        message_type,
        pb.message_id or new_message_id(),
        timestamp_to_datetime(pb.timestamp) if pb.HasField("timestamp") else utc_now(),
        struct_to_dict(pb.metadata) if pb.HasField("metadata") else {},
        pb.correlation_id,
        priority,
        pb.ttl,
        pb.reply_to,
        pb.ack_required,
        {key: headers[key] for key in headers} if headers else {},
        timestamp_to_datetime(pb.deliver_at, "deliver_at") if pb.HasField("deliver_at") else None,
        wire,
    )


def _known_enums(pb: message_pb2.Message, strict: bool) -> tuple[MessageType, Priority]:
    """The type and priority of an envelope where one is unset (REQUEST, or BROADCAST for a
    message to "broadcast"; MEDIUM) or a number this contract does not define (``strict``:
    refused, so that a message is not taken for something else)."""
    violations = [
        _undefined(field_name, number, known)
        for field_name, number, known in (
            ("message_type", pb.message_type, _TYPE_FROM_PB),
            ("priority", pb.priority, _PRIORITY_FROM_PB),
        )
        if number and number not in known
    ]
    if violations and strict:
        raise MessageValidationError.from_violations(violations)
    kind = _TYPE_FROM_PB.get(pb.message_type)
    if kind is None:
        kind = MessageType.BROADCAST if pb.to_agent == BROADCAST_TARGET else MessageType.REQUEST
    return kind, _PRIORITY_FROM_PB.get(pb.priority, Priority.MEDIUM)


def _undefined(field_name: str, number: int, known: Mapping[int, Any]) -> FieldViolation:
    names = ", ".join(f"{kind.value}={n}" for n, kind in known.items())
    return FieldViolation(field_name, f"{field_name} {number} is not defined (known: {names})")


def message_size(message: Message) -> int:
    """The bytes of a message on the wire (what it came in as, when the codec kept it)."""
    encoded = message.encoded
    if encoded.__class__ is message_pb2.Message:
        return encoded.ByteSize()
    return message_to_pb(message).ByteSize()


def message_to_pb(message: Message, out: message_pb2.Message | None = None) -> message_pb2.Message:
    pb = message_pb2.Message() if out is None else out
    encoded = message.encoded
    if encoded.__class__ is message_pb2.Message:  # unchanged since it came in: one copy
        pb.CopyFrom(encoded)
        return pb
    if encoded.__class__ is EncodedBefore:
        # A copy of a message that came in, changed in its scalar fields only (a request's
        # type and correlation, a broadcast copy's to_agent...): one copy, and those fields.
        pb.CopyFrom(cast(message_pb2.Message, encoded.encoded))
        pb.message_id = message.message_id
        pb.from_agent = message.from_agent
        pb.to_agent = message.to_agent
        pb.message_type = _TYPE_TO_PB[message.message_type]
        pb.correlation_id = message.correlation_id
        pb.priority = _PRIORITY_TO_PB[message.priority]
        pb.ttl = message.ttl
        pb.reply_to = message.reply_to
        pb.ack_required = message.ack_required
        return pb
    try:
        pb.message_id = message.message_id
        pb.from_agent = message.from_agent
        pb.to_agent = message.to_agent
        pb.message_type = _TYPE_TO_PB[message.message_type]
        if message.content is not None:
            dict_to_struct(_an_object(message.content, "content"), pb.content)
        datetime_to_timestamp(message.timestamp, pb.timestamp)
        if message.metadata:
            dict_to_struct(_an_object(message.metadata, "metadata"), pb.metadata)
        pb.correlation_id = message.correlation_id
        pb.priority = _PRIORITY_TO_PB[message.priority]
        pb.ttl = message.ttl
        pb.reply_to = message.reply_to
        pb.ack_required = message.ack_required
        headers = pb.headers
        for key, value in message.headers.items():
            try:
                headers[key] = value
            except TypeError:
                raise MessageValidationError.for_field(
                    "headers", f"headers must map strings to strings, not {key!r}: {value!r}"
                ) from None
        if message.deliver_at is not None:
            datetime_to_timestamp(message.deliver_at, pb.deliver_at)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError):
        raise _misfilled(message) from None
    except RecursionError:  # (content that holds itself, or nests past Python's own limit)
        raise MessageValidationError.for_field(
            "content", "content nests too deep to encode (is it circular?)"
        ) from None
    return pb


_ENVELOPE_KINDS: tuple[tuple[str, tuple[type, ...], str], ...] = (
    ("message_id", (str,), "a string"),
    ("from_agent", (str,), "a string"),
    ("to_agent", (str,), "a string"),
    ("correlation_id", (str,), "a string"),
    ("reply_to", (str,), "a string"),
    ("timestamp", (datetime,), "a datetime"),
    ("deliver_at", (datetime, type(None)), "a datetime or None"),
    ("ack_required", (bool,), "True or False"),
    ("headers", (Mapping,), "a dict of strings"),
)


def _misfilled(message: Message) -> MessageValidationError:
    """What is wrong with a :class:`Message` built by hand that could not be encoded: the
    first field that is not of its type (a ttl of 1.5, a timestamp given as text...)."""
    for name, kinds, told in _ENVELOPE_KINDS:
        value = getattr(message, name)
        if not isinstance(value, kinds):
            return MessageValidationError.for_field(
                name, f"{name} must be {told}, not {type(value).__name__} {value!r:.60}"
            )
    if type(message.ttl) is not int or not -(2**31) <= message.ttl < 2**31:
        return MessageValidationError.for_field(
            "ttl", f"ttl must be a whole number of seconds, not {message.ttl!r:.60}"
        )
    for name, known in (("message_type", _TYPE_TO_PB), ("priority", _PRIORITY_TO_PB)):
        value = getattr(message, name)
        try:
            known_value = value in known
        except TypeError:  # (unhashable)
            known_value = False
        if not known_value:
            return MessageValidationError.for_field(
                name, f"{name} must be one of {', '.join(map(str, known))}, not {value!r:.60}"
            )
    for name in ("message_id", "from_agent", "to_agent", "correlation_id", "reply_to"):
        if not _is_text(getattr(message, name)):
            return _not_text(name)
    for name in ("headers", "content", "metadata"):
        where = _not_text_within(getattr(message, name), name)
        if where:
            return _not_text(where)
    return MessageValidationError("the message could not be encoded: one of its fields is wrong")


def _is_text(value: str) -> bool:
    """False for a str that UTF-8 cannot write: a lone surrogate (``"\\ud800"``, what
    ``json.loads`` makes of an unpaired ``\\ud800`` escape, or a file read with
    ``errors="surrogateescape"``)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _not_text_within(value: object, path: str) -> str:
    """Where in a JSON value a key or a string is not text protobuf can write ("" for
    nowhere); looked for only once encoding failed."""
    pending: list[tuple[object, str]] = [(value, path)]
    seen: set[int] = set()  # (content that holds itself is walked once)
    while pending:
        value, path = pending.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, Mapping):
            for key, item in value.items():
                if isinstance(key, str) and not _is_text(key):
                    return f"{path} (a key)"
                pending.append((item, f"{path}.{key}"))
        elif isinstance(value, (list, tuple)):
            pending.extend((item, f"{path}.{i}") for i, item in enumerate(value))
    return ""


def _not_text(where: str) -> MessageValidationError:
    field = where.split(" ", 1)[0].split(".", 1)[0]
    return MessageValidationError.for_field(
        field,
        f"{where} is not text UTF-8 can write (it holds a lone surrogate, such as \\ud800)",
    )


def _an_object(value: Any, field_name: str) -> Mapping[str, JSON]:
    """``value`` when it is a JSON object (a mapping), else the error that says so."""
    if type(value) is dict or isinstance(value, Mapping):
        return cast(Mapping[str, JSON], value)
    raise MessageValidationError.for_field(
        field_name, f"{field_name} must be an object (a dict), not a {type(value).__name__}"
    )


def gather_message_from_pb(
    pb: message_pb2.Message, *, in_place: bool = False, strict: bool = False
) -> Message:
    """The message of a gather: an unset type means BROADCAST copies."""
    message = message_from_pb(pb, in_place=in_place, strict=strict)
    if pb.message_type == message_pb2.MESSAGE_TYPE_UNSPECIFIED:
        message = message.evolve(message_type=MessageType.BROADCAST)
    return message


def priority_from_pb(value: int) -> Priority:
    """A priority taken in by a server: unset is MEDIUM, an undefined number is refused."""
    return _defined(value, _PRIORITY_FROM_PB, "priority", Priority.MEDIUM)


def _defined(number: int, known: Mapping[int, K], field_name: str, unset: K) -> K:
    """An enum's value taken in by a server: ``unset`` for 0, an undefined number refused
    (MessageValidationError on ``field_name``)."""
    found = known.get(number)
    if found is not None:
        return found
    if number:
        raise MessageValidationError.from_violations([_undefined(field_name, number, known)])
    return unset


def priority_to_pb(priority: Priority) -> int:
    return int(_PRIORITY_TO_PB[priority])


def handoff_from_pb(pb: message_pb2.Handoff) -> Handoff:
    return Handoff(
        task_description=pb.task_description,
        context=struct_to_dict(pb.context),
        previous_result=value_to_python(pb.previous_result)
        if pb.HasField("previous_result")
        else None,
        constraints=struct_to_dict(pb.constraints),
        workflow_id=pb.workflow_id,
        step_number=pb.step_number,
    )


def handoff_to_pb(handoff: Handoff, out: message_pb2.Handoff) -> message_pb2.Handoff:
    out.task_description = handoff.task_description
    dict_to_struct(handoff.context, out.context)
    if handoff.previous_result is not None:
        python_to_value(handoff.previous_result, out.previous_result)
    dict_to_struct(handoff.constraints, out.constraints)
    out.workflow_id = handoff.workflow_id
    out.step_number = handoff.step_number
    return out


# -- agents --------------------------------------------------------------------------------


def agent_from_pb(pb: message_pb2.AgentInfo) -> AgentInfo:
    delivery_mode = _defined(
        pb.delivery_mode, _DELIVERY_FROM_PB, "agent.delivery_mode", DeliveryMode.PULL
    )
    return AgentInfo(
        agent_id=pb.agent_id,
        agent_types=tuple(pb.agent_types),
        address=pb.address,
        capabilities=tuple(pb.capabilities),
        registered_at=timestamp_to_datetime(pb.registered_at, "registered_at")
        if pb.HasField("registered_at")
        else None,
        instances=tuple(pb.instances),
        lost_at=timestamp_to_datetime(pb.lost_at, "lost_at") if pb.HasField("lost_at") else None,
        delivery_mode=delivery_mode,
        max_in_flight=pb.max_in_flight,
        # (each one's calls in flight at most are the broker's to know: 0 here)
        pushed=dict.fromkeys(pb.push_instances, 0),
        required_fields=tuple(pb.required_fields),
    )


def agent_to_pb(info: AgentInfo, out: message_pb2.AgentInfo | None = None) -> message_pb2.AgentInfo:
    pb = message_pb2.AgentInfo() if out is None else out
    pb.agent_id = info.agent_id
    pb.agent_types.extend(info.agent_types)
    pb.address = info.address
    pb.capabilities.extend(info.capabilities)
    if info.registered_at is not None:
        datetime_to_timestamp(info.registered_at, pb.registered_at)
    pb.instances.extend(info.instances)
    if info.lost_at is not None:
        datetime_to_timestamp(info.lost_at, pb.lost_at)
    pb.delivery_mode = _DELIVERY_TO_PB[info.delivery_mode]
    pb.max_in_flight = info.max_in_flight
    pb.push_instances.extend(info.push_instances)
    pb.required_fields.extend(info.required_fields)
    return pb


def card_to_pb(card: AgentCard, out: message_pb2.AgentCard) -> message_pb2.AgentCard:
    out.agent_id = card.agent_id
    out.agent_types.extend(card.agent_types)
    out.capabilities.extend(card.capabilities)
    for tool in card.tools:
        out.tools.add(name=tool.name, description=tool.description)
    out.description = card.description
    out.actions.extend(card.actions)
    return out


def card_from_pb(pb: message_pb2.AgentCard) -> AgentCard:
    return AgentCard(
        agent_id=pb.agent_id,
        agent_types=tuple(pb.agent_types),
        capabilities=tuple(pb.capabilities),
        tools=tuple(Tool(name=t.name, description=t.description) for t in pb.tools),
        description=pb.description,
        actions=tuple(pb.actions),
    )


# -- deliveries, dead letters, errors -------------------------------------------------------


def delivery_to_pb(
    delivery: Delivery, out: broker_pb2.Delivery, stamps: LeaseStamps | None = None
) -> broker_pb2.Delivery:
    """``stamps``: for the deliveries of one batch, which share their lease deadline."""
    message_to_pb(delivery.message, out.message)
    out.delivery_attempt = delivery.attempt
    out.max_delivery_attempts = delivery.max_attempts
    expires = delivery.lease_expires_at
    if expires is not None:
        if stamps is None:
            datetime_to_timestamp(expires, out.lease_expires_at)
        else:
            stamps.write(expires, out.lease_expires_at)
    return out


class LeaseStamps:
    """Lease deadlines written as Timestamps, the last one converted kept: the deliveries of
    one lease share one deadline (one datetime), converted once for all of them."""

    __slots__ = ("_at", "_pb")

    def __init__(self) -> None:
        self._at: datetime | None = None
        self._pb = timestamp_pb2.Timestamp()

    def write(self, at: datetime, out: timestamp_pb2.Timestamp) -> None:
        if at is not self._at:
            datetime_to_timestamp(at, self._pb)
            self._at = at
        out.CopyFrom(self._pb)


def delivery_from_pb(pb: broker_pb2.Delivery) -> Delivery:
    return Delivery(
        message_from_pb(pb.message),
        pb.delivery_attempt,
        timestamp_to_datetime(pb.lease_expires_at) if pb.HasField("lease_expires_at") else None,
        pb.max_delivery_attempts,
    )


def dead_letter_to_pb(dead: DeadLetter, out: broker_pb2.DeadLetter) -> broker_pb2.DeadLetter:
    message_to_pb(dead.message, out.message)
    out.reason = dead.reason
    out.delivery_attempts = dead.attempts
    datetime_to_timestamp(dead.dead_lettered_at, out.dead_lettered_at)
    return out


def queued_to_pb(queued: QueuedMessage, out: broker_pb2.QueuedMessage) -> broker_pb2.QueuedMessage:
    message_to_pb(queued.message, out.message)
    out.delivery_attempts = queued.attempts
    datetime_to_timestamp(queued.accepted_at, out.accepted_at)
    datetime_to_timestamp(queued.expires_at, out.expires_at)
    out.state = broker_pb2.QueuedState.Value(f"QUEUED_STATE_{queued.state.value}")
    if queued.until is not None:
        datetime_to_timestamp(queued.until, out.until)
    return out


def queued_from_pb(pb: broker_pb2.QueuedMessage) -> QueuedMessage:
    state = broker_pb2.QueuedState.Name(pb.state).removeprefix("QUEUED_STATE_")
    return QueuedMessage(
        message_from_pb(pb.message),
        pb.delivery_attempts,
        timestamp_to_datetime(pb.accepted_at),
        timestamp_to_datetime(pb.expires_at),
        QueuedState(state) if state in QueuedState.__members__ else QueuedState.WAITING,
        timestamp_to_datetime(pb.until) if pb.HasField("until") else None,
    )


def dead_letter_from_pb(pb: broker_pb2.DeadLetter) -> DeadLetter:
    return DeadLetter(
        message_from_pb(pb.message),
        pb.reason,
        pb.delivery_attempts,
        timestamp_to_datetime(pb.dead_lettered_at),
    )


def error_to_pb(error: MeshError, out: broker_pb2.Error) -> broker_pb2.Error:
    out.code = STATUS_CODES.get(error.code, STATUS_CODES["INTERNAL"])
    out.message = error.message
    out.reason = error.reason
    for v in error.field_violations:
        out.field_violations.add(field=v.field, description=v.description)
    if error.retry_after is not None:
        seconds_to_duration(error.retry_after, out.retry_delay)
    return out


def error_from_pb(pb: broker_pb2.Error) -> MeshError:
    code = STATUS_NAMES.get(pb.code, "UNKNOWN")
    cls = error_class_for(pb.reason, code)
    return cls(
        pb.message,
        field_violations=tuple(FieldViolation(v.field, v.description) for v in pb.field_violations),
        retry_after=duration_seconds(pb.retry_delay) if pb.HasField("retry_delay") else None,
        reason=pb.reason or None,
        code=code,
    )


def content_of(data: dict[str, Any] | None) -> dict[str, JSON] | None:
    """Content as the wire will carry it (keys as strings)."""
    return None if data is None else {str(k): v for k, v in data.items()}

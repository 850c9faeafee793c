"""Requests are read with room to spare below protobuf's nesting limit.

Protobuf's parsers (upb in Python, C++, Java) refuse a message nested more than 100 levels
deep. What a request carries travels on inside deeper frames: a message sent in a
`SendMessage` call is delivered inside a batch frame of a `Connect` stream, four levels
further down; an agent's answer comes back to a pattern's client inside its event data, a
dozen further. A request that used all 100 levels would be accepted and then could not be
read where it goes: one such message in a batch frame would fail the frame, and every
message with it, at every delivery. So a server of the mesh reads each request as if it
were :data:`HEADROOM` levels further down, and refuses what does not fit with
INVALID_ARGUMENT (JSON content may still nest about 25 levels).

The same reading refuses a JSON value (google.protobuf.Value) that holds NaN or Infinity:
protobuf takes them, JSON has neither, and a client reading JSON (grpcurl, buf curl, a
browser) fails on the whole answer that carries one, a ReceiveMessages of every message it
took off the queue included.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor

PARSER_DEPTH = 100
"""How deep upb, C++ and Java parse a message before they refuse it."""
HEADROOM = 16
"""Levels a request leaves unused for the frames that carry its contents on."""

_PACKAGE = "agentmesh_internal.headroom"
_START, _END, _LEAF = b"\x0b", b"\x0c", b"\x12"
"""Field 1 as a group (opened and closed: no length to work out) and field 2 with a length."""
_UNWRAP_ABOVE = 4096
"""Bytes above which a request is taken out of its wrapper rather than parsed again."""


_NON_FINITE = re.compile(rb"\x11[\x00-\xff]{6}[\xf0-\xff][\x7f\xff]", re.DOTALL)
"""A double in field 2 of a message (Value.number_value) whose exponent bits are all set: NaN
or an infinity. Bytes elsewhere may look the same: a match is looked into field by field."""


_JSON_TYPES = ("google.protobuf.Struct", "google.protobuf.ListValue")
"""Whose own field names (fields, values) a path leaves out: content.x, not content.fields.x."""


def non_finite_value(message: Any, path: str = "") -> str:
    """Where ``message`` holds a google.protobuf.Value of NaN or Infinity ("" for nowhere)."""
    if message.DESCRIPTOR.full_name == "google.protobuf.Value":
        kind = message.WhichOneof("kind")
        if kind == "number_value" and not math.isfinite(message.number_value):
            return path or "value"
        if kind == "struct_value":
            return non_finite_value(message.struct_value, path)
        if kind == "list_value":
            return non_finite_value(message.list_value, path)
        return ""
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            items: Any = (
                value.items() if field.message_type.fields_by_name["value"].message_type else ()
            )
        elif field.is_repeated:
            items = enumerate(value)
        else:
            items = [(None, value)]
        name = "" if message.DESCRIPTOR.full_name in _JSON_TYPES else field.name
        for key, item in items:
            where = ".".join(p for p in (path, name, "" if key is None else str(key)) if p)
            found = non_finite_value(item, where)
            if found:
                return found
    return ""


class NonFiniteError(ValueError):
    def __init__(self, where: str) -> None:
        super().__init__(f"{where} is NaN or Infinity, which JSON has no way to write")


def _wrapper(descriptor: Descriptor) -> Any:
    """A message type that holds itself (field 1, group-encoded) or the request (field 2):
    parsing a request at the bottom of ``HEADROOM - 1`` of them measures it ``HEADROOM``
    levels down. Added to the default pool once per request type."""
    pool = descriptor_pool.Default()
    name = descriptor.full_name.replace(".", "_")
    file_name = f"agentmesh_internal/headroom/{descriptor.full_name}.proto"
    try:
        pool.FindFileByName(file_name)
    except KeyError:
        file = descriptor_pb2.FileDescriptorProto(
            name=file_name,
            package=_PACKAGE,
            syntax="editions",
            edition=descriptor_pb2.EDITION_2023,
            dependency=[descriptor.file.name],
        )
        wrapper = file.message_type.add(name=name)
        field = descriptor_pb2.FieldDescriptorProto
        inner = wrapper.field.add(
            name="inner", number=1, type=field.TYPE_MESSAGE, type_name=f".{_PACKAGE}.{name}"
        )
        inner.options.features.message_encoding = descriptor_pb2.FeatureSet.DELIMITED
        wrapper.field.add(
            name="request", number=2, type=field.TYPE_MESSAGE, type_name=f".{descriptor.full_name}"
        )
        pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


def with_headroom(message_class: Any, headroom: int = HEADROOM) -> Callable[[bytes], Any]:
    """A parser of ``message_class`` that refuses a message that would not parse
    ``headroom`` levels further down (DeepRequestError) or that holds NaN or Infinity in a
    JSON value (NonFiniteError); bytes that are no such message keep protobuf's own error.
    Small requests are parsed in the wrapper and again on their own (cheaper than walking
    out of the wrapper); large ones are taken out of it (cheaper than a second parse)."""
    wrapper = _wrapper(message_class.DESCRIPTOR)
    opened, closed = _START * (headroom - 1), _END * (headroom - 1)
    wrapped, parse = wrapper.FromString, message_class.FromString

    def parse_with_headroom(data: bytes) -> Any:
        try:
            held = wrapped(b"".join((opened, _LEAF, _varint_bytes(len(data)), data, closed)))
        except Exception:
            try:
                parse(data)
            except Exception as error:  # its own error, unless it is its depth too
                if "MaxDepth" not in str(error):
                    raise
            raise DeepRequestError(headroom) from None
        if len(data) <= _UNWRAP_ABOVE:
            request = parse(data)
        else:
            for _ in range(headroom - 1):
                held = held.inner
            request = held.request
        if _NON_FINITE.search(data) and (where := non_finite_value(request)):
            raise NonFiniteError(where)
        return request

    return parse_with_headroom


parser_for = functools.cache(with_headroom)
""":func:`with_headroom`, made once per request type."""


class DeepRequestError(ValueError):
    """A request that parses, but not with :data:`HEADROOM` levels to spare."""

    def __init__(self, headroom: int) -> None:
        super().__init__(
            f"it nests more than {PARSER_DEPTH - headroom} levels deep; the mesh keeps"
            f" {headroom} of protobuf's {PARSER_DEPTH} for the frames that carry what a request"
            " holds on to where it goes (JSON values may nest about 25 levels)"
        )


def wire_fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """The top-level fields of protobuf bytes, read without their type: (number, value), a
    varint as an int, anything else as its bytes. For what can be read of a request that
    does not decode (its seq, its parts); stops where the bytes stop making sense."""
    at, end = 0, len(data)
    while at < end:
        key, at = _varint(data, at)
        if key is None:
            return
        number, kind = key >> 3, key & 7
        value: int | bytes | None
        if kind == 0:
            value, at = _varint(data, at)
        elif kind == 2:
            length, at = _varint(data, at)
            if length is None or at + length > end:
                return
            value, at = data[at : at + length], at + length
        elif kind in (1, 5):
            size = 8 if kind == 1 else 4
            value, at = data[at : at + size], at + size
        else:  # groups: none in the contract
            return
        if value is None or at > end:
            return
        yield number, value


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varint(data: bytes, at: int) -> tuple[int | None, int]:
    value, shift = 0, 0
    for index in range(at, min(at + 10, len(data))):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    return None, len(data)

"""Requests read with room to spare below protobuf's nesting limit, and what can be read of
bytes that do not decode."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from mesh.headroom import HEADROOM, PARSER_DEPTH, DeepRequestError, wire_fields, with_headroom
from mesh.v1 import broker_pb2


def nested_value(depth: int) -> struct_pb2.Value:
    """A Value ``depth`` objects deep (each one Value, Struct and map entry: three levels)."""
    value = struct_pb2.Value(string_value="bottom")
    for _ in range(depth):
        outer = struct_pb2.Value()
        outer.struct_value.fields["k"].CopyFrom(value)
        value = outer
    return value


def levels(depth: int) -> int:
    """Levels of a SendMessageRequest whose content holds ``nested_value(depth)``:
    request, message, content Struct, its map entry, then the value's."""
    return 4 + 3 * depth + 1


def request(depth: int, padding: int = 0) -> broker_pb2.SendMessageRequest:
    pb = broker_pb2.SendMessageRequest()
    pb.message.from_agent, pb.message.to_agent = "a", "b"
    pb.message.content.fields["nest"].CopyFrom(nested_value(depth))
    pb.message.content.fields["pad"].string_value = "x" * padding
    return pb


@pytest.mark.parametrize("padding", [0, 10_000], ids=["small", "large"])
def test_a_request_with_room_to_spare_reads_as_it_was_written(padding: int) -> None:
    parse = with_headroom(broker_pb2.SendMessageRequest)
    deepest = max(d for d in range(40) if levels(d) <= PARSER_DEPTH - HEADROOM)
    written = request(deepest, padding)
    read = parse(written.SerializeToString())
    assert isinstance(read, broker_pb2.SendMessageRequest)
    assert read == written


@pytest.mark.parametrize("padding", [0, 10_000], ids=["small", "large"])
def test_a_request_that_leaves_too_little_room_is_refused_saying_why(padding: int) -> None:
    parse = with_headroom(broker_pb2.SendMessageRequest)
    too_deep = min(d for d in range(40) if levels(d) > PARSER_DEPTH - HEADROOM)
    raw = request(too_deep, padding).SerializeToString()
    assert broker_pb2.SendMessageRequest.FromString(raw)  # protobuf alone would take it
    with pytest.raises(DeepRequestError, match="nests more than 84 levels deep"):
        parse(raw)


def test_bytes_that_are_not_a_request_keep_protobufs_own_error() -> None:
    with pytest.raises(Exception, match="Error parsing message") as info:
        with_headroom(broker_pb2.SendMessageRequest)(b"\xff\xff\xff")
    assert not isinstance(info.value, DeepRequestError)


def test_the_fields_of_undecodable_bytes_are_read_as_far_as_they_go() -> None:
    frame = broker_pb2.ConnectRequest(seq=300)
    frame.batch.frames.add(seq=7).ack.agent_id = "A"
    raw = frame.SerializeToString()
    fields = list(wire_fields(raw))
    assert fields[0] == (1, 300)
    [(number, batch)] = fields[1:]
    assert number == 9 and isinstance(batch, bytes)
    [(inner_number, inner)] = list(wire_fields(batch))
    assert inner_number == 1 and next(wire_fields(inner)) == (1, 7)  # type: ignore[arg-type]
    assert list(wire_fields(raw[:-2])) == [(1, 300)]  # cut short: what was whole


@given(st.binary(max_size=200))
def test_reading_the_fields_of_any_bytes_never_fails(data: bytes) -> None:
    for number, value in wire_fields(data):
        assert number >= 0 and isinstance(value, int | bytes)

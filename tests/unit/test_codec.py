"""Content kept in its wire form (the broker's way): reads, validation and re-encoding agree
with the decoded dict."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import uuid
from collections.abc import Mapping
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from types import MappingProxyType
from typing import Any, ClassVar

import pydantic
import pytest
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import codec
from mesh.config import BrokerConfig
from mesh.core.errors import MessageValidationError
from mesh.core.model import Delivery, Message, MessageType, Priority, plain_content
from mesh.core.validation import validate_message
from mesh.v1 import broker_pb2

CONTENT = {
    "action": "process_payment",
    "parameters": {"amount": 450, "flight": "Flight A", "legs": [1, {"seat": None}]},
    "tags": ["a", 2.5],
    "note": None,
    "urgent": True,
}


def arrived(content: dict[str, object] | None, **fields: object) -> Message:
    """The message as the broker sees it after decoding the frame."""
    sent = Message(from_agent="FlightAgent", to_agent="PaymentAgent", content=content, **fields)  # type: ignore[arg-type]
    return codec.message_from_pb(codec.message_to_pb(sent), in_place=True)


def test_wire_content_reads_like_the_dict_it_encodes() -> None:
    message = arrived(CONTENT)
    content = message.content
    assert isinstance(content, codec.WireContent)
    assert content == CONTENT
    assert CONTENT == content  # noqa: SIM300 (the dict's side of the comparison)
    assert message.action == "process_payment"
    assert message.parameters == CONTENT["parameters"]
    assert sorted(content) == sorted(CONTENT) and len(content) == len(CONTENT)
    assert content["note"] is None and content.get("missing", 7) == 7
    assert "urgent" in content and "missing" not in content
    with pytest.raises(KeyError):
        content["missing"]
    assert json.loads(json.dumps(message.to_dict()))["content"] == CONTENT
    assert Message.from_dict(message.to_dict()).content == CONTENT


def test_wire_content_is_written_out_as_it_came_in() -> None:
    first = codec.message_to_pb(
        Message(from_agent="FlightAgent", to_agent="PaymentAgent", content=CONTENT)
    )
    message = codec.message_from_pb(first, in_place=True)
    again = codec.message_to_pb(message)
    assert again == first
    assert codec.struct_to_dict(again.content) == CONTENT


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ({"parameters": {"amount": 1}}, "content.action is required"),
        ({"action": 3}, "content.action must be a string"),
        ({"action": "x", "parameters": [1, 2]}, "content.parameters must be an object"),
        ({"action": "x", "parameters": "450"}, "content.parameters must be an object"),
        ({"action": "x", "context": 1}, "content.context must be an object"),
    ],
)
def test_wire_content_is_validated_like_a_dict(content: dict[str, object], problem: str) -> None:
    config = BrokerConfig()
    for message in (
        Message(from_agent="FlightAgent", to_agent="PaymentAgent", content=content),  # type: ignore[arg-type]
        arrived(content),
    ):
        with pytest.raises(MessageValidationError, match=problem):
            validate_message(message, config)


def test_null_parameters_and_broadcasts_without_action_pass_in_wire_form() -> None:
    config = BrokerConfig()
    validate_message(arrived({"action": "x", "parameters": None, "context": {}}), config)
    validate_message(arrived({"alert": "maintenance"}, message_type=MessageType.BROADCAST), config)


def test_message_ids_are_distinct_random_uuids_in_text_form() -> None:
    ids = [Message(from_agent="a", to_agent="b", content={}).message_id for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for text in ids:
        parsed = uuid.UUID(text)
        assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)
        assert str(parsed) == text


def test_undefined_enum_numbers_are_refused_in_and_read_as_unset_out() -> None:
    from mesh.v1 import message_pb2

    odd = message_pb2.Message(from_agent="a", to_agent="b", message_type=42, priority=7)
    with pytest.raises(MessageValidationError) as info:
        codec.message_from_pb(odd, strict=True)  # a server taking it in
    assert [v.field for v in info.value.field_violations] == ["message_type", "priority"]
    assert info.value.field_violations[1].description == (
        "priority 7 is not defined (known: HIGH=1, MEDIUM=2, LOW=3)"
    )
    # A client reading what a newer broker delivered: taken as unset.
    read = codec.message_from_pb(odd)
    assert (read.message_type, read.priority) == (MessageType.REQUEST, Priority.MEDIUM)
    with pytest.raises(MessageValidationError, match="priority 9 is not defined"):
        codec.priority_from_pb(9)
    assert codec.priority_from_pb(0) is Priority.MEDIUM


def test_a_message_taken_in_is_written_out_as_one_copy_that_says_what_it_says() -> None:
    from mesh.v1 import message_pb2

    # What a client of another language may send: no id, no time, type and priority unset.
    bare = message_pb2.Message(from_agent="a", to_agent="b", ttl=30)
    codec.dict_to_struct({"action": "go"}, bare.content)
    bare.headers["x-tenant"] = "t1"
    taken = codec.message_from_pb(bare, in_place=True, strict=True)
    bare.to_agent = "changed after it was read"  # the frame is not the message
    written = codec.message_to_pb(taken)
    assert written.message_id == taken.message_id and uuid.UUID(written.message_id)
    assert codec.timestamp_to_datetime(written.timestamp) == taken.timestamp
    assert written.message_type == message_pb2.MESSAGE_TYPE_REQUEST
    assert written.priority == message_pb2.PRIORITY_MEDIUM
    assert (written.to_agent, written.ttl, dict(written.headers)) == ("b", 30, {"x-tenant": "t1"})
    # Field by field, the message encodes to the same envelope.
    decoded = Message(**{**_fields(taken), "content": {"action": "go"}})  # type: ignore[arg-type]
    assert written == codec.message_to_pb(decoded)
    # A changed copy carries its change, not the form the original came in.
    moved = taken.copy_to("c", priority=Priority.HIGH)
    out = codec.message_to_pb(moved)
    assert (out.to_agent, out.priority, out.message_id) == ("c", 1, taken.message_id)
    assert moved == codec.message_from_pb(out)  # `encoded` takes no part in equality
    assert codec.message_to_pb(taken).to_agent == "b"  # the original is as it was


@pytest.mark.parametrize(
    "changes",
    [
        {"to_agent": "c"},
        {"message_type": MessageType.BROADCAST, "to_agent": "broadcast"},
        {"correlation_id": "r-1", "ttl": 5, "message_type": MessageType.RESPONSE},
        {"priority": Priority.LOW, "reply_to": "z", "ack_required": True},
        {"message_id": "m-2", "from_agent": "y"},
        {"content": {"action": "other"}},
        {"headers": {"x-tenant": "t2"}},
        {"metadata": {"workflow_id": "wf"}},
        {"timestamp": datetime(2026, 1, 2, 3, 4, 5, 6000, tzinfo=UTC)},
    ],
)
def test_a_changed_copy_of_a_message_taken_in_is_written_out_as_it_now_is(
    changes: dict[str, object],
) -> None:
    """Whatever a copy changes, and whether or not it keeps the form the original came in
    (its envelope's scalars only), it is written out exactly as the same message built
    field by field would be; copies of copies too."""
    sent = Message(
        from_agent="a",
        to_agent="b",
        content={"action": "go", "parameters": {"n": 1}},
        metadata={"step_number": 2},
        headers={"x-tenant": "t1"},
        ttl=30,
    )
    taken = codec.message_from_pb(codec.message_to_pb(sent), in_place=True, strict=True)
    for copy in (taken.evolve(**changes), taken.copy_to("q").evolve(**changes)):
        plain = Message(**{**_fields(copy), "content": _plain(copy.content)})  # type: ignore[arg-type]
        assert plain.encoded is None
        assert codec.message_to_pb(copy) == codec.message_to_pb(plain)
        assert copy == plain
    assert codec.message_to_pb(taken) == codec.message_to_pb(sent)


def test_an_unknown_field_is_refused_by_evolve() -> None:
    with pytest.raises(TypeError):
        Message(from_agent="a", to_agent="b", content={}).evolve(colour="red")


def _plain(content: object) -> object:
    return content.to_dict() if isinstance(content, codec.WireContent) else content


def _fields(message: Message) -> dict[str, object]:
    import dataclasses

    return {f.name: getattr(message, f.name) for f in dataclasses.fields(message) if f.init}


# JSON as a client hands it in: what it decodes to comes back (whole numbers as int).
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _as_decoded(value: object) -> object:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _as_decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_decoded(v) for v in value]
    return value


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _json, max_size=5))
def test_json_content_comes_back_as_it_was_sent(content: dict[str, object]) -> None:
    struct = struct_pb2.Struct()
    codec.dict_to_struct(content, struct)
    decoded = codec.struct_to_dict(struct_pb2.Struct.FromString(struct.SerializeToString()))
    expected = _as_decoded(content)
    assert decoded == expected
    assert all(type(decoded[key]) is type(expected[key]) for key in expected)


class _Level(enum.IntEnum):
    HIGH = 3


def test_content_of_other_python_types_is_encoded_by_what_it_is() -> None:
    struct = struct_pb2.Struct()
    codec.dict_to_struct(
        {
            "flag": True,  # a bool stays a bool, not the number 1
            "level": _Level.HIGH,  # an int subclass is a number
            "pair": (1, "b"),  # a tuple is a list
            7: "seven",  # a key that is not a string is written as one
            "empty": {},
            "when": datetime(2025, 11, 16, 10, 0, 5, tzinfo=UTC),  # times in ISO 8601
            "day": date(2025, 11, 16),
            "at": time(10, 0, 5),
            "amount": Decimal("450.25"),  # a decimal is a number
            "other": uuid.UUID(int=1),  # anything else as its text
        },
        struct,
    )
    assert codec.struct_to_dict(struct) == {
        "flag": True,
        "level": 3,
        "pair": [1, "b"],
        "7": "seven",
        "empty": {},
        "when": "2025-11-16T10:00:05+00:00",
        "day": "2025-11-16",
        "at": "10:00:05",
        "amount": 450.25,
        "other": "00000000-0000-0000-0000-000000000001",
    }
    assert struct.fields["empty"].WhichOneof("kind") == "struct_value"


def test_a_mapping_within_content_is_an_object_as_a_dict_is() -> None:
    """Any mapping is a JSON object, at the top of content or within it: a read-only view,
    or the content of a message as it came in (a WireContent). Within content it was written
    as its Python text ("{'k': 1}"), and a validator took it for no object."""
    came_in = struct_pb2.Struct()
    came_in.update({"action": "quote", "parameters": {"amount": 450, "legs": [{"to": "MAD"}]}})
    wire = codec.WireContent(came_in)
    content = {
        "action": "review",
        "parameters": MappingProxyType({"original": wire, "view": MappingProxyType({"k": 1})}),
    }
    message = Message(from_agent="A", to_agent="B", content=content)
    validate_message(message, BrokerConfig(), 0)
    assert message.parameters == {"original": wire, "view": {"k": 1}}
    decoded = codec.message_from_pb(codec.message_to_pb(message))
    assert plain_content(decoded.content) == {
        "action": "review",
        "parameters": {
            "original": {"action": "quote", "parameters": {"amount": 450, "legs": [{"to": "MAD"}]}},
            "view": {"k": 1},
        },
    }


@dataclasses.dataclass
class _Leg:
    to: str
    seats: int = 1
    then: _Leg | None = None
    kind: ClassVar[str] = "leg"  # (no field of its objects: not written)
    checked: dataclasses.InitVar[bool] = True  # (given to __init__ alone: not written)

    def __post_init__(self, checked: bool) -> None:
        pass


class _Cabin(enum.Enum):
    ECONOMY = "economy"
    BUSINESS = "business"


def test_a_dataclass_is_an_object_and_an_enum_member_its_value_as_orjson_writes_them() -> None:
    """They were written as their Python text: "_Leg(to='MAD', seats=1, then=None)" and
    "_Cabin.BUSINESS"."""
    struct = struct_pb2.Struct()
    codec.dict_to_struct(
        {"leg": _Leg("MAD", 2, _Leg("LIS")), "cabin": _Cabin.BUSINESS, "legs": [_Leg("OPO")]},
        struct,
    )
    assert codec.struct_to_dict(struct) == {
        "leg": {"to": "MAD", "seats": 2, "then": {"to": "LIS", "seats": 1, "then": None}},
        "cabin": "business",
        "legs": [{"to": "OPO", "seats": 1, "then": None}],
    }
    codec.dict_to_struct({"kind": _Leg}, struct)  # (a class is no instance: its text)
    assert struct.fields["kind"].string_value == str(_Leg)


def test_a_pydantic_model_is_the_json_it_dumps() -> None:
    """A model, as a handler returns the structured output it parsed, is what its
    model_dump(mode="json") says; it was sent as its Python text ("to='MAD' seats=2")."""

    class Leg(pydantic.BaseModel):
        to: str
        seats: int = 1
        cabin: _Cabin = _Cabin.ECONOMY
        when: date | None = None

    struct = struct_pb2.Struct()
    codec.dict_to_struct({"leg": Leg(to="MAD", seats=2, when=date(2026, 1, 2))}, struct)
    assert codec.struct_to_dict(struct) == {
        "leg": {"to": "MAD", "seats": 2, "cabin": "economy", "when": "2026-01-02"}
    }


def test_a_dataclass_within_content_counts_toward_its_depth() -> None:
    circular = _Leg("MAD")
    circular.then = circular
    with pytest.raises(MessageValidationError, match="nests more than 25 levels deep"):
        codec.check_depth({"result": circular})
    codec.check_depth({"result": _Leg("MAD", then=_Leg("LIS"))})


def test_a_mapping_within_content_counts_toward_its_depth() -> None:
    deep: dict[str, object] = {"leaf": 1}
    for _ in range(24):
        deep = {"down": deep}
    came_in = struct_pb2.Struct()
    came_in.update(deep)  # type: ignore[arg-type]
    codec.check_depth(codec.WireContent(came_in))  # 25 levels: as deep as an answer goes
    within: Mapping[str, object]
    for within in (codec.WireContent(came_in), MappingProxyType(deep)):
        with pytest.raises(MessageValidationError, match="nests more than 25 levels deep"):
            codec.check_depth({"result": within})
        with pytest.raises(MessageValidationError, match="nests more than 25 levels deep"):
            codec.check_depth({"results": (within,)})


def test_an_event_over_the_stream_limit_leaves_out_its_longest_values() -> None:
    from gateway.codec import event_to_pb
    from gateway.events import EventKind, Pattern, PatternEvent
    from mesh.serving import ANSWER_BYTES
    from mesh.v1 import gateway_pb2

    text = "x" * 900_000
    answers = [{"agent_id": f"a{i}", "reasoning": text, "confidence": 0.8} for i in range(5)]
    event = PatternEvent(
        run_id="r",
        pattern=Pattern.GROUP_CHAT,
        kind=EventKind.RESULT,
        summary="done",
        data={"status": "COMPLETED", "contributions": answers, "history": answers},
    )
    out = event_to_pb(event, gateway_pb2.PatternEvent())
    assert out.ByteSize() <= ANSWER_BYTES
    data = codec.struct_to_dict(out.data)
    assert data["status"] == "COMPLETED"
    kept = [*data["contributions"], *data["history"]]  # type: ignore[misc]
    assert [a["agent_id"] for a in kept] == [f"a{i}" for i in range(5)] * 2
    omitted = [a for a in kept if a["reasoning"] != text]
    assert len(omitted) == 7  # the fewest texts that bring it under the limit
    assert all(a["reasoning"] == {"omitted_bytes": 900_004} for a in omitted)

    # A summary larger than the limit on its own: what can be left out is, and no more.
    event = PatternEvent(
        run_id="r", pattern=Pattern.GROUP_CHAT, kind=EventKind.RESULT, summary=text * 4
    )
    assert event_to_pb(event, gateway_pb2.PatternEvent()).summary == text * 4


@pytest.mark.parametrize(
    "content",
    [
        {"action": "x", "score": float("nan")},
        {"action": "x", "scores": [0.5, float("inf")]},
        {"action": "x", "deep": {"deeper": {"low": -float("inf")}}},
        {"action": "x", "amount": Decimal("NaN")},
        {"action": "x", "amount": Decimal("1e400")},
    ],
    ids=["nan", "in a list", "nested", "decimal", "decimal past a double"],
)
def test_nan_and_infinity_are_refused_where_a_json_value_is_made(
    content: dict[str, object],
) -> None:
    """Protobuf would carry them; no client reading JSON could read what holds one."""
    from mesh.core.errors import MessageValidationError

    with pytest.raises(MessageValidationError, match="is not a number JSON can write"):
        codec.dict_to_struct(content, struct_pb2.Struct())  # type: ignore[arg-type]
    finite = struct_pb2.Struct()
    codec.dict_to_struct({"a": 1.5, "b": [2, -0.0], "c": {"d": 1e308}}, finite)
    assert codec.struct_to_dict(finite) == {"a": 1.5, "b": [2, 0], "c": {"d": 1e308}}


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ({"order_id": 12345678901234567}, "the integer 12345678901234567"),
        ({"ids": [1, 2**53]}, "the integer 9007199254740992"),
        ({"deep": {"n": -(2**53)}}, "the integer -9007199254740992"),
        ({"huge": 10**400}, "the integer of 401 digits"),
    ],
    ids=["beyond 2**53", "in a list", "nested, negative", "past a double"],
)
def test_an_integer_a_json_number_would_round_is_refused(
    content: dict[str, object], said: str
) -> None:
    """A JSON number is a double (in protobuf's Struct and in JavaScript): 12345678901234567
    would arrive as 12345678901234568, and 10**400 not at all. Refused where the value is
    made, with what to do instead; the largest integers it carries exactly go through."""
    with pytest.raises(MessageValidationError, match=f"{said} is beyond .*send it as a string"):
        codec.dict_to_struct(content, struct_pb2.Struct())  # type: ignore[arg-type]

    class Level(enum.IntEnum):
        HIGH = 3

    exact = struct_pb2.Struct()
    edge = 2**53 - 1
    codec.dict_to_struct({"a": edge, "b": [-edge], "c": {"d": Level.HIGH}}, exact)
    assert codec.struct_to_dict(exact) == {"a": edge, "b": [-edge], "c": {"d": 3}}


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"content": ["book"]}, "content must be an object (a dict), not a list"),
        ({"metadata": "wf_1"}, "metadata must be an object (a dict), not a str"),  # type: ignore[dict-item]
        (
            {"content": {"action": "a", "blob": b"\x00"}},
            "bytes is not a JSON value: send its base64",
        ),
        ({"content": {"action": "a", "tags": {"x"}}}, "set is not a JSON value: send a list"),
        ({"headers": {"attempt": 3}}, "headers must map strings to strings, not 'attempt': 3"),
        ({"headers": {1: "x"}}, "headers must map strings to strings, not 1: 'x'"),
        (
            {"content": {"action": "a", "notes": ["ok", {"name": "caf\udce9"}]}},
            "content.notes.1.name is not text UTF-8 can write (it holds a lone surrogate",
        ),
        ({"content": {"action": "a", "\ud800": 1}}, "content (a key) is not text UTF-8"),
        ({"reply_to": "Pay\ud800"}, "reply_to is not text UTF-8 can write"),
        ({"headers": {"trace": "\udfff"}}, "headers.trace is not text UTF-8 can write"),
    ],
    ids=[
        "content a list",
        "metadata a string",
        "bytes",
        "a set",
        "a header's value",
        "a key",
        "a lone surrogate in a value",
        "in a key",
        "in reply_to",
        "in a header",
    ],
)
def test_what_json_or_the_envelope_cannot_carry_is_a_validation_error(
    fields: dict[str, object], said: str
) -> None:
    """Not a TypeError or AttributeError from deep inside protobuf, nor a value's repr sent
    as text: the sender hears what is wrong, before anything travels."""
    fields.setdefault("content", {"action": "a"})
    message = Message(from_agent="a", to_agent="b", **fields)  # type: ignore[arg-type]
    with pytest.raises(MessageValidationError, match=re.escape(said)):
        codec.message_to_pb(message)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"ttl": 1.5}, "ttl must be a whole number of seconds, not 1.5"),
        ({"ttl": "5"}, "ttl must be a whole number of seconds, not '5'"),
        ({"ttl": 2**40}, "ttl must be a whole number of seconds, not 1099511627776"),
        ({"timestamp": "2026-11-26T12:00:00Z"}, "timestamp must be a datetime, not str"),
        ({"deliver_at": 30}, "deliver_at must be a datetime or None, not int 30"),
        ({"correlation_id": 5}, "correlation_id must be a string, not int 5"),
        ({"ack_required": "yes"}, "ack_required must be True or False, not str 'yes'"),
        ({"headers": None}, "headers must be a dict of strings, not NoneType None"),
        ({"priority": "URGENT"}, "priority must be one of HIGH, MEDIUM, LOW, not 'URGENT'"),
        ({"message_type": ["REQUEST"]}, "message_type must be one of REQUEST, RESPONSE"),
    ],
    ids=lambda value: str(value)[:20] if isinstance(value, dict) else "",
)
def test_a_message_built_by_hand_with_a_field_of_the_wrong_type_is_a_validation_error(
    fields: dict[str, object], said: str
) -> None:
    """``Message(...)`` takes what it is given; encoding it names the first wrong field,
    where protobuf would raise a bare TypeError (or AttributeError, KeyError)."""
    message = Message(from_agent="a", to_agent="b", content={"action": "a"}, **fields)  # type: ignore[arg-type]
    with pytest.raises(MessageValidationError, match=re.escape(said)):
        codec.message_to_pb(message)


def test_wire_content_names_the_kind_of_each_value_without_decoding_it() -> None:
    content = arrived({**CONTENT, "count": 3, "context": {}}).content
    assert isinstance(content, codec.WireContent)
    kinds = {key: content.value_kind(key) for key in (*CONTENT, "count", "context", "missing")}
    assert kinds == {
        "action": "string",
        "parameters": "object",
        "tags": "array",
        "note": "null",
        "urgent": "boolean",
        "count": "number",
        "context": "object",
        "missing": None,
    }


def test_a_decoded_message_is_the_message_its_fields_make() -> None:
    sent = Message(
        from_agent="FlightAgent",
        to_agent="PaymentAgent",
        content=CONTENT,
        message_type=MessageType.HANDOFF,
        metadata={"workflow_id": "w-1"},
        correlation_id="c-1",
        priority=Priority.HIGH,
        ttl=30,
        reply_to="Desk",
        ack_required=True,
        headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
        deliver_at=datetime(2026, 12, 8, 9, 30, 0, 250000, tzinfo=UTC),
    )
    assert Message.from_dict(sent.to_dict()) == sent  # (the JSON form: logs, stores)
    for in_place in (False, True):
        decoded = codec.message_from_pb(codec.message_to_pb(sent), in_place=in_place)
        assert decoded == sent  # every field compared (encoded is not)
        assert (decoded.encoded is not None) is in_place
        assert decoded.evolve(to_agent="Other") == Message(
            **{**{f: getattr(sent, f) for f in _FIELDS}, "to_agent": "Other"}
        )


_FIELDS = tuple(f.name for f in dataclasses.fields(Message) if f.init)


def test_deliveries_leased_together_are_written_with_their_own_deadlines() -> None:
    message = arrived(CONTENT)
    first = datetime(2026, 11, 26, 12, 0, 30, 250_000, tzinfo=UTC)
    later = first + timedelta(seconds=5, microseconds=7)
    stamps = codec.LeaseStamps()
    written = [
        codec.delivery_to_pb(Delivery(message, attempt, at), broker_pb2.Delivery(), stamps)
        for attempt, at in ((1, first), (2, first), (1, later), (3, first))
    ]
    assert [d.lease_expires_at.ToDatetime(UTC) for d in written] == [first, first, later, first]
    assert [d.delivery_attempt for d in written] == [1, 2, 1, 3]
    alone = codec.delivery_to_pb(Delivery(message, 1, later), broker_pb2.Delivery())
    assert alone == written[2]


def test_content_that_holds_itself_is_refused_saying_so() -> None:
    """A circular dict raised Python's RecursionError out of a send; it is the caller's
    mistake like any other content JSON cannot carry."""
    content: dict[str, object] = {"action": "loop"}
    content["self"] = content
    with pytest.raises(MessageValidationError, match=r"content nests too deep to encode \(is it"):
        codec.message_to_pb(Message(from_agent="A", to_agent="B", content=content))
    with pytest.raises(MessageValidationError, match="content nests more than 25 levels deep"):
        codec.check_depth(content)
    codec.check_depth({"action": "flat", "list": [[[1]]], "object": {"a": {"b": 1}}})


def test_a_json_value_a_caller_gives_with_text_utf8_cannot_write_names_where() -> None:
    """A state entry's value, a tool's arguments, an insight: a lone surrogate (what
    ``json.loads`` makes of an unpaired ``\\ud800`` escape) raised protobuf's bare
    UnicodeEncodeError; it is the caller's mistake, named like any other."""
    with pytest.raises(MessageValidationError, match=r"^value\.plan\.0 is not text UTF-8"):
        codec.encode_value({"plan": ["caf\udce9"]}, struct_pb2.Value(), "value")
    with pytest.raises(MessageValidationError, match=r"^arguments \(a key\) is not text"):
        codec.encode_struct({"\ud800": 1}, struct_pb2.Struct(), "arguments")
    out = struct_pb2.Value()
    codec.encode_value({"plan": ["café"]}, out, "value")
    assert codec.value_to_python(out) == {"plan": ["café"]}


def test_a_deliver_at_ahead_is_held_to_its_limits_and_one_past_means_at_once() -> None:
    """A scheduled message (``deliver_at`` ahead of this clock) is at most ``max_ttl`` ahead,
    due before a ttl it gives ends, and never an answer or an ack; a ``deliver_at`` already
    past passes on any message, as an answer made from a scheduled request carries it."""
    config = BrokerConfig(max_ttl=600, default_ttl=600)
    now = datetime.now(UTC)

    def problems(ahead: float, **fields: Any) -> list[str]:
        message = Message(
            from_agent="a",
            to_agent="b",
            content={"action": "x"},
            deliver_at=now + timedelta(seconds=ahead),
            **fields,
        )
        try:
            validate_message(message, config)
        except MessageValidationError as error:
            return [v.description for v in error.field_violations]
        return []

    assert problems(300) == []
    assert problems(900) == ["deliver_at must be at most 600 seconds ahead"]
    assert problems(30, ttl=60) == []
    assert problems(90, ttl=60) == [
        "deliver_at must come before the message's ttl of 60 s ends"
        " (60.0 s from now, counted from its timestamp)"
    ]
    for kind in (MessageType.RESPONSE, MessageType.ERROR, MessageType.ACK):
        assert problems(30, message_type=kind, correlation_id="c") == [
            f"deliver_at is not for a {kind.value}: it goes at once"
        ]
        assert problems(-30, message_type=kind, correlation_id="c") == []
    assert problems(-86400 * 2) == []

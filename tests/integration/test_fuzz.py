"""Property-based tests over every RPC of the contract, against real servers.

Hypothesis builds requests from the protobuf descriptors (arbitrary strings, numbers out of
range, unknown enum values, nested messages, Struct values, broken Durations) and also sends
random bytes; every Timestamp and Duration a request can carry is also sent past the limits
of its type. Whatever arrives, the answer is a defined status that names the caller's
mistake, never INTERNAL, UNKNOWN or UNIMPLEMENTED; the servers stay up; and messages accepted
before the storm are all still there after it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.research.corpus import RESEARCH_POLICY, DocumentFolder, research_tools
from gateway.server import serve_gateway
from mesh import AgentContext, LocalMesh, Message, SecurityConfig, agent, connect
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.core.tools import ToolHost
from mesh.v1 import (
    agent_pb2,
    broker_pb2,
    broker_pb2_grpc,
    gateway_pb2,
    memory_pb2,
    memory_pb2_grpc,
    message_pb2,
    tools_pb2,
)

T = TypeVar("T")

FORBIDDEN = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNAVAILABLE,  # the servers must stay up
}
FORBIDDEN_CODES = {c.value[0] for c in FORBIDDEN}
NAMES = ["", "Echo", "broadcast", "gateway", "x" * 300, "ünïcødé", "a/b", "\x00"]
CANARIES = 20


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    running = Servers.start(tmp_path_factory.mktemp("fuzz"))
    try:
        yield running
    finally:
        running.stop()


@dataclass
class Servers:
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    mesh: LocalMesh
    gateway: Any
    addresses: dict[str, str]
    canaries: list[str]

    @staticmethod
    def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    @classmethod
    def start(cls, folder: Path) -> Servers:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="fuzzed-servers", daemon=True)
        thread.start()

        @agent("Echo")
        async def echo(message: Message, ctx: AgentContext) -> dict:
            return {"echo": message.action}

        async def up() -> tuple[LocalMesh, Any, str, list[str]]:
            tools = ToolHost(
                research_tools(docs=DocumentFolder(), output=folder / "reports"),
                RESEARCH_POLICY,
            )
            mesh = await LocalMesh(
                BrokerConfig(sweep_interval=0.05, default_request_timeout=1.0),
                tool_host=tools,
            ).start()
            served = await mesh.add_agent(echo)
            gateway = await serve_gateway(mesh.address, security=SecurityConfig())
            async with connect(mesh.address, retry=NO_RETRY, security=SecurityConfig()) as c:
                await c.register("Canary")
                sent = [(await c.send("Canary", {"action": "keep"})).message_id for _ in range(20)]
            return mesh, gateway, served.address, sent

        mesh, gateway, agent_address, canaries = cls.run(loop, up())
        addresses = {
            "mesh.v1.BrokerService": mesh.address,
            "mesh.v1.MemoryService": mesh.address,
            "mesh.v1.ToolService": mesh.address,
            "mesh.v1.GatewayService": gateway.address,
            "mesh.v1.AgentService": agent_address,
        }
        return cls(loop, thread, mesh, gateway, addresses, canaries)

    def stop(self) -> None:
        async def down() -> None:
            await self.gateway.stop(0.5)
            await self.mesh.stop()

        self.run(self.loop, down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# -- requests from descriptors ----------------------------------------------------------------

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}

json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False, width=32) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return st.sampled_from(NAMES) | st.text(max_size=30)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=30)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(width=32 if kind == FieldDescriptor.TYPE_FLOAT else 64)
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.integers(-3, 12)  # open enums: unknown numbers arrive too
    low, high = _INT_RANGES[kind]
    return st.integers(max(low, -3), 100) | st.integers(low, high)


def message_of(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Messages of one type with arbitrary values in arbitrary fields."""
    cls = message_factory.GetMessageClass(descriptor)
    name = descriptor.full_name
    if name == "google.protobuf.Struct":
        return st.dictionaries(st.text(max_size=8), json_values, max_size=4).map(
            lambda d: json_format.ParseDict(d, cls())
        )
    if name == "google.protobuf.Value":
        return json_values.map(lambda v: json_format.ParseDict(v, cls()))
    if name in ("google.protobuf.Duration", "google.protobuf.Timestamp"):
        return st.builds(
            lambda s, n: cls(seconds=s, nanos=n),
            st.integers(-(10**6), 10**9),
            st.integers(-(2**31), 2**31 - 1),
        )
    if depth > 3:
        return st.just(cls())
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field = field.message_type.fields_by_name["key"]
            value_field = field.message_type.fields_by_name["value"]
            value = (
                message_of(value_field.message_type, depth + 1)
                if value_field.message_type
                else _scalar(value_field)
            )
            optional[field.name] = st.dictionaries(_scalar(key_field), value, max_size=3)
            continue
        one = message_of(field.message_type, depth + 1) if field.message_type else _scalar(field)
        is_repeated = field.is_repeated
        optional[field.name] = st.lists(one, max_size=3) if is_repeated else one

    def build(values: dict[str, Any]) -> Any:
        made = cls()
        for key, value in values.items():
            field = descriptor.fields_by_name[key]
            target = getattr(made, key)
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                for k, v in value.items():
                    if hasattr(v, "CopyFrom"):
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
            elif field.is_repeated:
                for item in value:
                    if hasattr(item, "CopyFrom"):
                        target.add().CopyFrom(item)
                    else:
                        target.append(item)
            elif field.message_type is not None:
                target.CopyFrom(value)
            else:
                setattr(made, key, value)
        return made

    return st.fixed_dictionaries({}, optional=optional).map(build)


def _methods() -> list[MethodDescriptor]:
    found = []
    for module, name in (
        (broker_pb2, "BrokerService"),
        (memory_pb2, "MemoryService"),
        (tools_pb2, "ToolService"),
        (gateway_pb2, "GatewayService"),
        (agent_pb2, "AgentService"),
    ):
        found.extend(module.DESCRIPTOR.services_by_name[name].methods)
    return found


METHODS = _methods()


def call(servers: Servers, method: MethodDescriptor, payloads: list[bytes]) -> list[int]:
    """Calls a method with raw request bytes; returns every status code it answered with
    (for Connect, also the codes of error frames)."""
    service = method.containing_service.full_name
    path = f"/{service}/{method.name}"
    codes: list[int] = []
    with grpc.insecure_channel(servers.addresses[service]) as channel:
        try:
            if method.client_streaming:
                responses = channel.stream_stream(path)(iter(payloads), timeout=1.5)
                for raw in responses:
                    frame = broker_pb2.ConnectResponse.FromString(raw)
                    if frame.HasField("error"):
                        codes.append(frame.error.code)
            elif method.server_streaming:
                # A watch that took its request has no end: half a second shows how it answered.
                timeout = 0.5 if method.name.startswith("Watch") else 1.5
                for count, _ in enumerate(channel.unary_stream(path)(payloads[0], timeout=timeout)):
                    if count > 50:
                        break
            else:
                channel.unary_unary(path)(payloads[0], timeout=3)
            codes.append(0)
        except grpc.RpcError as error:
            codes.append(error.code().value[0])
    return codes


def assert_defined(method: MethodDescriptor, codes: list[int]) -> None:
    bad = [c for c in codes if c in FORBIDDEN_CODES]
    assert not bad, f"{method.full_name} answered with status {bad}"


FUZZ = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


@pytest.mark.parametrize("method", METHODS, ids=[m.full_name for m in METHODS])
def test_every_rpc_answers_arbitrary_requests_with_a_defined_status(
    servers: Servers, method: MethodDescriptor
) -> None:
    requests = message_of(method.input_type).map(lambda m: m.SerializeToString())

    @FUZZ
    @given(st.lists(requests, min_size=1, max_size=4) if method.client_streaming else requests)
    def fuzz(payload: Any) -> None:
        payloads = payload if isinstance(payload, list) else [payload]
        assert_defined(method, call(servers, method, payloads))

    fuzz()


@pytest.mark.parametrize("method", METHODS, ids=[m.full_name for m in METHODS])
def test_every_rpc_answers_random_bytes_with_a_defined_status(
    servers: Servers, method: MethodDescriptor
) -> None:
    @FUZZ
    @given(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    def fuzz(payloads: list[bytes]) -> None:
        assert_defined(method, call(servers, method, payloads))

    fuzz()


def test_after_the_storm_servers_are_up_and_nothing_accepted_was_lost(servers: Servers) -> None:
    for address in set(servers.addresses.values()):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    async def drain() -> list[str]:
        async with connect(
            servers.mesh.address, retry=NO_RETRY, security=SecurityConfig()
        ) as client:
            return [m.message_id for m in await client.receive("Canary")]

    # Broadcasts of the storm may have added to the queue; nothing accepted went missing.
    assert set(servers.canaries) <= set(Servers.run(servers.loop, drain()))


# -- times at and past the limits of their types ------------------------------------------------

TIME_TYPES = ("google.protobuf.Timestamp", "google.protobuf.Duration")
OUT_OF_RANGE = [
    (-62_135_596_801, 0),  # a second before 0001-01-01T00:00:00Z
    (253_402_300_800, 0),  # a second after 9999-12-31T23:59:59Z
    (315_576_000_001, 0),  # a Duration past its 10,000 years
    (2**63 - 1, 0),
    (0, -1),  # nanos out of 0..999,999,999
    (0, 1_000_000_000),
]


def time_fields(descriptor: Descriptor, depth: int = 0) -> list[tuple[FieldDescriptor, ...]]:
    """Every Timestamp and Duration a request can carry, as the fields that lead to it."""
    found: list[tuple[FieldDescriptor, ...]] = []
    for field in descriptor.fields:
        kind = field.message_type
        if kind is None or kind.GetOptions().map_entry:
            continue
        if kind.full_name in TIME_TYPES:
            found.append((field,))
        elif depth < 4 and kind.full_name not in (
            "google.protobuf.Struct",
            "google.protobuf.Value",
        ):
            found.extend((field, *rest) for rest in time_fields(kind, depth + 1))
    return found


def with_time(
    method: MethodDescriptor, path: tuple[FieldDescriptor, ...], value: tuple[int, int]
) -> bytes:
    request = message_factory.GetMessageClass(method.input_type)()
    target = request
    for field in path[:-1]:
        target = (
            getattr(target, field.name).add() if field.is_repeated else getattr(target, field.name)
        )
    last = path[-1]
    time = getattr(target, last.name).add() if last.is_repeated else getattr(target, last.name)
    time.seconds, time.nanos = value
    return request.SerializeToString()


TIMED = [(m, p) for m in METHODS for p in time_fields(m.input_type)]


@pytest.mark.parametrize(
    ("method", "path"),
    TIMED,
    ids=[f"{m.name}:{'.'.join(f.name for f in p)}" for m, p in TIMED],
)
def test_a_time_out_of_its_range_is_refused_as_the_callers_mistake(
    servers: Servers, method: MethodDescriptor, path: tuple[FieldDescriptor, ...]
) -> None:
    for value in OUT_OF_RANGE:
        codes = call(servers, method, [with_time(method, path, value)])
        assert not [c for c in codes if c in FORBIDDEN_CODES], (
            f"{method.full_name} with {'.'.join(f.name for f in path)} = {value}: {codes}"
        )


def test_digits_that_int_cannot_read_are_refused_as_bad_input(servers: Servers) -> None:
    """Found by the fuzzing above: "¹" is a digit to str.isdigit, but int() cannot read it.
    A page token, or an address's port, made of such characters failed the call with
    INTERNAL; a page token is now refused as the argument it is, and an address whose port
    is no number is taken as gRPC would take it (a target it resolves)."""
    with grpc.insecure_channel(servers.addresses["mesh.v1.BrokerService"]) as channel:
        broker = broker_pb2_grpc.BrokerServiceStub(channel)
        for token in ("¹", "٣", "12a"):
            with pytest.raises(grpc.RpcError) as refused:
                broker.ListDeadLetters(broker_pb2.ListDeadLettersRequest(page_token=token))
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "page_token is not a next_page_token" in (refused.value.details() or "")
        registered = broker.RegisterAgent(
            broker_pb2.RegisterAgentRequest(
                agent=message_pb2.AgentInfo(agent_id="SuperscriptPort", address="127.0.0.1:¹")
            )
        )
        assert registered.agent.address == "127.0.0.1:¹"
        broker.DeregisterAgent(broker_pb2.DeregisterAgentRequest(agent_id="SuperscriptPort"))
    with grpc.insecure_channel(servers.addresses["mesh.v1.MemoryService"]) as channel:
        memory = memory_pb2_grpc.MemoryServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            memory.ReadInsights(memory_pb2.ReadInsightsRequest(page_token="²"))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT

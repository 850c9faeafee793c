"""Every bounded resource refuses with a clear error, the right status, and keeps what it had."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from gateway.client import GatewayClient
from gateway.dispatch import BrokerDispatcher
from gateway.server import serve_gateway
from mesh import (
    LocalMesh,
    Message,
    MessageQueueFullError,
    MessageValidationError,
    Priority,
    SecurityConfig,
)
from mesh.agent import agent
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.core.errors import LimitExceededError, MessageTooLargeError
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2


@pytest.fixture
async def small() -> AsyncIterator[LocalMesh]:
    config = BrokerConfig(
        max_agents=3, max_batch_size=3, max_context_bytes=1024, max_message_bytes=4096
    )
    async with LocalMesh(config) as mesh:
        yield mesh


async def held(mesh: LocalMesh) -> int:
    assert mesh.broker is not None
    return await mesh.broker.store.held()


async def test_message_size(small: LocalMesh) -> None:
    client = small.client("sender", retry=NO_RETRY)
    await client.register("Sink")
    with pytest.raises(MessageTooLargeError, match="the limit is 4096 bytes") as info:
        await client.send("Sink", {"action": "big", "parameters": {"blob": "x" * 5000}})
    assert info.value.code == "INVALID_ARGUMENT"
    assert await held(small) == 0


async def test_every_way_of_sending_keeps_to_the_message_size(small: LocalMesh) -> None:
    """A request, a broadcast and a gather were measured by nothing: messages far above the
    limit went out (up to gRPC's own 8 MB frame), on the session and on the unary calls
    alike. Each is refused like a send now, and no agent gets anything."""
    got: list[str] = []

    @agent("Sink", agent_types=["sink"])
    async def sink(message: Any, ctx: Any) -> dict[str, Any]:
        got.append(message.message_id)
        return {"ok": True}

    await small.add_agent(sink)
    big = {"action": "big", "parameters": {"blob": "x" * 5000}}
    client = small.client("sender", retry=NO_RETRY)

    async def gather() -> None:
        async for _ in client.gather(big, agent_ids=["Sink"], timeout=2):
            pass

    attempts: list[Callable[[], Awaitable[Any]]] = [
        lambda: client.request("Sink", big, timeout=2),
        lambda: client.broadcast(big),
        lambda: client.broadcast(big, agent_types=["sink"]),
        gather,
    ]
    for attempt in attempts:
        with pytest.raises(MessageTooLargeError, match="the limit is 4096 bytes") as info:
            await attempt()
        assert info.value.code == "INVALID_ARGUMENT"
    async with grpc.aio.insecure_channel(small.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        message = message_pb2.Message(from_agent="sender", to_agent="Sink")
        message.content.update(big)
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: stub.SendRequest(broker_pb2.SendRequestRequest(message=message), timeout=2),
            lambda: stub.Broadcast(broker_pb2.BroadcastRequest(message=message), timeout=2),
            lambda: _drain(
                stub.Gather(broker_pb2.GatherRequest(message=message, agent_ids=["Sink"]))
            ),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "the limit is 4096 bytes" in (refused.value.details() or "")
    assert await held(small) == 0
    assert got == []
    # (and within the limit, each goes through)
    assert (await client.request("Sink", {"action": "small"}, timeout=5)).content["ok"] is True


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


async def test_handoff_context_size(small: LocalMesh) -> None:
    client = small.client("sender", retry=NO_RETRY)
    await client.register("Seller")
    with pytest.raises(MessageValidationError, match="the limit is 1 KB") as info:
        await client.handoff("Seller", "approve", context={"notes": "y" * 2000})
    assert info.value.code == "INVALID_ARGUMENT"
    assert [v.field for v in info.value.field_violations] == ["content.parameters.context"]
    # As a plain HANDOFF message it is refused the same way.
    with pytest.raises(MessageValidationError, match="the limit is 1 KB"):
        await client.send(
            "Seller",
            {
                "action": "handoff",
                "parameters": {"task_description": "approve", "context": {"n": "y" * 2000}},
            },
            message_type="HANDOFF",
        )
    await client.handoff("Seller", "approve", context={"notes": "short"})
    assert await held(small) == 1


async def test_headers(small: LocalMesh) -> None:
    client = small.client("sender", retry=NO_RETRY)
    await client.register("Sink")
    with pytest.raises(MessageValidationError, match="at most 64 headers") as info:
        await client.send("Sink", {"action": "a"}, headers={f"h{i}": "v" for i in range(65)})
    assert info.value.field_violations[0].field == "headers"


async def test_registered_agents_and_their_descriptions(small: LocalMesh) -> None:
    client = small.client("admin", retry=NO_RETRY)
    for name in ("A", "B", "C"):
        await client.register(name)
    with pytest.raises(LimitExceededError, match="limit of 3 agents") as info:
        await client.register("D")
    assert info.value.code == "RESOURCE_EXHAUSTED"
    await client.register("A", agent_types=["again"])  # re-registering is not a new agent
    with pytest.raises(MessageValidationError, match="at most 32 agent_types"):
        await client.register("B", agent_types=[f"t{i}" for i in range(33)])
    assert sorted(a.agent_id for a in await client.list_agents()) == ["A", "B", "C"]


async def test_batch_size(small: LocalMesh) -> None:
    client = small.client("sender", retry=NO_RETRY)
    await client.register("Sink")
    batch = [client.build("Sink", {"action": "a"}) for _ in range(4)]
    with pytest.raises(MessageValidationError, match="at most 3 messages"):
        await client.send_batch(batch)
    assert await held(small) == 0
    results = await client.send_batch(batch[:3])
    assert [r.message_id for r in results] == [m.message_id for m in batch[:3]]  # type: ignore[union-attr]


async def test_pattern_group_sizes(small: LocalMesh) -> None:
    gateway = await serve_gateway(small.address, security=SecurityConfig())
    try:
        async with GatewayClient(gateway.address, security=SecurityConfig()) as gw:
            many = [f"agent{i}" for i in range(51)]
            cases = [
                gw.group_chat(agent_ids=many, query="q"),
                gw.collaborative_filtering(agent_ids=many, query="q"),
                gw.consensus(problem="p", proposer_id="a", reviewer_ids=many),
                gw.parallel([{"group_chat": {"agent_ids": ["a"], "query": "q"}}] * 17),
            ]
            for events in cases:
                with pytest.raises(MessageValidationError, match=r"at most (50 agents|16)") as info:
                    await gw.collect(events)
                assert info.value.code == "INVALID_ARGUMENT"
    finally:
        await gateway.stop(0.5)


async def test_a_flood_of_low_priority_does_not_starve_high() -> None:
    async with LocalMesh(BrokerConfig(max_messages_per_agent=100)) as mesh:
        flooder = mesh.client("flooder", retry=NO_RETRY)
        urgent = mesh.client("urgent", retry=NO_RETRY)
        await flooder.register("Worker")
        low_accepted = 0
        with pytest.raises(MessageQueueFullError, match="LOW priority"):
            while True:
                await flooder.send("Worker", {"action": "bulk"}, priority=Priority.LOW)
                low_accepted += 1
        assert low_accepted == 80  # the last 20 places are kept for HIGH and MEDIUM
        # The queue is full for LOW, yet HIGH traffic is still accepted...
        high = [
            (await urgent.send("Worker", {"action": "now"}, priority=Priority.HIGH)).message_id
            for _ in range(10)
        ]
        # ...and delivered ahead of the whole LOW backlog.
        sub = flooder.subscribe("Worker", max_in_flight=10)
        first = []
        async for delivery in sub:
            first.append(delivery.message.message_id)
            await delivery.ack()
            if len(first) == 10:
                break
        await sub.close()
        assert first == high


async def test_messages_near_the_size_limit_go_and_come_many_at_once() -> None:
    """Twelve messages of 900 KB (the limit is 1 MiB): sent at once over one session, taken
    by a plain gRPC client (4 MiB answers at most) and by the SDK a few per answer, and
    delivered to a subscriber; none refused, none lost."""
    blob = "x" * 900_000
    async with LocalMesh() as mesh:
        sender = mesh.client("sender", retry=NO_RETRY)
        await sender.register("Sink")

        async def send_twelve() -> None:
            sent = await asyncio.gather(
                *(
                    sender.send("Sink", {"action": "big", "parameters": {"i": i, "blob": blob}})
                    for i in range(12)
                )
            )
            assert len({m.message_id for m in sent}) == 12

        async def taken(receive: Callable[[], Awaitable[list[Any]]]) -> list[int]:
            found: list[int] = []
            while answer := await receive():
                assert len(answer) < 12  # (a few per answer: 3 MiB at most)
                found += [int(item) for item in answer]
            return found

        await send_twelve()
        async with grpc.aio.insecure_channel(mesh.address) as channel:  # gRPC's defaults
            stub = broker_pb2_grpc.BrokerServiceStub(channel)

            async def raw() -> list[Any]:
                answer = await stub.ReceiveMessages(
                    broker_pb2.ReceiveMessagesRequest(agent_id="Sink")
                )
                assert all(
                    len(m.content.fields["parameters"].struct_value.fields["blob"].string_value)
                    == 900_000
                    for m in answer.messages
                )
                return [
                    m.content.fields["parameters"].struct_value.fields["i"].number_value
                    for m in answer.messages
                ]

            assert sorted(await taken(raw)) == list(range(12))

        await send_twelve()
        receiver = mesh.client("Sink", retry=NO_RETRY)

        async def sdk() -> list[Any]:
            return [m.parameters["i"] for m in await receiver.receive("Sink")]

        assert sorted(await taken(sdk)) == list(range(12))

        await send_twelve()
        got: list[int] = []
        async with asyncio.timeout(30):
            async for delivered in receiver.subscribe("Sink", max_in_flight=16):
                assert delivered.message.parameters["blob"] == blob
                got.append(int(delivered.message.parameters["i"]))  # type: ignore[arg-type]
                await delivered.ack()
                if len(got) == 12:
                    break
        assert sorted(got) == list(range(12))
        await receiver.close()  # (after the acknowledgements still on their way)
        assert await held(mesh) == 0


async def test_a_group_chat_of_answers_near_the_size_limit_ends_with_its_result() -> None:
    """Five experts answering 900 KB each: every answer arrives in its CONTRIBUTION event,
    and the RESULT, which repeats them all, arrives too (13 MB before, which failed the run
    with 'Sent message larger than max'), its longest texts left out."""
    reasoning = "x" * 900_000
    async with LocalMesh() as mesh:
        for i in range(5):

            @agent(f"expert{i}", agent_types=["expert"])
            async def expert(message: Any, ctx: Any) -> dict[str, Any]:
                return {"recommendation": "Buy AAPL", "confidence": 0.8, "reasoning": reasoning}

            await mesh.add_agent(expert)
        gateway = await serve_gateway(mesh.address, security=SecurityConfig())
        try:
            async with GatewayClient(gateway.address, security=SecurityConfig()) as gw:
                events = await gw.collect(
                    gw.group_chat(agent_ids=[f"expert{i}" for i in range(5)], query="q")
                )
        finally:
            await gateway.stop(0.5)
    contributions = [e for e in events if e["kind"] == "CONTRIBUTION"]
    assert sorted(e["agent_id"] for e in contributions) == [f"expert{i}" for i in range(5)]
    assert all(e["data"]["reasoning"] == reasoning for e in contributions)
    result = events[-1]
    assert result["kind"] == "RESULT"
    assert result["data"]["status"] == "COMPLETED"
    assert result["data"]["aggregate"]["recommendation"].startswith("Buy AAPL")
    assert {"omitted_bytes": 900_004} in [c["reasoning"] for c in result["data"]["contributions"]]


def nested(depth: int) -> Any:
    """A JSON value ``depth`` objects deep."""
    value: Any = "bottom"
    for _ in range(depth):
        value = {"k": value}
    return value


async def test_what_nests_as_deep_as_the_mesh_takes_reaches_every_reader() -> None:
    """Protobuf's parsers stop at 100 levels. A request is read with 16 to spare, so that what
    it carries still decodes inside the deeper frames that carry it on: a batch of deliveries,
    an answer back to the requester, a pattern's events. Deeper: INVALID_ARGUMENT, and the
    queue goes on (one such message used to fail every batch frame it was in)."""
    got: list[Any] = []
    answer_with: dict[str, Any] = {}
    async with LocalMesh() as mesh:

        @agent("Deep", agent_types=["deep"])
        async def deep(message: Any, ctx: Any) -> dict[str, Any]:
            got.append(message.content)
            return {"status": "DONE", **answer_with}

        client = mesh.client("asker", retry=NO_RETRY)
        await client.register("Sink")
        depth = 40
        while True:  # the deepest value the broker takes
            try:
                await client.send("Sink", {"action": "keep", "nest": nested(depth)})
                break
            except MessageValidationError as error:
                assert "it nests more than 84 levels deep" in error.message
                assert error.code == "INVALID_ARGUMENT"
                depth -= 1
        assert depth >= 20  # JSON as deep as anyone writes it goes
        await client.send("Sink", {"action": "after"})
        async with mesh.client("Sink") as sink, sink.subscribe() as inbox:
            async for delivery in inbox:  # (both in one batch of deliveries)
                got.append(delivery.message.content)
                await delivery.ack()
                if len(got) == 2:
                    break
        assert got == [{"action": "keep", "nest": nested(depth)}, {"action": "after"}]

        # An answer as deep as an agent may send comes back to its requester, and inside a
        # pattern's events to the pattern's client.
        answer_with["nest"] = nested(depth - 2)
        await mesh.add_agent(deep)
        answer = await client.request("Deep", {"action": "echo"})
        assert answer.content["nest"] == nested(depth - 2)
        gateway = await serve_gateway(mesh.address, security=SecurityConfig())
        try:
            async with GatewayClient(gateway.address, security=SecurityConfig()) as gw:
                steps = [{"agent_id": "Deep"}]
                events = await gw.collect(gw.handoff_workflow(steps=steps, task="t"))
        finally:
            await gateway.stop(0.5)
        result = events[-1]["data"]
        assert result["status"] == "COMPLETED"
        assert result["final_result"]["nest"] == nested(depth - 2)
        assert result["previous_results"][0]["nest"] == nested(depth - 2)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def _deep_send(seq: int, depth: int) -> bytes:
    """A session `send` frame whose content nests ``depth`` objects: written by hand, since
    protobuf's own writer goes no deeper than its reader."""
    value = struct_pb2.Value(string_value="bottom").SerializeToString()
    for _ in range(depth):  # Value.struct_value -> Struct.fields entry {key, value}
        entry = _length_delimited(1, b"k") + _length_delimited(2, value)
        value = _length_delimited(5, _length_delimited(1, entry))
    action = struct_pb2.Value(string_value="deep").SerializeToString()
    content = _length_delimited(1, _length_delimited(1, b"action") + _length_delimited(2, action))
    content += _length_delimited(1, _length_delimited(1, b"nest") + _length_delimited(2, value))
    message = _length_delimited(2, b"sender") + _length_delimited(3, b"Sink")
    return bytes([0x08, seq]) + _length_delimited(3, message + _length_delimited(5, content))


async def test_a_session_frame_too_deep_is_refused_by_its_seq_and_the_batch_goes_on() -> None:
    """The frame names no seq the broker could read once decoded; it is read from the bytes,
    so its sender hears at once (it waited for its deadline before). In a batch, the frames
    around it are taken as they came."""
    async with LocalMesh() as mesh, grpc.aio.insecure_channel(mesh.address) as channel:
        client = mesh.client("sender", retry=NO_RETRY)
        await client.register("Sink")

        def send(seq: int, action: str) -> bytes:
            frame = broker_pb2.ConnectRequest(seq=seq)
            frame.send.from_agent, frame.send.to_agent = "sender", "Sink"
            frame.send.content.update({"action": action})
            return frame.SerializeToString()

        frames = [send(1, "first"), _deep_send(2, 40), _deep_send(3, 30), send(4, "last")]
        batch = _length_delimited(9, b"".join(_length_delimited(1, f) for f in frames))
        call = channel.stream_stream(
            "/mesh.v1.BrokerService/Connect",
            response_deserializer=broker_pb2.ConnectResponse.FromString,
        )()
        for raw in (batch, _deep_send(5, 30)):
            await call.write(raw)
        answers: dict[int, broker_pb2.ConnectResponse] = {}
        async with asyncio.timeout(10):
            while len(answers) < 5:
                frame = await call.read()
                for inner in frame.batch.frames if frame.HasField("batch") else [frame]:
                    answers[inner.seq] = inner
        await call.done_writing()
        assert {seq: a.WhichOneof("frame") for seq, a in answers.items()} == {
            1: "accepted",
            2: "error",
            3: "error",
            4: "accepted",
            5: "error",
        }
        for seq in (2, 3, 5):
            assert answers[seq].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "it nests more than 84 levels deep" in answers[seq].error.message
        assert [m.content["action"] for m in await client.receive("Sink")] == ["first", "last"]


async def test_a_listing_of_agents_past_one_answer_comes_in_pages() -> None:
    """140 agents of 128 capabilities of 250 characters each, about 4.5 MB: in one answer,
    more than a gRPC client reads by default (4 MiB), so that nobody could list the agents.
    ListAgents answers 3 MiB at most, or page_size agents, and says where to go on; pages go
    on by id, so that agents registering or leaving between pages move no other."""
    capabilities = [f"{i}-".ljust(250, "c") for i in range(128)]
    ids = [f"Wide{i:03d}" for i in range(140)]
    async with LocalMesh() as mesh, mesh.client("catalog") as client:
        for agent_id in ids:
            await client.register(agent_id, agent_types=["wide"], capabilities=capabilities)
        await client.register("Narrow", agent_types=["other"])
        async with grpc.aio.insecure_channel(mesh.address) as channel:  # gRPC's 4 MiB default
            stub = broker_pb2_grpc.BrokerServiceStub(channel)

            async def pages(**fields: Any) -> list[list[str]]:
                request = broker_pb2.ListAgentsRequest(**fields)
                found = []
                while True:
                    page = await stub.ListAgents(request)
                    found.append([a.agent_id for a in page.agents])
                    if not page.next_page_token:
                        return found
                    assert page.next_page_token == page.agents[-1].agent_id
                    request.page_token = page.next_page_token

            by_size = await pages()
            assert len(by_size) == 2 and 90 <= len(by_size[0]) < 140
            assert [a for page in by_size for a in page] == ["Narrow", *ids]
            by_count = await pages(agent_type="wide", page_size=50)
            assert by_count == [ids[:50], ids[50:100], ids[100:]]

            # Between pages: one agent leaves from the page read, one registers before the
            # token and one after it. Nobody else repeats or goes missing.
            first = await stub.ListAgents(broker_pb2.ListAgentsRequest(page_size=10))
            await client.deregister("Wide005")
            await client.register("Wide004b", agent_types=["wide"])
            await client.register("Wide100b", agent_types=["wide"])
            second = await stub.ListAgents(
                broker_pb2.ListAgentsRequest(page_size=10, page_token=first.next_page_token)
            )
            assert [a.agent_id for a in first.agents] == ["Narrow", *ids[:9]]
            assert [a.agent_id for a in second.agents] == ids[9:19]

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListAgents(broker_pb2.ListAgentsRequest(page_size=-1))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "page_size must not be negative" in (info.value.details() or "")
        # The SDK reads every page.
        listed = [a.agent_id for a in await client.list_agents("wide")]
        assert listed == sorted({*ids, "Wide004b", "Wide100b"} - {"Wide005"})
        assert len(listed) == 141


async def test_a_call_about_an_agent_that_names_none_is_invalid_not_not_found() -> None:
    """Subscribe, ReceiveMessages and DeregisterAgent without an agent_id answered NOT_FOUND
    "agent  is not registered", as if an agent "" were missing, and Ack, Nack and ExtendLease
    OK having done nothing: the request is what is wrong."""
    async with LocalMesh() as mesh, grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        calls = [
            lambda: stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest()),
            lambda: stub.DeregisterAgent(
                broker_pb2.DeregisterAgentRequest(address="10.0.0.7:7000")
            ),
            lambda: anext(aiter(stub.Subscribe(broker_pb2.SubscribeRequest()))),
            # (These answered OK having done nothing: the messages stayed leased.)
            lambda: stub.Ack(broker_pb2.AckRequest(message_ids=["m1"])),
            lambda: stub.Nack(broker_pb2.NackRequest(message_ids=["m1"])),
            lambda: stub.ExtendLease(broker_pb2.ExtendLeaseRequest(message_ids=["m1"])),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == "agent_id is required"


async def test_a_subscriptions_window_and_lengths_are_checked_before_it_opens() -> None:
    """A NaN lease, a negative window or ack linger, an insight's NaN ttl: the caller's
    mistake, MessageValidationError naming the field before anything is sent (they were a
    bare ValueError from protobuf, or taken as they came). A negative max_messages is refused
    on a session as on ReceiveMessages (a session took it for "all")."""
    async with LocalMesh() as mesh, mesh.client("reader") as client:
        await client.register("Desk")
        await client.send("Desk", {"action": "keep"})
        for options, field in (
            ({"max_in_flight": -1}, "max_in_flight"),
            ({"lease_seconds": float("nan")}, "lease_seconds"),
            ({"ack_linger": float("inf")}, "ack_linger"),
        ):
            with pytest.raises(MessageValidationError) as info:
                client.subscribe("Desk", **options)  # type: ignore[arg-type]
            assert [v.field for v in info.value.field_violations] == [field]
        with pytest.raises(MessageValidationError, match="ttl must be a finite number"):
            await client.write_insight("note", ttl=float("nan"))
        with pytest.raises(MessageValidationError, match="max_messages must not be negative"):
            await client.receive("Desk", max_messages=-1)
        assert [m.content["action"] for m in await client.receive("Desk")] == ["keep"]
        assert (await client.memory_stats()).total_insights == 0


async def test_a_group_chat_whose_history_outgrows_the_message_limit_ends_with_its_rounds(
    small: LocalMesh,
) -> None:
    """Round 2 shows every agent the history; with long answers that broadcast is above the
    broker's message limit. The chat failed INVALID_ARGUMENT, as if the caller had erred, and
    lost round 1; now it ends there, PARTIAL, saying why."""
    for agent_id in ("A", "B", "C"):

        @agent(agent_id)
        async def expert(message: Any, ctx: Any) -> dict[str, Any]:
            return {"recommendation": "Buy AAPL", "confidence": 0.8, "reasoning": "r" * 1500}

        await small.add_agent(expert)
    gateway = await serve_gateway(small.address)
    try:
        async with GatewayClient(gateway.address) as client:
            events = await client.collect(
                client.group_chat(agent_ids=["A", "B", "C"], query="Which stock?", rounds=3)
            )
    finally:
        await gateway.stop(0.5)
    kinds = [(e["kind"], e["round"]) for e in events]
    assert kinds[-3:] == [("FAILURE", 2), ("AGGREGATION", 0), ("RESULT", 0)], kinds
    assert [r for k, r in kinds if k == "CONTRIBUTION"] == [1, 1, 1]
    result = events[-1]["data"]
    assert (result["status"], result["rounds_run"]) == ("PARTIAL", 1)
    assert result["stopped_early"].startswith("round 2 was not run: its broadcast, with the")
    assert "the limit is 4096 bytes" in result["stopped_early"]
    assert result["aggregate"]["consensus"] == "Buy AAPL"
    assert [h["round"] for h in result["message_history"]] == [1, 1, 1, 1]  # (no round 2)


async def test_a_pattern_in_the_brokers_process_keeps_to_the_message_size(small: LocalMesh) -> None:
    """The in-process dispatcher measures what it sends as the wire would: a pattern's
    message above the limit is refused there as it is through a gateway over gRPC."""
    assert small.broker is not None
    client = small.client("sender", retry=NO_RETRY)
    await client.register("Sink")
    dispatcher = BrokerDispatcher(small.broker)
    big = Message(
        from_agent="gateway", to_agent="Sink", content={"action": "big", "blob": "x" * 5000}
    )
    with pytest.raises(MessageTooLargeError, match="the limit is 4096 bytes"):
        await dispatcher.ask(big, 2)
    items = dispatcher.gather(big.evolve(to_agent="group"), ["Sink"], 2)
    with pytest.raises(MessageTooLargeError, match="the limit is 4096 bytes"):
        await anext(items)
    assert await held(small) == 0

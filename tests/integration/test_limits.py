"""Every bounded resource refuses with a clear error, the right status, and keeps what it had."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from gateway.client import GatewayClient
from gateway.server import serve_gateway
from mesh import LocalMesh, MessageQueueFullError, MessageValidationError, Priority, SecurityConfig
from mesh.agent import agent
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.core.errors import LimitExceededError, MessageTooLargeError
from mesh.v1 import broker_pb2, broker_pb2_grpc


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

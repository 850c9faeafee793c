"""RF-009 (agent communication and hand-off), scenarios 1 to 20, through real gRPC servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

from mesh import (
    Agent,
    AgentClient,
    AgentContext,
    AgentError,
    BrokerConfig,
    LocalMesh,
    Message,
    MessageIdTakenError,
    MessageQueueFullError,
    MessageType,
    MessageValidationError,
    Priority,
    RequestTimeoutError,
    agent,
    connect,
    on,
)
from mesh.client import NO_RETRY, MeshClient
from mesh.codec import message_to_pb
from mesh.config import ServerConfig
from mesh.core.broker import Broker
from mesh.core.queue import InMemoryQueueStore
from mesh.logs import JsonFormatter
from mesh.server import serve_broker
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2
from tests.helpers.processes import free_port

HIGH = message_pb2.PRIORITY_HIGH
ISO_8601 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}")


async def register(client: MeshClient, *agents: str, agent_types: tuple[str, ...] = ()) -> None:
    for agent_id in agents:
        await client.register(agent_id, agent_types=agent_types)


class Collector:
    """An agent that records what it gets and answers REQUESTs with what it was told."""

    def __init__(self) -> None:
        self.got: list[Message] = []
        self.arrived = asyncio.Event()

    def make(self, agent_id: str, reply: dict | None = None, **kwargs: object) -> Agent:
        async def handler(message: Message, ctx: AgentContext) -> dict | None:
            self.got.append(message)
            self.arrived.set()
            return reply

        return agent(agent_id, **kwargs)(handler)  # type: ignore[arg-type]

    async def wait(self, count: int = 1, timeout: float = 5.0) -> list[Message]:
        async with asyncio.timeout(timeout):
            while len(self.got) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return self.got


async def test_scenario_01_send_message_between_agents(mesh: LocalMesh) -> None:
    async with mesh.client("FlightAgent") as flight:
        await register(flight, "PaymentAgent", "FlightAgent")
        sent = await flight.send(
            "PaymentAgent",
            {"action": "process_payment", "parameters": {"flight": "Flight A", "amount": 450}},
            message_type=MessageType.REQUEST,
        )
        assert uuid.UUID(sent.message_id).version == 4
        stats = await flight.queue_stats("PaymentAgent")
        assert stats.agents[0].depth == 1

        [got] = await flight.receive("PaymentAgent")
        assert got.message_id == sent.message_id
        assert got.from_agent == "FlightAgent"
        assert got.to_agent == "PaymentAgent"
        assert got.message_type is MessageType.REQUEST
        assert got.content == {
            "action": "process_payment",
            "parameters": {"flight": "Flight A", "amount": 450},
        }
        assert ISO_8601.match(got.to_dict()["timestamp"])


async def test_scenario_01_in_rf009s_own_words(mesh: LocalMesh) -> None:
    """``FlightAgent.send_message(to_agent=..., message_type="REQUEST", content={...})``."""
    async with mesh.client("FlightAgent") as flight:
        await register(flight, "PaymentAgent", "FlightAgent")
        content = {"action": "process_payment", "parameters": {"flight": "Flight A"}}
        sent = await flight.send_message(
            to_agent="PaymentAgent", message_type="REQUEST", content=content, priority="HIGH"
        )
        assert (sent.message_type, sent.priority) == (MessageType.REQUEST, Priority.HIGH)
        [got] = await flight.receive_messages("PaymentAgent")
        assert (got.message_id, got.from_agent, got.content) == (
            sent.message_id,
            "FlightAgent",
            content,
        )
        assert got.message_type is MessageType.REQUEST and got.priority is Priority.HIGH
        with pytest.raises(TypeError, match="needs a message, or to_agent="):
            await flight.send_message(content=content)
        with pytest.raises(TypeError, match="takes no fields: ttl"):
            await flight.send_message(sent, ttl=5)
        with pytest.raises(MessageValidationError, match="priority 'URGENT' is not one of HIGH"):
            await flight.send_message(to_agent="PaymentAgent", content=content, priority="URGENT")
        assert await flight.receive_messages("PaymentAgent") == []  # nothing else went


async def test_scenario_02_receive_messages(mesh: LocalMesh) -> None:
    async with mesh.client() as client:
        await register(client, "PaymentAgent")
        for mid, sender in (
            ("msg_001", "FlightAgent"),
            ("msg_002", "HotelAgent"),
            ("msg_003", "CarAgent"),
        ):
            await client.send_message(
                Message(
                    message_id=mid,
                    from_agent=sender,
                    to_agent="PaymentAgent",
                    content={"action": "process_payment"},
                )
            )
        messages = await client.receive("PaymentAgent")
        assert [m.message_id for m in messages] == ["msg_001", "msg_002", "msg_003"]
        assert [m.from_agent for m in messages] == ["FlightAgent", "HotelAgent", "CarAgent"]
        assert all(m.message_type is MessageType.REQUEST for m in messages)
        assert await client.receive("PaymentAgent") == []  # removed from the queue


async def test_scenario_03_broadcast_to_all_agents(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mesh.broker")
    names = ["FlightAgent", "HotelAgent", "CarAgent", "PaymentAgent", "NotifyAgent"]
    async with mesh.client("Orchestrator") as orchestrator:
        await register(orchestrator, "Orchestrator", *names)
        result = await orchestrator.broadcast({"alert": "System maintenance in 10 minutes"})
        assert sorted(result.recipients) == sorted(names)
        copies = {}
        for name in names:
            [copy] = await orchestrator.receive(name)
            copies[name] = copy
        assert await orchestrator.receive("Orchestrator") == []  # not to the sender
        first = copies["FlightAgent"].to_dict()
        for name, copy in copies.items():
            assert copy.to_agent == name
            assert copy.message_type is MessageType.BROADCAST
            assert copy.content == {"alert": "System maintenance in 10 minutes"}
            data = copy.to_dict()
            assert {k: v for k, v in data.items() if k != "to_agent"} == {
                k: v for k, v in first.items() if k != "to_agent"
            }
    logged = [r for r in caplog.records if getattr(r, "event", {}).get("category") == "broadcast"]
    assert logged and sorted(logged[-1].event["recipients"]) == sorted(names)


async def test_scenario_03_in_rf009s_own_calls_a_prepared_message_is_broadcast(
    mesh: LocalMesh,
) -> None:
    """RF-009's layer spells it ``broadcast(message)`` and ``receive_messages(agent_id)``:
    a prepared message goes to every other agent as a BROADCAST with its id and priority."""
    names = ["FlightAgent", "HotelAgent"]
    async with mesh.client("Orchestrator") as orchestrator:
        await register(orchestrator, "Orchestrator", *names)
        alert = Message(
            message_id="msg_alert",
            from_agent="Orchestrator",
            to_agent="",
            content={"alert": "System maintenance in 10 minutes"},
            priority=Priority.HIGH,
        )
        result = await orchestrator.broadcast(alert)
        assert (result.message_id, sorted(result.recipients)) == ("msg_alert", names)
        for name in names:
            [copy] = await orchestrator.receive_messages(name)
            assert (copy.message_id, copy.to_agent, copy.message_type, copy.priority) == (
                "msg_alert",
                name,
                MessageType.BROADCAST,
                Priority.HIGH,
            )
        assert await orchestrator.receive_messages("Orchestrator") == []
        with pytest.raises(TypeError, match="takes no options: ttl"):
            await orchestrator.broadcast(alert, ttl=5)
        # Scenario 3's words: broadcast(message_type="BROADCAST", content={...}).
        again = await orchestrator.broadcast(message_type="BROADCAST", content={"alert": "again"})
        assert sorted(again.recipients) == names
        for name in names:
            [copy] = await orchestrator.receive_messages(name)
            assert (copy.message_type, copy.content) == (MessageType.BROADCAST, {"alert": "again"})


async def test_scenario_03_a_broadcast_alert_to_running_agents_is_taken_not_answered(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """The alert reaches every running agent once: a catch-all agent's handler returns
    something, yet nobody answers a broadcast that was not asked (the sender's queue stays
    empty), an agent with no handler for it leaves it aside, and nothing is redelivered,
    dead-lettered or refused. A gather to the same agents is answered by each."""
    caplog.set_level(logging.WARNING)
    seen: list[str] = []

    @agent("FlightAgent", agent_types=["travel"])
    async def flight(message: Message, ctx: AgentContext) -> dict[str, object]:
        seen.append(f"flight:{message.message_type.value}")
        return {"noted": True}

    class Payment(Agent):
        agent_id = "PaymentAgent"
        agent_types = ("travel",)

        @on("process_payment")
        async def pay(self, message: Message, ctx: AgentContext) -> dict[str, object]:
            return {"status": "PAID"}

    await mesh.add_agent(flight)
    await mesh.add_agent(Payment())
    async with mesh.client("Orchestrator") as orchestrator:
        await orchestrator.register("Orchestrator")
        result = await orchestrator.broadcast({"alert": "System maintenance in 10 minutes"})
        assert sorted(result.recipients) == ["FlightAgent", "PaymentAgent"]
        async with asyncio.timeout(5):
            while seen != ["flight:BROADCAST"]:  # noqa: ASYNC110 - the agent's progress
                await asyncio.sleep(0.02)
            while (await orchestrator.queue_stats()).totals["delivered_count"] < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # (an answer, were one sent, would be queued by now)
        assert await orchestrator.receive("Orchestrator") == []
        totals = (await orchestrator.queue_stats()).totals
        assert (totals["held"], totals["redelivered_count"], totals["dead_lettered_count"]) == (
            0,
            0,
            0,
        )
        # Asked, every agent answers at once: PaymentAgent, which has no handler for it,
        # with an ERROR (the gather does not wait its timeout for it).
        answers = {
            item.agent_id: (item.response.message_type, item.response.content.get("reason"))
            async for item in orchestrator.gather(
                {"query": "status?"}, agent_types=["travel"], timeout=30
            )
            if item.response is not None
        }
        assert answers == {
            "FlightAgent": (MessageType.RESPONSE, None),
            "PaymentAgent": (MessageType.ERROR, "UNHANDLED_ACTION"),
        }
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_scenario_04_request_response_correlation(mesh: LocalMesh) -> None:
    class Payment(Agent):
        agent_id = "PaymentAgent"

        @on("process_payment")
        async def pay(self, message: Message, ctx: AgentContext) -> dict:
            return {"status": "PAID", "amount": message.parameters["amount"]}

    await mesh.add_agent(Payment())
    async with mesh.client("HotelAgent") as hotel:
        response = await hotel.request(
            "PaymentAgent",
            {"action": "process_payment", "parameters": {"amount": 120}},
            correlation_id="cor_123",
        )
    assert response.correlation_id == "cor_123"
    assert response.message_type is MessageType.RESPONSE
    assert response.from_agent == "PaymentAgent"
    assert response.to_agent == "HotelAgent"
    assert response.content == {"action": "process_payment", "status": "PAID", "amount": 120}


async def test_scenario_05_message_priority(mesh: LocalMesh) -> None:
    async with mesh.client() as client:
        await register(client, "PaymentAgent")
        table = [
            ("msg_001", Priority.LOW, "2025-11-16T10:00:00+00:00"),
            ("msg_002", Priority.HIGH, "2025-11-16T10:00:05+00:00"),
            ("msg_003", Priority.MEDIUM, "2025-11-16T10:00:02+00:00"),
        ]
        for mid, priority, ts in table:
            await client.send_message(
                Message(
                    message_id=mid,
                    from_agent="FlightAgent",
                    to_agent="PaymentAgent",
                    content={"action": "process_payment"},
                    priority=priority,
                    timestamp=datetime.fromisoformat(ts),
                )
            )
        messages = await client.receive("PaymentAgent")
    assert [(m.message_id, m.priority) for m in messages] == [
        ("msg_002", Priority.HIGH),
        ("msg_003", Priority.MEDIUM),
        ("msg_001", Priority.LOW),
    ]


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_scenario_06_message_ttl(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mesh.broker")
    clock = ManualClock()
    broker = Broker(BrokerConfig(), store=InMemoryQueueStore(clock=clock))
    async with LocalMesh(broker=broker) as local, local.client("FlightAgent") as flight:
        await register(flight, "PaymentAgent")
        sent = await flight.send("PaymentAgent", {"action": "process_payment"}, ttl=60)
        clock.now += 65
        assert await flight.receive("PaymentAgent") == []
        report = await flight.queue_stats()
        assert report.totals["expired_count"] == 1
    expired = [r for r in caplog.records if getattr(r, "event", {}).get("category") == "expired"]
    assert [r.event["message_id"] for r in expired] == [sent.message_id]
    assert expired[0].event["ttl"] == 60


async def test_scenario_06_a_message_made_longer_ago_than_its_ttl_is_never_delivered(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """Sent at T with ttl 60, received at T+65: over plain gRPC, as any client sends it."""
    caplog.set_level(logging.INFO, logger="mesh.broker")
    now = datetime.now(UTC)

    def stamped(action: str, seconds_ago: float, ttl: int = 0) -> message_pb2.Message:
        pb = message_pb2.Message(from_agent="FlightAgent", to_agent="PaymentAgent", ttl=ttl)
        pb.content.update({"action": action})
        pb.timestamp.FromDatetime(now - timedelta(seconds=seconds_ago))
        return pb

    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id="PaymentAgent"))
        )
        late = await stub.SendMessage(
            broker_pb2.SendMessageRequest(message=stamped("late", 65, ttl=60))
        )
        for message in (
            stamped("in_time", 30, ttl=60),
            stamped("no_ttl", 300 * 86_400),  # the default ttl counts from acceptance
            stamped("ahead", -120, ttl=60),  # a clock ahead of the broker's
        ):
            await stub.SendMessage(broker_pb2.SendMessageRequest(message=message))
        received = await stub.ReceiveMessages(
            broker_pb2.ReceiveMessagesRequest(agent_id="PaymentAgent")
        )
        stats = await stub.GetQueueStats(broker_pb2.GetQueueStatsRequest())
    # (MEDIUM all, so in timestamp order)
    assert [m.content["action"] for m in received.messages] == ["no_ttl", "in_time", "ahead"]
    assert late.message.message_id
    assert stats.totals.expired_count == 1
    expired = [r for r in caplog.records if getattr(r, "event", {}).get("category") == "expired"]
    assert [r.event["message_id"] for r in expired] == [late.message.message_id]


async def test_scenario_06_a_ttl_counts_from_the_timestamp_while_queued() -> None:
    clock = ManualClock()
    broker = Broker(BrokerConfig(), store=InMemoryQueueStore(clock=clock))
    async with LocalMesh(broker=broker) as local, local.client("FlightAgent") as flight:
        await register(flight, "PaymentAgent")
        made_earlier = datetime.now(UTC) - timedelta(seconds=50)
        for action, timestamp in (("made_earlier", made_earlier), ("made_now", None)):
            stamp = {"timestamp": timestamp} if timestamp else {}
            await flight.send_message(
                Message(
                    from_agent="FlightAgent",
                    to_agent="PaymentAgent",
                    content={"action": action},
                    ttl=60,
                    **stamp,  # type: ignore[arg-type]
                )
            )
        clock.now += 11  # 61 s after the first was made, 11 s after the second
        received = await flight.receive("PaymentAgent")
        report = await flight.queue_stats()
    assert [m.content["action"] for m in received] == ["made_now"]
    assert report.totals["expired_count"] == 1


async def test_a_request_or_gather_older_than_its_ttl_is_refused_at_once(
    mesh: LocalMesh,
) -> None:
    collector = Collector()
    await mesh.add_agent(
        collector.make("PaymentAgent", reply={"status": "PAID"}, agent_types=["payment"])
    )
    async with mesh.client("HotelAgent") as hotel:
        stale = Message(
            from_agent="HotelAgent",
            to_agent="PaymentAgent",
            content={"action": "process_payment"},
            ttl=5,
            timestamp=datetime.now(UTC) - timedelta(seconds=10),
        )
        with pytest.raises(RequestTimeoutError, match="expired before it was queued"):
            await hotel.request_message(stale, timeout=30)
        with pytest.raises(RequestTimeoutError, match="expired before it was queued"):
            question = Message(
                from_agent="HotelAgent",
                to_agent="broadcast",
                message_type=MessageType.BROADCAST,
                content={"query": "q"},
                ttl=5,
                timestamp=stale.timestamp,
            )
            async for _ in hotel.gather(question, agent_types=["payment"], timeout=30):
                pass
        # What is in time still gets its answer; the stale ones never reached the agent.
        answer = await hotel.request("PaymentAgent", {"action": "process_payment"}, ttl=5)
        report = await hotel.queue_stats()
    assert answer.content["status"] == "PAID"
    assert [m.content["action"] for m in collector.got] == ["process_payment"]
    assert collector.got[0].message_id == answer.correlation_id
    assert report.totals["expired_count"] == 2


async def test_a_request_or_gather_that_expires_in_the_queue_is_timed_out_then(
    mesh: LocalMesh,
) -> None:
    """A request with a ttl shorter than its caller's timeout, to an agent that does not take
    it (registered, nobody consuming): the caller hears DEADLINE_EXCEEDED as the ttl ends,
    not at its own deadline; a gather's copy likewise, beside the agents that answered."""
    collector = Collector()
    await mesh.add_agent(
        collector.make("PaymentAgent", reply={"status": "PAID"}, agent_types=["payment"])
    )
    async with mesh.client("HotelAgent") as hotel, mesh.client("LedgerAgent") as ledger:
        await ledger.register(agent_types=["payment"])  # and never consumes
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError, match=r"did not take request .* within its ttl"):
            await hotel.request("LedgerAgent", {"action": "record"}, ttl=1, timeout=20)
        assert time.monotonic() - started < 10
        started = time.monotonic()
        results = [
            r
            async for r in hotel.gather(
                {"action": "quote"}, agent_types=["payment"], ttl=1, timeout=20
            )
        ]
        assert time.monotonic() - started < 10
        report = await hotel.queue_stats()
    assert [(r.agent_id, type(r.error).__name__) for r in results] == [
        ("PaymentAgent", "NoneType"),
        ("LedgerAgent", "RequestTimeoutError"),
    ]
    assert results[0].response is not None and results[0].response.content["status"] == "PAID"
    assert "LedgerAgent did not take broadcast" in str(results[1].error)
    assert report.totals["expired_count"] == 2


async def test_scenario_06_ttl_limits(mesh: LocalMesh) -> None:
    async with mesh.client("FlightAgent") as flight:
        await register(flight, "PaymentAgent")
        with pytest.raises(MessageValidationError, match="ttl must be at most 86400 seconds"):
            await flight.send("PaymentAgent", {"action": "x"}, ttl=86_401)
        await flight.send("PaymentAgent", {"action": "x"}, ttl=86_400)


async def test_scenario_07_handoff_between_agents(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mesh.handoff")
    seller = Collector()
    await mesh.add_agent(seller.make("SellerAgent"))
    async with mesh.client("CustomerAgent") as customer:
        await customer.handoff(
            "SellerAgent",
            "Approve refund for order 12345",
            context={"order_id": "12345", "reason": "defective product", "amount": 50},
            previous_result={"order_id": "12345", "refund_eligible": True},
            workflow_id="wf_refund_123",
            step_number=2,
        )
    [got] = await seller.wait()
    assert got.message_type is MessageType.HANDOFF
    handoff = got.handoff
    assert handoff is not None
    assert handoff.task_description == "Approve refund for order 12345"
    assert handoff.context == {"order_id": "12345", "reason": "defective product", "amount": 50}
    assert handoff.previous_result == {"order_id": "12345", "refund_eligible": True}
    assert handoff.constraints == {}
    assert (handoff.workflow_id, handoff.step_number) == ("wf_refund_123", 2)
    logged = [r for r in caplog.records if getattr(r, "event", {}).get("category") == "handoff"]
    assert logged[-1].event["to_agent"] == "SellerAgent"


async def test_scenario_07_step_increments_when_an_agent_hands_on(mesh: LocalMesh) -> None:
    payment = Collector()
    await mesh.add_agent(payment.make("PaymentAgent"))

    @agent("SellerAgent")
    async def seller(message: Message, ctx: AgentContext) -> None:
        await ctx.handoff(
            "PaymentAgent",
            "Pay refund",
            context=message.handoff.context,
            previous_result={"approved": True},
        )

    await mesh.add_agent(seller)
    async with mesh.client("CustomerAgent") as customer:
        await customer.handoff(
            "SellerAgent",
            "Approve refund",
            context={"order_id": "12345"},
            workflow_id="wf_1",
            step_number=1,
        )
    [got] = await payment.wait()
    assert (got.handoff.workflow_id, got.handoff.step_number) == ("wf_1", 2)
    assert got.from_agent == "SellerAgent"


async def test_scenario_07_a_handoff_of_the_wrong_shape_is_refused_naming_the_part(
    mesh: LocalMesh,
) -> None:
    """A step "2" was read as step 0 and a context "x" as none, each without a word; the SDK
    refuses them before sending, and the broker from a client that is no SDK."""
    async with mesh.client("CustomerAgent") as customer:
        await register(customer, "SellerAgent")
        for field, options in [
            ("step_number", {"step_number": "2"}),
            ("step_number", {"step_number": True}),
            ("context", {"context": "x"}),
            ("constraints", {"constraints": ["fast"]}),
            ("task_description", {"task_description": 5}),
        ]:
            options.setdefault("task_description", "Approve refund")
            with pytest.raises(MessageValidationError) as refused:
                await customer.handoff("SellerAgent", **options)
            assert [v.field for v in refused.value.field_violations] == [field]

        async with grpc.aio.insecure_channel(mesh.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            for field, parameters, metadata in [
                ("metadata.step_number", {}, {"step_number": "2"}),
                ("metadata.step_number", {}, {"step_number": 1.5}),
                ("metadata.workflow_id", {}, {"workflow_id": {"id": 1}}),
                ("content.parameters.context", {"context": "x"}, {}),
                ("content.parameters.constraints", {"constraints": [1]}, {}),
                ("content.parameters.task_description", {"task_description": 5}, {}),
            ]:
                message = message_pb2.Message(
                    from_agent="CustomerAgent",
                    to_agent="SellerAgent",
                    message_type=message_pb2.MESSAGE_TYPE_HANDOFF,
                )
                message.content.update(
                    {
                        "action": "execute_handoff",
                        "parameters": {"task_description": "Approve refund", **parameters},
                    }
                )
                message.metadata.update({"workflow_id": "wf_1", **metadata})
                with pytest.raises(grpc.aio.AioRpcError) as refused_rpc:
                    await stub.SendMessage(broker_pb2.SendMessageRequest(message=message))
                assert refused_rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"{field} must be" in (refused_rpc.value.details() or "")
        assert await customer.receive_messages("SellerAgent") == []


async def test_scenario_08_handoff_with_context_transfer(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mesh.handoff")
    payment = Collector()
    await mesh.add_agent(payment.make("PaymentAgent"))
    context = {
        "user_preferences": {"prefer_morning": True, "notes": "x" * 4700},
        "travel_dates": {"departure": "Dec 15", "return": "Dec 20"},
        "selected_flight": {"id": "Flight A", "price": 450},
    }
    size_kb = len(json.dumps(context, separators=(",", ":")).encode()) / 1024
    assert 4.5 < size_kb < 5.5
    async with mesh.client("FlightAgent") as flight:
        await flight.handoff("PaymentAgent", "Charge the selected flight", context=context)
    [got] = await payment.wait()
    assert got.handoff.context == context
    assert got.handoff.context["user_preferences"]["prefer_morning"] is True
    [log] = [r for r in caplog.records if getattr(r, "event", {}).get("category") == "handoff"]
    assert log.event["context_size_kb"] == pytest.approx(size_kb, abs=0.01)


async def test_scenario_09_sequential_handoff_chain(mesh: LocalMesh) -> None:
    done = Collector()
    await mesh.add_agent(done.make("WorkflowObserver"))
    chain = ["CustomerAgent", "SellerAgent", "PaymentAgent", "NotificationAgent"]
    results = {
        "CustomerAgent": {"order_id": "12345", "eligible": True},
        "SellerAgent": {"approved": True, "reason": "defective"},
        "PaymentAgent": {"refunded": 50, "status": "SUCCESS"},
        "NotificationAgent": {"email": "SENT"},
    }
    seen: list[tuple[str, object, int]] = []

    def make(index: int, name: str) -> Agent:
        async def handler(message: Message, ctx: AgentContext) -> None:
            handoff = message.handoff
            seen.append((name, handoff.previous_result, handoff.step_number))
            nxt = chain[index + 1] if index + 1 < len(chain) else "WorkflowObserver"
            await ctx.handoff(
                nxt, f"step after {name}", context=handoff.context, previous_result=results[name]
            )

        return agent(name)(handler)

    for i, name in enumerate(chain):
        await mesh.add_agent(make(i, name))
    async with mesh.client("user") as user:
        await user.handoff(
            "CustomerAgent",
            "Process refund for order #12345",
            workflow_id="wf_chain",
            step_number=1,
        )
    [final] = await done.wait()
    assert [s[0] for s in seen] == chain
    assert [s[2] for s in seen] == [1, 2, 3, 4]
    assert seen[1][1] == results["CustomerAgent"]
    assert seen[2][1] == results["SellerAgent"]
    assert seen[3][1] == results["PaymentAgent"]
    assert final.handoff.previous_result == {"email": "SENT"}
    assert mesh.broker is not None and mesh.broker.metrics.totals.handoffs == 5


@pytest.mark.parametrize(
    ("approval", "expected"), [("APPROVED", "PaymentAgent"), ("REJECTED", "NotificationAgent")]
)
async def test_scenario_10_conditional_handoff(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture, approval: str, expected: str
) -> None:
    caplog.set_level(logging.INFO)
    payment, notification = Collector(), Collector()
    await mesh.add_agent(payment.make("PaymentAgent"))
    await mesh.add_agent(notification.make("NotificationAgent"))

    @agent("SellerAgent")
    async def seller(message: Message, ctx: AgentContext) -> None:
        result = message.handoff.context["approval_result"]
        nxt = "PaymentAgent" if result == "APPROVED" else "NotificationAgent"
        logging.getLogger("refund").info("approval_result=%s -> %s", result, nxt)
        await ctx.handoff(nxt, "continue refund", previous_result={"approval_result": result})

    await mesh.add_agent(seller)
    async with mesh.client("CustomerAgent") as customer:
        await customer.handoff(
            "SellerAgent", "Review refund", context={"approval_result": approval}
        )
    chosen = payment if expected == "PaymentAgent" else notification
    other = notification if chosen is payment else payment
    [got] = await chosen.wait()
    assert got.handoff.previous_result == {"approval_result": approval}
    assert other.got == []
    assert any(f"-> {expected}" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("content", "field", "said"),
    [
        (None, "content", "content is required"),
        ({}, "content.action", "content.action is required"),
    ],
    ids=["absent", "empty object"],
)
async def test_scenario_11_message_validation_error(
    mesh: LocalMesh, content: dict | None, field: str, said: str
) -> None:
    async with mesh.client("FlightAgent") as flight:
        await register(flight, "PaymentAgent")
        with pytest.raises(MessageValidationError) as info:
            await flight.send("PaymentAgent", content, message_type=MessageType.REQUEST)
        assert info.value.message == said
        assert info.value.code == "INVALID_ARGUMENT"
        assert [v.field for v in info.value.field_violations] == [field]
        stats = await flight.queue_stats("PaymentAgent")
        assert stats.agents[0].depth == 0
        assert stats.totals["validation_errors"] == 1


async def test_a_prepared_message_is_sent_and_requested_as_it_is(mesh: LocalMesh) -> None:
    collector = Collector()
    async with mesh.client("FlightAgent") as flight:
        await mesh.add_agent(collector.make("PaymentAgent", reply={"status": "PAID"}))
        prepared = Message(
            from_agent="FlightAgent",
            to_agent="PaymentAgent",
            message_type=MessageType.REQUEST,
            content={"action": "process_payment", "parameters": {"amount": 450}},
            priority=Priority.HIGH,
        )
        answer = await flight.request(prepared, timeout=10)
        assert answer.content == {"status": "PAID", "action": "process_payment"}
        assert answer.correlation_id == prepared.message_id
        told = prepared.evolve(message_type=MessageType.HANDOFF, message_id="m-told")
        told = told.evolve(
            content={"action": "execute_handoff", "parameters": {"task_description": "Pay"}}
        )
        assert (await flight.send(told)).message_id == "m-told"
        [asked, handed] = await collector.wait(2)
        assert (asked.message_id, asked.priority) == (prepared.message_id, Priority.HIGH)
        assert (handed.message_id, handed.message_type) == ("m-told", MessageType.HANDOFF)
        with pytest.raises(TypeError, match="takes no content or options: content, priority"):
            await flight.send(prepared, {"action": "x"}, priority=Priority.LOW)
        with pytest.raises(TypeError, match="takes no content or options: ttl"):
            await flight.request(prepared, ttl=5)


class RecordingSleep:
    def __init__(self, on_call: dict[int, object] | None = None) -> None:
        self.delays: list[float] = []
        self.on_call = on_call or {}

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        hook = self.on_call.get(len(self.delays))
        if hook is not None:
            await hook()  # type: ignore[operator]


async def test_a_message_id_another_sender_holds_in_the_queue_is_refused(
    mesh: LocalMesh,
) -> None:
    """Clients that number their own messages ("1", "2", ...): a second sender's "1" to an
    agent whose queue holds the first sender's "1" was taken for a retry of it and silently
    dropped, though the sender was told it was accepted. It is refused ALREADY_EXISTS,
    naming the holder; the same sender's retry is still taken once, and once the first is
    taken from the queue the id is free again."""
    async with mesh.client("Desk") as desk:
        await desk.register()
        async with grpc.aio.insecure_channel(mesh.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)

            def numbered(sender: str, n: str) -> broker_pb2.SendMessageRequest:
                pb = message_pb2.Message(
                    message_id=n,
                    from_agent=sender,
                    to_agent="Desk",
                    message_type=message_pb2.MESSAGE_TYPE_REQUEST,
                )
                pb.content.update({"action": "file", "by": sender})
                return broker_pb2.SendMessageRequest(message=pb)

            await stub.SendMessage(numbered("ClientA", "1"))
            await stub.SendMessage(numbered("ClientA", "1"))  # a retry: taken once
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SendMessage(numbered("ClientB", "1"))
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "Desk's queue holds a message '1' from ClientA" in str(info.value.details())
            async with mesh.client("ClientB") as b:
                with pytest.raises(MessageIdTakenError, match="a message id must be unique"):
                    await b.send(
                        Message(
                            message_id="1",
                            from_agent="ClientB",
                            to_agent="Desk",
                            content={"action": "file", "by": "ClientB"},
                        )
                    )
            taken = await desk.receive()
            assert [(m.message_id, m.content["by"]) for m in taken] == [("1", "ClientA")]
            await stub.SendMessage(numbered("ClientB", "1"))  # free again
            assert [m.content["by"] for m in await desk.receive()] == ["ClientB"]


async def test_scenario_12_message_queue_full() -> None:
    async with LocalMesh(BrokerConfig(max_messages_per_agent=1000)) as local:
        async with local.client("FlightAgent", retry=NO_RETRY) as flight:
            await register(flight, "PaymentAgent")
            batch = [
                flight.build("PaymentAgent", {"action": "process_payment", "parameters": {"i": i}})
                for i in range(1000)
            ]
            assert all(isinstance(r, Message) for r in await flight.send_batch(batch))
            with pytest.raises(MessageQueueFullError, match="PaymentAgent queue full") as info:
                await flight.send("PaymentAgent", {"action": "process_payment"})
            assert info.value.code == "RESOURCE_EXHAUSTED"
            assert info.value.retry_after is not None

        # With the default policy the sender backs off 100 ms, 500 ms, 2000 ms ...
        exhausted = RecordingSleep()
        async with local.client("FlightAgent", sleep=exhausted) as flight:
            with pytest.raises(MessageQueueFullError):
                await flight.send("PaymentAgent", {"action": "process_payment"})
            assert exhausted.delays == [0.1, 0.5, 2.0]
            assert flight.stats.retries == {"RESOURCE_EXHAUSTED": 3}

            # ... and once the queue clears, the message is sent.
            async def drain() -> None:
                await flight.receive("PaymentAgent", max_messages=10)

            clearing = RecordingSleep({2: drain})
            flight._sleep = clearing
            sent = await flight.send("PaymentAgent", {"action": "process_payment", "last": True})
            assert clearing.delays == [0.1, 0.5]
            stats = await flight.queue_stats("PaymentAgent")
            assert stats.agents[0].depth == 991
            assert stats.totals["dropped_count"] == 1 + 4 + 2  # every refusal counted
            # RT-011's drop rate: dropped per message offered (accepted or dropped).
            assert stats.totals["drop_rate"] == pytest.approx(7 / (1001 + 7))
            messages = await flight.receive("PaymentAgent")
            assert messages[-1].message_id == sent.message_id


async def test_a_sender_waits_no_less_than_the_broker_asks_before_trying_again() -> None:
    """The refusal's google.rpc.RetryInfo (the broker's ``retry_after_seconds``) is heeded
    where it asks for longer than RT-011's backoff."""
    config = BrokerConfig(max_messages_per_agent=1, retry_after_seconds=1.0)
    async with LocalMesh(config) as local:
        waits = RecordingSleep()
        async with local.client("FlightAgent", sleep=waits) as flight:
            await register(flight, "PaymentAgent")
            await flight.send("PaymentAgent", {"action": "process_payment"})
            with pytest.raises(MessageQueueFullError) as refused:
                await flight.send("PaymentAgent", {"action": "process_payment"})
    assert refused.value.retry_after == 1.0
    assert waits.delays == [1.0, 1.0, 2.0]


async def test_scenario_13_acknowledge_receipt(mesh: LocalMesh) -> None:
    flight = Collector()
    await mesh.add_agent(flight.make("FlightAgent", reply={"status": "searching"}))
    async with mesh.client("Orchestrator") as orchestrator:
        await orchestrator.register()
        sent = await orchestrator.send(
            "FlightAgent", {"action": "search_flights"}, ack_required=True
        )
        async with orchestrator.subscribe() as inbox:
            async for received in inbox:
                await received.ack()
                if received.message.message_type is MessageType.ACK:
                    ack = received.message
                    break
    assert ack.correlation_id == sent.message_id
    assert ack.from_agent == "FlightAgent"
    assert ack.to_agent == "Orchestrator"


async def test_scenario_13_the_broker_acknowledges_receipt_for_a_plain_grpc_agent(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent of plain gRPC stubs (no SDK) still gives its senders their ACK of receipt,
    once, as the broker first hands it each message: on a subscription or a receive."""

    def asking(message_id: str, sender: str = "Orchestrator") -> broker_pb2.SendMessageRequest:
        return broker_pb2.SendMessageRequest(
            message=message_pb2.Message(
                message_id=message_id,
                from_agent=sender,
                to_agent="FlightAgent",
                content=message_to_pb(
                    Message(from_agent="x", to_agent="y", content={"action": "search_flights"})
                ).content,
                ack_required=True,
            )
        )

    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        for agent_id in ("Orchestrator", "FlightAgent"):
            await stub.RegisterAgent(
                broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id=agent_id))
            )
        stream = stub.Subscribe(broker_pb2.SubscribeRequest(agent_id="FlightAgent"))
        await stub.SendMessage(asking("m-pushed"))
        first = await stream.read()
        await stub.Nack(broker_pb2.NackRequest(agent_id="FlightAgent", message_ids=["m-pushed"]))
        again = await stream.read()  # delivered again: no second ACK
        assert (first.delivery.delivery_attempt, again.delivery.delivery_attempt) == (1, 2)
        await stub.Ack(broker_pb2.AckRequest(agent_id="FlightAgent", message_ids=["m-pushed"]))
        stream.cancel()

        await stub.SendMessage(asking("m-received"))
        got = await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="FlightAgent"))
        assert [m.message_id for m in got.messages] == ["m-received"]

        caplog.set_level(logging.WARNING, logger="mesh.broker")
        await stub.SendMessage(asking("m-unknown-sender", sender="Ghost"))  # not registered
        got = await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="FlightAgent"))
        assert [m.message_id for m in got.messages] == ["m-unknown-sender"]

        acks = await stub.ReceiveMessages(
            broker_pb2.ReceiveMessagesRequest(agent_id="Orchestrator")
        )
    assert [
        (m.message_type, m.correlation_id, m.from_agent, m.to_agent, m.priority)
        for m in acks.messages
    ] == [
        (message_pb2.MESSAGE_TYPE_ACK, message_id, "FlightAgent", "Orchestrator", HIGH)
        for message_id in ("m-pushed", "m-received")
    ]
    assert acks.messages[0].content.fields["acknowledged_message_id"].string_value == "m-pushed"
    [lost] = [r for r in caplog.records if "not acknowledged" in r.getMessage()]
    assert lost.event["to_agent"] == "Ghost" and lost.event["reason"] == "AGENT_NOT_FOUND"


async def test_scenario_14_parallel_messages(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mesh.client")
    collectors = {name: Collector() for name in ("FlightAgent", "HotelAgent", "CarAgent")}
    for name, collector in collectors.items():
        await mesh.add_agent(collector.make(name))
    async with mesh.client("Orchestrator") as orchestrator:
        messages = [
            orchestrator.build(name, {"action": "book"}, message_type=MessageType.BROADCAST)
            for name in collectors
        ]
        sent = await orchestrator.send_messages_parallel(messages)  # RF-009's name for it
    assert [m.message_id for m in sent] == [m.message_id for m in messages]
    for name, collector in collectors.items():
        [got] = await collector.wait()
        assert got.to_agent == name
    logged = [
        r for r in caplog.records if getattr(r, "event", {}).get("category") == "parallel_send"
    ]
    assert logged[-1].event["count"] == 3


async def test_scenario_15_retry_with_backoff_on_network_error() -> None:
    port = free_port()
    started: list[object] = []

    async def start_broker() -> None:
        broker, server = await serve_broker(server_config=ServerConfig(port=port))
        await broker.register(__import__("mesh").AgentInfo(agent_id="PaymentAgent"))
        started.append(server)

    class RealSleep(RecordingSleep):
        async def __call__(self, delay: float) -> None:
            await super().__call__(delay)
            await asyncio.sleep(delay)

    sleep = RealSleep({3: start_broker})
    try:
        async with MeshClient(f"127.0.0.1:{port}", agent_id="FlightAgent", sleep=sleep) as flight:
            sent = await flight.send("PaymentAgent", {"action": "process_payment"})
            assert sleep.delays == [0.1, 0.5, 2.0]
            assert flight.stats.retries == {"UNAVAILABLE": 3}
            [got] = await flight.receive("PaymentAgent")
            assert got.message_id == sent.message_id
    finally:
        for server in started:
            await server.stop(0)  # type: ignore[attr-defined]


async def test_scenario_16_handoff_logging(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mesh.handoff")
    seller = Collector()
    await mesh.add_agent(seller.make("SellerAgent"))
    context = {"order_id": "12345", "amount": 50}
    async with mesh.client("CustomerAgent") as customer:
        await customer.handoff(
            "SellerAgent",
            "Approve refund",
            context=context,
            workflow_id="wf_refund_123",
            step_number=2,
        )
    await seller.wait()
    [record] = [r for r in caplog.records if r.name == "mesh.handoff"]
    line = json.loads(JsonFormatter().format(record))
    assert line["category"] == "handoff"
    assert line["from_agent"] == "CustomerAgent"
    assert line["to_agent"] == "SellerAgent"
    assert line["workflow_id"] == "wf_refund_123"
    assert line["step_number"] == 2
    assert line["task_description"] == "Approve refund"
    expected_kb = len(json.dumps(context, separators=(",", ":")).encode()) / 1024
    assert line["context_size_kb"] == pytest.approx(expected_kb, abs=0.001)
    assert ISO_8601.match(line["timestamp"])


async def test_scenario_17_broadcast_with_selective_targeting(mesh: LocalMesh) -> None:
    async with mesh.client("Orchestrator") as orchestrator:
        await register(
            orchestrator, "FlightAgent", "HotelAgent", "CarAgent", agent_types=("booking",)
        )
        await register(orchestrator, "PaymentAgent", agent_types=("payment",))
        await register(orchestrator, "NotificationAgent", agent_types=("notification",))
        result = await orchestrator.broadcast_to_types(
            ["booking"], {"alert": "Booking API maintenance"}
        )
        assert sorted(result.recipients) == ["CarAgent", "FlightAgent", "HotelAgent"]
        for name in ("FlightAgent", "HotelAgent", "CarAgent"):
            [got] = await orchestrator.receive(name)
            assert got.content == {"alert": "Booking API maintenance"}
        for name in ("PaymentAgent", "NotificationAgent"):
            assert await orchestrator.receive(name) == []
        stats = await orchestrator.queue_stats()
        assert stats.totals["broadcast_count"] == 1


async def test_scenario_18_content_structure_validation(mesh: LocalMesh) -> None:
    async with mesh.client("FlightAgent") as flight:
        await register(flight, "PaymentAgent")
        await flight.send(
            "PaymentAgent",
            {"action": "process_payment", "parameters": {"amount": 450, "flight": "Flight A"}},
        )
        [accepted] = await flight.receive("PaymentAgent")
        assert accepted.parameters == {"amount": 450, "flight": "Flight A"}
        with pytest.raises(MessageValidationError, match=r"content\.action is required"):
            await flight.send("PaymentAgent", {"parameters": {"amount": 450}})
        with pytest.raises(MessageValidationError, match=r"content\.parameters must be an object"):
            await flight.send("PaymentAgent", {"action": "x", "parameters": [1, 2]})
        assert await flight.receive("PaymentAgent") == []


async def test_scenario_18_an_agent_requires_the_content_fields_it_names(
    mesh: LocalMesh,
) -> None:
    """PaymentAgent requires ["action", "parameters"]: a message with both reaches it, one
    without "parameters" is refused to its sender, over the SDK and over plain gRPC, and
    never reaches the handler; an alert to every agent is not held to it."""
    payments = Collector()
    served = await mesh.add_agent(
        payments.make(
            "PaymentAgent", reply={"status": "PAID"}, required_fields=["action", "parameters"]
        )
    )
    async with mesh.client("FlightAgent") as flight:
        await flight.register(agent_types=["booking"])
        [listed] = [a for a in await flight.list_agents() if a.agent_id == "PaymentAgent"]
        assert listed.required_fields == ("action", "parameters")

        paid = await flight.request(
            "PaymentAgent",
            {"action": "process_payment", "parameters": {"amount": 450, "flight": "Flight A"}},
            timeout=10,
        )
        assert paid.content == {"status": "PAID", "action": "process_payment"}
        for content in (
            {"action": "process_payment"},
            {"action": "process_payment", "parameters": None},
        ):
            with pytest.raises(MessageValidationError) as refused:
                await flight.send("PaymentAgent", content)
            assert refused.value.code == "INVALID_ARGUMENT"
            assert refused.value.message == "content.parameters is required by PaymentAgent"
            assert [v.field for v in refused.value.field_violations] == ["content.parameters"]
        with pytest.raises(MessageValidationError, match=r"content\.parameters is required"):
            await flight.request("PaymentAgent", {"action": "process_payment"}, timeout=10)
        [sent, refused_in_batch] = await flight.send_batch(
            [
                Message(
                    from_agent="FlightAgent",
                    to_agent="PaymentAgent",
                    content={"action": "process_payment", "parameters": {"amount": 1}},
                ),
                Message(
                    from_agent="FlightAgent",
                    to_agent="PaymentAgent",
                    content={"action": "process_payment"},
                ),
            ]
        )
        assert isinstance(sent, Message)
        assert isinstance(refused_in_batch, MessageValidationError)
        await flight.broadcast({"alert": "System maintenance in 10 minutes"})

        async with grpc.aio.insecure_channel(mesh.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            bare = message_pb2.Message(
                from_agent="FlightAgent", to_agent="PaymentAgent", message_type=1
            )
            bare.content.update({"action": "process_payment"})
            with pytest.raises(grpc.aio.AioRpcError) as plain:
                await stub.SendMessage(broker_pb2.SendMessageRequest(message=bare))
            assert plain.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert plain.value.details() == "content.parameters is required by PaymentAgent"
        async with AgentClient(served.address) as direct:  # (its own server holds it too)
            with pytest.raises(MessageValidationError) as refused:
                await direct.handle(
                    Message(
                        from_agent="FlightAgent",
                        to_agent="PaymentAgent",
                        content={"action": "process_payment"},
                    )
                )
            assert refused.value.message == "content.parameters is required by PaymentAgent"

        got = await payments.wait(3)
        assert [(m.message_type, m.content.get("parameters")) for m in got] == [
            (MessageType.REQUEST, {"amount": 450, "flight": "Flight A"}),
            (MessageType.REQUEST, {"amount": 1}),
            (MessageType.BROADCAST, None),
        ]
        await asyncio.sleep(0.2)  # (nothing else arrives)
        assert len(payments.got) == 3
        stats = await flight.queue_stats()
        assert stats.totals["validation_errors"] == 5


async def test_the_required_fields_an_agent_names_are_checked_as_it_registers(
    mesh: LocalMesh,
) -> None:
    async with mesh.client("PaymentAgent") as payment:
        for required, said in (
            ([""], "required fields must not be empty"),
            ([f"f{i}" for i in range(33)], "at most 32 required_fields"),
            (["x" * 257], "required_fields must be at most 256 characters"),
            (
                "parameters",
                "required_fields is a list of content keys, not one string: write ['parameters']",
            ),
        ):
            with pytest.raises(MessageValidationError) as refused:
                await payment.register(required_fields=required)
            assert refused.value.message == said
            assert [v.field for v in refused.value.field_violations] == ["agent.required_fields"]
        assert await payment.list_agents() == []
        with pytest.raises(MessageValidationError, match="a list of content keys, not one"):
            Agent("PaymentAgent", required_fields="parameters")  # (not its letters)
        # The latest registration's hold; repeated keys count once.
        await payment.register(required_fields=["parameters", "parameters", "context"])
        await payment.register(required_fields=["parameters", "context"])
        [listed] = await payment.list_agents()
        assert listed.required_fields == ("parameters", "context")
        with pytest.raises(MessageValidationError) as refused:
            await payment.send("PaymentAgent", {"action": "pay"})
        assert [v.field for v in refused.value.field_violations] == [
            "content.parameters",
            "content.context",
        ]
        await payment.register()
        await payment.send("PaymentAgent", {"action": "pay"})
        assert [m.action for m in await payment.receive()] == ["pay"]


async def test_a_bare_string_where_a_list_is_asked_is_refused_not_read_letter_by_letter(
    mesh: LocalMesh,
) -> None:
    """A string is a list of its letters to Python: ``agent_types="hotel"`` registered the
    types h, o, t, e and l, and a broadcast to them reached any agent of a type "h"; an ack
    of "<id>" acked its characters. Each is refused, naming the field, and nothing is done."""
    async with mesh.client("Hotel") as hotel, mesh.client("boss") as boss:
        await hotel.register(agent_types=["h"])
        sent = await boss.send("Hotel", {"action": "book"})
        inbox = hotel.subscribe(lease_seconds=30)
        got = await asyncio.wait_for(anext(aiter(inbox)), 5)
        lease = got.message.message_id
        calls: list[tuple[str, Any]] = [
            ("agent.agent_types", lambda: boss.register("Desk", agent_types="hotel")),
            ("agent.capabilities", lambda: boss.register("Desk", capabilities="book")),
            ("agent_types", lambda: boss.broadcast({"action": "x"}, agent_types="hotel")),
            ("agent_types", lambda: boss.broadcast_to_types("hotel", {"action": "x"})),
            ("agent_ids", lambda: anext(boss.gather({"action": "x"}, agent_ids="Hotel"))),
            ("agent_types", lambda: anext(boss.gather({"action": "x"}, agent_types="h"))),
            ("message_ids", lambda: hotel.ack(lease)),
            ("message_ids", lambda: hotel.nack(lease)),
            ("message_ids", lambda: boss.requeue_dead_letters("Hotel", lease)),
            ("insight.tags", lambda: boss.write_insight({"n": 1}, tags="vote")),
            ("tags", lambda: boss.read_insights(tags="vote")),
            ("peers", lambda: boss.negotiate("Hotel", {"price": 1})),
        ]
        for field, call in calls:
            with pytest.raises(MessageValidationError) as refused:
                await call()
            assert [v.field for v in refused.value.field_violations] == [field]
            assert "not one string: write [" in refused.value.message
        assert [a.agent_id for a in await boss.list_agents()] == ["Hotel"]
        assert await boss.read_insights() == []
        # No broadcast came to the agent of the type "h"; its delivery was neither acked nor
        # handed back.
        [queue] = (await boss.queue_stats("Hotel")).agents
        assert (queue.depth, queue.in_flight, queue.dead_letters) == (0, 1, 0)
        assert await hotel.ack([lease]) == 1 and lease == sent.message_id
        await inbox.close()

    class Voter(Agent):
        # The mistake: ("voter") is a string, not a tuple of one.
        agent_types = ("voter")  # fmt: skip

    with pytest.raises(MessageValidationError, match=r"write \['voter'\]"):
        Voter("v1")


async def test_a_message_s_parts_of_the_wrong_kind_are_refused_naming_them(
    mesh: LocalMesh,
) -> None:
    """Metadata or headers that are no mapping, a timeout that is no number: each was a bare
    TypeError from deep inside the SDK ("cannot convert dictionary update sequence...",
    "'<=' not supported..."); now a MessageValidationError on the field, nothing sent."""
    async with mesh.client("FlightAgent") as flight:
        await register(flight, "PaymentAgent")
        content = {"action": "quote"}
        for field, call in [
            ("metadata", lambda: flight.send("PaymentAgent", content, metadata=["wf_1"])),
            ("headers", lambda: flight.send("PaymentAgent", content, headers="k=v")),
            ("timeout", lambda: flight.request("PaymentAgent", content, timeout=timedelta(1))),
            ("timeout", lambda: flight.request("PaymentAgent", content, timeout="5")),
            ("insight.metadata", lambda: flight.write_insight({"n": 1}, metadata=[("k", 1)])),
            ("arguments", lambda: flight.call_tool("search", ["lithium"])),
            ("ttl", lambda: flight.put_state("budget", 100, ttl="60")),
            ("wait", lambda: flight.lock_state("budget", wait="1")),
            # An id that is no string was protobuf's "bad argument type for built-in operation".
            ("key", lambda: flight.put_state(5, 100)),  # type: ignore[arg-type]
            ("agent_id", lambda: flight.queue_stats(5)),  # type: ignore[arg-type]
            ("agent_id", lambda: flight.receive(5)),  # type: ignore[arg-type]
            ("agent.agent_id", lambda: flight.register(5)),  # type: ignore[arg-type]
            ("agent_type", lambda: flight.list_agents(["payment"])),  # type: ignore[arg-type]
            ("page_size", lambda: flight.list_state("", page_size="5")),  # type: ignore[arg-type]
            ("insight.importance", lambda: flight.write_insight({"n": 1}, importance="high")),  # type: ignore[arg-type]
        ]:
            with pytest.raises(MessageValidationError) as refused:
                await call()
            assert [v.field for v in refused.value.field_violations] == [field]
        sent = await flight.send("PaymentAgent", content)
        # A message that is no Message, alone or among others: none of them is sent.
        with pytest.raises(TypeError, match=r"takes Message objects \(mesh.Message\), not dict"):
            await flight.send_message({"to_agent": "PaymentAgent", "content": content})
        for call_many in (flight.send_parallel, flight.send_batch):
            with pytest.raises(TypeError, match="takes Message objects"):
                await call_many([sent.evolve(message_id=""), "PaymentAgent"])  # type: ignore[list-item]
        assert [m.message_id for m in await flight.receive_messages("PaymentAgent")] == [
            sent.message_id
        ]
        assert await flight.read_insights() == []
        assert await flight.get_state("budget") is None


async def test_a_durable_broker_keeps_the_fields_an_agent_requires(tmp_path: Path) -> None:
    config = BrokerConfig(store=f"sqlite:///{tmp_path / 'queues.db'}")
    async with LocalMesh(config) as before, before.client("FlightAgent") as flight:
        await flight.register("PaymentAgent", required_fields=["parameters"])
    async with LocalMesh(config) as after, after.client("FlightAgent") as flight:
        [listed] = await flight.list_agents()
        assert listed.required_fields == ("parameters",)
        with pytest.raises(MessageValidationError, match=r"content\.parameters is required"):
            await flight.send("PaymentAgent", {"action": "process_payment"})


async def test_scenario_19_handoff_with_constraints(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mesh.handoff")
    outcomes = Collector()
    await mesh.add_agent(outcomes.make("Outcomes"))

    @agent("PaymentAgent")
    async def payment(message: Message, ctx: AgentContext) -> None:
        constraints = message.handoff.constraints
        days = {"within_3_days": 3}[constraints["processing_time"]]
        await ctx.send(
            "Outcomes",
            {
                "action": "refund_done",
                "method": constraints["refund_method"],
                "processing_days": days,
            },
        )

    await mesh.add_agent(payment)
    constraints = {"refund_method": "original_payment", "processing_time": "within_3_days"}
    async with mesh.client("SellerAgent") as seller:
        await seller.handoff("PaymentAgent", "Refund $50", constraints=constraints)
    [outcome] = await outcomes.wait()
    assert outcome.content == {
        "action": "refund_done",
        "method": "original_payment",
        "processing_days": 3,
    }
    [record] = [r for r in caplog.records if r.name == "mesh.handoff"]
    assert record.event["constraints"] == constraints


async def scrape(port: int) -> dict[str, float]:
    """/metrics read as a scraper does, from another thread (the loop goes on meanwhile)."""
    url = f"http://127.0.0.1:{port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def test_scenario_20_communication_metrics() -> None:
    async with LocalMesh(metrics_port=0) as local:
        async with local.client("FlightAgent") as flight:
            await register(flight, "PaymentAgent", "SellerAgent")
            batch = [
                flight.build("PaymentAgent", {"action": "process_payment", "parameters": {"i": i}})
                for i in range(1000)
            ]
            results = await flight.send_batch(batch)
            assert all(isinstance(r, Message) for r in results)
            received = await flight.receive("PaymentAgent")
            assert len(received) == 1000
            for step in range(150):
                await flight.handoff(
                    "SellerAgent", "Approve refund", workflow_id="wf", step_number=step + 1
                )
            assert len(await flight.receive("SellerAgent")) == 150
            report = await flight.queue_stats()
        assert report.totals["sent_count"] == 1150
        assert report.totals["delivered_count"] == 1150
        assert report.totals["handoff_count"] == 150
        assert report.totals["dropped_count"] == 0
        assert report.totals["drop_rate"] == 0
        for figure in ("send", "receive", "handoff"):  # RT-011 targets: < 10, 10, 200 ms
            p50, p95 = (report.totals[f"{figure}_latency_p{p}_ms"] for p in (50, 95))
            assert 0 < p50 <= p95 <= report.totals[f"{figure}_latency_p99_ms"], figure
        assert local.server is not None and local.server.metrics_port
        samples = await scrape(local.server.metrics_port)
    # RT-011's required metrics and RF-009's, under their own names (milliseconds).
    assert samples["multi_agent_messages_sent_count"] == 1150
    assert samples["multi_agent_messages_received_count"] == 1150
    assert samples["multi_agent_handoffs_count"] == 150
    assert samples["multi_agent_message_dropped_count"] == 0
    assert samples["multi_agent_message_expired_count"] == 0
    assert samples["multi_agent_message_drop_rate"] == 0
    assert samples['multi_agent_message_queue_depth{agent="PaymentAgent"}'] == 0
    for name in (
        "message_send_latency_p50",
        "message_send_latency_p95",
        "message_send_latency_p99",
        "message_receive_latency_p50",
        "message_receive_latency_p95",
        "handoff_latency_p50",
        "handoff_latency_p95",
    ):
        assert samples[f"multi_agent_{name}"] > 0, name
    assert samples["multi_agent_message_send_latency_p95"] == pytest.approx(
        report.totals["send_latency_p95_ms"], rel=0.5
    )
    assert samples["multi_agent_message_roundtrip_latency_p95"] == 0  # no request yet
    assert samples["multi_agent_broadcast_latency_p50"] == 0  # no broadcast yet
    # The SDK gives the same figures by RT-011's dotted names (nothing ran in between).
    rt011 = report.metrics
    assert rt011["messages_sent_count"] == 1150 and rt011["handoffs_count"] == 150
    assert rt011["multi_agent.message.expired_count"] == 0
    assert rt011.pop("multi_agent.message.queue_depth") == 0  # exported per agent
    for dotted, value in rt011.items():
        exported = "multi_agent_" + dotted.removeprefix("multi_agent.").replace(".", "_")
        assert samples[exported] == pytest.approx(value), dotted
    assert samples['agentmesh_messages_sent_total{message_type="REQUEST"}'] == 1000
    assert samples['agentmesh_messages_sent_total{message_type="HANDOFF"}'] == 150
    assert samples['agentmesh_messages_received_total{path="receive"}'] == 1150
    assert samples["agentmesh_handoffs_total"] == 150
    assert samples["agentmesh_send_latency_seconds_count"] == 1150
    assert samples["agentmesh_handoff_latency_seconds_count"] == 150
    assert samples["agentmesh_receive_latency_seconds_count"] == 2
    assert samples.get('agentmesh_messages_dropped_total{reason="queue_full"}', 0) == 0
    assert samples["agentmesh_messages_expired_total"] == 0


async def test_queue_depth_is_what_the_queues_hold_when_scraped() -> None:
    """RT-011's queue depth, per agent: scraped at once after the sends it counts them (it
    used to lag by a sweep); an empty queue of a registered agent shows 0, and an agent that
    left shows nothing once its queue is empty."""
    async with LocalMesh(metrics_port=0) as local:
        assert local.server is not None
        port = local.server.metrics_port
        async with local.client("FlightAgent") as flight:
            await register(flight, "PaymentAgent", "SellerAgent", "TempAgent")
            for priority in (Priority.LOW, Priority.HIGH, Priority.MEDIUM):
                await flight.send("PaymentAgent", {"action": "pay"}, priority=priority)
            await flight.send("TempAgent", {"action": "note"})
            await flight.deregister("TempAgent")
            samples = await scrape(port)
            depths = {
                name: value
                for name, value in samples.items()
                if name.startswith("agentmesh_queue_depth{")
            }
            assert depths == {
                'agentmesh_queue_depth{agent="PaymentAgent"}': 3,
                'agentmesh_queue_depth{agent="SellerAgent"}': 0,
                'agentmesh_queue_depth{agent="TempAgent"}': 1,  # still holds a message
            }
            assert samples["agentmesh_messages_held"] == 4

            assert len(await flight.receive("PaymentAgent")) == 3
            assert len(await flight.receive("TempAgent")) == 1
            samples = await scrape(port)
        assert samples['agentmesh_queue_depth{agent="PaymentAgent"}'] == 0
        assert 'agentmesh_queue_depth{agent="TempAgent"}' not in samples
        assert samples["agentmesh_messages_held"] == 0


async def test_queue_depth_through_one_replica_counts_what_came_through_another(
    redis_url: str,
) -> None:
    """Broker replicas on one Redis: /metrics of either shows what the shared queues hold,
    whichever replica the messages came through."""
    config = BrokerConfig(store=redis_url)
    _, via_a = await serve_broker(server_config=ServerConfig(port=0), broker_config=config)
    _, via_b = await serve_broker(
        server_config=ServerConfig(port=0, metrics_port=0), broker_config=config
    )
    try:
        async with connect(via_a.address, agent_id="FlightAgent", retry=NO_RETRY) as flight:
            await flight.register("PaymentAgent")
            depth = 'agentmesh_queue_depth{agent="PaymentAgent"}'
            async with asyncio.timeout(5):  # B hears of the registration, and shows it empty
                while (await scrape(via_b.metrics_port)).get(depth) != 0:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            for _ in range(2):
                await flight.send("PaymentAgent", {"action": "pay"})
            samples = await scrape(via_b.metrics_port)
        assert samples[depth] == 2
        assert samples["agentmesh_messages_held"] == 2
    finally:
        await via_a.stop(0.5)
        await via_b.stop(0.5)


async def test_agents_that_left_with_nothing_waiting_leave_no_queue_behind() -> None:
    """Agents that come and go under new ids (one per worker process, say) must not pile
    up in the queue statistics: one that leaves with an empty queue is gone from them; one
    that leaves messages waiting stays listed with them until they are taken."""
    async with LocalMesh() as local, local.client("FlightAgent") as flight:
        await register(flight, "PaymentAgent")
        for i in range(50):
            worker = f"worker-{i}"
            await register(flight, worker)
            await flight.send(worker, {"action": "work"})
            assert len(await flight.receive(worker)) == 1
            await flight.deregister(worker)
        await register(flight, "TempAgent")
        await flight.send("TempAgent", {"action": "note"})
        await flight.deregister("TempAgent")
        stats = await flight.queue_stats()
        assert [(q.agent_id, q.depth) for q in stats.agents] == [
            ("PaymentAgent", 0),
            ("TempAgent", 1),
        ]
        [kept] = await flight.receive("TempAgent")
        assert kept.content == {"action": "note"}


async def test_an_answer_the_broker_would_refuse_reaches_the_requester_as_an_error(
    mesh: LocalMesh,
) -> None:
    """An agent whose handler returns NaN (or too much, or too deep) cannot send that answer;
    the requester hears why at once, not when its deadline passes."""

    @agent("Analyst")
    async def analyst(message: Message, ctx: AgentContext) -> dict:
        return {"confidence": float("nan")}

    await mesh.add_agent(analyst)
    async with mesh.client("HotelAgent") as hotel:
        # (an AgentError, not the RequestTimeoutError of a deadline passing)
        with pytest.raises(AgentError, match="Analyst's answer was refused: nan is not a number"):
            await hotel.request("Analyst", {"action": "analyze"}, timeout=20)


async def test_an_integer_json_would_round_is_refused_before_it_travels(mesh: LocalMesh) -> None:
    """12345678901234567 would arrive as 12345678901234568 (a JSON number is a double): the
    sender hears so and nothing is queued; an agent answering with one cannot, and its
    requester hears why at once."""

    @agent("Ledger")
    async def ledger(message: Message, ctx: AgentContext) -> dict:
        return {"order_id": 12345678901234567}

    await mesh.add_agent(ledger)
    async with mesh.client("ShopAgent") as shop:
        with pytest.raises(MessageValidationError, match="send it as a string"):
            await shop.send("Ledger", {"action": "note", "order_id": 12345678901234567})
        view = (await shop.queue_stats("Ledger")).for_agent("Ledger")
        assert view is not None and view.depth == 0
        with pytest.raises(
            AgentError, match="Ledger's answer was refused: the integer 12345678901234567 is"
        ):
            await shop.request("Ledger", {"action": "look_up"}, timeout=20)


def _nested(levels: int) -> dict[str, Any]:
    content: dict[str, Any] = {"leaf": True}
    for _ in range(levels - 1):
        content = {"n": content}
    return content


def _circular() -> dict[str, Any]:
    content: dict[str, Any] = {"action": "loop"}
    content["self"] = content
    return content


@pytest.mark.parametrize(
    ("reply", "said", "reason"),
    [
        # (its size in bytes: a trace context in its metadata, when tracing is on, adds some)
        (
            {"report": "x" * 1_100_000},
            r"message is 110\d{4} bytes; the limit is 1048576 bytes",
            "MESSAGE_TOO_LARGE",
        ),
        (
            Message(from_agent="", to_agent="", content=None, message_type=MessageType.RESPONSE),
            "content is required",
            "VALIDATION_FAILED",
        ),
        # (a frame too deep for the broker to read told nobody: the SDK refuses it first)
        (_nested(40), r"content nests more than 25 levels deep \(is it circular", "AGENT_ERROR"),
        (_circular(), r"content nests more than 25 levels deep", "AGENT_ERROR"),
    ],
    ids=["too large", "no content", "too deep", "circular"],
)
async def test_an_answer_the_broker_refuses_reaches_the_requester_as_an_error(
    mesh: LocalMesh, reply: object, said: str, reason: str
) -> None:
    """The answer goes out and the broker refuses it (too large, no content): whoever waits
    hears why at once, from the broker, and the agent's delivery is settled (not delivered
    again at its lease's end)."""
    handled: list[str] = []

    @agent("Writer")
    async def writer(message: Message, ctx: AgentContext) -> object:
        handled.append(message.message_id)
        return reply

    await mesh.add_agent(writer, lease_seconds=0.5)
    async with mesh.client("Editor") as editor:
        with pytest.raises(AgentError, match=f"Writer's answer was refused: {said}") as info:
            await editor.request("Writer", {"action": "write"}, timeout=20)
        assert info.value.reason == reason
        await asyncio.sleep(1.0)  # two leases
        assert len(handled) == 1
        view = (await editor.queue_stats("Writer")).for_agent("Writer")
        assert view is not None and (view.depth, view.in_flight) == (0, 0)


def _nan_content(answer: message_pb2.Message) -> None:
    answer.content["score"] = math.nan


def _nan_metadata(answer: message_pb2.Message) -> None:
    answer.metadata["weight"] = math.inf


def _undefined_priority(answer: message_pb2.Message) -> None:
    answer.priority = 99  # type: ignore[assignment]


def _time_out_of_range(answer: message_pb2.Message) -> None:
    answer.timestamp.seconds = 10**12


def _too_deep(answer: message_pb2.Message) -> None:
    answer.content.update(_nested(40))


def _length_delimited(number: int, payload: bytes) -> bytes:
    """A protobuf field of wire type 2 (what a batch frame wraps its frames in)."""

    def varint(value: int) -> bytes:
        out = bytearray()
        while value > 0x7F:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        return bytes([*out, value])

    return varint(number << 3 | 2) + varint(len(payload)) + payload


BATCH = broker_pb2.ConnectRequest.DESCRIPTOR.fields_by_name["batch"].number
BATCH_FRAMES = broker_pb2.ConnectRequestBatch.DESCRIPTOR.fields_by_name["frames"].number


async def _raw_answering_agent(
    address: str, agent_id: str, spoil: Any, batched: bool, refusals: asyncio.Queue[str]
) -> None:
    """An agent on a plain Connect session (as a client in any language writes one): it
    answers each delivery with ``spoil`` applied to its answer, in a batch frame or not,
    and keeps the broker's refusals of its frames."""
    async with grpc.aio.insecure_channel(address) as channel:
        session = channel.stream_stream(
            "/mesh.v1.BrokerService/Connect",
            request_serializer=bytes,
            response_deserializer=broker_pb2.ConnectResponse.FromString,
        )()
        subscribe = broker_pb2.ConnectRequest(seq=1)
        subscribe.subscribe.agent_id = agent_id
        await session.write(subscribe.SerializeToString())
        seq = 1
        async for frame in session:
            inner = frame.batch.frames if frame.WhichOneof("frame") == "batch" else [frame]
            for each in inner:
                if each.WhichOneof("frame") == "error":
                    refusals.put_nowait(each.error.message)
                if each.WhichOneof("frame") != "delivery":
                    continue
                request = each.delivery.message
                seq += 1
                out = broker_pb2.ConnectRequest(seq=seq)
                answer = out.send
                answer.from_agent, answer.to_agent = agent_id, request.from_agent
                answer.message_type = message_pb2.MESSAGE_TYPE_RESPONSE
                answer.correlation_id = request.message_id
                answer.content.update({"action": "answer", "score": 0.5})
                spoil(answer)
                data = out.SerializeToString()
                if batched:  # (by hand: this protobuf copies no message nested so deep)
                    data = _length_delimited(BATCH, _length_delimited(BATCH_FRAMES, data))
                await session.write(data)


@pytest.mark.parametrize("batched", [False, True], ids=["frame", "batch"])
@pytest.mark.parametrize(
    ("spoil", "said"),
    [
        (_nan_content, "send.content.score is NaN or Infinity"),
        (_nan_metadata, "send.metadata.weight is NaN or Infinity"),
        (_undefined_priority, "priority 99 is not defined"),
        (_time_out_of_range, "timestamp must be from 0001-01-01"),
        (_too_deep, "it nests more than 84 levels deep"),
    ],
    ids=["NaN content", "NaN metadata", "undefined priority", "time out of range", "too deep"],
)
async def test_an_answer_the_broker_cannot_read_reaches_the_requester_as_an_error(
    mesh: LocalMesh, spoil: Any, said: str, batched: bool
) -> None:
    """An agent that is no SDK answers with a frame the broker cannot read into a message:
    the agent hears why, and so does its requester, at once (an AgentError, not a timeout at
    its deadline); the request is settled, not delivered again."""
    refusals: asyncio.Queue[str] = asyncio.Queue()
    async with mesh.client("Asker") as asker:
        await asker.register("Raw")
        answering = asyncio.create_task(
            _raw_answering_agent(mesh.address, "Raw", spoil, batched, refusals)
        )
        try:
            with pytest.raises(AgentError) as info:
                await asker.request("Raw", {"action": "score"}, timeout=30)
            assert info.value.message.startswith("Raw's answer was refused: ")
            assert said in info.value.message
            assert info.value.reason == "VALIDATION_FAILED"
            # (the two hear it on two streams: the agent's may come in after the requester's)
            assert said in await asyncio.wait_for(refusals.get(), 10)
            view = (await asker.queue_stats("Raw")).for_agent("Raw")
            assert view is not None and (view.depth, view.in_flight) == (0, 0)
            assert refusals.empty()  # refused once, not delivered and answered again
        finally:
            answering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await answering


async def _asked_of_raw(
    asker: MeshClient, broker: broker_pb2_grpc.BrokerServiceStub
) -> tuple[asyncio.Task[Message], message_pb2.Message]:
    """``asker`` asks the agent Raw (registered here), which takes the request with
    ReceiveMessages, as a client that is no SDK does: the request waiting, and an answer to
    it (a RESPONSE under its correlation id) for the test to spoil and send."""
    await asker.register("Raw")
    asking = asyncio.create_task(asker.request("Raw", {"action": "score"}, timeout=30))
    taken: list[message_pb2.Message] = []
    while not taken:
        received = await broker.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="Raw"))
        taken = list(received.messages)
    answer = message_pb2.Message(
        from_agent="Raw",
        to_agent="Asker",
        message_type=message_pb2.MESSAGE_TYPE_RESPONSE,
        correlation_id=taken[0].message_id,
    )
    answer.content.update({"action": "answer"})
    return asking, answer


@pytest.mark.parametrize(
    ("spoil", "said"),
    [
        (_undefined_priority, "priority 99 is not defined"),
        (_time_out_of_range, "timestamp must be from 0001-01-01"),
    ],
    ids=["undefined priority", "time out of range"],
)
@pytest.mark.parametrize("rpc", ["SendMessage", "SendMessages"])
async def test_an_answer_sent_by_a_unary_call_that_is_refused_reaches_the_requester(
    mesh: LocalMesh, spoil: Any, said: str, rpc: str
) -> None:
    """The same for an agent that takes its request by ReceiveMessages and answers with a
    unary call: the call is refused, and the requester hears why at once."""
    async with mesh.client("Asker") as asker, grpc.aio.insecure_channel(mesh.address) as channel:
        broker = broker_pb2_grpc.BrokerServiceStub(channel)
        asking, answer = await _asked_of_raw(asker, broker)
        spoil(answer)
        if rpc == "SendMessage":
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await broker.SendMessage(broker_pb2.SendMessageRequest(message=answer))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        else:
            sent = await broker.SendMessages(broker_pb2.SendMessagesRequest(messages=[answer]))
            assert said in sent.results[0].error.message
        with pytest.raises(AgentError) as info:
            await asking
        assert info.value.message.startswith("Raw's answer was refused: ")
        assert said in info.value.message


MESSAGES = broker_pb2.SendMessagesRequest.DESCRIPTOR.fields_by_name["messages"].number


@pytest.mark.parametrize(
    ("spoil", "said"),
    [
        (_nan_content, "content.score is NaN or Infinity"),
        (_too_deep, "it nests more than 84 levels deep"),
    ],
    ids=["NaN content", "too deep"],
)
@pytest.mark.parametrize("rpc", ["SendMessage", "SendMessages"])
async def test_an_answer_in_a_unary_call_that_does_not_decode_reaches_the_requester(
    mesh: LocalMesh, spoil: Any, said: str, rpc: str
) -> None:
    """The same when the call's bytes do not decode at all (a value no JSON holds, content
    nested past what the broker reads): the call is refused INVALID_ARGUMENT, and what can
    be read of it (who answers whom, under which correlation id) tells the requester why at
    once, instead of leaving it to its deadline."""
    async with mesh.client("Asker") as asker, grpc.aio.insecure_channel(mesh.address) as channel:
        await asker.register("Other")
        broker = broker_pb2_grpc.BrokerServiceStub(channel)
        asking, answer = await _asked_of_raw(asker, broker)
        spoil(answer)
        # By hand, as a client that checks nothing writes it (this protobuf writes no
        # message nested so deep inside another).
        field = 1 if rpc == "SendMessage" else MESSAGES
        fine = message_pb2.Message(
            from_agent="Other", to_agent="Raw", message_type=message_pb2.MESSAGE_TYPE_REQUEST
        )
        fine.content.update({"action": "note"})
        data = _length_delimited(field, answer.SerializeToString())
        if rpc == "SendMessages":
            data += _length_delimited(field, fine.SerializeToString())
        call = channel.unary_unary(
            f"/mesh.v1.BrokerService/{rpc}",
            request_serializer=bytes,
            response_deserializer=bytes,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(data)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(AgentError) as info:
            await asking
        assert info.value.message.startswith("Raw's answer was refused: ")
        assert said in info.value.message
        # Nothing else of the call was taken: the whole call is refused.
        view = (await asker.queue_stats("Raw")).for_agent("Raw")
        assert view is not None and view.depth == 0


async def test_a_cancellation_from_inside_a_handler_answers_with_an_error(
    mesh: LocalMesh,
) -> None:
    """A task the handler awaited was cancelled by someone else: the CancelledError is the
    handler's failure, not the runtime's cancellation of it; the requester hears so at once."""

    @agent("Waiter")
    async def waiter(message: Message, ctx: AgentContext) -> dict:
        side = asyncio.create_task(asyncio.sleep(30))
        asyncio.get_running_loop().call_later(0.05, side.cancel)
        await side
        return {"waited": True}

    await mesh.add_agent(waiter)
    async with mesh.client("Guest") as guest:
        with pytest.raises(AgentError, match="was cancelled from within") as info:
            await guest.request("Waiter", {"action": "wait"}, timeout=20)
        assert info.value.reason == "HANDLER_CANCELLED"


async def test_a_client_that_names_no_agent_is_told_how_to_send(mesh: LocalMesh) -> None:
    """RF-009 scenario 11, from the SDK: a message needs its sender; a client connected
    without an agent id hears how to give one, and nothing is sent."""
    async with mesh.client("Inbox") as inbox, mesh.client() as anonymous:
        await inbox.register()
        for call in (
            lambda: anonymous.send("Inbox", {"action": "note"}),
            lambda: anonymous.request("Inbox", {"action": "note"}, timeout=1),
            lambda: anonymous.broadcast({"action": "note"}),
        ):
            with pytest.raises(
                MessageValidationError, match="connect\\(\\.\\.\\., agent_id="
            ) as info:
                await call()
            assert [v.field for v in info.value.field_violations] == ["from_agent"]
        sent = await anonymous.send("Inbox", {"action": "note"}, from_agent="Desk")
        assert sent.from_agent == "Desk"
        view = (await anonymous.queue_stats("Inbox")).for_agent("Inbox")
        assert view is not None and view.depth == 1

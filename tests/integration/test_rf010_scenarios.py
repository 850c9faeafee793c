"""RF-010 (multi-agent patterns), scenarios 1 to 20, through the gateway's gRPC API with agents
on the mesh."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agents import sample_agents
from agents._data import DEFAULT_DATA_DIR
from agents.refund import PaymentAgent
from agents.stocks import IndustryExpertAgent
from gateway.client import GatewayClient
from gateway.embedded import EmbeddedMesh, start_embedded
from gateway.server import serve_gateway
from mesh import (
    Agent,
    AgentContext,
    AgentError,
    ChangeKind,
    LocalMesh,
    Message,
    MessageType,
    MessageValidationError,
    agent,
    connect,
    on,
)
from mesh.core.errors import MeshError

REFUND_STEPS = [
    {"agent_id": a} for a in ("CustomerAgent", "SellerAgent", "PaymentAgent", "NotificationAgent")
]
HOTEL_AGENTS = ["PriceAgent", "QualityAgent", "LocationAgent", "ReviewsAgent"]
HOTEL_WEIGHTS = {"price": 0.2, "quality": 0.4, "location": 0.3, "reviews": 0.1}
EXPERTS = ["IndustryExpertAgent", "TechnicalAnalysisAgent", "FundamentalAnalysisAgent"]


def of_kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


def result_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert events[-1]["kind"] == "RESULT"
    return events[-1]["data"]


@pytest.fixture
async def gw(embedded: EmbeddedMesh) -> AsyncIterator[GatewayClient]:
    async with GatewayClient(embedded.gateway.address, timeout=30) as client:
        yield client


def data_copy(tmp_path: Path, name: str, change: Any) -> Path:
    """A data folder like the shipped one, with one file changed."""
    for source in DEFAULT_DATA_DIR.glob("*.json"):
        (tmp_path / source.name).write_text(source.read_text())
    data = json.loads((tmp_path / name).read_text())
    change(data)
    (tmp_path / name).write_text(json.dumps(data))
    return tmp_path


class Recorder:
    """Agents that record what they receive and answer with a fixed contribution."""

    def __init__(self) -> None:
        self.received: dict[str, list[Message]] = {}

    def expert(self, agent_id: str, recommendation: str, confidence: float) -> Agent:
        async def handler(message: Message, ctx: AgentContext) -> dict[str, Any]:
            self.received.setdefault(agent_id, []).append(message)
            return {
                "recommendation": recommendation,
                "confidence": confidence,
                "reasoning": f"{agent_id} likes {recommendation}",
            }

        return agent(agent_id, agent_types=["expert"])(handler)


@pytest.fixture
async def recorded() -> AsyncIterator[tuple[LocalMesh, GatewayClient, Recorder]]:
    recorder = Recorder()
    async with LocalMesh() as local:
        for name, rec, conf in (
            ("IndustryExpert", "Buy AAPL", 0.8),
            ("TechnicalAnalyst", "Buy AAPL", 0.7),
            ("FundamentalAnalyst", "Buy AAPL", 0.9),
        ):
            await local.add_agent(recorder.expert(name, rec, conf))
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                yield local, client, recorder
        finally:
            await gateway.stop(0.5)


GROUP = ["IndustryExpert", "TechnicalAnalyst", "FundamentalAnalyst"]


# -- group chat -------------------------------------------------------------------------------


async def test_scenario_01_group_chat_creation(gw: GatewayClient) -> None:
    events = await gw.collect(gw.group_chat(agent_ids=EXPERTS, query="What stock should I buy?"))
    created = events[0]
    assert created["kind"] == "GROUP_CREATED"
    data = created["data"]
    assert data["group_id"] and data["group_id"] == created["run_id"]
    assert data["agents"] == EXPERTS
    assert data["message_history"] == []
    assert data["status"] == "ACTIVE"


async def test_scenario_02_broadcast_query_to_group(recorded: Any) -> None:
    _, client, recorder = recorded
    events = await client.collect(
        client.group_chat(agent_ids=GROUP, query="Recommend a tech stock")
    )
    [sent] = of_kind(events, "BROADCAST_SENT")
    assert sent["data"]["recipients"] == GROUP
    for name in GROUP:
        [message] = recorder.received[name]
        assert message.message_type is MessageType.BROADCAST
        assert message.from_agent == "user"
        assert message.content == {"query": "Recommend a tech stock"}
        assert message.message_id == sent["data"]["message_id"]
    history = result_of(events)["message_history"]
    assert history[0] == {
        "from_agent": "user",
        "message_type": "BROADCAST",
        "content": {"query": "Recommend a tech stock"},
        "round": 1,
    }


async def test_scenario_03_agents_contribute_to_group(recorded: Any) -> None:
    _, client, recorder = recorded
    events = await client.collect(
        client.group_chat(agent_ids=GROUP, query="Recommend a tech stock", rounds=2)
    )
    contributions = of_kind(events, "CONTRIBUTION")
    assert len(contributions) == 6
    assert {c["agent_id"] for c in contributions} == set(GROUP)
    assert all(c["data"]["timestamp"] for c in contributions)
    # In round 2 every agent sees every round-1 response: the shared history.
    for name in GROUP:
        second = recorder.received[name][1]
        history = second.content["history"]
        responders = {h["from_agent"] for h in history if h["message_type"] == "RESPONSE"}
        assert responders == set(GROUP)
        assert second.content["round"] == 2
    result = result_of(events)
    assert len([h for h in result["message_history"] if h["message_type"] == "RESPONSE"]) == 6


async def test_scenario_04_aggregate_unanimous(gw: GatewayClient) -> None:
    events = await gw.collect(
        gw.group_chat(agent_ids=EXPERTS, query="What stock should I buy?", option_label="stocks")
    )
    aggregate = result_of(events)["aggregate"]
    assert aggregate["consensus"] == "Buy AAPL"
    assert aggregate["confidence"] == "HIGH"
    assert aggregate["recommendation"] == "Buy AAPL (unanimous expert consensus)"
    assert aggregate["reasoning"] == [
        "AAPL strong in tech sector (sector strength 0.80)",
        "AAPL shows bullish pattern (RSI=65)",
        "AAPL P/E ratio attractive (P/E=28)",
    ]


def disagreeing_stocks(data: dict[str, Any]) -> None:
    stocks = data["stocks"]
    stocks["AAPL"].update(rsi=75, earnings_growth=-0.01)  # leads its sector, nothing else
    stocks["MSFT"].update(rsi=65, trend_strength=0.9, pe=40)
    stocks["GOOGL"].update(rsi=45, pe=30, earnings_growth=0.05)
    data["sectors"]["technology"]["strength"] = 0.8


async def test_scenario_05_group_chat_with_disagreement(tmp_path: Path) -> None:
    running = await start_embedded(data_dir=data_copy(tmp_path, "stocks.json", disagreeing_stocks))
    try:
        async with GatewayClient(running.gateway.address) as client:
            events = await client.collect(client.route("stock_recommendation"))
    finally:
        await running.stop(0.5)
    contributions = {c["agent_id"]: c["data"] for c in of_kind(events, "CONTRIBUTION")}
    assert {k: (v["recommendation"], v["confidence"]) for k, v in contributions.items()} == {
        "IndustryExpertAgent": ("Buy AAPL", 0.8),
        "TechnicalAnalysisAgent": ("Buy MSFT", 0.9),
        "FundamentalAnalysisAgent": ("Buy GOOGL", 0.7),
    }
    aggregate = result_of(events)["aggregate"]
    assert aggregate["scores"] == {"Buy AAPL": 0.8, "Buy MSFT": 0.9, "Buy GOOGL": 0.7}
    assert aggregate["recommendation"] == "Buy MSFT (highest confidence)"
    assert aggregate["note"] == "Disagreement detected: 3 different stocks recommended"


async def test_a_data_file_edited_into_bad_json_is_named_in_the_agents_answer(
    tmp_path: Path,
) -> None:
    """The sample agents read their data file on every message (edit it and see): an edit
    that leaves it no JSON, or no object, is said with the file's path and where it broke."""
    folder = data_copy(tmp_path, "stocks.json", lambda data: None)
    (folder / "stocks.json").write_text('{"sectors": {\n')
    async with LocalMesh() as local:
        await local.add_agent(IndustryExpertAgent(data_dir=folder))
        async with local.client("Asker") as asker:
            with pytest.raises(AgentError) as broken:
                await asker.request("IndustryExpertAgent", {"action": "analyze"}, timeout=10)
            assert f"{folder / 'stocks.json'} is not valid JSON: Expecting" in broken.value.message
            assert "line 2 column 1" in broken.value.message
            (folder / "stocks.json").write_text("[1, 2]")
            with pytest.raises(AgentError, match="must hold a JSON object, not list"):
                await asker.request("IndustryExpertAgent", {"action": "analyze"}, timeout=10)


async def test_answers_whose_confidence_or_scores_are_not_shares_are_left_out_saying_why() -> None:
    """Agents are other processes. A NaN confidence would win every comparison ("Buy A
    (highest confidence)", confidence NaN, which JSON cannot even carry: the SDK refuses to
    send it, and the agent answers ERROR), an 85 would outweigh the rest: such answers are
    left out, each with its reason, and the others decide."""
    answers: dict[str, dict[str, Any]] = {
        "Careful": {"recommendation": "Buy MSFT", "confidence": 0.6, "scores": {"H": 0.6}},
        "NotANumber": {"recommendation": "Buy AAPL", "confidence": float("nan")},
        "Percent": {"recommendation": "Buy AAPL", "confidence": 85, "scores": {"H": 0.9}},
        "Worded": {"recommendation": "Buy AAPL", "confidence": "high"},
        "Beyond": {"recommendation": "Buy AAPL", "scores": {"H": 1.5}},
    }
    async with LocalMesh() as mesh:
        for name, answer in answers.items():

            @agent(name)
            async def answers_so(message: Message, ctx: AgentContext, answer: Any = answer) -> Any:
                return answer

            await mesh.add_agent(answers_so)
        gateway = await serve_gateway(mesh.address)
        try:
            async with GatewayClient(gateway.address) as client:
                chat = await client.collect(client.group_chat(agent_ids=list(answers), query="q"))
                weights = {name: 0.2 for name in answers}
                scored = await client.collect(
                    client.collaborative_filtering(
                        agent_ids=list(answers), query="q", weights=weights
                    )
                )
        finally:
            await gateway.stop(0.5)
    chat_result = result_of(chat)
    # Careful's 0.6 against Beyond's unstated confidence (0.5): the NaN does not win.
    assert chat_result["aggregate"]["scores"] == {"Buy MSFT": 0.6, "Buy AAPL": 0.5}
    assert chat_result["aggregate"]["recommendation"] == "Buy MSFT (highest confidence)"
    reasons = chat_result["missing_reasons"]
    assert reasons.pop("NotANumber").startswith(  # (its agent could not even send it)
        "NotANumber's answer was refused: nan is not a number JSON can write"
    )
    assert reasons == {
        "Percent": "confidence must be a number from 0 to 1, got 85",
        "Worded": "confidence must be a number from 0 to 1, got 'high'",
    }
    assert {e["agent_id"] for e in of_kind(chat, "AGENT_MISSING")} == {
        "NotANumber",
        "Percent",
        "Worded",
    }
    scored_result = result_of(scored)
    assert scored_result["missing_reasons"]["Beyond"] == (
        "scores.H must be a number from 0 to 1, got 1.5"
    )
    assert "Careful" not in scored_result["missing_reasons"]


async def test_group_chat_agent_stopped_mid_pattern_finishes_with_the_others() -> None:
    entered = asyncio.Event()

    @agent("SlowExpert")
    async def slow(message: Message, ctx: AgentContext) -> dict[str, Any]:
        entered.set()
        await asyncio.Event().wait()  # never answers; stopped mid-pattern below
        return {}

    recorder = Recorder()
    async with LocalMesh() as local:
        await local.add_agent(recorder.expert("A", "Buy AAPL", 0.8))
        await local.add_agent(recorder.expert("B", "Buy AAPL", 0.6))
        await local.add_agent(slow)
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                run = asyncio.create_task(
                    client.collect(
                        client.group_chat(
                            agent_ids=["A", "B", "SlowExpert"], query="q", agent_timeout="1s"
                        )
                    )
                )
                await entered.wait()
                await local.stop_agent("SlowExpert", grace=0.05)
                events = await run
        finally:
            await gateway.stop(0.5)
    result = result_of(events)
    assert result["status"] == "PARTIAL"
    assert result["missing"] == ["SlowExpert"]
    assert result["answered"] == ["A", "B"]
    assert result["aggregate"]["recommendation"] == "Buy AAPL (unanimous expert consensus)"
    [missing] = of_kind(events, "AGENT_MISSING")
    assert missing["agent_id"] == "SlowExpert"


async def test_group_chat_where_no_agent_answers_fails_and_says_why(gw: GatewayClient) -> None:
    events = await gw.collect(gw.group_chat(agent_ids=["GhostAgent"], query="Should I buy?"))
    result = result_of(events)
    assert result["status"] == "FAILED"
    assert result["answered"] == []
    assert result["missing"] == ["GhostAgent"]
    [aggregation] = of_kind(events, "AGGREGATION")
    assert aggregation["summary"] == "nothing to aggregate: no agent answered"
    assert events[-1]["summary"] == (
        "group chat failed: no agent answered (GhostAgent: agent GhostAgent is not registered)"
    )


@pytest.mark.parametrize(
    ("rpc", "request_", "field"),
    [
        ("RunGroupChat", {"agent_ids": EXPERTS, "query": "Buy?"}, "agent_timeout"),
        ("RunHandoffWorkflow", {"steps": REFUND_STEPS, "task": "refund"}, "step_timeout"),
        (
            "RunCollaborativeFiltering",
            {"agent_ids": HOTEL_AGENTS, "weights": HOTEL_WEIGHTS, "query": "Hotel in Paris"},
            "agent_timeout",
        ),
        ("RunConsensus", {"problem": "Adopt it?"}, "agent_timeout"),
        ("RunResearch", {"query": "battery recycling"}, "subagent_timeout"),
    ],
)
async def test_a_pattern_waits_for_its_agents_at_most_rt011s_30_s(
    gw: GatewayClient, rpc: str, request_: dict[str, Any], field: str
) -> None:
    for wait in ("31s", "86400s", "0s", "-1s"):
        with pytest.raises(MessageValidationError) as refused:
            await gw.collect(gw.run(rpc, {**request_, field: wait}))
        assert refused.value.code == "INVALID_ARGUMENT"
        assert str(refused.value) == (
            f"{field} must be more than 0 and at most 30 s (RT-011's aggregation timeout), "
            f"got {float(wait.removesuffix('s')):g} s"
        )
    events = await gw.collect(gw.run(rpc, {**request_, field: "30s"}))
    assert events[-1]["kind"] == "RESULT"


# -- hand-off ---------------------------------------------------------------------------------


async def test_scenario_06_handoff_workflow_creation(gw: GatewayClient) -> None:
    events = await gw.collect(
        gw.handoff_workflow(steps=REFUND_STEPS, task="Process refund for order #12345")
    )
    created = events[0]
    assert created["kind"] == "WORKFLOW_CREATED"
    assert created["data"]["workflow_id"] == created["run_id"]
    assert created["data"]["current_step"] == 0
    assert [s["agent_id"] for s in created["data"]["steps"]] == [
        s["agent_id"] for s in REFUND_STEPS
    ]
    assert [s["step"] for s in created["data"]["steps"]] == [1, 2, 3, 4]


async def workflow_status(embedded: EmbeddedMesh, workflow_id: str) -> Any:
    """The workflow's status in the shared state, as any client reads it."""
    async with connect(embedded.broker.address, agent_id="StatusReader") as client:
        return await client.get_state(f"workflow/{workflow_id}")


async def test_scenario_07_execute_handoff_workflow(
    gw: GatewayClient, embedded: EmbeddedMesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mesh.handoff")
    events = await gw.collect(
        gw.handoff_workflow(steps=REFUND_STEPS, task="Process refund for order #12345")
    )
    steps = [(e["agent_id"], e["data"]["status"]) for e in of_kind(events, "STEP_RESULT")]
    assert steps == [
        ("CustomerAgent", "APPROVED"),
        ("SellerAgent", "APPROVED"),
        ("PaymentAgent", "SUCCESS"),
        ("NotificationAgent", "SENT"),
    ]
    handoffs = [
        (e["data"]["from_agent"], e["data"]["to_agent"]) for e in of_kind(events, "HANDOFF")
    ]
    assert handoffs == [
        ("user", "CustomerAgent"),
        ("CustomerAgent", "SellerAgent"),
        ("SellerAgent", "PaymentAgent"),
        ("PaymentAgent", "NotificationAgent"),
    ]
    result = result_of(events)
    assert result["status"] == "COMPLETED"
    assert result["current_step"] == 4
    assert result["accumulated_context"]["refunded"] == 50
    # The shared state follows the workflow (RT-011 hand-off protocol) to its end.
    status = await workflow_status(embedded, result["workflow_id"])
    assert status is not None and status.version == 5  # four hand-offs, then the ending
    assert status.value["status"] == "COMPLETED" and status.value["step"] == 4
    assert status.value["current_agent"] == "NotificationAgent"
    assert status.value["finished_at"] and status.updated_by == "gateway"
    assert status.expires_at is not None  # (for the time its hand-offs gave it)
    logged = [
        (r.event["from_agent"], r.event["to_agent"], r.event["step_number"])
        for r in caplog.records
        if r.name == "mesh.handoff"
    ]
    assert logged == [
        ("user", "CustomerAgent", 1),
        ("CustomerAgent", "SellerAgent", 2),
        ("SellerAgent", "PaymentAgent", 3),
        ("PaymentAgent", "NotificationAgent", 4),
    ]


async def test_scenario_08_handoff_with_context_accumulation() -> None:
    received: list[Message] = []

    class RecordingPayment(PaymentAgent):
        async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
            received.append(message)
            return await super().handle(message, ctx)

    async with LocalMesh() as local:
        for a in sample_agents():
            await local.add_agent(RecordingPayment() if a.agent_id == "PaymentAgent" else a)
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                await client.collect(
                    client.handoff_workflow(
                        steps=REFUND_STEPS, task="Process refund for order #12345"
                    )
                )
        finally:
            await gateway.stop(0.5)
    [message] = received
    context = message.handoff.context
    assert context["previous_results"] == [
        {"order_id": "12345", "eligible": True},
        {"approved": True, "reason": "defective"},
    ]
    assert context["accumulated_context"] == {
        "order_id": "12345",
        "eligible": True,
        "approved": True,
        "reason": "defective",
    }
    assert message.handoff.previous_result == {"approved": True, "reason": "defective"}


async def test_scenario_09_conditional_handoff_rejection_skips_payment(
    gw: GatewayClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.handoff")
    events = await gw.collect(
        gw.handoff_workflow(steps=REFUND_STEPS, task="Process refund for order #12346")
    )
    result = result_of(events)
    assert result["path"] == ["CustomerAgent", "SellerAgent", "NotificationAgent"]
    assert "PaymentAgent" not in [e["agent_id"] for e in of_kind(events, "HANDOFF")]
    assert result["status"] == "COMPLETED"
    assert result["final_result"]["email"].startswith("Refund rejected: order 12346")
    seller = of_kind(events, "STEP_RESULT")[1]
    assert seller["data"]["status"] == "REJECTED"
    # The condition is logged (RF-009 scenario 10): what the seller said, and where it led.
    decisions = [
        r.event  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "event", {}).get("category") == "handoff_decision"
    ]
    assert [(d["from_agent"], d["status"], d["to_agent"]) for d in decisions] == [
        ("SellerAgent", "REJECTED", "NotificationAgent")
    ]
    assert decisions[0]["workflow_id"] == result["workflow_id"]
    assert decisions[0]["step_number"] == 2


async def test_scenario_10_handoff_chain_interruption(
    gw: GatewayClient, embedded: EmbeddedMesh
) -> None:
    events = await gw.collect(
        gw.handoff_workflow(
            steps=REFUND_STEPS,
            task="Process refund for order #12347",
            failure_agent="NotificationAgent",
        )
    )
    result = result_of(events)
    assert result["status"] == "FAILED"
    assert result["failed_at_step"] == 2
    assert result["agent_id"] == "PaymentAgent"
    assert result["error_reason"] == "Payment failed"
    assert result["notification"]["email"] == "Refund failed - payment error"
    [failure] = of_kind(events, "FAILURE")
    assert failure["data"]["failed_at_step"] == 2
    # The summary counts steps as the step events do (PaymentAgent is step 3).
    assert failure["summary"] == "workflow failed at step 3 PaymentAgent: Payment failed"
    error_handoff = of_kind(events, "HANDOFF")[-1]["data"]
    assert (error_handoff["from_agent"], error_handoff["to_agent"]) == (
        "PaymentAgent",
        "NotificationAgent",
    )
    assert error_handoff["error_handoff"] is True
    # status = FAILED, failed_at_step = 2, error_reason: in the shared state too.
    status = await workflow_status(embedded, result["workflow_id"])
    assert status is not None
    assert {k: status.value[k] for k in ("status", "failed_at_step", "error_reason")} == {
        "status": "FAILED",
        "failed_at_step": 2,
        "error_reason": "Payment failed",
    }
    assert status.value["current_agent"] == "NotificationAgent"  # told, after the failure


async def test_handoff_loop_protection_stops_with_a_clear_error() -> None:
    @agent("PingAgent")
    async def ping(message: Message, ctx: AgentContext) -> dict[str, Any]:
        return {"status": "DONE", "next_agent": "PongAgent"}

    @agent("PongAgent")
    async def pong(message: Message, ctx: AgentContext) -> dict[str, Any]:
        return {"status": "DONE", "next_agent": "PingAgent"}

    async with LocalMesh() as local:
        await local.add_agent(ping)
        await local.add_agent(pong)
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                events = await client.collect(
                    client.handoff_workflow(
                        steps=[{"agent_id": "PingAgent"}, {"agent_id": "PongAgent"}],
                        task="bounce",
                        max_hops=5,
                    )
                )
        finally:
            await gateway.stop(0.5)
    result = result_of(events)
    assert result["status"] == "FAILED"
    assert result["hops"] == 5
    assert result["error_reason"] == "workflow exceeded 5 hand-offs (loop protection)"


async def cut_short(
    workflow_id: str, *, gateway_stops: bool
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Runs IntakeAgent, then ReviewAgent (30 s at it), through a gateway; with step 2 under
    way, the caller stops reading (or the gateway stops). The workflow's statuses as a
    watcher saw them, up to the first that is not IN_PROGRESS, and the run's events as the
    gateway's observers (the dashboard, the feedback ledger) were told them."""
    started = asyncio.Event()

    @agent("IntakeAgent")
    async def intake(message: Message, ctx: AgentContext) -> dict[str, Any]:
        return {"status": "APPROVED"}

    @agent("ReviewAgent")
    async def review(message: Message, ctx: AgentContext) -> dict[str, Any]:
        started.set()
        await asyncio.sleep(30)
        return {"status": "APPROVED"}

    statuses: list[dict[str, Any]] = []
    async with LocalMesh() as local:
        await local.add_agent(intake)
        await local.add_agent(review)
        gateway = await serve_gateway(local.address)
        told: list[Any] = []
        assert gateway.servicer is not None
        gateway.servicer.observers.append(told.append)
        try:
            async with GatewayClient(gateway.address) as client, local.client("Desk") as desk:
                changes = desk.watch_state(f"workflow/{workflow_id}")
                assert (await anext(changes)).kind is ChangeKind.SYNCED
                stream = client.handoff_workflow(
                    steps=[{"agent_id": "IntakeAgent"}, {"agent_id": "ReviewAgent"}],
                    task="review claim 7",
                    workflow_id=workflow_id,
                )
                async for event in stream:
                    if event["kind"] == "HANDOFF" and event["data"]["to_agent"] == "ReviewAgent":
                        break
                await asyncio.wait_for(started.wait(), 10)  # step 2 under way
                if gateway_stops:
                    await gateway.stop(0.2)
                    with pytest.raises(MeshError):
                        async for _ in stream:
                            pass
                else:
                    await stream.aclose()
                while not statuses or statuses[-1]["status"] == "IN_PROGRESS":
                    change = await asyncio.wait_for(anext(changes), 10)
                    assert change.entry is not None
                    statuses.append(dict(change.entry.value))
                await changes.aclose()
        finally:
            await gateway.stop(0.2)
    return statuses, told


@pytest.mark.parametrize("gateway_stops", [False, True], ids=["caller gives up", "gateway stops"])
async def test_a_workflow_cut_short_is_recorded_failed_where_it_was(gateway_stops: bool) -> None:
    """The caller stops reading, or the gateway stops, while step 2 is under way: the run is
    cancelled, and the workflow's status says FAILED at that step, where it stayed IN_PROGRESS
    (for `agentmesh workflows`, a dashboard, a watcher) until its ttl ran out a day later. (A
    stopping gateway closed its broker client before the run could record its ending.)"""
    statuses, told = await cut_short("wf_cut_short", gateway_stops=gateway_stops)
    assert [(s["status"], s["current_agent"]) for s in statuses] == [
        ("IN_PROGRESS", "IntakeAgent"),
        ("IN_PROGRESS", "ReviewAgent"),
        ("FAILED", "ReviewAgent"),
    ]
    assert statuses[-1]["failed_at_step"] == 1
    assert statuses[-1]["error_reason"].startswith("the run was cancelled: its caller stopped")
    # The dashboard and the ledger are told it ended (they showed it running for good).
    ended = told[-1]
    assert (ended.run_id, ended.kind.value, ended.data["status"]) == (
        "wf_cut_short",
        "RESULT",
        "CANCELLED",
    )
    assert ended.summary.startswith("hand_off run ended without a result: cancelled")


async def test_a_step_whose_agent_cannot_take_the_hand_off_fails_at_once_saying_why() -> None:
    """The agent has no handler for a hand-off: it dead-letters it. The workflow waited the
    step's timeout for an answer that could not come; now it fails at once, with the reason."""

    class PickyAgent(Agent):
        agent_id = "PickyAgent"

        @on("something_else")
        async def other(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
            return {"status": "DONE"}

    async with LocalMesh() as local:
        await local.add_agent(PickyAgent())
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                started = asyncio.get_running_loop().time()
                events = await client.collect(
                    client.handoff_workflow(
                        steps=[{"agent_id": "PickyAgent"}], task="do it", step_timeout="30s"
                    )
                )
                waited = asyncio.get_running_loop().time() - started
        finally:
            await gateway.stop(0.5)
    result = result_of(events)
    assert result["status"] == "FAILED"
    assert result["error_reason"] == (
        "PickyAgent did not answer: the message was dead-lettered "
        "(PickyAgent does not handle action 'execute_handoff')"
    )
    assert waited < 15  # (not the step's 30 s)


# -- collaborative filtering ------------------------------------------------------------------


async def test_scenario_11_collaborative_filtering_setup(gw: GatewayClient) -> None:
    events = await gw.collect(
        gw.collaborative_filtering(
            agent_ids=HOTEL_AGENTS, weights=HOTEL_WEIGHTS, query="Hotel in Paris near Eiffel Tower"
        )
    )
    sent = of_kind(events, "BROADCAST_SENT")[0]["data"]
    assert sent["recipients"] == HOTEL_AGENTS
    assert sent["weights"] == HOTEL_WEIGHTS
    with pytest.raises(MessageValidationError, match=r"weights must sum to 1\.0, got 0\.9") as info:
        await gw.collect(
            gw.collaborative_filtering(
                agent_ids=HOTEL_AGENTS,
                weights={**HOTEL_WEIGHTS, "reviews": 0.0},
                query="Hotel in Paris",
            )
        )
    assert info.value.code == "INVALID_ARGUMENT"


async def filter_hotels(
    scores: dict[str, float], agent_ids: list[str], before: Any = None
) -> list[dict[str, Any]]:
    """A collaborative filtering over HOTEL_WEIGHTS (by agent type) of hotel agents that
    score "Hotel A" as ``scores`` says (each awaiting ``before()`` first, when given), asked
    of ``agent_ids``: its events."""

    def make(name: str) -> Agent:
        async def handler(message: Message, ctx: AgentContext) -> dict[str, Any]:
            if before is not None:
                await before()
            return {"scores": {"Hotel A": scores[name]}, "confidence": scores[name]}

        return agent(name, agent_types=["hotel", name.removesuffix("Agent").lower()])(handler)

    async with LocalMesh() as local:
        for name in scores:
            await local.add_agent(make(name))
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                return await client.collect(
                    client.collaborative_filtering(
                        agent_ids=agent_ids, weights=HOTEL_WEIGHTS, query="Hotel in Paris"
                    )
                )
        finally:
            await gateway.stop(0.5)


async def test_an_agent_weighed_by_type_that_is_not_registered_is_missing_not_a_refusal() -> None:
    """Weights by agent type, and one of the agents asked not registered: its type, and so
    its weight, is unknown; it is named missing, as in every pattern, and the weights of
    those that answered are scaled back to 1.0 (before: the whole run was refused,
    INVALID_ARGUMENT "no weight for agent")."""
    scores = {"PriceAgent": 0.9, "QualityAgent": 0.7, "LocationAgent": 0.8}
    events = await filter_hotels(scores, HOTEL_AGENTS)
    [missing] = of_kind(events, "AGENT_MISSING")
    assert missing["agent_id"] == "ReviewsAgent"
    assert missing["data"]["reason"] == "agent ReviewsAgent is not registered"
    result = result_of(events)
    assert result["status"] == "PARTIAL"  # (as with any agent missing)
    # (0.2 x 0.9 + 0.4 x 0.7 + 0.3 x 0.8) / 0.9, the weights that answered
    assert result["score"] == pytest.approx(0.7 / 0.9)


async def test_scenario_12_parallel_recommendations() -> None:
    """All four agents must be working at the same moment: a barrier that only opens when all
    four have started proves the calls run in parallel."""
    barrier = asyncio.Barrier(4)
    scores = {"PriceAgent": 0.9, "QualityAgent": 0.7, "LocationAgent": 0.8, "ReviewsAgent": 0.6}

    async def all_four_started() -> None:
        async with asyncio.timeout(3):
            await barrier.wait()

    events = await filter_hotels(scores, list(scores), all_four_started)
    result = result_of(events)
    assert result["status"] == "COMPLETED"
    assert sorted(result["agent_durations_ms"]) == sorted(scores)
    assert result["score"] == pytest.approx(0.76)


async def test_scenario_13_weighted_aggregation(gw: GatewayClient) -> None:
    events = await gw.collect(
        gw.collaborative_filtering(
            agent_ids=HOTEL_AGENTS, weights=HOTEL_WEIGHTS, query="Hotel in Paris near Eiffel Tower"
        )
    )
    opinions = {e["agent_id"]: e["data"]["scores"] for e in of_kind(events, "SCORES")}
    assert opinions == {
        "PriceAgent": {"Hotel A": 0.9, "Hotel B": 0.6, "Hotel C": 0.5},
        "QualityAgent": {"Hotel A": 0.7, "Hotel B": 0.9, "Hotel C": 0.6},
        "LocationAgent": {"Hotel A": 0.8, "Hotel B": 0.8, "Hotel C": 0.9},
        "ReviewsAgent": {"Hotel A": 0.6, "Hotel B": 0.9, "Hotel C": 0.7},
    }
    result = result_of(events)
    assert result["decision"]["breakdown"] == {"Hotel A": 0.76, "Hotel B": 0.81, "Hotel C": 0.68}
    assert result["recommendation"] == "Hotel B"
    assert result["score"] == 0.81


def confidence_hotels(data: dict[str, Any]) -> None:
    data["cities"]["Paris"]["options"] = [
        {
            "name": "Hotel A",
            "price": 100,
            "rating": 3.5,
            "distance_km": 2.0,
            "review_ratings": [2.5],
        },
        {
            "name": "Hotel B",
            "price": 400,
            "rating": 4.75,
            "distance_km": 3.0,
            "review_ratings": [2.75],
        },
        {"name": "Hotel C", "price": 500, "rating": 3.0, "distance_km": 2.5, "review_ratings": [3]},
    ]


async def test_collaborative_filtering_where_no_agent_scores_fails_and_says_why(
    gw: GatewayClient,
) -> None:
    events = await gw.collect(
        gw.collaborative_filtering(
            agent_ids=["GhostA", "GhostB"], weights={"GhostA": 0.5, "GhostB": 0.5}, query="hotel"
        )
    )
    result = result_of(events)
    assert result["status"] == "FAILED"
    assert result["recommendation"] is None
    assert result["missing"] == ["GhostA", "GhostB"]
    [aggregation] = of_kind(events, "AGGREGATION")
    assert aggregation["summary"] == "nothing to aggregate: no agent gave scores"
    assert events[-1]["summary"] == (
        "no recommendation: no agent answered (GhostA: agent GhostA is not registered; "
        "GhostB: agent GhostB is not registered)"
    )


async def test_scenario_14_confidence_based_weighting(tmp_path: Path) -> None:
    running = await start_embedded(data_dir=data_copy(tmp_path, "hotels.json", confidence_hotels))
    try:
        async with GatewayClient(running.gateway.address) as client:
            events = await client.collect(
                client.collaborative_filtering(
                    agent_ids=HOTEL_AGENTS,
                    weights=HOTEL_WEIGHTS,
                    query="Hotel in Paris",
                    method="confidence",
                )
            )
    finally:
        await running.stop(0.5)
    picks = {
        e["agent_id"]: (e["data"]["recommendation"], e["data"]["confidence"])
        for e in of_kind(events, "SCORES")
    }
    assert picks == {
        "PriceAgent": ("Hotel A", 0.9),
        "QualityAgent": ("Hotel B", 0.95),
        "LocationAgent": ("Hotel A", 0.8),
        "ReviewsAgent": ("Hotel C", 0.6),
    }
    decision = result_of(events)["decision"]
    assert decision["breakdown"] == {
        "Hotel A": {"votes": 2, "agents": ["PriceAgent", "LocationAgent"], "avg_confidence": 0.85},
        "Hotel B": {"votes": 1, "agents": ["QualityAgent"], "avg_confidence": 0.95},
        "Hotel C": {"votes": 1, "agents": ["ReviewsAgent"], "avg_confidence": 0.6},
    }
    assert decision["recommendation"] == "Hotel B"


def tied_hotels(data: dict[str, Any]) -> None:
    data["cities"]["Paris"]["options"] = [
        {"name": "Hotel A", "price": 100, "rating": 3.5, "distance_km": 0.0, "review_ratings": [3]},
        {
            "name": "Hotel B",
            "price": 500,
            "rating": 4.5,
            "distance_km": 1.0,
            "review_ratings": [4.5],
        },
    ]


async def test_scenario_15_tie_breaking(tmp_path: Path) -> None:
    running = await start_embedded(data_dir=data_copy(tmp_path, "hotels.json", tied_hotels))
    try:
        async with GatewayClient(running.gateway.address) as client:
            runs = [
                await client.collect(
                    client.collaborative_filtering(
                        agent_ids=HOTEL_AGENTS,
                        weights=HOTEL_WEIGHTS,
                        query="Hotel in Paris",
                        seed=7,
                    )
                )
                for _ in range(2)
            ]
    finally:
        await running.stop(0.5)
    for events in runs:
        decision = result_of(events)["decision"]
        assert decision["breakdown"] == {"Hotel A": 0.82, "Hotel B": 0.82}
        assert decision["tie"] == ["Hotel A", "Hotel B"]
        assert decision["recommendation"] == "Hotel B"
        assert decision["tie_break"] == "highest individual agent score: quality 0.9 > 0.7"


# -- orchestration ----------------------------------------------------------------------------


async def test_scenario_16_orchestrator_routes_to_pattern(gw: GatewayClient) -> None:
    events = await gw.collect(gw.route("stock_recommendation", "What stock should I buy?"))
    routed = events[0]
    assert routed["kind"] == "ROUTED"
    assert routed["data"]["pattern"] == "GROUP_CHAT"
    assert routed["data"]["reason"] == "Multiple expert opinions needed"
    assert events[1]["kind"] == "GROUP_CREATED"
    assert routed["run_id"] == events[1]["run_id"]
    assert result_of(events)["aggregate"]["consensus"] == "Buy AAPL"
    with pytest.raises(MeshError, match="no pattern for request type 'weather'") as info:
        await gw.collect(gw.route("weather"))
    assert info.value.code == "INVALID_ARGUMENT"


async def test_scenario_17_pattern_switching_mid_workflow(
    gw: GatewayClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.handoff")
    events = await gw.collect(gw.route("refund_with_review", order_id="12345"))
    switches = [
        (e["data"]["from_pattern"], e["data"]["to_pattern"], e["data"]["at_step"])
        for e in of_kind(events, "PATTERN_SWITCH")
    ]
    assert switches == [("HAND_OFF", "GROUP_CHAT", 2), ("GROUP_CHAT", "HAND_OFF", 2)]
    members = {e["agent_id"] for e in of_kind(events, "CONTRIBUTION")}
    assert members == {"PolicyAgent", "FraudCheckAgent", "FinanceAgent"}
    result = result_of(events)
    assert result["status"] == "COMPLETED"
    assert result["path"] == ["CustomerAgent", "ApprovalBoard", "PaymentAgent", "NotificationAgent"]
    assert result["accumulated_context"]["decision"] == "APPROVED"
    logged = [
        r.event["to_pattern"]
        for r in caplog.records
        if getattr(r, "event", {}).get("category") == "pattern_switch"
    ]
    assert logged == ["GROUP_CHAT", "HAND_OFF"]


async def test_scenario_18_parallel_patterns(gw: GatewayClient) -> None:
    events = await gw.collect(
        gw.parallel(
            [
                {"name": "hotel", "route": {"request_type": "hotel_recommendation"}},
                {"name": "flight", "route": {"request_type": "flight_recommendation"}},
            ]
        )
    )
    result = result_of(events)
    assert result["status"] == "COMPLETED"
    assert result["results"]["hotel"]["recommendation"] == "Hotel B"
    assert result["results"]["flight"]["recommendation"] == "IB3402 13:30"
    assert len(result["results"]["hotel"]["opinions"]) == 4
    assert len(result["results"]["flight"]["opinions"]) == 3
    # Both ran at once: both questions went out before either pattern finished.
    kinds = [(e["kind"], e["pattern"]) for e in events]
    first_result = kinds.index(("RESULT", "COLLABORATIVE_FILTERING"))
    assert [k for k, _ in kinds[:first_result]].count("BROADCAST_SENT") == 2


async def test_scenario_19_pattern_tracing(recorded: Any, span_exporter: Any) -> None:
    _, client, _ = recorded
    span_exporter.clear()
    events = await client.collect(
        client.group_chat(agent_ids=GROUP, query="Stock?", group_id="wf_stock_rec_123")
    )
    finished = span_exporter.get_finished_spans()
    [root] = [
        s
        for s in finished
        if s.name == "group_chat" and s.attributes.get("group_id") == "wf_stock_rec_123"
    ]
    assert root.attributes["workflow_id"] == "wf_stock_rec_123"
    spans = [s for s in finished if s.context.trace_id == root.context.trace_id]
    names = [s.name for s in spans]
    for name in (
        "group_chat.broadcast",
        "industry_expert.analyze",
        "technical_analyst.analyze",
        "fundamental_analyst.analyze",
        "group_chat.aggregate",
    ):
        assert names.count(name) == 1, name
    assert names.count("broker.queue") == 3
    by_id = {s.context.span_id: s for s in spans}

    def parent_of(span: Any) -> Any:
        return by_id[span.parent.span_id]

    assert parent_of(root).name == "gateway.group_chat"  # the RPC's span holds the pattern
    for span in spans:
        if span.name != "gateway.group_chat":  # the rest hangs, through its parents, from root
            ancestor = span
            while ancestor is not root:
                ancestor = parent_of(ancestor)
    broadcast = next(s for s in spans if s.name == "group_chat.broadcast")
    analyze = [s for s in spans if s.name.endswith(".analyze")]
    for span in analyze:
        queued = parent_of(span)
        assert queued.name == "broker.queue"  # the wait in the agent's queue is in the trace
        assert queued.attributes["queue_wait_ms"] >= 0
        assert queued.attributes["agent"] == span.attributes["agent"]
        assert parent_of(queued) is broadcast
    assert parent_of(next(s for s in spans if s.name == "group_chat.aggregate")) is root
    slowest = max(analyze, key=lambda s: s.end_time)
    assert events[-1]["data"]["critical_path"][0] == "group_chat.broadcast"
    assert events[-1]["data"]["critical_path"][-1] == "group_chat.aggregate"
    assert slowest.name in {
        "industry_expert.analyze",
        "technical_analyst.analyze",
        "fundamental_analyst.analyze",
    }


async def test_scenario_20_pattern_performance_metrics(embedded: EmbeddedMesh) -> None:
    async with GatewayClient(embedded.gateway.address) as client:
        for _ in range(2):
            await client.collect(client.route("stock_recommendation"))
        refunds = [
            (await client.collect(client.route("refund_request", order_id=order)))[-1]
            for order in ("12345", "12346", "12347")
        ]
        hotels = [
            (await client.collect(client.route("hotel_recommendation")))[-1] for _ in range(3)
        ]
        # Users say which recommendations satisfied them (accuracy = user satisfaction).
        for hotel, satisfied in zip(hotels, (True, True, False), strict=True):
            rated = await client.feedback(hotel["run_id"], satisfied)
        assert rated["pattern"] == "COLLABORATIVE_FILTERING"
        assert (rated["rated"], rated["satisfied"]) == (3, 2)
        assert rated["accuracy"] == pytest.approx(2 / 3)
        [failed_refund] = [r for r in refunds if r["data"]["status"] == "FAILED"]
        with pytest.raises(MeshError) as refused:
            await client.feedback(failed_refund["run_id"], True)
        assert (refused.value.code, refused.value.reason) == ("FAILED_PRECONDITION", "RUN_FAILED")
        with pytest.raises(MeshError) as refused:
            await client.feedback("cf_never_ran", True)
        assert refused.value.code == "NOT_FOUND"
        stats = await client.pattern_stats()
    assert stats["GROUP_CHAT"]["runs"] == 2
    assert stats["GROUP_CHAT"]["consensus_rate"] == 1.0
    assert stats["HAND_OFF"]["runs"] == 3
    assert stats["HAND_OFF"]["failed"] == 1
    assert stats["HAND_OFF"]["completion_rate"] == pytest.approx(2 / 3)
    assert stats["COLLABORATIVE_FILTERING"]["completed"] == 3
    assert stats["COLLABORATIVE_FILTERING"]["accuracy"] == pytest.approx(2 / 3)
    assert stats["HAND_OFF"]["rated"] == 0 and stats["HAND_OFF"]["accuracy"] == 0.0
    assert stats["HAND_OFF"]["duration_avg_seconds"] > 0
    port = embedded.broker.metrics_port
    url = f"http://127.0.0.1:{port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    samples = {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in body.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['agentmesh_pattern_duration_seconds_count{pattern="GROUP_CHAT"}'] == 2
    assert samples['agentmesh_pattern_runs_total{pattern="HAND_OFF",status="FAILED"}'] == 1
    assert samples['agentmesh_pattern_completion_rate{pattern="HAND_OFF"}'] == pytest.approx(2 / 3)
    assert samples["agentmesh_group_chat_consensus_rate"] == 1.0
    assert samples["agentmesh_routing_latency_seconds_count"] == 8
    accuracy = samples['agentmesh_pattern_accuracy{pattern="COLLABORATIVE_FILTERING"}']
    assert accuracy == pytest.approx(2 / 3)
    feedback = 'agentmesh_pattern_feedback_total{pattern="COLLABORATIVE_FILTERING",satisfied="%s"}'
    assert samples[feedback % "true"] == 2 and samples[feedback % "false"] == 1
    # RT-011's orchestration metrics under their own names, in milliseconds.
    assert samples["multi_agent_orchestration_routing_latency_p95"] > 0
    assert samples["multi_agent_orchestration_aggregation_latency_p95"] > 0
    resolved = samples["multi_agent_conflict_resolution_count"]
    assert resolved == samples["agentmesh_conflict_resolutions_total"]
    conflict_ms = samples["agentmesh_conflict_resolution_latency_seconds_sum"] * 1000
    assert samples["multi_agent_conflict_resolution_latency_avg"] == pytest.approx(
        conflict_ms / resolved if resolved else 0
    )
    # The broker's own metrics are on the same page.
    assert samples["agentmesh_handoffs_total"] >= 10


async def test_group_chat_conflict_strategies_through_the_gateway() -> None:
    """RT-011 conflict resolution, chosen per run: majority, unanimous, and hierarchy (the
    request's levels: the higher-level agent overrides the others)."""
    recorder = Recorder()
    async with LocalMesh() as local:
        await local.add_agent(recorder.expert("Junior1", "Buy AAPL", 0.6))
        await local.add_agent(recorder.expert("Junior2", "Buy AAPL", 0.5))
        await local.add_agent(recorder.expert("Lead", "Buy MSFT", 0.95))
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                group = ["Junior1", "Junior2", "Lead"]

                async def aggregate_by(strategy: str, **extra: Any) -> dict[str, Any]:
                    events = await client.collect(
                        client.group_chat(agent_ids=group, query="q", strategy=strategy, **extra)
                    )
                    return dict(result_of(events)["aggregate"])

                majority = await aggregate_by("majority")
                assert majority["recommendation"] == "Buy AAPL (majority: 2 of 3 votes)"
                unanimous = await aggregate_by("unanimous")
                assert unanimous["decided"] is False and unanimous["recommendation"] is None
                ranked = await aggregate_by("hierarchy", hierarchy={"Lead": 0, "Junior1": 2})
                assert ranked["consensus"] == "Buy MSFT" and ranked["decided_by"] == ["Lead"]
                assert ranked["overruled"] == ["Junior1", "Junior2"]
                with pytest.raises(MessageValidationError):
                    await aggregate_by("hierarchy", hierarchy={"Stranger": 0})
        finally:
            await gateway.stop(0.5)


async def test_a_parallel_merge_step_hands_off_to_several_agents_and_merges_their_results() -> None:
    """RT-011 hand-off type parallel_merge: (Flights || Hotels || Cars) -> Booker."""
    seen: list[Message] = []

    def finder(agent_id: str, found: dict[str, Any]) -> Agent:
        async def handler(message: Message, ctx: AgentContext) -> dict[str, Any]:
            seen.append(message)
            if found.get("fail"):
                raise RuntimeError(f"{agent_id} is down")
            return found

        return agent(agent_id)(handler)

    booked: list[Message] = []

    @agent("Booker")
    async def booker(message: Message, ctx: AgentContext) -> dict[str, Any]:
        booked.append(message)
        return {"booked": True}

    async with LocalMesh() as local:
        for agent_id, found in (
            ("Flights", {"flight": "AF123"}),
            ("Hotels", {"hotel": "Ritz"}),
            ("Cars", {"car": "Mini"}),
            ("BrokenCars", {"fail": True}),
        ):
            await local.add_agent(finder(agent_id, found))
        await local.add_agent(booker)
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                events = await client.collect(
                    client.handoff_workflow(
                        steps=[
                            {"parallel_agent_ids": ["Flights", "Hotels", "Cars"]},
                            {"agent_id": "Booker"},
                        ],
                        task="Book a trip to Paris",
                    )
                )
                result = result_of(events)
                assert result["status"] == "COMPLETED"
                assert result["path"] == ["Flights|Hotels|Cars", "Booker"]
                [created] = of_kind(events, "WORKFLOW_CREATED")
                assert created["data"]["steps"][0]["pattern"] == "PARALLEL_MERGE"
                handoffs = of_kind(events, "HANDOFF")
                assert sorted(h["data"]["to_agent"] for h in handoffs[:3]) == [
                    "Cars",
                    "Flights",
                    "Hotels",
                ]
                assert {h["data"]["step_number"] for h in handoffs[:3]} == {1}
                assert {m.message_type for m in seen} == {MessageType.HANDOFF}
                [message] = booked
                assert message.handoff is not None
                assert message.handoff.previous_result == {
                    "Flights": {"flight": "AF123"},
                    "Hotels": {"hotel": "Ritz"},
                    "Cars": {"car": "Mini"},
                }
                accumulated = message.handoff.context["accumulated_context"]
                assert accumulated == {"flight": "AF123", "hotel": "Ritz", "car": "Mini"}

                failing = result_of(
                    await client.collect(
                        client.handoff_workflow(
                            steps=[
                                {"parallel_agent_ids": ["Flights", "BrokenCars"]},
                                {"agent_id": "Booker"},
                            ],
                            task="Book a trip to Rome",
                            step_timeout="1s",  # a failing hand-off is not answered
                        )
                    )
                )
                assert failing["status"] == "FAILED" and failing["failed_at_step"] == 0
                assert "BrokenCars" in failing["error_reason"]
                assert len(booked) == 1  # the failed step handed nothing on
        finally:
            await gateway.stop(0.5)


async def test_users_feedback_becomes_the_agents_track_record_in_conflict_resolution() -> None:
    """RT-011 conflict resolution weighs expertise (0.5), confidence (0.3) and historical
    accuracy (0.2); the accuracy comes from users rating the group chats the agents were in."""
    recorder = Recorder()
    async with LocalMesh() as local:
        await local.add_agent(recorder.expert("Junior1", "Buy AAPL", 0.6))
        await local.add_agent(recorder.expert("Junior2", "Buy AAPL", 0.5))
        await local.add_agent(recorder.expert("Lead", "Buy MSFT", 0.95))
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                group = ["Junior1", "Junior2", "Lead"]

                async def chat(strategy: str) -> dict[str, Any]:
                    events = await client.collect(
                        client.group_chat(
                            agent_ids=group, query="q", strategy=strategy, expertise={"Lead": 0.9}
                        )
                    )
                    return result_of(events)

                before = (await chat("expertise_weighted"))["aggregate"]
                assert before["weights"] == {"Junior1": 0.53, "Junior2": 0.5, "Lead": 0.835}
                assert before["winner"] == "Buy AAPL"
                # The group went with AAPL; the user was not satisfied: the juniors were wrong.
                rated = await chat("weighted_voting")
                await client.feedback(rated["group_id"], False)
                after = (await chat("expertise_weighted"))["aggregate"]
                assert after["historical_accuracy"] == {"Junior1": 0.0, "Junior2": 0.0, "Lead": 1.0}
                assert after["weights"] == {"Junior1": 0.43, "Junior2": 0.4, "Lead": 0.935}
                assert after["winner"] == "Buy MSFT"
        finally:
            await gateway.stop(0.5)


async def test_the_sample_refund_checks_run_in_parallel_and_merge(embedded: EmbeddedMesh) -> None:
    """The demo's parallel-merge refund: three checks at once; all pass -> payment; one
    refuses (MIXED) -> straight to the customer's email, naming the check."""
    steps = [
        {"agent_id": "CustomerAgent"},
        {
            "parallel_agent_ids": ["PolicyAgent", "FraudCheckAgent", "FinanceAgent"],
            "routes": {"MIXED": "NotificationAgent", "REJECTED": "NotificationAgent"},
        },
        {"agent_id": "PaymentAgent"},
        {"agent_id": "NotificationAgent"},
    ]
    emails = {}
    async with GatewayClient(embedded.gateway.address) as client:
        for order in ("12345", "12346"):
            events = await client.collect(
                client.handoff_workflow(
                    steps=steps,
                    task=f"Process refund for order #{order}",
                    context={"order_id": order},
                )
            )
            result = result_of(events)
            emails[order] = (result["path"], result["final_result"]["email"])
    checks = "PolicyAgent|FraudCheckAgent|FinanceAgent"
    assert emails["12345"] == (
        ["CustomerAgent", checks, "PaymentAgent", "NotificationAgent"],
        "Refund approved: $50 to original_payment for order 12345",
    )
    assert emails["12346"] == (
        ["CustomerAgent", checks, "NotificationAgent"],
        "Refund rejected: order 12346 did not pass PolicyAgent",
    )

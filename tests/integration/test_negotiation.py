"""RT-011 peer-to-peer coordination: an agent negotiates terms with its peers directly, each
peer an agent on its own gRPC server, for at most 3 rounds and 5 seconds, with 10 peers at most."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mesh import (
    Agent,
    AgentContext,
    AgentNotFoundError,
    LocalMesh,
    Message,
    MessageType,
    MessageValidationError,
    agent,
    negotiation,
    on,
)
from mesh.core.model import JSON


class Seller(Agent):
    """Sells at ``floor`` or more: accepts a price at or above it, counters below it with the
    midpoint (but never below the floor), and refuses anything under half of it."""

    def __init__(self, agent_id: str, floor: float) -> None:
        super().__init__(agent_id, agent_types=["seller"])
        self.floor = floor
        self.seen: list[Message] = []

    @on("negotiate")
    async def consider(self, message: Message, ctx: AgentContext) -> dict[str, JSON]:
        self.seen.append(message)
        price = float(message.parameters["proposal"]["price"])
        if price >= self.floor:
            return negotiation.accept("fair")
        if price < self.floor / 2:
            return negotiation.reject(f"{price:g} is not serious")
        return negotiation.counter({"price": max(self.floor, (price + self.floor) / 2)}, "more")


@pytest.fixture
async def mesh() -> AsyncIterator[LocalMesh]:
    async with LocalMesh() as local:
        yield local


async def test_peers_that_accept_at_once_agree_in_one_round(mesh: LocalMesh) -> None:
    sellers = [Seller(f"Seller{i}", floor=80) for i in range(3)]
    for seller in sellers:
        await mesh.add_agent(seller)
    buyer = mesh.client("Buyer")
    outcome = await buyer.negotiate(
        [s.agent_id for s in sellers], {"price": 100, "item": "lamp"}, topic="lamp"
    )
    assert outcome.status is negotiation.Status.AGREED and outcome.agreed
    assert outcome.proposal == {"price": 100, "item": "lamp"}
    [only] = outcome.rounds
    assert [r.peer for r in only.replies] == ["Seller0", "Seller1", "Seller2"]
    assert {r.decision for r in only.replies} == {negotiation.Decision.ACCEPT}
    # Each peer got the proposal directly, as a REQUEST from the buyer.
    for seller in sellers:
        [message] = seller.seen
        assert message.message_type is MessageType.REQUEST
        assert message.from_agent == "Buyer"
        assert message.action == "negotiate"
        assert message.parameters["round"] == 1
        assert message.parameters["topic"] == "lamp"
        assert message.parameters["negotiation_id"] == outcome.negotiation_id


async def test_counters_are_taken_up_round_by_round_until_every_peer_accepts(
    mesh: LocalMesh,
) -> None:
    await mesh.add_agent(Seller("Cheap", floor=60))
    await mesh.add_agent(Seller("Dear", floor=90))
    buyer = mesh.client("Buyer")
    outcome = await buyer.negotiate(["Cheap", "Dear"], {"price": 50})
    assert outcome.status is negotiation.Status.AGREED
    # Round 1 at 50: both counter (55 -> floor 60; 70 -> floor 90); the counters' terms are
    # taken in peer order, so round 2 proposes 90, which both accept.
    assert [r.proposal for r in outcome.rounds] == [{"price": 50}, {"price": 90.0}]
    assert outcome.proposal == {"price": 90.0}
    assert [r.decision for r in outcome.rounds[0].replies] == ["counter", "counter"]


async def test_the_proposer_may_revise_by_its_own_policy_and_runs_out_of_rounds(
    mesh: LocalMesh,
) -> None:
    await mesh.add_agent(Seller("Dear", floor=90))
    buyer = mesh.client("Buyer")

    def stingy(terms: dict[str, JSON], counters: Any) -> dict[str, JSON]:
        price = terms["price"]
        assert isinstance(price, int | float)
        return {"price": price + 5}  # concedes 5 a round, whatever the peers ask

    outcome = await buyer.negotiate(["Dear"], {"price": 60}, revise=stingy)
    assert outcome.status is negotiation.Status.NO_AGREEMENT
    assert [r.proposal["price"] for r in outcome.rounds] == [60, 65, 70]  # 3 rounds at most
    assert outcome.proposal == {"price": 70}
    shorter = await buyer.negotiate(["Dear"], {"price": 60}, rounds=1)
    assert shorter.status is negotiation.Status.NO_AGREEMENT and len(shorter.rounds) == 1


async def test_a_rejection_or_a_failing_peer_ends_the_negotiation(mesh: LocalMesh) -> None:
    await mesh.add_agent(Seller("Proud", floor=100))
    await mesh.add_agent(Seller("Easy", floor=10))

    @agent("Broken")
    async def broken(message: Message, ctx: AgentContext) -> dict[str, JSON]:
        raise RuntimeError("price list unavailable")

    await mesh.add_agent(broken)
    buyer = mesh.client("Buyer")
    refused = await buyer.negotiate(["Easy", "Proud"], {"price": 20})
    assert refused.status is negotiation.Status.REJECTED
    assert len(refused.rounds) == 1
    [easy, proud] = refused.rounds[0].replies
    assert easy.decision is negotiation.Decision.ACCEPT
    assert proud.decision is negotiation.Decision.REJECT and proud.reason == "20 is not serious"
    failed = await buyer.negotiate(["Easy", "Broken"], {"price": 20})
    assert failed.status is negotiation.Status.REJECTED
    assert "price list unavailable" in failed.rounds[0].replies[1].reason


async def test_a_peer_that_does_not_answer_in_time_ends_it_timed_out(mesh: LocalMesh) -> None:
    await mesh.add_agent(Seller("Quick", floor=10))

    @agent("Slow")
    async def slow(message: Message, ctx: AgentContext) -> dict[str, JSON]:
        await asyncio.sleep(2)
        return negotiation.accept()

    await mesh.add_agent(slow)
    outcome = await mesh.client("Buyer").negotiate(["Quick", "Slow"], {"price": 20}, timeout=0.5)
    assert outcome.status is negotiation.Status.TIMED_OUT
    [only] = outcome.rounds
    assert only.missing == ("Slow",)
    assert [r.peer for r in only.replies] == ["Quick"]


async def test_peers_negotiate_with_each_other_from_their_handlers(mesh: LocalMesh) -> None:
    """Decentralised: an agent asked to buy negotiates with the sellers itself."""
    await mesh.add_agent(Seller("Cheap", floor=60))

    @agent("Purchaser")
    async def purchaser(message: Message, ctx: AgentContext) -> dict[str, JSON]:
        outcome = await ctx.negotiate(["Cheap"], {"price": 40}, topic="chair")
        return {"status": outcome.status.value, "price": outcome.proposal["price"]}

    await mesh.add_agent(purchaser)
    answer = await mesh.client("User").request("Purchaser", {"action": "buy"}, timeout=5)
    assert answer.content == {"action": "buy", "status": "AGREED", "price": 60}


async def test_limits_are_refused_before_anything_is_sent(
    mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    seller = Seller("Seller0", floor=10)
    await mesh.add_agent(seller)
    buyer = mesh.client("Buyer")
    eleven = [f"Peer{i}" for i in range(11)]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"peers": eleven}, "peers"),
        ({"peers": []}, "peers"),
        ({"peers": ["Seller0", "Seller0"]}, "peers"),
        ({"peers": ["Buyer"]}, "peers"),
        ({"peers": ["Seller0"], "rounds": 4}, "rounds"),
        ({"peers": ["Seller0"], "rounds": 0}, "rounds"),
        ({"peers": ["Seller0"], "timeout": 6.0}, "timeout"),
    ]
    for options, field in cases:
        peers = options.pop("peers")
        with pytest.raises(MessageValidationError) as caught:
            await buyer.negotiate(peers, {"price": 1}, **options)
        assert [v.field for v in caught.value.field_violations] == [field]
    assert seller.seen == []
    # A peer that is not registered: refused before any peer is asked.
    with pytest.raises(AgentNotFoundError, match="Nobody is not registered"):
        await buyer.negotiate(["Seller0", "Nobody"], {"price": 50})
    # A negotiation that ran is logged as one structured event.
    caplog.set_level(logging.INFO, logger="mesh.client")
    await buyer.negotiate(["Seller0"], {"price": 50}, topic="desk")
    # (a proposal of the refused negotiation would have reached Seller0 first, in order)
    [proposal] = seller.seen
    assert proposal.parameters["topic"] == "desk"
    events = [getattr(r, "event", {}) for r in caplog.records]
    [event] = [json.loads(json.dumps(e)) for e in events if e.get("category") == "negotiation"]
    assert event["peers"] == ["Seller0"] and event["status"] == "AGREED" and event["rounds"] == 1

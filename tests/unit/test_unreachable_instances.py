"""What the broker's core says of an agent taking its messages by push while none of its
instances can be reached: each instance's server silent, or serving another agent (its
address given to another pod or process), and since when."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from mesh.config import BrokerConfig
from mesh.core.broker import Broker
from mesh.core.model import AgentInfo, DeliveryMode, Message

TAX = "this server serves Tax, not Ledger"
ANOTHERS = f"is another agent's ({TAX})"


async def ledger(*addresses: str) -> Broker:
    broker = Broker(BrokerConfig())
    for address in addresses:
        await broker.register(
            AgentInfo(agent_id="Ledger", address=address, delivery_mode=DeliveryMode.PUSH)
        )
    await broker.register(AgentInfo(agent_id="Cashier"))
    return broker


async def why_left_out(broker: Broker) -> str:
    asked = Message(from_agent="Cashier", to_agent="", content={"action": "balance"})
    (item,) = [i async for i in broker.gather(asked, agent_ids=("Ledger",), timeout=5)]
    assert item.error is not None and item.error.reason == "NO_INSTANCE"
    return item.error.message


async def test_each_instance_says_why_it_cannot_be_reached_and_the_earliest_since_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = await ledger("a:7000", "b:7000", "c:7000")
    hours = iter(range(9, 24))
    monkeypatch.setattr(
        "mesh.core.broker.utc_now", lambda: datetime(2026, 11, 29, next(hours), tzinfo=UTC)
    )
    broker.instance_unreachable("Ledger", "b:7000", ANOTHERS)
    broker.instance_unreachable("Ledger", "a:7000")
    broker.instance_unreachable("Ledger", "c:7000")
    assert await why_left_out(broker) == (
        "no instance of Ledger can be reached: no answer from a:7000, c:7000; the server at"
        f" b:7000 is another agent's ({TAX}) since 2026-11-29T09:00:00+00:00"
    )
    # Its server goes silent, another answers as another agent's: each away since it first was.
    broker.instance_unreachable("Ledger", "b:7000")
    broker.instance_unreachable("Ledger", "a:7000", ANOTHERS)
    assert await why_left_out(broker) == (
        "no instance of Ledger can be reached: no answer from b:7000, c:7000; the server at"
        f" a:7000 is another agent's ({TAX}) since 2026-11-29T09:00:00+00:00"
    )
    broker.instance_reachable("Ledger", "b:7000")  # (b, away again, since now)
    broker.instance_unreachable("Ledger", "b:7000")
    assert await why_left_out(broker) == (
        "no instance of Ledger can be reached: no answer from b:7000, c:7000; the server at"
        f" a:7000 is another agent's ({TAX}) since 2026-11-29T10:00:00+00:00"
    )


async def test_an_instance_reached_again_takes_the_agent_back_into_gathers() -> None:
    broker = await ledger("a:7000", "b:7000")
    broker.instance_unreachable("Ledger", "a:7000", ANOTHERS)
    broker.instance_unreachable("Ledger", "b:7000")
    assert "can be reached" in await why_left_out(broker)
    broker.instance_reachable("Ledger", "a:7000")
    asked = Message(from_agent="Cashier", to_agent="", content={"action": "balance"})
    (item,) = [i async for i in broker.gather(asked, agent_ids=("Ledger",), timeout=0.05)]
    assert item.error is not None and item.error.reason != "NO_INSTANCE"  # asked, no answer


async def test_an_instance_refusing_for_long_is_lost_and_its_agent_forgotten(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # (forget_lost_after 0.04 s: the sweeps look every 10 ms; the clock below says how long)
    broker = Broker(BrokerConfig(forget_lost_after=0.04))
    await broker.register(
        AgentInfo(agent_id="Ledger", address="a:7000", delivery_mode=DeliveryMode.PUSH)
    )
    now = {"at": datetime(2026, 11, 29, 9, tzinfo=UTC)}
    monkeypatch.setattr("mesh.core.broker.utc_now", lambda: now["at"])
    broker.instance_unreachable("Ledger", "a:7000", ANOTHERS)
    now["at"] = datetime(2026, 11, 29, 9, 2, tzinfo=UTC)
    await asyncio.sleep(0.02)
    await broker.sweep()
    assert broker.registry.get("Ledger") is None
    assert (
        f"the instance at a:7000 is gone (its server {ANOTHERS} since 2026-11-29T09:00:00+00:00)"
        in caplog.text
    )


async def test_the_whole_agent_leaving_names_the_instances_to_tell_and_one_leaving_none() -> None:
    """Deregistered whole, the core names the instances it pushed to (they hold no
    subscription whose end would tell them); one instance leaving by its address names
    none (most often that process, stopping), and a pulling instance is never named."""
    broker = await ledger("a:7000", "b:7000", "c:7000")
    await broker.register(AgentInfo(agent_id="Ledger", address="d:7000"))  # (pulls)
    assert await broker.deregister("Ledger", "a:7000") == ()
    assert await broker.deregister("Ledger") == ("b:7000", "c:7000")
    assert await broker.deregister("Cashier") == ()
    assert broker.list_agents() == []

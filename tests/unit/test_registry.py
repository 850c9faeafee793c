"""The registry's instances: several processes serving one agent id, one leaving at a time."""

from __future__ import annotations

import pytest

from mesh.core.errors import AgentNotFoundError
from mesh.core.model import AgentInfo
from mesh.core.registry import MAX_INSTANCES, AgentRegistry


def test_an_agent_stays_registered_until_its_last_instance_leaves() -> None:
    registry = AgentRegistry()
    registry.register(AgentInfo(agent_id="Payment", address="10.0.0.1:7000"))
    second = registry.register(AgentInfo(agent_id="Payment", address="10.0.0.2:7000"))
    assert second.instances == ("10.0.0.1:7000", "10.0.0.2:7000")
    assert second.address == "10.0.0.2:7000"
    again = registry.register(AgentInfo(agent_id="Payment", address="10.0.0.1:7000"))
    assert again.instances == ("10.0.0.2:7000", "10.0.0.1:7000")  # re-registered: latest last
    left = registry.leave("Payment", "10.0.0.1:7000")
    assert left is not None and left.instances == ("10.0.0.2:7000",)
    assert left.address == "10.0.0.2:7000" and "Payment" in registry
    assert registry.leave("Payment", "10.0.0.9:7000") is not None  # not one of them: no change
    assert registry.leave("Payment", "10.0.0.2:7000") is None
    assert "Payment" not in registry
    with pytest.raises(AgentNotFoundError):
        registry.leave("Payment", "10.0.0.2:7000")


def test_deregistering_takes_every_instance_off() -> None:
    registry = AgentRegistry()
    for host in ("a", "b"):
        registry.register(AgentInfo(agent_id="Payment", address=f"{host}:7000"))
    registry.deregister("Payment")
    assert "Payment" not in registry


def test_an_agent_without_an_address_leaves_with_its_first_leave() -> None:
    registry = AgentRegistry()
    info = registry.register(AgentInfo(agent_id="Inbox"))
    assert info.instances == ()
    assert registry.leave("Inbox", "") is None and "Inbox" not in registry


def test_instances_are_bounded_and_a_kept_registration_is_restored_as_it_was() -> None:
    registry = AgentRegistry()
    for i in range(MAX_INSTANCES + 5):
        info = registry.register(AgentInfo(agent_id="Busy", address=f"10.0.0.{i}:7000"))
    assert len(info.instances) == MAX_INSTANCES
    assert info.instances[0] == "10.0.0.5:7000" and info.instances[-1] == "10.0.0.68:7000"
    kept = AgentInfo.from_dict(info.to_dict())
    assert kept.instances == info.instances
    restored = AgentRegistry().register(kept, restore=True)
    assert restored.instances == info.instances and restored.registered_at == info.registered_at
    # A registration kept before instances were counted: its address is its one instance.
    old = AgentInfo.from_dict({"agent_id": "Old", "address": "h:1", "registered_at": None})
    assert AgentRegistry().register(old, restore=True).instances == ("h:1",)

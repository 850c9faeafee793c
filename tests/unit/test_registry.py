"""The registry's instances: several processes serving one agent id, one leaving at a time."""

from __future__ import annotations

import pytest

from mesh.core.errors import AgentNotFoundError, MessageValidationError
from mesh.core.model import AgentInfo, DeliveryMode
from mesh.core.registry import MAX_INSTANCES, AgentRegistry, address_problem


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


def test_a_lost_subscription_takes_its_instance_off_and_keeps_the_agent() -> None:
    registry = AgentRegistry()
    for host in ("a", "b"):
        registry.register(AgentInfo(agent_id="Payment", agent_types=("pay",), address=f"{host}:1"))
    registry.hold("Payment", "a:1", "Payment#r1-1")
    registry.hold("Payment", "b:1", "Payment#r1-2")
    assert registry.lose("Payment", "b:1", "Payment#r1-9") is None  # not the one holding it
    lost = registry.lose("Payment", "b:1", "Payment#r1-2")
    assert lost is not None and lost.instances == ("a:1",) and lost.address == "a:1"
    assert registry.lose("Payment", "b:1", "Payment#r1-2") is None  # gone already
    last = registry.lose("Payment", "a:1", "Payment#r1-1")
    assert last is not None and last.instances == () and last.address == ""
    assert "Payment" in registry and last.agent_types == ("pay",)  # its queue still takes


def test_a_newer_subscription_of_the_instance_outlives_the_older_ones_end() -> None:
    """The process's stream broke and it subscribed again (here, or through another replica)
    before the broker noticed the old one end: the old one's end takes nothing off."""
    registry = AgentRegistry()
    registry.register(AgentInfo(agent_id="Payment", address="a:1"))
    registry.hold("Payment", "a:1", "Payment#r1-1")
    registry.hold("Payment", "a:1", "Payment#r2-1")
    assert registry.lose("Payment", "a:1", "Payment#r1-1") is None
    assert registry.require("Payment").instances == ("a:1",)
    assert registry.lose("Payment", "a:1", "Payment#r2-1") is not None


def test_a_subscription_puts_its_lost_instance_back() -> None:
    registry = AgentRegistry()
    registry.register(AgentInfo(agent_id="Payment", address="a:1"))
    registry.register(AgentInfo(agent_id="Payment", address="b:1"))
    registry.hold("Payment", "a:1", "s1")
    registry.lose("Payment", "a:1", "s1")
    back = registry.hold("Payment", "a:1", "s2")
    assert back.instances == ("b:1", "a:1") and back.address == "a:1"  # the latest again
    assert dict(back.subscribed) == {"a:1": "s2"}


def test_leaving_or_registering_again_keeps_the_holders_of_the_instances_left() -> None:
    registry = AgentRegistry()
    for host in ("a", "b"):
        registry.register(AgentInfo(agent_id="Payment", address=f"{host}:1"))
        registry.hold("Payment", f"{host}:1", f"s-{host}")
    registry.leave("Payment", "a:1")
    again = registry.register(AgentInfo(agent_id="Payment", address="a:1"))
    assert dict(again.subscribed) == {"b:1": "s-b"}  # a:1 registered anew, held by none yet
    assert registry.lose("Payment", "a:1", "s-a") is None
    kept = AgentInfo.from_dict(again.to_dict())
    assert dict(kept.subscribed) == {"b:1": "s-b"}
    restored = AgentRegistry().register(kept, restore=True)
    assert dict(restored.subscribed) == {"b:1": "s-b"} and restored.instances == ("b:1", "a:1")


def test_holding_needs_the_agent_and_a_bounded_address() -> None:
    registry = AgentRegistry(max_id_length=16)
    with pytest.raises(AgentNotFoundError):
        registry.hold("Nobody", "a:1", "s1")
    registry.register(AgentInfo(agent_id="Payment"))
    with pytest.raises(MessageValidationError):
        registry.hold("Payment", "x" * 17, "s1")


def test_an_agent_whose_last_instance_was_lost_says_since_when_until_one_serves_again() -> None:
    registry = AgentRegistry()
    registry.register(AgentInfo(agent_id="Payment", address="a:1"))
    registry.register(AgentInfo(agent_id="Payment", address="b:1"))
    registry.hold("Payment", "a:1", "s1")
    registry.hold("Payment", "b:1", "s2")
    assert registry.lose("Payment", "a:1", "s1").lost_at is None  # type: ignore[union-attr]
    last = registry.lose("Payment", "b:1", "s2")
    assert last is not None and last.lost_at is not None
    kept = AgentInfo.from_dict(last.to_dict())
    assert kept.lost_at == last.lost_at
    assert registry.register(AgentInfo(agent_id="Payment")).lost_at == last.lost_at  # no address
    assert registry.hold("Payment", "a:1", "s3").lost_at is None  # one serves again
    registry.lose("Payment", "a:1", "s3")
    assert registry.register(AgentInfo(agent_id="Payment", address="c:1")).lost_at is None
    registry.register(AgentInfo(agent_id="Inbox"))  # never named an instance: never lost
    assert registry.require("Inbox").lost_at is None


def test_push_delivery_needs_an_address_and_is_kept_with_the_registration() -> None:
    registry = AgentRegistry()
    with pytest.raises(MessageValidationError) as refused:
        registry.register(AgentInfo(agent_id="Ledger", delivery_mode=DeliveryMode.PUSH))
    assert [v.field for v in refused.value.field_violations] == ["agent.address"]
    assert "Ledger" not in registry
    pushed = registry.register(
        AgentInfo(
            agent_id="Ledger",
            address="10.0.0.1:7000",
            delivery_mode=DeliveryMode.PUSH,
            max_in_flight=4,
        )
    )
    assert pushed.delivery_mode is DeliveryMode.PUSH
    # As the durable and Redis stores keep it, and as a registration from before it was kept.
    kept = AgentInfo.from_dict(pushed.to_dict())
    assert kept.delivery_mode is DeliveryMode.PUSH and kept.instances == ("10.0.0.1:7000",)
    assert kept.max_in_flight == 4 and kept.pushed == {"10.0.0.1:7000": 4}
    before_instances = {k: v for k, v in pushed.to_dict().items() if k != "pushed"}
    assert AgentInfo.from_dict(before_instances).pushed == {"10.0.0.1:7000": 4}
    older = {
        k: v
        for k, v in pushed.to_dict().items()
        if k not in ("delivery_mode", "max_in_flight", "pushed")
    }
    assert AgentInfo.from_dict(older).delivery_mode is DeliveryMode.PULL
    assert AgentInfo.from_dict(older).max_in_flight == 0
    assert AgentInfo.from_dict(older).push_instances == ()


def test_each_instance_keeps_the_delivery_it_registered_with() -> None:
    registry = AgentRegistry()
    registry.register(
        AgentInfo(agent_id="Ledger", address="a:7000", delivery_mode=DeliveryMode.PUSH)
    )
    registry.register(
        AgentInfo(
            agent_id="Ledger", address="b:7000", delivery_mode=DeliveryMode.PUSH, max_in_flight=2
        )
    )
    # An instance pulling (an old process of a rolling update) stops no push to the others.
    mixed = registry.register(AgentInfo(agent_id="Ledger", address="c:7000"))
    assert mixed.delivery_mode is DeliveryMode.PULL  # (the latest registration's)
    assert mixed.push_instances == ("a:7000", "b:7000")
    assert mixed.pushed == {"a:7000": 0, "b:7000": 2}
    # One registering again with another delivery changes its own alone.
    changed = registry.register(AgentInfo(agent_id="Ledger", address="a:7000"))
    assert changed.push_instances == ("b:7000",)
    assert AgentInfo.from_dict(changed.to_dict()).push_instances == ("b:7000",)
    # A registration with no address (a client reading the queue) changes none of them.
    assert registry.register(AgentInfo(agent_id="Ledger")).push_instances == ("b:7000",)
    # Leaving, lost, held again: the pushed ones left keep theirs.
    left = registry.leave("Ledger", "c:7000")
    assert left is not None and left.push_instances == ("b:7000",)
    held = registry.hold("Ledger", "d:7000", "sub-1")
    assert held.push_instances == ("b:7000",) and held.instances[-1] == "d:7000"
    lost = registry.lose("Ledger", "b:7000", "sub-x")  # (not its holder: no change)
    assert lost is None
    assert registry.leave("Ledger", "b:7000") is not None
    assert registry.require("Ledger").push_instances == ()


@pytest.mark.parametrize(
    ("address", "said"),
    [
        ("127.0.0.1:99999", "127.0.0.1:99999: a port is from 1 to 65535"),
        ("10.0.0.1:0", "10.0.0.1:0: a port is from 1 to 65535"),
        ("   ", "an address is required"),
        (
            "http://ledger.svc:50051/",  # (what buf curl is given: gRPC reads it as a host name)
            "http://ledger.svc:50051/ is a URL, not a gRPC target: give host:port "
            "(ledger.svc:50051; TLS is set apart, not by http://)",
        ),
        ("GRPCS://10.0.0.1:7000", "is a URL, not a gRPC target: give host:port (10.0.0.1:7000"),
    ],
)
def test_an_address_grpc_would_dial_elsewhere_is_refused(address: str, said: str) -> None:
    """gRPC takes port 99999 as 34463 (it wraps it round): an agent registered so would be
    pushed to, and its health asked of, some other server."""
    assert said in (address_problem(address) or "")
    with pytest.raises(MessageValidationError) as refused:
        AgentRegistry().register(
            AgentInfo(agent_id="Ledger", address=address, delivery_mode=DeliveryMode.PUSH)
        )
    [violation] = refused.value.field_violations
    assert violation.field == "agent.address" and said in violation.description


@pytest.mark.parametrize(
    "address",
    ["10.0.0.1:7000", "[::1]:50051", "ledger.svc:50051", "dns:///ledger:50051", "unix:/run/a.sock"],
)
def test_an_address_grpc_dials_as_meant_is_taken(address: str) -> None:
    assert address_problem(address) is None
    assert (
        AgentRegistry().register(AgentInfo(agent_id="Ledger", address=address)).address == address
    )

"""Several processes serve one agent id (scaled out, or old and new during a rolling update):
they share its queue, and one stopping leaves the agent on the mesh while the others serve it
(it used to take the agent off for all of them: every send then NOT_FOUND)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from mesh import AgentContext, AgentNotFoundError, Message, agent, connect, serve
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.server import serve_broker
from mesh.testing import LocalMesh


def payment(tag: str, handled: Counter[str]) -> Any:
    @agent("Payment", agent_types=["payment"])
    async def pay(message: Message, ctx: AgentContext) -> dict[str, Any]:
        handled[tag] += 1
        await asyncio.sleep(0.005)
        return {"by": tag}

    return pay


async def test_one_instance_stopping_leaves_the_agent_to_the_others() -> None:
    handled: Counter[str] = Counter()
    async with LocalMesh() as mesh, mesh.client("caller") as caller:
        old = await serve(payment("old", handled), mesh.address)
        new = await serve(payment("new", handled), mesh.address)
        [info] = await caller.list_agents()
        assert info.instances == (old.address, new.address) and info.address == new.address
        answers = await asyncio.gather(
            *(caller.request("Payment", {"action": "pay"}, timeout=5) for _ in range(40))
        )
        assert len(answers) == 40 and sum(handled.values()) == 40  # one queue, shared
        await old.stop(1.0)
        [info] = await caller.list_agents()
        assert info.instances == (new.address,) and info.address == new.address
        after = await asyncio.gather(
            *(caller.request("Payment", {"action": "pay"}, timeout=5) for _ in range(10))
        )
        assert {a.content["by"] for a in after} == {"new"}
        await new.stop(1.0)  # the last one: the agent leaves
        assert await caller.list_agents() == []
        with pytest.raises(AgentNotFoundError):
            await caller.send("Payment", {"action": "pay"})


async def test_deregistering_an_agent_by_id_takes_every_instance_off() -> None:
    async with LocalMesh() as mesh, mesh.client("admin") as admin:
        await admin.register("Payment", address="10.0.0.1:7000")
        await admin.register("Payment", address="10.0.0.2:7000")
        await admin.deregister("Payment", address="10.0.0.1:7000")
        [info] = await admin.list_agents()
        assert info.instances == ("10.0.0.2:7000",)
        await admin.register("Payment", address="10.0.0.1:7000")
        await admin.deregister("Payment")  # no address: the agent, every instance
        assert await admin.list_agents() == []


async def test_instances_registered_through_different_replicas_are_one_agent(
    redis_url: str,
) -> None:
    """Two broker replicas on one Redis: an instance registered through each, the one on A
    stops, and a sender through A still reaches the agent (served through B)."""
    config = BrokerConfig(store=redis_url)
    _, server_a = await serve_broker(broker_config=config)
    _, server_b = await serve_broker(broker_config=config)
    handled: Counter[str] = Counter()
    try:
        on_a = await serve(payment("a", handled), server_a.address)
        on_b = await serve(payment("b", handled), server_b.address)
        async with connect(server_a.address, agent_id="caller", retry=NO_RETRY) as caller:
            [info] = [a for a in await caller.list_agents() if a.agent_id == "Payment"]
            assert set(info.instances) == {on_a.address, on_b.address}
            await on_a.stop(1.0)
            [info] = [a for a in await caller.list_agents() if a.agent_id == "Payment"]
            assert info.instances == (on_b.address,)
            answer = await caller.request("Payment", {"action": "pay"}, timeout=5)
            assert answer.content["by"] == "b"
            await on_b.stop(1.0)
            assert "Payment" not in [a.agent_id for a in await caller.list_agents()]
    finally:
        await server_a.stop(0.5)
        await server_b.stop(0.5)


@pytest.fixture(params=["redis", "redis-cluster"])
def one_redis(request: pytest.FixtureRequest) -> str:
    return str(
        request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
    )


async def test_instances_registering_and_leaving_at_once_through_two_replicas_are_all_kept(
    one_redis: str,
) -> None:
    """Sixteen instances of one agent register at the same moment, half through each of two
    replicas on one Redis (pods of a scaled-out agent group starting together): the agent
    keeps all sixteen, as each replica sees it. Then fifteen leave at once: the one left is
    the agent's instance, and with it gone the agent is off."""
    from mesh.core.broker import Broker
    from mesh.core.model import AgentInfo
    from mesh.redis_store import RedisQueueStore

    replicas = [Broker(BrokerConfig(), store=RedisQueueStore(one_redis)) for _ in range(2)]
    for replica in replicas:
        await replica.start()
    addresses = [f"10.1.0.{n}:7000" for n in range(16)]
    try:
        await asyncio.gather(
            *(
                replicas[n % 2].register(
                    AgentInfo(agent_id="Crowd", agent_types=("crowd",), address=address)
                )
                for n, address in enumerate(addresses)
            )
        )
        saved = await replicas[0].store.saved_agent("Crowd")
        assert saved is not None and sorted(saved.instances) == sorted(addresses)
        await asyncio.sleep(0.2)  # each replica hears of the other's registrations
        for replica in replicas:
            [seen] = replica.list_agents("crowd")
            assert sorted(seen.instances) == sorted(addresses)

        await asyncio.gather(
            *(
                replicas[n % 2].deregister("Crowd", address)
                for n, address in enumerate(addresses[1:])
            )
        )
        saved = await replicas[1].store.saved_agent("Crowd")
        assert saved is not None and saved.instances == (addresses[0],)
        assert saved.address == addresses[0]
        await replicas[0].deregister("Crowd", addresses[0])
        assert await replicas[1].store.saved_agent("Crowd") is None
        await asyncio.sleep(0.2)
        assert [r.list_agents("crowd") for r in replicas] == [[], []]
    finally:
        for replica in replicas:
            await replica.stop()

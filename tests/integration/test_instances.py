"""Several processes serve one agent id (scaled out, or old and new during a rolling update):
they share its queue, and one stopping leaves the agent on the mesh while the others serve it
(it used to take the agent off for all of them: every send then NOT_FOUND)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from mesh import (
    AgentContext,
    AgentNotFoundError,
    Message,
    RequestTimeoutError,
    RoutingError,
    agent,
    connect,
    serve,
)
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.redis_store import RedisQueueStore
from mesh.server import serve_broker
from mesh.testing import LocalMesh
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2
from tests.helpers.processes import BROKER_READY, instances_become, start, stop
from tests.helpers.stores import BROKER_STORES, store_url


def payment(tag: str, handled: Counter[str]) -> Any:
    @agent("Payment", agent_types=["payment"])
    async def pay(message: Message, ctx: AgentContext) -> dict[str, Any]:
        handled[tag] += 1
        await asyncio.sleep(0.005)
        return {"by": tag}

    return pay


async def test_one_instance_stopping_leaves_the_agent_to_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="mesh.broker")
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
    # Each left as it stopped, none was lost.
    said = [r.getMessage() for r in caplog.records if r.name == "mesh.broker"]
    assert sum(f"the instance at {old.address} left" in m for m in said) == 1
    assert "agent deregistered: Payment" in said
    assert not [m for m in said if "is gone" in m]


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
            # (It left through B: A lists it until it hears so, a moment later.)
            async with asyncio.timeout(10):
                listed = [a.agent_id for a in await caller.list_agents()]
                while "Payment" in listed:
                    await asyncio.sleep(0.02)
                    listed = [a.agent_id for a in await caller.list_agents()]
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


async def test_an_instance_is_held_by_its_latest_subscription_across_replicas(
    redis_url: str,
) -> None:
    """An instance's stream to replica A breaks and it subscribes again through B before A
    notices: A's late end of the old stream leaves the instance named; the end of the one
    through B takes it off (and the agent stays, its queue taking messages)."""
    config = BrokerConfig(store=redis_url)
    _, server_a = await serve_broker(broker_config=config)
    _, server_b = await serve_broker(broker_config=config)
    channels = [grpc.aio.insecure_channel(s.address) for s in (server_a, server_b)]
    store = RedisQueueStore(redis_url)  # (to see which subscription holds the instance)
    try:
        on_a, on_b = (broker_pb2_grpc.BrokerServiceStub(c) for c in channels)
        await on_a.RegisterAgent(
            broker_pb2.RegisterAgentRequest(
                agent=message_pb2.AgentInfo(agent_id="Payment", address="10.0.0.1:7000")
            )
        )

        async def subscribed(stub: Any, replacing: str = "") -> tuple[Any, str]:
            """A subscription naming the instance, and its id, once it holds the instance."""
            stream = stub.Subscribe(
                broker_pb2.SubscribeRequest(agent_id="Payment", instance="10.0.0.1:7000")
            )
            async with asyncio.timeout(10):
                while True:
                    saved = await store.saved_agent("Payment")
                    holder = saved.subscribed.get("10.0.0.1:7000", "") if saved else ""
                    if holder and holder != replacing:
                        return stream, holder
                    await asyncio.sleep(0.02)

        async def instances(stub: Any, expected: list[str]) -> None:
            async with asyncio.timeout(10):
                while True:
                    listed = await stub.ListAgents(broker_pb2.ListAgentsRequest())
                    [payment] = [a for a in listed.agents if a.agent_id == "Payment"]
                    if list(payment.instances) == expected:
                        return
                    await asyncio.sleep(0.02)

        old, held_by_a = await subscribed(on_a)
        new, _ = await subscribed(on_b, replacing=held_by_a)
        old.cancel()
        async with asyncio.timeout(10):  # A sees the old stream end
            while True:
                stats = await on_a.GetQueueStats(
                    broker_pb2.GetQueueStatsRequest(agent_id="Payment")
                )
                if stats.agents and stats.agents[0].subscribers == 0:
                    break
                await asyncio.sleep(0.02)
        for stub in (on_a, on_b):
            await instances(stub, ["10.0.0.1:7000"])
        new.cancel()
        for stub in (on_a, on_b):
            await instances(stub, [])
        sent = await on_a.SendMessage(
            broker_pb2.SendMessageRequest(
                message=message_pb2.Message(
                    from_agent="caller",
                    to_agent="Payment",
                    message_type=message_pb2.MESSAGE_TYPE_REQUEST,
                    content=struct_pb2.Struct(
                        fields={"action": struct_pb2.Value(string_value="pay")}
                    ),
                )
            )
        )
        assert list(sent.recipients) == ["Payment"]
    finally:
        for channel in channels:
            await channel.close()
        await store.close()
        await server_a.stop(0.5)
        await server_b.stop(0.5)


async def test_after_a_restart_an_instance_that_does_not_subscribe_again_is_taken_off(
    tmp_path: Path,
) -> None:
    """A broker on its durable store restarts: the instance whose process subscribes again
    stays; the one whose process died meanwhile is taken off within a lease of the start."""
    from mesh.core.broker import Broker
    from mesh.core.model import AgentInfo

    config = BrokerConfig(store=f"sqlite://{tmp_path / 'queues.db'}", lease_seconds=0.5)
    before = Broker(config)
    await before.start()
    for address in ("10.0.0.1:7000", "10.0.0.2:7000"):
        await before.register(AgentInfo(agent_id="Payment", address=address))
        await before.subscribe("Payment", instance=address)
    await before.stop()  # (stopping, a broker takes no instance off)

    after = Broker(config)
    await after.start()
    try:
        [restored] = after.list_agents()
        assert restored.instances == ("10.0.0.1:7000", "10.0.0.2:7000")
        await after.subscribe("Payment", instance="10.0.0.2:7000")  # this one came back
        async with asyncio.timeout(10):
            while after.list_agents()[0].instances != ("10.0.0.2:7000",):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        await after.stop()
    again = Broker(config)  # and so it was kept
    await again.start()
    try:
        assert [a.instances for a in again.list_agents()] == [("10.0.0.2:7000",)]
    finally:
        await again.stop()


async def test_an_unsubscribe_keeps_the_instance_a_session_ended_under_it_does_not() -> None:
    """On plain gRPC: a subscription ended by an unsubscribe leaves the instance it named alone
    (its client lives on, and deregisters it when it means to); a session that ends while
    subscribed (cancelled, as a dying process's is, or ended by its client) takes it off, and
    the next subscription naming it puts it back."""
    async with LocalMesh() as mesh, grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(
                agent=message_pb2.AgentInfo(agent_id="Desk", address="10.0.0.1:7000")
            )
        )
        subscribe = broker_pb2.ConnectRequest(
            seq=1, subscribe=broker_pb2.SubscribeRequest(agent_id="Desk", instance="10.0.0.1:7000")
        )

        async def instances() -> list[str]:
            listed = await stub.ListAgents(broker_pb2.ListAgentsRequest())
            return [i for a in listed.agents if a.agent_id == "Desk" for i in a.instances]

        async def subscribed() -> Any:
            session = stub.Connect()
            await session.write(subscribe)
            assert (await session.read()).HasField("accepted")
            assert await instances() == ["10.0.0.1:7000"]
            return session

        async def instance_gone() -> None:
            async with asyncio.timeout(10):
                while await instances():  # noqa: ASYNC110 - the broker's view
                    await asyncio.sleep(0.02)

        unsubscribed = await subscribed()
        await unsubscribed.write(
            broker_pb2.ConnectRequest(
                seq=2, unsubscribe=broker_pb2.UnsubscribeRequest(agent_id="Desk")
            )
        )
        assert (await unsubscribed.read()).HasField("accepted")
        await unsubscribed.done_writing()
        assert await unsubscribed.read() == grpc.aio.EOF
        assert await instances() == ["10.0.0.1:7000"]

        ended = await subscribed()
        await ended.done_writing()
        assert await ended.read() == grpc.aio.EOF
        await instance_gone()

        cancelled = await subscribed()  # (back)
        cancelled.cancel()
        await instance_gone()
        [desk] = (await stub.ListAgents(broker_pb2.ListAgentsRequest())).agents
        assert (desk.agent_id, list(desk.instances), desk.address) == ("Desk", [], "")
        assert mesh.broker is not None
        lost = mesh.broker.metrics.registry.get_sample_value(
            "agentmesh_agent_instances_lost_total", {"agent": "Desk"}
        )
        assert lost == 2  # the session ended, then the one cancelled: not the unsubscribe


async def test_a_gather_leaves_out_at_once_an_agent_whose_every_instance_died() -> None:
    """A group's agent whose only process died (its session lost) is left out of a gather at
    once, with NO_INSTANCE, rather than waited for until the gather's timeout; once a process
    of it subscribes again, it is asked again."""

    @agent("Talker", agent_types=["advisor"])
    async def talker(message: Message, ctx: AgentContext) -> dict[str, Any]:
        return {"recommendation": "hold"}

    async with LocalMesh() as mesh, grpc.aio.insecure_channel(mesh.address) as channel:
        await mesh.add_agent(talker)
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(
                agent=message_pb2.AgentInfo(
                    agent_id="Quiet", agent_types=["advisor"], address="10.0.0.9:7000"
                )
            )
        )
        subscribe = broker_pb2.ConnectRequest(
            seq=1,
            subscribe=broker_pb2.SubscribeRequest(agent_id="Quiet", instance="10.0.0.9:7000"),
        )
        session = stub.Connect()
        await session.write(subscribe)
        assert (await session.read()).HasField("accepted")
        session.cancel()  # the process dies
        async with mesh.client("Chair") as chair:
            await instances_become(chair, "Quiet", ())

            async def ask() -> dict[str, Any]:
                return {
                    r.agent_id: r
                    async for r in chair.gather(
                        {"query": "AAPL?"}, agent_types=["advisor"], timeout=30
                    )
                }

            outcome = await ask()
            assert outcome["Talker"].response is not None
            refused = outcome["Quiet"].error
            assert isinstance(refused, RoutingError) and refused.reason == "NO_INSTANCE"
            assert "no instance of Quiet is serving" in refused.message
            stats = (await chair.queue_stats("Quiet")).for_agent("Quiet")
            assert stats is not None and stats.depth == 0  # no copy waits for nobody
            # A request still goes in (a process may come back in time); its timeout says why.
            with pytest.raises(RequestTimeoutError) as timed_out:
                await chair.request("Quiet", {"action": "quote"}, timeout=0.2)
            assert "(no instance of Quiet is serving: its last was lost at" in str(
                timed_out.value.message
            )

            back = stub.Connect()  # a new process of it
            await back.write(subscribe)
            assert (await back.read()).HasField("accepted")
            asking = asyncio.create_task(ask())
            delivered = await back.read()
            assert delivered.delivery.message.to_agent == "Quiet"
            back.cancel()
            asking.cancel()


@pytest.mark.parametrize("store", BROKER_STORES)
async def test_an_agent_no_process_served_for_long_is_forgotten_its_queue_kept(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """``--forget-lost-after 1``: an agent whose only process died and did not come back
    (agents named after their pod or process, restarted under new ids, left one such entry
    each, until the registry refused every new agent) is taken off the registry a second
    later, as a deregistration would, on every store; one that never named an instance is
    kept. What was sent to it meanwhile stays in its queue, for a process that registers
    again under its id; on SQLite it stays forgotten after a restart."""
    url = store_url(store, request, tmp_path)
    args = ("broker", "--port", "0", "--store", url, "--forget-lost-after", "1")
    args += ("--sweep-interval", "0.05")
    broker = await start(*args, ready=BROKER_READY)
    worker = message_pb2.AgentInfo(agent_id="worker-7f3a", address="10.0.0.7:7000")
    subscribe = broker_pb2.ConnectRequest(
        seq=1,
        subscribe=broker_pb2.SubscribeRequest(agent_id="worker-7f3a", instance=worker.address),
    )
    try:
        async with grpc.aio.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            await stub.RegisterAgent(broker_pb2.RegisterAgentRequest(agent=worker))
            inbox = message_pb2.AgentInfo(agent_id="inbox")  # polls; names no instance
            await stub.RegisterAgent(broker_pb2.RegisterAgentRequest(agent=inbox))
            session = stub.Connect()
            await session.write(subscribe)
            assert (await session.read()).HasField("accepted")
            session.cancel()  # its process dies, and no process of it comes back

            async def registered() -> list[str]:
                listed = await stub.ListAgents(broker_pb2.ListAgentsRequest())
                return [a.agent_id for a in listed.agents]

            content = struct_pb2.Struct()
            content.update({"action": "work"})
            sent = await stub.SendMessage(
                broker_pb2.SendMessageRequest(
                    message=message_pb2.Message(
                        message_id="m-1",
                        from_agent="inbox",
                        to_agent="worker-7f3a",
                        message_type=message_pb2.MESSAGE_TYPE_REQUEST,
                        content=content,
                        ttl=600,
                    )
                )
            )
            # (lost, not forgotten yet: a process may come back)
            assert list(sent.recipients) == ["worker-7f3a"]
            async with asyncio.timeout(15):
                while "worker-7f3a" in await registered():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert await registered() == ["inbox"]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SendMessage(
                    broker_pb2.SendMessageRequest(
                        message=message_pb2.Message(
                            from_agent="inbox",
                            to_agent="worker-7f3a",
                            message_type=message_pb2.MESSAGE_TYPE_REQUEST,
                            content=content,
                        )
                    )
                )
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        async with asyncio.timeout(10):  # (its log line read from its output)
            said = "agent worker-7f3a forgotten: no instance has"
            while not any(said in line for line in broker.output):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        if store == "sqlite":
            await stop(broker)
            broker = await start(*args, ready=BROKER_READY)
        async with grpc.aio.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            assert "worker-7f3a" not in [
                a.agent_id for a in (await stub.ListAgents(broker_pb2.ListAgentsRequest())).agents
            ]
            # A process of it registers again: what was sent to it is there.
            await stub.RegisterAgent(broker_pb2.RegisterAgentRequest(agent=worker))
            session = stub.Connect()
            await session.write(subscribe)
            assert (await session.read()).HasField("accepted")
            delivered = await session.read()
            assert delivered.delivery.message.message_id == "m-1"
            session.cancel()
    finally:
        await stop(broker)


async def test_an_agent_back_in_time_is_not_forgotten_and_0_forgets_none() -> None:
    """The time counts from the last instance lost: a process subscribing again meanwhile
    keeps the agent; with ``forget_lost_after=0`` a lost agent stays registered for good. An
    agent that leaves takes its own metric series along."""
    from mesh.core.broker import Broker
    from mesh.core.model import AgentInfo

    async def lost(broker: Broker, agent_id: str) -> None:
        address = f"10.0.0.1:{7000 + len(broker.list_agents())}"
        await broker.register(AgentInfo(agent_id=agent_id, address=address))
        sub = await broker.subscribe(agent_id, instance=address)
        await sub.close(lost=True)
        assert broker.registry.require(agent_id).lost_at is not None

    forgetting = Broker(BrokerConfig(forget_lost_after=0.6, sweep_interval=0.05))
    keeping = Broker(BrokerConfig(forget_lost_after=0, sweep_interval=0.05))
    for broker in (forgetting, keeping):
        await broker.start()
    try:
        await lost(forgetting, "gone")
        await lost(forgetting, "back")
        await lost(keeping, "gone")
        samples = forgetting.metrics.registry.get_sample_value
        assert samples("agentmesh_agent_instances_lost_total", {"agent": "gone"}) == 1
        await asyncio.sleep(0.3)
        address = forgetting.registry.require("back").address or "10.0.0.1:7999"
        await forgetting.subscribe("back", instance=address)  # served again, in time
        async with asyncio.timeout(10):
            while "gone" in forgetting.registry:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        assert [a.agent_id for a in forgetting.list_agents()] == ["back"]
        assert [a.agent_id for a in keeping.list_agents()] == ["gone"]
        assert samples("agentmesh_agent_instances_lost_total", {"agent": "gone"}) is None
        assert samples("agentmesh_agents_forgotten_total") == 1
    finally:
        for broker in (forgetting, keeping):
            await broker.stop()


@pytest.mark.parametrize("store", BROKER_STORES)
async def test_processes_dying_as_they_subscribe_are_taken_off_on_every_store(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Eight instances' sessions end the moment their subscription is accepted (processes
    killed as they start, as a crash loop does): each instance is taken off. On SQLite and
    Redis the broker's clean-up of a dead session waits on its store, and grpc.aio cancels
    the session's handler again meanwhile: the instance stayed named for good, its
    subscription half closed."""
    url = store_url(store, request, tmp_path)
    broker = await start("broker", "--port", "0", "--store", url, ready=BROKER_READY)
    addresses = [f"10.0.0.{n}:7000" for n in range(1, 9)]
    try:
        async with grpc.aio.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            for address in addresses:
                await stub.RegisterAgent(
                    broker_pb2.RegisterAgentRequest(
                        agent=message_pb2.AgentInfo(agent_id="Crashing", address=address)
                    )
                )

            async def dies_as_it_subscribes(address: str) -> None:
                session = stub.Connect()
                subscribe = broker_pb2.SubscribeRequest(agent_id="Crashing", instance=address)
                await session.write(broker_pb2.ConnectRequest(seq=1, subscribe=subscribe))
                assert (await session.read()).HasField("accepted")
                session.cancel()

            await asyncio.gather(*(dies_as_it_subscribes(a) for a in addresses))
            async with asyncio.timeout(10):
                while True:
                    listed = await stub.ListAgents(broker_pb2.ListAgentsRequest())
                    [crashing] = listed.agents
                    if not crashing.instances:
                        break
                    await asyncio.sleep(0.05)
            stats = await stub.GetQueueStats(broker_pb2.GetQueueStatsRequest(agent_id="Crashing"))
            assert [a.subscribers for a in stats.agents] == [0]
        assert not [line for line in broker.output if "Task was destroyed" in line]
    finally:
        await stop(broker)

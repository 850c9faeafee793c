"""Two brokers on a Redis Cluster with a replica per primary, and a primary that crashes: the
cluster fails over to its replica; meanwhile the brokers refuse what they cannot store with
UNAVAILABLE; afterwards every queue is served again, what was accepted before the crash is
delivered, and the brokers follow each other again (the one whose watcher listened on the dead
node moves to another node once, without flapping)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from mesh import BrokerUnavailableError, Message
from mesh.config import BrokerConfig
from mesh.redis_store import AGENTS as REGISTRATIONS
from mesh.redis_store import RedisQueueStore
from mesh.server import serve_broker
from mesh.testing import LocalRedis
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2
from tests.helpers.stores import two_replicas

AGENTS = [f"agent-{i}" for i in range(12)]  # their queues fall on every primary
CLUSTER = "redis.asyncio.cluster"  # redis-py's cluster client's logger


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalRedis]:
    """A cluster of this test's own (three primaries, a replica each), since it kills a node."""
    if why := LocalRedis.unavailable():
        pytest.skip(f"{why}; .ci/run adds it")
    started = LocalRedis.start_cluster(tmp_path / "cluster", nodes=3, replicas=1)
    try:
        yield started
    finally:
        started.stop()


async def test_a_primary_crash_fails_over_and_loses_nothing_accepted(
    cluster: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mesh")
    async with two_replicas(cluster.url, grace=0.5) as mesh:
        via_a, via_b, broker_b = mesh.via_a, mesh.via_b, mesh.broker_b
        for agent_id in AGENTS:
            await via_a.register(agent_id)
            await via_a.send(agent_id, {"action": "before"})
        await via_b.register("Listener")
        on_b = via_b.subscribe("Listener")
        await on_b.start()

        # The primary broker B's watcher listens on: wake-ups must find another way.
        kwargs = broker_b.store._pubsub_client.connection_pool.connection_kwargs  # type: ignore[attr-defined]
        watched = f"{kwargs['host']}:{kwargs['port']}"
        assert watched in cluster.primaries()
        await asyncio.sleep(0.5)  # replication is asynchronous: let the replicas catch up
        await asyncio.to_thread(cluster.kill_node, watched)

        # Sends are refused with UNAVAILABLE while a primary is missing, then accepted
        # again once its replica has taken over: for every queue. A refusal can be
        # ambiguous (the write reached Redis, its answer did not): like the SDK's own
        # retries, the loop sends the same message again, which the store takes once.
        after = {
            agent_id: Message(from_agent="alice", to_agent=agent_id, content={"action": "after"})
            for agent_id in AGENTS
        }
        refused = 0
        pending = set(AGENTS)
        started = time.monotonic()
        while pending:
            assert time.monotonic() - started < 30, f"still refused: {sorted(pending)}"
            for agent_id in sorted(pending):
                try:
                    await via_a.send_message(after[agent_id])
                    pending.discard(agent_id)
                except BrokerUnavailableError:
                    refused += 1
            await asyncio.sleep(0.2)
        assert refused > 0  # the crash was felt
        assert cluster.primaries() != [] and watched not in cluster.primaries()

        # Nothing accepted is lost: each queue holds its message from before, then after.
        for agent_id in AGENTS:
            actions = [m.action for m in await via_a.receive(agent_id)]
            assert actions == ["before", "after"], (agent_id, actions)

        # A message through A reaches the subscriber on B: B follows the others again.
        sent = await via_a.send("Listener", {"action": "wake"})
        got = await asyncio.wait_for(anext(aiter(on_b)), 5)
        assert got.message.message_id == sent.message_id
        await got.ack()
        await on_b.close()
    failed = [r for r in caplog.records if "following the other replicas failed" in r.message]
    again = [r for r in caplog.records if "following the other replicas again" in r.message]
    # One outage for each watcher that listened on the dead node (B's, maybe A's too), over
    # at once on another node: no flapping while the cluster failed over.
    assert 1 <= len(failed) <= 2
    assert len(again) == len(failed)
    assert all(r.levelno == logging.WARNING for r in failed)
    # Neither broker took the other for dead because both were cut off for a while.
    assert not [r for r in caplog.records if "broker replicas gone" in r.message]


def lost_said(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The brokers' words on finding that the store lost the registrations."""
    return [r for r in caplog.records if r.message.startswith("the store lost the registrations")]


async def test_a_primary_without_a_replica_that_restarts_empty_loses_no_registration(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The primary holding the registrations' slot restarts with nothing (no replica to fail
    over to, no persistence), while the other primaries and the brokers' watchers may not
    notice at all: each broker sees the store's mark gone with its slot on its next beat, puts
    back the registrations it knows, and its agents stay on the mesh (a subscription on one
    broker gets what is sent through the other). Before, they were missing from the store for
    good, and every replica that read the registry again took them as deregistered."""
    if why := LocalRedis.unavailable():
        pytest.skip(f"{why}; .ci/run adds it")
    cluster = LocalRedis.start_cluster(tmp_path / "cluster", nodes=3)
    caplog.set_level(logging.INFO, logger="mesh")
    try:
        async with two_replicas(cluster.url, grace=0.5) as mesh:
            via_a, via_b = mesh.via_a, mesh.via_b
            for agent_id in AGENTS:
                await via_a.register(agent_id, agent_types=["worker"])
            await via_b.register("Listener")
            on_b = via_b.subscribe("Listener")
            await on_b.start()

            holder = cluster.slot_holder(REGISTRATIONS)
            await asyncio.to_thread(cluster.kill_node, holder)
            await asyncio.to_thread(cluster.restart_node, holder)
            # Each broker's beat notices the loss by itself, and puts back what it knows; the
            # other's news of what it put back follows.
            store = RedisQueueStore(cluster.url)
            saved: list[str] = []
            listed: list[list[str]] = []
            try:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    # (refused until the cluster serves the restarted node's slots again)
                    with contextlib.suppress(BrokerUnavailableError):
                        saved = sorted(info.agent_id for info in await store.saved_agents())
                    listed = [
                        sorted(a.agent_id for a in await client.list_agents(agent_type="worker"))
                        for client in (via_a, via_b)
                    ]
                    if (
                        saved == sorted([*AGENTS, "Listener"])
                        and listed == [sorted(AGENTS)] * 2
                        and len(lost_said(caplog)) == 2  # (the later broker's beat too)
                    ):
                        break
                    await asyncio.sleep(0.1)
            finally:
                await store.close()
            assert saved == sorted([*AGENTS, "Listener"])
            assert listed == [sorted(AGENTS)] * 2  # by broker A, by broker B
            assert any("registrations put back" in r.message for r in caplog.records)

            async with asyncio.timeout(20):
                while True:  # (until the cluster serves the restarted node's slots again)
                    try:
                        sent = await via_a.send("Listener", {"action": "after"})
                        break
                    except BrokerUnavailableError:
                        await asyncio.sleep(0.2)
                got = await anext(aiter(on_b))
            assert got.message.message_id == sent.message_id
            await got.ack()
            await on_b.close()
    finally:
        cluster.stop()
    assert len(lost_said(caplog)) == 2  # once by each broker
    assert not [r for r in caplog.records if "left the registry" in r.message]


@contextlib.asynccontextmanager
async def broker_on_cluster(
    folder: Path,
) -> AsyncIterator[tuple[LocalRedis, broker_pb2_grpc.BrokerServiceAsyncStub]]:
    """A Redis Cluster of three primaries and no replica, a broker on it, and a plain gRPC
    stub of that broker, agents "alice" and "Worker" registered."""
    if why := LocalRedis.unavailable():
        pytest.skip(f"{why}; .ci/run adds it")
    cluster = LocalRedis.start_cluster(folder, nodes=3)
    try:
        _, server = await serve_broker(broker_config=BrokerConfig(store=cluster.url))
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = broker_pb2_grpc.BrokerServiceStub(channel)
                for agent_id in ("alice", "Worker"):
                    await stub.RegisterAgent(
                        broker_pb2.RegisterAgentRequest(
                            agent=message_pb2.AgentInfo(agent_id=agent_id)
                        ),
                        timeout=10,
                    )
                yield cluster, stub
        finally:
            await server.stop(0.5)
    finally:
        cluster.stop()


def work_for_worker() -> broker_pb2.SendMessageRequest:
    request = broker_pb2.SendMessageRequest()
    request.message.from_agent, request.message.to_agent = "alice", "Worker"
    request.message.content.update({"action": "work"})
    return request


async def test_a_send_to_a_queue_on_a_node_that_is_down_is_refused_within_its_deadline(
    tmp_path: Path,
) -> None:
    """A plain gRPC client's send, with a 2 s deadline, to an agent whose queue is on a
    primary that is down (no replica to take over) is refused UNAVAILABLE, the store's
    reason given, well within the deadline: the broker's call to that node gives up after a
    few quick attempts. Before, redis-py 8.2's cluster client spent 3.4-5 s waiting out its
    own default backoff, and the client saw only DEADLINE_EXCEEDED."""
    async with broker_on_cluster(tmp_path / "cluster") as (cluster, stub):
        await asyncio.to_thread(cluster.kill_node, cluster.slot_holder("mesh:{Worker}:ready"))
        codes = []
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SendMessage(work_for_worker(), timeout=2)
            codes.append(refused.value.code())
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 3
        assert "unavailable" in (refused.value.details() or "").lower()


async def test_while_every_node_of_the_cluster_is_down_calls_are_refused_unavailable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With every node of the cluster down, a plain gRPC client's sends and receives are
    refused UNAVAILABLE, call after call, and the broker's heartbeat logs no fault.
    Before, once redis-py 8.2's cluster client had failed to refresh its map of the nodes it
    raised RedisClusterUnreachableError, which is no RedisError: a receive was answered
    INTERNAL "internal error", which clients do not retry, and a heartbeat logged an ERROR."""
    async with broker_on_cluster(tmp_path / "cluster") as (cluster, stub):
        for node in cluster.primaries():
            await asyncio.to_thread(cluster.kill_node, node)
        codes = []
        for _ in range(4):  # (the later calls after a refresh of the map has failed)
            for call in (
                stub.SendMessage(work_for_worker(), timeout=5),
                stub.ReceiveMessages(
                    broker_pb2.ReceiveMessagesRequest(agent_id="Worker"), timeout=5
                ),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                codes.append(refused.value.code())
            await asyncio.sleep(1)
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 8
    # (redis-py says each failed refresh of its map as an ERROR of its own logger)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name != CLUSTER]

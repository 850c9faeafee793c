"""Two brokers on a Redis Cluster with a replica per primary, and a primary that crashes: the
cluster fails over to its replica; meanwhile the brokers refuse what they cannot store with
UNAVAILABLE; afterwards every queue is served again, what was accepted before the crash is
delivered, and the brokers follow each other again (the one whose watcher listened on the dead
node moves to another node once, without flapping)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh import BrokerUnavailableError, Message, connect
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.server import serve_broker
from mesh.testing import LocalRedis

AGENTS = [f"agent-{i}" for i in range(12)]  # their queues fall on every primary


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
    config = BrokerConfig(store=cluster.url)
    _, server_a = await serve_broker(broker_config=config)
    broker_b, server_b = await serve_broker(broker_config=config)
    try:
        async with (
            connect(server_a.address, agent_id="alice", retry=NO_RETRY) as via_a,
            connect(server_b.address, agent_id="bob", retry=NO_RETRY) as via_b,
        ):
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
                agent_id: Message(
                    from_agent="alice", to_agent=agent_id, content={"action": "after"}
                )
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
    finally:
        await server_a.stop(0.5)
        await server_b.stop(0.5)
    failed = [r for r in caplog.records if "following the other replicas failed" in r.message]
    again = [r for r in caplog.records if "following the other replicas again" in r.message]
    # One outage for each watcher that listened on the dead node (B's, maybe A's too), over
    # at once on another node: no flapping while the cluster failed over.
    assert 1 <= len(failed) <= 2
    assert len(again) == len(failed)
    assert all(r.levelno == logging.WARNING for r in failed)
    # Neither broker took the other for dead because both were cut off for a while.
    assert not [r for r in caplog.records if "broker replicas gone" in r.message]

"""The sends one Connect session has in flight, on the stores where each would otherwise wait
on its own: on SQLite they share a commit (each accepted only once it is on disk; a commit that
fails is said to each of its senders), on Redis their puts travel together; in the order they
were sent."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from mesh import BrokerConfig, BrokerUnavailableError
from mesh.client import NO_RETRY
from mesh.core.durable import SqliteQueueStore
from mesh.testing import LocalMesh


def on_disk(db: Path, agent_id: str) -> set[str]:
    """The ids of the agent's messages another reader of the database sees committed."""
    with sqlite3.connect(db) as reader:
        rows = reader.execute("SELECT message_id FROM messages WHERE agent_id = ?", (agent_id,))
        return {message_id for (message_id,) in rows}


async def test_a_sessions_sends_share_commits_and_are_accepted_once_on_disk(
    tmp_path: Path,
) -> None:
    db = tmp_path / "queues.db"
    async with LocalMesh(BrokerConfig(store=f"sqlite://{db}")) as mesh:
        sender = mesh.client("Sender")
        await sender.register("Sink")
        assert mesh.broker is not None and isinstance(mesh.broker.store, SqliteQueueStore)
        journal = mesh.broker.store.journal
        commits = journal.commits
        ids = [f"m{i:02d}" for i in range(64)]

        accepted = await asyncio.gather(
            *(
                sender.send("Sink", {"action": "record", "parameters": {"i": i}}, message_id=id_)
                for i, id_ in enumerate(ids)
            )
        )

        assert [m.message_id for m in accepted] == ids
        assert on_disk(db, "Sink") == set(ids)  # every accepted one, committed
        # One session's 64 sends, a commit each before: now a few commits shared by them all.
        assert journal.commits - commits <= 16
        received = await sender.receive("Sink")
        assert [m.message_id for m in received] == ids  # in the order they were sent


async def test_a_commit_that_fails_is_said_to_each_of_its_senders(tmp_path: Path) -> None:
    db = tmp_path / "queues.db"
    async with LocalMesh(BrokerConfig(store=f"sqlite://{db}")) as mesh:
        sender = mesh.client("Sender", retry=NO_RETRY)
        await sender.register("Sink")
        # Another process holds the database's write lock: the broker's commit waits for it
        # (SQLite's five seconds), then fails.
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            outcomes = await asyncio.gather(
                *(sender.send("Sink", {"action": "record"}) for _ in range(8)),
                return_exceptions=True,
            )
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert len(outcomes) == 8
        for outcome in outcomes:
            assert isinstance(outcome, BrokerUnavailableError), outcome
            assert outcome.code == "UNAVAILABLE"
        assert on_disk(db, "Sink") == set()


async def test_a_sessions_sends_travel_together_to_a_shared_store(redis_url: str) -> None:
    """On Redis, each put is a round trip: the sends a session has in flight (batch frames,
    as the SDK writes them while a write is under way) take theirs together."""
    import redis.asyncio as aioredis

    redis = aioredis.from_url(redis_url)
    async with LocalMesh(BrokerConfig(store=redis_url)) as mesh:
        sender = mesh.client("Sender")
        await sender.register("Sink")
        await redis.config_resetstat()
        ids = [f"m{i:02d}" for i in range(64)]

        accepted = await asyncio.gather(
            *(
                sender.send("Sink", {"action": "record", "parameters": {"i": i}}, message_id=id_)
                for i, id_ in enumerate(ids)
            )
        )

        assert [m.message_id for m in accepted] == ids
        # Each group of puts takes its places in the broker-wide count with one INCRBY.
        groups = (await redis.info("commandstats"))["cmdstat_incrby"]["calls"]
        assert groups <= 16
        received = await sender.receive("Sink")
        assert [m.message_id for m in received] == ids
    await redis.aclose()

"""The shared memory pool and the shared state across two broker processes on one Redis (or
one Redis Cluster): an insight written through one replica is read through the other; entries,
versions and locks are the same whichever replica a client talks to."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from mesh import (
    AgentNotFoundError,
    ChangeKind,
    LocalMesh,
    LockNotHeldError,
    MessageValidationError,
    StateConflictError,
    connect,
    redis_shared,
)
from mesh.client import NO_RETRY, MeshClient
from mesh.config import BrokerConfig
from mesh.core.broker import Broker
from mesh.core.model import AgentInfo, Message, MessageType
from mesh.core.registry import AgentRegistry
from mesh.core.state import StateChange
from mesh.redis_store import RedisQueueStore
from tests.helpers.processes import BROKER_READY, ROOT, Proc, start, stop
from tests.integration.test_processes import CLI_AT_A_TERMINAL

pytestmark = pytest.mark.processes


@pytest.fixture(params=["redis", "redis-cluster"])
async def replicas(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Proc, Proc]]:
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        urls = [url, url]
    else:
        urls = request.getfixturevalue("redis_cluster")[:2]
    a = await start("broker", "--port", "0", "--store", urls[0], ready=BROKER_READY)
    b = await start("broker", "--port", "0", "--store", urls[1], ready=BROKER_READY)
    try:
        yield a, b
    finally:
        await stop(a)
        await stop(b)


async def test_insights_written_through_one_replica_are_read_through_the_other(
    replicas: tuple[Proc, Proc],
) -> None:
    a, b = replicas
    async with (
        connect(a.address, agent_id="proposer", retry=NO_RETRY) as via_a,
        connect(b.address, agent_id="reviewer_1", retry=NO_RETRY) as via_b,
    ):
        proposal = await via_a.write_insight(
            {"proposal": "Adopt an API gateway", "cost": 12345.678901234567},
            tags=["proposal", "pending", "proposal_p1"],
            importance=0.9,
            segment="proposals",
        )
        await via_b.write_insight(
            {"vote": "approve"}, tags=["vote", "proposal_p1"], importance=0.5, segment="votes"
        )
        await via_b.write_insight(
            {"vote": "modify"}, tags=["vote", "proposal_p1"], importance=0.7, segment="votes"
        )
        [found] = await via_b.read_insights(tags=["proposal", "proposal_p1"])
        assert found.insight_id == proposal.insight_id
        assert found.content == {"proposal": "Adopt an API gateway", "cost": 12345.678901234567}
        assert found.agent_id == "proposer" and found.segment == "proposals"
        votes = await via_a.read_insights(tags=["vote"], segment="votes")
        assert [v.content for v in votes] == [{"vote": "modify"}, {"vote": "approve"}]
        assert [v.content for v in await via_a.read_insights(min_importance=0.6)] == [
            proposal.content,
            {"vote": "modify"},
        ]
        assert await via_a.read_insights(tags=["vote"], agent_id="proposer") == []
        stats = await via_a.memory_stats()
        assert stats.total_insights == 3 and stats.agents_involved == 2
        assert stats.tag_distribution["proposal_p1"] == 3
        assert stats.segment_distribution == {"proposals": 1, "votes": 2}


async def test_entries_versions_and_locks_are_one_across_replicas(
    replicas: tuple[Proc, Proc],
) -> None:
    a, b = replicas
    async with (
        connect(a.address, agent_id="Planner", retry=NO_RETRY) as via_a,
        connect(b.address, agent_id="Buyer", retry=NO_RETRY) as via_b,
    ):
        first = await via_a.put_state("budget", {"left": 100}, expected_version=0)
        assert first.version == 1
        seen = await via_b.get_state("budget")
        assert seen is not None and seen.value == {"left": 100} and seen.updated_by == "Planner"
        with pytest.raises(StateConflictError) as lost:
            await via_b.put_state("budget", {"left": 1}, expected_version=0)
        assert lost.value.reason == "VERSION_CONFLICT"

        lock = await via_a.lock_state("budget", lease=5)
        with pytest.raises(StateConflictError) as locked:
            await via_b.put_state("budget", {"left": 0})
        assert locked.value.reason == "STATE_LOCKED" and "Planner" in locked.value.message
        with pytest.raises(StateConflictError) as waited:
            await via_b.lock_state("budget", wait=0.1)
        assert waited.value.reason == "LOCK_TIMEOUT"

        async def release_soon() -> None:
            await asyncio.sleep(0.2)
            await via_a.put_state("budget", {"left": 80}, lock=lock)
            await via_a.unlock_state(lock)

        releasing = asyncio.create_task(release_soon())
        theirs = await via_b.lock_state("budget", wait=1.0)  # waits across replicas
        await releasing
        with pytest.raises(LockNotHeldError):
            await via_a.put_state("budget", {"left": 70}, lock=lock)
        written = await via_b.put_state("budget", {"left": 60}, lock=theirs)
        assert (written.version, written.updated_by) == (3, "Buyer")
        await via_b.unlock_state(theirs)
        gone = await via_a.delete_state("budget", expected_version=3)
        assert gone.value == {"left": 60}
        assert await via_b.get_state("budget") is None


async def test_locked_increments_through_both_replicas_lose_nothing(
    replicas: tuple[Proc, Proc],
) -> None:
    a, b = replicas
    clients = [
        MeshClient(address, agent_id=f"Counter{i}", retry=NO_RETRY)
        for i, address in enumerate((a.address, b.address, a.address, b.address))
    ]
    try:
        await clients[0].put_state("counter", 0)

        async def add_ones(client: MeshClient) -> None:
            for _ in range(10):
                async with client.locked("counter") as lock:
                    entry = await client.get_state("counter")
                    assert entry is not None
                    await client.put_state("counter", entry.value + 1, lock=lock)  # type: ignore[operator]

        await asyncio.gather(*(add_ones(c) for c in clients))
        final = await clients[1].get_state("counter")
        assert final is not None and final.value == 40 and final.version == 41
    finally:
        for client in clients:
            await client.close()


async def test_at_most_five_writers_hold_locks_across_replicas(
    replicas: tuple[Proc, Proc],
) -> None:
    a, b = replicas
    clients = [
        MeshClient((a.address, b.address)[i % 2], agent_id=f"Writer{i}", retry=NO_RETRY)
        for i in range(6)
    ]
    try:
        held = [await c.lock_state(f"key-{i}") for i, c in enumerate(clients[:5])]
        with pytest.raises(StateConflictError) as full:
            await clients[5].lock_state("key-5", wait=0.2)
        assert full.value.reason == "LOCK_TIMEOUT"
        assert "5 agents hold locks" in full.value.message
        await clients[2].unlock_state(held[2])
        assert (await clients[5].lock_state("key-5", wait=1.0)).holder == "Writer5"
    finally:
        for client in clients:
            await client.close()


@pytest.fixture(params=["redis", "redis-cluster"])
def one_redis(request: pytest.FixtureRequest) -> str:
    return str(
        request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
    )


async def test_a_release_through_one_replica_wakes_the_lock_request_waiting_on_another(
    one_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiting lock request is woken by the release (published by the unlock script), not
    by looking again: with the look-again interval made 30 s (and a lock timeout of 60 s, so
    that the wait's own end cannot be what ends it), it still gets the lock at once."""
    monkeypatch.setattr(redis_shared, "RECHECK_SECONDS", 30.0)
    a = Broker(BrokerConfig(), store=RedisQueueStore(one_redis))
    b = Broker(BrokerConfig(), store=RedisQueueStore(one_redis))
    patient = redis_shared.RedisSharedState(b.store, lock_timeout=60)  # type: ignore[arg-type]
    await a.start()
    await b.start()  # follows the other replicas, releases included
    try:
        held = await a.state.lock("budget", "Planner", lease=10)
        waiting = asyncio.create_task(patient.lock("budget", "Buyer", wait=60))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # held by the Planner: the Buyer waits
        await a.state.unlock("budget", held.token)
        theirs = await asyncio.wait_for(waiting, 10)  # far less than a look again's 30 s
        assert theirs.holder == "Buyer"
        await patient.unlock("budget", theirs.token)
    finally:
        await a.stop()
        await b.stop()


async def test_entries_lapse_and_workflows_are_followed_across_replicas(
    replicas: tuple[Proc, Proc],
) -> None:
    """An entry written with a ttl through one replica lapses for the other; a workflow's
    status, written by whichever replica took its hand-off, is one for both."""
    a, b = replicas
    async with (
        connect(a.address, agent_id="Customer", retry=NO_RETRY) as via_a,
        connect(b.address, agent_id="Seller", retry=NO_RETRY) as via_b,
    ):
        brief = await via_a.put_state("lapsing/printer", "busy", ttl=0.4)
        assert brief.expires_at is not None
        seen = await via_b.get_state("lapsing/printer")
        assert seen is not None and seen.expires_at == brief.expires_at
        await asyncio.sleep(0.6)
        assert await via_b.get_state("lapsing/printer") is None
        again = await via_b.put_state("lapsing/printer", "free", expected_version=0)
        assert again.version == 1 and again.expires_at is None  # its key free, written anew
        await via_b.delete_state("lapsing/printer")

        await via_a.register("ReplicaSeller")
        await via_a.register("ReplicaPayment")
        await via_a.handoff("ReplicaSeller", "Approve", workflow_id="wf-replicas", step_number=1)
        first = await via_b.get_state("workflow/wf-replicas")
        assert first is not None and first.value["current_agent"] == "ReplicaSeller"
        await via_b.handoff("ReplicaPayment", "Refund", workflow_id="wf-replicas", step_number=2)
        second = await via_a.get_state("workflow/wf-replicas")
        assert second is not None and second.version == 2
        assert (second.value["current_agent"], second.value["step"]) == ("ReplicaPayment", 2)
        assert second.updated_by == "Seller" and second.expires_at is not None
        await via_a.delete_state("workflow/wf-replicas")
        await via_a.deregister("ReplicaSeller")
        await via_a.deregister("ReplicaPayment")


async def test_a_listing_is_one_across_replicas_page_by_page(
    replicas: tuple[Proc, Proc],
) -> None:
    """Entries written through either replica are listed through both, by prefix and in key
    order; a listing begun on one replica goes on through the other with its page token."""
    a, b = replicas
    async with (
        connect(a.address, agent_id="Planner", retry=NO_RETRY) as via_a,
        connect(b.address, agent_id="Buyer", retry=NO_RETRY) as via_b,
    ):
        for i in range(0, 7, 2):
            await via_a.put_state(f"listing/item{i}", {"i": i})
        for i in range(1, 7, 2):
            await via_b.put_state(f"listing/item{i}", {"i": i})
        await via_b.put_state("listing/item7", "brief", ttl=0.3)
        await via_a.put_state("listingx", "not under listing/")
        first = await via_a.list_state("listing/", page_size=3)
        assert [e.key for e in first.entries] == [f"listing/item{i}" for i in range(3)]
        assert [e.updated_by for e in first.entries] == ["Planner", "Buyer", "Planner"]
        assert first.entries[1].value == {"i": 1}
        await via_a.delete_state("listing/item4")  # gone before the next page is read
        second = await via_b.list_state("listing/", page_size=3, page_token=first.next_page_token)
        assert [e.key for e in second.entries] == [
            "listing/item3",
            "listing/item5",
            "listing/item6",
        ]
        third = await via_a.list_state("listing/", page_size=3, page_token=second.next_page_token)
        assert [e.key for e in third.entries] == ["listing/item7"]
        assert third.next_page_token == ""
        await asyncio.sleep(0.5)  # item7 lapses
        walked = [e.key async for e in via_b.state_entries("listing/")]
        assert walked == [f"listing/item{i}" for i in (0, 1, 2, 3, 5, 6)]
        for key in [*walked, "listingx"]:
            await via_a.delete_state(key)
        assert [e async for e in via_b.state_entries("listing/")] == []


async def test_a_watch_through_one_replica_sees_the_changes_made_through_the_other(
    replicas: tuple[Proc, Proc],
) -> None:
    """Writes, deletions and a lapse made through replica A, watched through replica B: in
    order, each once; a watch begun while writes go on starts exactly where its initial
    entries end (no version missed, none told twice)."""
    a, b = replicas
    async with (
        connect(a.address, agent_id="Writer", retry=NO_RETRY) as via_a,
        connect(b.address, agent_id="Watcher", retry=NO_RETRY) as via_b,
    ):
        await via_a.put_state("watched/b", 1)
        await via_a.put_state("watched/a", 2)
        changes = via_b.watch_state("watched/", send_initial=True)
        first = [await asyncio.wait_for(anext(changes), 5) for _ in range(3)]
        assert [(c.kind.value, c.entry and c.entry.key) for c in first] == [
            ("current", "watched/a"),
            ("current", "watched/b"),
            ("synced", None),
        ]
        await via_a.put_state("watched/a", 3)
        await via_a.put_state("unwatched", 0)
        await via_a.delete_state("watched/b")
        await via_a.put_state("watched/brief", "soon gone", ttl=0.3)  # lapses, nobody writing
        told = [await asyncio.wait_for(anext(changes), 5) for _ in range(4)]
        assert [(c.kind.value, c.entry.key, c.entry.value) for c in told if c.entry] == [
            ("put", "watched/a", 3),
            ("delete", "watched/b", 1),
            ("put", "watched/brief", "soon gone"),
            ("lapse", "watched/brief", "soon gone"),
        ]
        await changes.aclose()

        # A counter written as fast as replica A takes it while B starts watching it.
        async def count() -> None:
            for n in range(200):
                await via_a.put_state("race/counter", n)

        counting = asyncio.create_task(count())
        await asyncio.sleep(0.05)
        versions = []
        async for change in via_b.watch_state("race/", send_initial=True):
            if change.entry is not None:
                versions.append(change.entry.version)
            if versions and versions[-1] == 200:
                break
        await counting
        assert versions == list(range(versions[0], 201)), versions
        for key in ("watched/a", "unwatched", "race/counter"):
            await via_a.delete_state(key)


async def test_a_replica_cut_off_from_redis_ends_its_watches(redis_url: str) -> None:
    """The replica's subscription is cut (as when Redis drops it): what was published
    meanwhile is lost to it, so its watches end with UNAVAILABLE instead of going on with
    changes missing; a new watch works once it follows again."""
    from mesh.core.errors import BrokerUnavailableError

    writer = Broker(BrokerConfig(), store=RedisQueueStore(redis_url))
    watcher = Broker(BrokerConfig(), store=RedisQueueStore(redis_url))
    await writer.start()
    await watcher.start()
    try:
        watch = await watcher.state.watch("cut/")
        assert (await anext(watch)).kind.value == "synced"
        await writer.state.put("cut/x", 1, "Writer")
        assert (await asyncio.wait_for(anext(watch), 5)).kind.value == "put"
        # A change numbered before a watch began, heard only after it began (published
        # before its entries were read, late on the channel), is not the watch's.
        late = await watcher.state.watch("cut/", send_initial=True)
        assert [(await anext(late)).kind.value for _ in range(2)] == ["current", "synced"]
        meta = '{"version":1,"updated_by":"Writer","updated_at":"2026-01-01T00:00:00+00:00"}'
        for number in (late.after, late.after + 1):
            watcher.state._changed(json.dumps([number, "put", "cut/y", meta, "1"]).encode())  # type: ignore[attr-defined]
        told = await asyncio.wait_for(anext(late), 5)
        assert told.entry is not None and told.entry.key == "cut/y"  # the later one alone
        assert late.after > 0 and not late._changes
        late.close()
        assert [(await anext(watch)).kind.value for _ in range(2)] == [
            "put",
            "put",
        ]  # (begun before)
        redis = await watcher.store._client()  # type: ignore[attr-defined]
        await redis.client_kill_filter(_type="pubsub")
        with pytest.raises(BrokerUnavailableError, match="missed changes"):
            await asyncio.wait_for(anext(watch), 10)
        for _ in range(50):  # following again (it tries every 0.5 s)
            try:  # (refused while it is not: a watch begun then would be ended)
                again = await watcher.state.watch("cut/")
            except BrokerUnavailableError as refused:
                assert "cut off from Redis" in refused.message
                await asyncio.sleep(0.3)
                continue
            await asyncio.sleep(0.3)
            await writer.state.put("cut/x", 2, "Writer")
            try:
                changes = [await asyncio.wait_for(anext(again), 2) for _ in range(2)]
            except (BrokerUnavailableError, TimeoutError):
                continue
            assert [c.kind.value for c in changes] == ["synced", "put"]
            break
        else:
            raise AssertionError("the replica did not follow again")
        await writer.state.delete("cut/x", "Writer")
    finally:
        await writer.stop()
        await watcher.stop()


async def test_a_resumed_watch_tells_what_changed_while_its_replica_was_down(
    redis_url: str,
) -> None:
    """A watcher on replica A, which crashes (SIGKILL) and comes back on its port while writes
    go on through replica B: the SDK's watch with ``resume`` and `agentmesh state --watch`
    each go on by themselves and tell exactly what changed meanwhile (the latest version of
    what was written, what was deleted, nothing of what was left alone), then each change as
    it is made again."""
    a = await start("broker", "--port", "0", "--store", redis_url, ready=BROKER_READY)
    b = await start("broker", "--port", "0", "--store", redis_url, ready=BROKER_READY)
    procs, cli = [a, b], None
    try:
        async with (
            connect(b.address, agent_id="Tracker", retry=NO_RETRY) as via_b,
            connect(a.address, agent_id="Watcher", reconnect_timeout=30) as via_a,
        ):
            for n in (1, 2, 3):
                await via_b.put_state(f"parcel/{n}", {"n": n})
            changes = via_a.watch_state("parcel/", send_initial=True, resume=True)
            assert [_told(await anext(changes)) for _ in range(4)] == [
                ("current", "parcel/1", 1, {"n": 1}),
                ("current", "parcel/2", 1, {"n": 2}),
                ("current", "parcel/3", 1, {"n": 3}),
                ("synced",),
            ]
            cli = await asyncio.create_subprocess_exec(
                *CLI_AT_A_TERMINAL,
                *("state", "--prefix", "parcel/", "--watch", "--broker", a.address),
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            assert cli.stdout is not None and cli.stderr is not None
            await _line_with(cli.stderr, "watching 'parcel/' (Ctrl-C to stop)")
            first = [(await cli.stdout.readline()).decode() for _ in range(3)]
            assert [line.split()[:4] for line in first] == [
                ["current", f"parcel/{n}", "version", "1"] for n in (1, 2, 3)
            ], first

            a.kill()
            await a.process.wait()
            await via_b.put_state("parcel/2", {"n": 20})
            await via_b.put_state("parcel/2", {"n": 21})
            await via_b.delete_state("parcel/3")
            await via_b.put_state("parcel/4", {"n": 4})
            port = a.address.rsplit(":", 1)[1]
            procs.append(
                await start("broker", "--port", port, "--store", redis_url, ready=BROKER_READY)
            )

            caught_up = [_told(await asyncio.wait_for(anext(changes), 30)) for _ in range(4)]
            assert caught_up == [
                ("put", "parcel/2", 3, {"n": 21}),
                ("put", "parcel/4", 1, {"n": 4}),
                ("delete", "parcel/3", 1, {"n": 3}),
                ("synced",),
            ]
            await _line_with(cli.stderr, "watching 'parcel/' again")
            printed = [
                (await asyncio.wait_for(cli.stdout.readline(), 10)).decode() for _ in range(3)
            ]
            assert [line.split()[:4] for line in printed] == [
                ["put", "parcel/2", "version", "3"],
                ["put", "parcel/4", "version", "1"],
                ["delete", "parcel/3", "version", "1"],
            ], printed

            await via_b.put_state("parcel/1", {"n": 10})
            live = await asyncio.wait_for(anext(changes), 10)
            assert _told(live) == ("put", "parcel/1", 2, {"n": 10})
            await changes.aclose()
            line = (await asyncio.wait_for(cli.stdout.readline(), 10)).decode()
            assert line.split()[:4] == ["put", "parcel/1", "version", "2"], line
            cli.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(cli.wait(), 10) == 130
    finally:
        if cli is not None and cli.returncode is None:
            cli.kill()
            await cli.wait()
        for proc in procs[1:]:
            await stop(proc)
        a.kill()


def _told(change: StateChange) -> tuple[object, ...]:
    entry = change.entry
    if entry is None:
        return (change.kind.value,)
    return change.kind.value, entry.key, entry.version, entry.value


async def _line_with(stream: asyncio.StreamReader, text: str) -> str:
    """The first line of ``stream`` that holds ``text`` (within 30 s)."""
    read = []
    async with asyncio.timeout(30):
        while line := (await stream.readline()).decode():
            if text in line:
                return line
            read.append(line)
    raise AssertionError(f"no line with {text!r} before the end: {''.join(read)}")


async def test_a_resumed_watch_goes_on_through_its_replica_losing_redis(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The watcher's replica loses its Redis subscription (as when Redis drops it): its watch
    ends UNAVAILABLE, changes may have been missed; with ``resume`` the SDK watches again (a
    new watch is refused until the replica follows Redis again) and tells what changed
    meanwhile, once."""
    writer = Broker(BrokerConfig(), store=RedisQueueStore(redis_url))
    await writer.start()
    try:
        async with LocalMesh(broker=Broker(BrokerConfig(), store=RedisQueueStore(redis_url))) as a:
            watcher = a.client("Watcher", reconnect_timeout=30)
            changes = watcher.watch_state("cut/", resume=True)
            assert (await anext(changes)).kind is ChangeKind.SYNCED
            await writer.state.put("cut/x", 1, "Writer")
            assert _told(await asyncio.wait_for(anext(changes), 5))[:3] == ("put", "cut/x", 1)
            assert a.broker is not None
            redis = await a.broker.store._client()  # type: ignore[attr-defined]
            await redis.client_kill_filter(_type="pubsub")
            await writer.state.put("cut/x", 2, "Writer")
            await writer.state.put("cut/y", 1, "Writer")
            told = []
            async with asyncio.timeout(30):
                while not told or told[-1] != ("synced",):
                    told.append(_told(await anext(changes)))
            # Whatever the replica still heard before the cut came as it was made; the rest
            # in the catch-up: either way, each entry's latest version, and nothing twice.
            assert told[-1] == ("synced",) and told.count(("synced",)) == 1, told
            latest = {change[1]: change[2] for change in told[:-1]}
            assert latest == {"cut/x": 2, "cut/y": 1}, told
            assert len(told) - 1 == len({change[1:3] for change in told[:-1]}), told
            await writer.state.put("cut/y", 2, "Writer")
            assert _told(await asyncio.wait_for(anext(changes), 5))[:3] == ("put", "cut/y", 2)
            await changes.aclose()
        # Why it watched again: the changes it missed; then, while the replica was not
        # following Redis yet, each new watch refused (not begun, to be ended once it does).
        said = [r.getMessage() for r in caplog.records if r.name == "mesh.client"]
        assert said and "missed changes" in said[0], said
        assert all("is cut off from Redis" in line for line in said[1:]), said
    finally:
        await writer.stop()


async def test_the_fields_an_agent_requires_hold_through_either_replica(
    replicas: tuple[Proc, Proc],
) -> None:
    a, b = replicas
    async with (
        connect(a.address, agent_id="PaymentAgent", retry=NO_RETRY) as via_a,
        connect(b.address, agent_id="FlightAgent", retry=NO_RETRY) as via_b,
    ):
        await via_a.register(required_fields=["parameters"])
        [listed] = [x for x in await via_b.list_agents() if x.agent_id == "PaymentAgent"]
        assert listed.required_fields == ("parameters",)
        with pytest.raises(MessageValidationError, match=r"content\.parameters is required"):
            await via_b.send("PaymentAgent", {"action": "process_payment"})
        # Changed through one, it changes through the other as soon as that one hears of it
        # (on a Redis Cluster the notice may come a moment after the registration's answer).
        await via_a.register(required_fields=[])
        async with asyncio.timeout(10):
            while True:
                try:
                    await via_b.send("PaymentAgent", {"action": "process_payment"})
                    break
                except MessageValidationError:
                    await asyncio.sleep(0.01)
        assert [m.action for m in await via_a.receive()] == ["process_payment"]
        await via_a.deregister()


async def test_an_agent_deregistered_through_one_replica_ends_its_subscription_on_the_other(
    replicas: tuple[Proc, Proc],
) -> None:
    a, b = replicas
    async with (
        connect(a.address, agent_id="admin", retry=NO_RETRY) as via_a,
        connect(b.address, agent_id="worker", retry=NO_RETRY) as via_b,
    ):
        await via_b.register("Payment")
        sent = await via_a.send("Payment", {"action": "pay"})
        async with via_b.subscribe("Payment") as payment:
            held = await anext(payment)  # (not acknowledged: it goes back to the queue)
            assert held.message.message_id == sent.message_id
            await via_a.deregister("Payment")
            with pytest.raises(AgentNotFoundError) as ended:
                async with asyncio.timeout(10):
                    await anext(payment)
            assert ended.value.reason == "AGENT_DEREGISTERED"
            await via_b.register("Payment")
            again = await asyncio.wait_for(anext(payment), 10)
            assert (again.message.message_id, again.attempt) == (sent.message_id, 2)
            await again.ack()
        await via_b.deregister("Payment")


async def registry_becomes(broker: Broker, holds: Callable[[AgentRegistry], bool]) -> None:
    """Waits (up to 10 s) until the broker's registry ``holds``, looked at as it changes."""
    changed = asyncio.Event()
    broker.registry_watchers.append(lambda _: changed.set())
    async with asyncio.timeout(10):
        while True:
            changed.clear()
            if holds(broker.registry):
                return
            await changed.wait()


async def test_a_replica_cut_off_from_redis_catches_up_with_the_registry(redis_url: str) -> None:
    """What registered and left through another replica while this one was cut off from
    Redis's pub/sub (the news lost with its connection) is read again once it follows
    again: before, it went on listing an agent deregistered meanwhile, with the subscription
    still open on it, and its broadcasts left out the agent registered meanwhile, until
    each changed again."""
    from mesh.core.errors import DEREGISTERED

    other = Broker(BrokerConfig(), store=RedisQueueStore(redis_url))
    cut = Broker(BrokerConfig(), store=RedisQueueStore(redis_url))
    await other.start()
    await cut.start()
    try:
        await other.register(AgentInfo(agent_id="Leaving"))
        await other.register(AgentInfo(agent_id="Sender"))
        await registry_becomes(cut, lambda r: "Leaving" in r)
        held = await cut.subscribe("Leaving")
        redis = await cut.store._client()  # type: ignore[attr-defined]
        await redis.client_kill_filter(_type="pubsub")
        await other.register(AgentInfo(agent_id="Arriving"))
        await other.deregister("Leaving")
        await registry_becomes(cut, lambda r: "Arriving" in r and "Leaving" not in r)
        assert held.ended_by is not None and held.ended_by.reason == DEREGISTERED
        told = await cut.broadcast(
            Message(from_agent="Sender", to_agent="", content={"alert": "noon"})
        )
        assert told.recipients == ("Arriving",)
    finally:
        await other.stop()
        await cut.stop()


@asynccontextmanager
async def shop_and_desk(url: str) -> AsyncIterator[tuple[Broker, Broker]]:
    """Two broker replicas on the Redis at ``url``, ``other`` and ``cut`` (the requester's,
    whose link to the others a test cuts), Shop and Desk registered and known to both."""
    other = Broker(BrokerConfig(), store=RedisQueueStore(url))
    cut = Broker(BrokerConfig(), store=RedisQueueStore(url))
    await other.start()
    await cut.start()
    try:
        for agent_id in ("Shop", "Desk"):
            await other.register(AgentInfo(agent_id=agent_id))
        await registry_becomes(cut, lambda r: "Shop" in r and "Desk" in r)
        yield other, cut
    finally:
        await other.stop()
        await cut.stop()


async def ask_across(
    asker: Broker, answerer: Broker, content: dict[str, object], *, timeout: float
) -> tuple[asyncio.Task[Message], Message]:
    """A request from Shop to Desk through ``asker`` (its task), and the request as Desk
    takes it through ``answerer``."""
    question = Message(from_agent="Shop", to_agent="Desk", content=content)
    asking = asyncio.create_task(asker.request(question, timeout=timeout))
    async with asyncio.timeout(5):
        taken = await answerer.receive("Desk")
        while not taken:  # (queued through the other replica)
            await asyncio.sleep(0.05)
            taken = await answerer.receive("Desk")
    [asked] = taken
    return asking, asked


def desk_answers(correlation_id: str, content: dict[str, object]) -> Message:
    return Message(
        from_agent="Desk",
        to_agent="Shop",
        message_type=MessageType.RESPONSE,
        correlation_id=correlation_id,
        content=content,
    )


async def test_an_answer_is_kept_for_the_replica_where_its_requester_waits(
    redis_url: str,
) -> None:
    """The requester waits on a replica that has just lost its subscription to the others'
    news (it subscribes again within half a second): an answer through the other replica is
    kept for that replica, which reads it when it listens again. Before, it went into the
    requester's queue as a message of its own, and the request timed out. An answer whose
    route names a replica that is gone is dropped as late, not queued."""
    async with shop_and_desk(redis_url) as (other, cut):
        asking, asked = await ask_across(cut, other, {"action": "pay"}, timeout=5)
        gap = asyncio.Event()
        cut.store.on_gap(gap.set)  # type: ignore[attr-defined]
        redis = await cut.store._client()  # type: ignore[attr-defined]
        await redis.client_kill_filter(_type="pubsub")
        async with asyncio.timeout(5):
            await gap.wait()  # (it knows it is cut off: not yet subscribed again)
        told = await other.send(desk_answers(asked.correlation_id, {"action": "pay", "paid": True}))
        assert told.recipients == ("Shop",)
        assert (await asking).content["paid"] is True

        await redis.set("mesh:route:Shop:cor-ghost", "replica-gone", px=10_000)
        late = await other.send(desk_answers("cor-ghost", {"action": "pay", "paid": True}))
        assert late.recipients == ()
        assert await other.receive("Shop") == [] and await cut.receive("Shop") == []


async def test_an_answer_lost_with_its_replicas_connection_is_read_again(one_redis: str) -> None:
    """Redis counted the answer's PUBLISH as heard, and the requester's replica lost it with
    its connection (the answer was in flight to a subscription that died): the replica reads
    it from the store when it follows the others again, and the request is answered. Before,
    pub/sub delivered it at most once, and the request timed out. An answer heard is not kept:
    nothing is read twice."""
    async with shop_and_desk(one_redis) as (other, cut):
        store: RedisQueueStore = cut.store  # type: ignore[assignment]
        handle, lost = store._handle, asyncio.Event()

        async def losing_the_first_answer(event: dict[str, object], listener: object) -> None:
            channel = str(event.get("channel", b""), "utf-8")
            if not lost.is_set() and channel.startswith("mesh:answer:"):
                lost.set()
                raise ConnectionError("connection lost with an answer on it")
            await handle(event, listener)

        store._handle = losing_the_first_answer  # type: ignore[method-assign]
        answered = []
        for n in (1, 2):
            asking, asked = await ask_across(cut, other, {"action": "pay", "n": n}, timeout=8)
            told = await other.send(
                desk_answers(asked.correlation_id, {"action": "pay", "n": n, "paid": True})
            )
            assert told.recipients == ("Shop",)
            answered.append((await asking).content)
        assert lost.is_set()
        assert [(a["n"], a["paid"]) for a in answered] == [(1, True), (2, True)]
        redis = await cut.store._client()  # type: ignore[attr-defined]
        kept = f"mesh:handed-over:{store.replica_id}"
        async with asyncio.timeout(5):
            left = await redis.hlen(kept)
            while left:  # (the one heard is forgotten in the background)
                await asyncio.sleep(0.05)
                left = await redis.hlen(kept)


async def test_a_second_answer_through_another_replica_is_dropped_as_late(
    redis_url: str,
) -> None:
    """The request was answered (through the other replica) and ended; the agent answers it
    again (a redelivered request answered twice): the second answer still finds the route to
    the requester's replica, which drops it as late. It is not queued to the requester as a
    message of its own (the route was deleted as the request ended, and the answer, finding
    none, was queued)."""
    async with shop_and_desk(redis_url) as (other, cut):
        asking, asked = await ask_across(cut, other, {"action": "pay"}, timeout=5)
        first = await other.send(desk_answers(asked.correlation_id, {"action": "pay", "n": 1}))
        assert first.recipients == ("Shop",)
        assert (await asking).content["n"] == 1
        second = await other.send(desk_answers(asked.correlation_id, {"action": "pay", "n": 2}))
        assert second.recipients == ("Shop",)  # (handed to the replica that asked)
        async with asyncio.timeout(5):
            while not cut.metrics.totals.late_answers:  # noqa: ASYNC110 (a broker figure)
                await asyncio.sleep(0.01)
        assert await cut.receive("Shop") == [] and await other.receive("Shop") == []

"""Two brokers on a Redis that crashes and comes back: meanwhile they refuse sends with
UNAVAILABLE and wait quietly (no busy loop around a failed subscription); afterwards they
follow each other again without being restarted, and a message sent through one reaches a
subscriber on the other."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mesh import BrokerUnavailableError, connect
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.core.model import Message, MessageType
from mesh.memory_server import MEMORY_SERVICE
from mesh.redis_store import RedisQueueStore
from mesh.server import BROKER_SERVICE, serve_broker
from mesh.testing import LocalRedis
from tests.helpers.health import NOT_SERVING, SERVING, health_of, watching
from tests.helpers.stores import two_replicas


class Heard(logging.Handler):
    """Sets ``heard`` when a record saying ``text`` is logged (in the event loop's thread)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.heard = asyncio.Event()
        self.times = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.times += 1
            self.heard.set()

    async def heard_times(self, times: int) -> None:
        """Returns once ``text`` has been logged ``times`` times."""
        while self.times < times:
            self.heard.clear()
            await self.heard.wait()


@pytest.fixture
def hearing() -> Iterator[Callable[[str], Heard]]:
    """Listens on the mesh's log for each text asked (:class:`Heard`); stops after the test."""
    mesh_log, attached = logging.getLogger("mesh"), list[Heard]()

    def hear(text: str) -> Heard:
        attached.append(Heard(text))
        mesh_log.addHandler(attached[-1])
        return attached[-1]

    yield hear
    for handler in attached:
        mesh_log.removeHandler(handler)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[LocalRedis]:
    """A redis-server of this test's own, since the test kills it."""
    if why := LocalRedis.unavailable():
        pytest.skip(f"{why}; .ci/run adds it")
    redis = LocalRedis.start(tmp_path / "redis")
    try:
        yield redis
    finally:
        redis.stop()


async def test_two_brokers_ride_out_a_redis_crash(
    own_redis: LocalRedis,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    hearing: Callable[[str], Heard],
) -> None:
    caplog.set_level(logging.INFO, logger="mesh")
    followed_again = hearing("following the other replicas again")
    async with two_replicas(own_redis.url) as mesh:
        via_a, via_b = mesh.via_a, mesh.via_b
        await via_b.register("Listener")
        on_b = via_b.subscribe("Listener")
        await on_b.start()
        before = await via_a.send("Listener", {"action": "before"})
        got = await asyncio.wait_for(anext(aiter(on_b)), 5)
        assert got.message.message_id == before.message_id
        await got.ack()

        own_redis.kill()
        with pytest.raises(BrokerUnavailableError):
            await via_a.send("Listener", {"action": "during"})
        # A wake-up while the store is away: the subscription finds it unreachable, and
        # stays (it does not end, nor stop delivering once the store is back).
        mesh.broker_b.on_wake("Listener")

        # Both brokers keep trying to follow each other, at a walk.
        cpu = time.process_time()
        await asyncio.sleep(1.5)
        assert time.process_time() - cpu < 0.75
        said = [r.message for r in caplog.records]
        assert sum("following the other replicas failed" in m for m in said) == 2
        assert sum("queue sweeps fail until the store is back" in m for m in said) == 2

        own_redis.restart(tmp_path / "redis")
        after = None
        async with asyncio.timeout(10):
            while after is None:  # until the brokers' connections are back
                try:
                    after = await via_a.send("Listener", {"action": "after"})
                except BrokerUnavailableError:
                    await asyncio.sleep(0.1)
            got = await anext(aiter(on_b))
        assert got.message.message_id == after.message_id
        assert got.message.content == {"action": "after"}
        await got.ack()
        await on_b.close()
        # Each broker's watcher looks again every 0.5 s: the delivery above may come
        # (through the subscription's own retry) before either has subscribed again.
        await asyncio.wait_for(followed_again.heard.wait(), 10)


async def test_brokers_put_their_registrations_back_in_a_redis_that_came_back_empty(
    own_redis: LocalRedis,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    hearing: Callable[[str], Heard],
) -> None:
    """A Redis without persistence restarts empty: the registrations are gone from it, but
    the agents are not gone from the mesh. Each broker finds the store emptied (not the
    agents deregistered through another replica) and keeps again the registrations it
    knows; a subscription stays open and gets what is sent through the other broker, and
    the listing is whole on both. (Before, a broker read every agent missing from the store
    as deregistered, and ended its subscriptions.)"""
    caplog.set_level(logging.INFO, logger="mesh")
    put_back = hearing("registrations put back in the store")
    async with two_replicas(own_redis.url) as mesh:
        via_a, via_b = mesh.via_a, mesh.via_b
        await via_a.register("Writer", agent_types=["writer"])
        await via_b.register("Listener", agent_types=["listener"])
        on_b = via_b.subscribe("Listener")
        await on_b.start()

        own_redis.kill()
        own_redis.restart(tmp_path / "redis")
        await asyncio.wait_for(put_back.heard_times(2), 10)
        said = [r.getMessage() for r in caplog.records]
        assert sum(m.startswith("the store lost the registrations") for m in said) == 2

        store = RedisQueueStore(own_redis.url)
        try:
            saved = {info.agent_id: info for info in await store.saved_agents()}
        finally:
            await store.close()
        assert sorted(saved) == ["Listener", "Writer"]
        assert saved["Listener"].agent_types == ("listener",)
        # Each listing is the replica's own view: the other's registration put back while it
        # was not listening yet is heard of once it follows the others again (it looks again
        # every 0.5 s, and then reads the registry whole).
        async with asyncio.timeout(10):
            for client in (via_a, via_b):
                while sorted(a.agent_id for a in await client.list_agents()) != [  # noqa: ASYNC110 - asked as a client would
                    "Listener",
                    "Writer",
                ]:
                    await asyncio.sleep(0.1)

        after = await via_a.send("Listener", {"action": "after"})
        got = await asyncio.wait_for(anext(aiter(on_b)), 5)
        assert got.message.message_id == after.message_id
        assert got.message.content == {"action": "after"}
        await got.ack()
        await on_b.close()


async def test_a_request_waiting_through_a_redis_that_came_back_empty_gets_its_answer(
    own_redis: LocalRedis,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    hearing: Callable[[str], Heard],
) -> None:
    """A request waits on broker A; its agent, on broker B, has it when Redis restarts empty,
    taking with it the route that says where the requester waits. A claims its waiting
    requests' routes again as it puts its registrations back, so the answer given through B
    still reaches the requester. (Before, B found no route, took the answer for a message to
    an agent named as the requester, and refused it: NOT_FOUND to the answering agent, and
    the requester waited out its deadline.)"""
    caplog.set_level(logging.INFO, logger="mesh")
    put_back = hearing("registrations put back in the store")
    async with two_replicas(own_redis.url) as mesh:
        await mesh.via_b.register("Thinker")
        on_b = mesh.via_b.subscribe("Thinker")
        await on_b.start()
        asking = asyncio.create_task(mesh.via_a.request("Thinker", {"action": "think"}, timeout=30))
        got = await asyncio.wait_for(anext(aiter(on_b)), 5)

        own_redis.kill()
        own_redis.restart(tmp_path / "redis")
        await asyncio.wait_for(put_back.heard_times(2), 10)
        said = [r.getMessage() for r in caplog.records if "put back" in r.getMessage()]
        assert sorted(m.rsplit(": ", 1)[1] for m in said) == ["0", "1"]  # A's one request

        answer = Message(
            from_agent="Thinker",
            to_agent=got.message.reply_target,
            message_type=MessageType.RESPONSE,
            correlation_id=got.message.correlation_id,
            content={"action": "think", "thought": "done"},
        )
        await mesh.via_b.send_message(answer)
        answered = await asyncio.wait_for(asking, 5)
        assert answered.content == {"action": "think", "thought": "done"}
        await on_b.close()


async def test_a_heartbeat_failing_unforeseen_does_not_stop_the_heartbeats(
    own_redis: LocalRedis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    hearing: Callable[[str], Heard],
) -> None:
    """A beat that fails in a way the store does not name (redis-py's cluster client raised
    AttributeError while a node restarted) is logged, and the next beat comes: here, it
    notices Redis flushed, and the registration is put back. Before, the heartbeat task
    ended with it: the replica beat no more, and saw nothing of the store losing its data."""
    caplog.set_level(logging.INFO, logger="mesh")
    put_back = hearing("registrations put back in the store")
    broker, server = await serve_broker(broker_config=BrokerConfig(store=own_redis.url))
    store = broker.store
    assert isinstance(store, RedisQueueStore)
    check_mark = store._check_mark  # (a heartbeat's own step: the sweeps beat too)
    torn = 1

    async def torn_check() -> bool:
        nonlocal torn
        if torn:
            torn -= 1
            raise AttributeError("'NoneType' object has no attribute 'writelines'")
        return await check_mark()

    monkeypatch.setattr(store, "_check_mark", torn_check)
    try:
        async with connect(server.address, agent_id="alice", retry=NO_RETRY) as client:
            await client.register("Worker")
            async with asyncio.timeout(5):
                while torn:  # noqa: ASYNC110 - the store's heartbeat task takes it
                    await asyncio.sleep(0.05)
            await asyncio.to_thread(own_redis.flush)
            await asyncio.wait_for(put_back.heard_times(1), 5)
            assert [a.agent_id for a in await client.list_agents()] == ["Worker"]
    finally:
        await server.stop(0)
    failed = [r for r in caplog.records if r.getMessage().startswith("a heartbeat failed")]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR


async def test_while_redis_is_away_the_broker_and_its_gateway_are_not_ready(
    own_redis: LocalRedis, tmp_path: Path
) -> None:
    """Readiness follows the store: a broker whose Redis is away says NOT_SERVING for its
    services (and the gateway on it for its own), while each server as a whole, which
    liveness asks, still serves; both are ready again once Redis is back."""
    from gateway.server import GATEWAY_SERVICE, serve_gateway
    from mesh import SecurityConfig

    _, broker = await serve_broker(broker_config=BrokerConfig(store=own_redis.url))
    gateway = await serve_gateway(broker.address, security=SecurityConfig())
    try:
        async with (
            watching(broker.address, BROKER_SERVICE) as broker_watch,
            watching(broker.address, MEMORY_SERVICE) as memory_watch,
            watching(gateway.address, GATEWAY_SERVICE) as gateway_watch,
        ):
            for watch in (broker_watch, memory_watch, gateway_watch):
                assert await watch.until(SERVING) == [SERVING]
            own_redis.kill()
            for watch in (broker_watch, memory_watch, gateway_watch):
                assert await watch.until(NOT_SERVING) == [NOT_SERVING]
            assert await health_of(broker.address) == SERVING
            assert await health_of(gateway.address) == SERVING
            own_redis.restart(tmp_path / "redis")
            for watch in (broker_watch, memory_watch, gateway_watch):
                assert await watch.until(SERVING) == [SERVING]
        async with connect(broker.address, agent_id="alice", retry=NO_RETRY) as client:
            await client.register("Worker")
            await client.send("Worker", {"action": "after"})
    finally:
        await gateway.stop(0)
        await broker.stop(0)


async def test_a_broker_whose_redis_is_away_stops_all_the_same(
    own_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopping while the store is away: the server and the broker stop (its sweeper and its
    store's connections too), saying it could not count what the store holds."""
    caplog.set_level(logging.WARNING, logger="mesh")
    broker, server = await serve_broker(broker_config=BrokerConfig(store=own_redis.url))
    try:
        async with connect(server.address, agent_id="alice", retry=NO_RETRY) as client:
            await client.register("Worker")
            await client.send("Worker", {"action": "kept"})
        own_redis.kill()
    finally:
        await server.stop(0)  # before, this raised UNAVAILABLE and left the broker running
    assert broker._sweeper is None
    said = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("shutting down without counting the messages held, which stay in the store")
        for m in said
    ), said
    assert not any(r.levelno >= logging.ERROR for r in caplog.records), said


async def test_after_a_redis_restart_the_store_answers_on_new_connections(
    own_redis: LocalRedis, tmp_path: Path
) -> None:
    """A restart closes every connection the store keeps open: the next call on each is made
    again on a new one, not answered with UNAVAILABLE."""
    store = RedisQueueStore(own_redis.url)
    try:
        assert await store.put(Message(from_agent="a", to_agent="q", content={"n": 1}), 60)
        # Five calls at once: five connections in the store's pool.
        assert await asyncio.gather(*(store.depth("q") for _ in range(5))) == [1] * 5

        own_redis.kill()  # (nothing is saved: the queue is gone with it)
        own_redis.restart(tmp_path / "redis")

        assert await store.held() == 0  # a pipeline of scripts
        assert await asyncio.gather(*(store.depth("q") for _ in range(5))) == [0] * 5
        assert await store.put(Message(from_agent="a", to_agent="q", content={"n": 2}), 60)
        assert await store.depth("q") == 1
    finally:
        await store.close()


async def test_a_client_sees_nothing_of_a_redis_restart_that_ended_before_its_call(
    own_redis: LocalRedis, tmp_path: Path
) -> None:
    """Through a broker, with no retry in the client: the call after each restart is answered
    (before, most were UNAVAILABLE: "Connection closed by server")."""
    _, server = await serve_broker(broker_config=BrokerConfig(store=own_redis.url))
    try:
        async with connect(server.address, agent_id="alice", retry=NO_RETRY) as client:
            for round_ in range(3):
                await client.register("Worker")
                sent = [{"action": "before", "n": n} for n in range(8)]
                await asyncio.gather(*(client.send("Worker", content) for content in sent))
                own_redis.kill()
                own_redis.restart(tmp_path / "redis")
                # (the restart emptied Redis: the agent registers again, as it would)
                await client.register("Worker")
                await client.send("Worker", {"action": "after", "round": round_})
                [got] = await client.receive("Worker")
                assert got.content == {"action": "after", "round": round_}
    finally:
        await server.stop(0)


async def test_a_broker_started_before_its_redis_waits_for_it(
    own_redis: LocalRedis, tmp_path: Path
) -> None:
    """A deployment starts Redis and the brokers side by side: `agentmesh broker` started
    first waits for its store (60 s by default), then serves; stopped while it waits, it
    ends at once; with `--wait-for-store 0` it fails at once, as it always did."""
    from tests.helpers.processes import BROKER_READY, signal_process, start, stop

    own_redis.kill()
    broker_args = ("broker", "--port", "0", "--store", own_redis.url)
    waiting = r"the broker (waits) for its queue store"
    broker = await start(*broker_args, ready=waiting)
    try:
        own_redis.restart(tmp_path / "redis")
        async with asyncio.timeout(15):
            while not any(re.search(BROKER_READY, line) for line in broker.output):  # noqa: ASYNC110 - its output, as its reader task takes it
                await asyncio.sleep(0.05)
        address = next(m[1] for line in broker.output if (m := re.search(BROKER_READY, line)))
        async with connect(address, agent_id="Early", retry=NO_RETRY) as client:
            await client.register("Early")
            sent = await client.send("Early", {"action": "note"})
            [got] = await client.receive("Early")
            assert got.message_id == sent.message_id
    finally:
        assert await stop(broker) == 0

    own_redis.kill()
    broker = await start(*broker_args, ready=waiting)
    signal_process(broker.process, signal.SIGTERM)
    async with asyncio.timeout(10):
        assert await broker.process.wait() == 0
    assert broker.reader is not None
    await broker.reader
    said = "agentmesh broker stopped before its queue store could be reached\n"
    assert said in broker.output

    refused = await start(*broker_args, "--wait-for-store", "0", ready=r"(error): UNAVAILABLE")
    assert await refused.process.wait() == 1
    assert not any("waits for its queue store" in line for line in refused.output)

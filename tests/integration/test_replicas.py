"""Two broker processes sharing one Redis (or one Redis Cluster): one mesh, whichever replica
a client talks to.

Delivery, registration, broadcast, request/response and scatter-gather cross replicas, with
no polling delay (a message queued through one replica wakes the subscriber on the other);
a replica killed with SIGKILL under traffic loses nothing that was accepted: its clients
fail over to the other one and its leases come back when they end. A lease that ends while
another replica sweeps comes back to the subscriber it was held through, or to the agent's
subscriber on any replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import grpc
import pytest

from mesh import AgentContext, MeshError, Message, agent, connect, serve
from mesh.agent import AGENT_SERVICE
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.core import broker as broker_module
from mesh.core.broker import Broker
from mesh.core.errors import AgentNotFoundError, MessageQueueFullError, RequestTimeoutError
from mesh.core.model import AgentInfo, MessageType, utc_now
from mesh.redis_store import RedisQueueStore
from mesh.server import serve_broker
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2
from tests.helpers.health import NOT_SERVING, SERVING, watching
from tests.helpers.plain_agent import PlainAgent, echo, start_plain
from tests.helpers.processes import BROKER_READY, Proc, start, stop, wait_killed
from tests.helpers.stores import CountingLeases

pytestmark = pytest.mark.processes


async def start_replica(redis_url: str) -> Proc:
    return await start("broker", "--port", "0", "--store", redis_url, ready=BROKER_READY)


@pytest.fixture(params=["redis", "redis-cluster"])
async def replicas(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Proc, Proc, str]]:
    """Two broker processes on one Redis, or on a three-node Redis Cluster (each replica
    given a different node's address)."""
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        urls = [url, url]
    else:
        urls = request.getfixturevalue("redis_cluster")[:2]
    a = await start_replica(urls[0])
    b = await start_replica(urls[1])
    try:
        yield a, b, urls[0]
    finally:
        await stop(a)
        await stop(b)


async def test_one_mesh_across_two_replicas(replicas: tuple[Proc, Proc, str]) -> None:
    a, b, _ = replicas
    agent = await start(
        "agent",
        "tests.helpers.process_agents:Payment",
        "--broker",
        a.address,
        ready=r"serving on (\S+)",
    )
    try:
        async with (
            connect(a.address, agent_id="alice", retry=NO_RETRY) as via_a,
            connect(b.address, agent_id="bob", retry=NO_RETRY) as via_b,
        ):
            # Registered through A, known through B.
            assert "PaymentAgent" in [info.agent_id for info in await via_b.list_agents()]

            # A request through B, answered by an agent subscribed through A.
            answer = await via_b.request(
                "PaymentAgent", {"action": "process_payment", "parameters": {"amount": 7}}
            )
            assert answer.content["status"] == "PAID"
            assert answer.content["pid"] == agent.process.pid

            # A subscriber on B gets what is sent through A, at once (no polling).
            await via_b.register("Listener", agent_types=("audit",))
            await via_a.register("Watcher", agent_types=("audit",))
            on_b = via_b.subscribe("Listener")
            on_a = via_a.subscribe("Watcher")
            await on_b.start()
            await on_a.start()
            sent = await via_a.send("Listener", {"action": "note"})
            got = await asyncio.wait_for(anext(aiter(on_b)), 2)
            assert got.message.message_id == sent.message_id
            await got.ack()

            # Broadcast through A reaches the audit agents on both replicas.
            outcome = await via_a.broadcast_to_types(["audit"], {"action": "hello"})
            assert sorted(outcome.recipients) == ["Listener", "Watcher"]
            for sub in (on_a, on_b):
                got = await asyncio.wait_for(anext(aiter(sub)), 2)
                assert got.message.action == "hello"
                await got.ack()
            await on_a.close()
            await on_b.close()

            # Scatter-gather through B: the agent on A answers.
            answers = [
                item
                async for item in via_b.gather(
                    {"action": "process_payment", "parameters": {"amount": 1}},
                    agent_ids=["PaymentAgent"],
                    timeout=5,
                )
            ]
            assert [i.response.content["status"] for i in answers if i.response] == ["PAID"]

            # One set of queues: what B holds is what A reports.
            await via_b.send("Listener", {"action": "later"})
            stats = (await via_a.queue_stats("Listener")).for_agent("Listener")
            assert stats is not None and stats.medium == 1
    finally:
        await stop(agent)


async def test_a_push_agent_is_served_by_every_replica_each_message_once(
    replicas: tuple[Proc, Proc, str],
) -> None:
    a, b, _ = replicas
    agent = PlainAgent(echo)
    server, address = await start_plain(agent)
    try:
        async with (
            connect(a.address, agent_id="alice", retry=NO_RETRY) as via_a,
            connect(b.address, agent_id="bob", retry=NO_RETRY) as via_b,
        ):
            await via_a.register("Ledger", address=address, delivery_mode="push")
            await via_b.register("bob")
            # Registered for push through A; a request through B is answered.
            answer = await via_b.request(
                "Ledger", {"action": "post", "parameters": {"n": -1}}, timeout=15
            )
            assert answer.content["echo"] == {"n": -1} and answer.from_agent == "Ledger"
            sent = [
                await via.send("Ledger", {"action": "post", "parameters": {"n": n}})
                for n, via in zip(range(20), itertools.cycle((via_a, via_b)))
            ]
            await agent.until_seen(21)
            await asyncio.sleep(0.5)  # (time for a second delivery, were there one)
    finally:
        await server.stop(None)
    pushed = [m.message_id for m in agent.seen[1:]]
    assert sorted(pushed) == sorted(m.message_id for m in sent)  # each once, none lost


async def test_a_replica_killed_under_traffic_loses_nothing_accepted(
    replicas: tuple[Proc, Proc, str],
) -> None:
    a, b, store_url = replicas
    both = f"ipv4:{a.address},{b.address}"  # one address for the pair: A first, then B
    acknowledged: set[str] = set()
    received: set[str] = set()
    counter = itertools.count()
    enough = asyncio.Event()

    async with connect(b.address, agent_id="admin", retry=NO_RETRY) as admin:
        await admin.register("Sink")

    async def sender(target: str, n: int) -> None:
        async with connect(target, agent_id=f"sender{n}", retry=NO_RETRY) as client:
            while (i := next(counter)) < 1500:
                try:
                    sent = await client.send("Sink", {"action": "record", "parameters": {"i": i}})
                except MeshError:
                    if target == a.address:
                        return  # this replica is gone; the others carry on
                    await asyncio.sleep(0.05)
                    continue
                acknowledged.add(sent.message_id)
                if len(acknowledged) >= 300:
                    enough.set()

    async def consumer() -> None:
        async with connect(both, agent_id="Sink") as client:
            # Leases of 30 s: what the dead replica had leased comes back once the other
            # replica sees it stopped beating (3 s), not when the leases end.
            sub = client.subscribe("Sink", max_in_flight=32, lease_seconds=30)
            async for delivery in sub:
                received.add(delivery.message.message_id)
                await delivery.ack()

    consuming = asyncio.create_task(consumer())
    senders = [
        asyncio.create_task(sender(target, n))
        for n, target in enumerate([a.address, a.address, b.address, b.address])
    ]
    await asyncio.wait_for(enough.wait(), 30)
    await wait_killed(a)
    await asyncio.gather(*senders)
    try:
        async with asyncio.timeout(15):
            while not acknowledged <= received:  # noqa: ASYNC110 - the consumer's progress
                await asyncio.sleep(0.1)
    finally:
        consuming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consuming
    missing = acknowledged - received
    assert not missing, f"{len(missing)} acknowledged messages never delivered"
    assert len(acknowledged) > 300
    # The surviving replica notices that A stopped beating (and hands back what it leased).
    async with asyncio.timeout(10):
        while not any("broker replicas gone" in line for line in b.output):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    # The broker-wide count agrees with what the queues hold (messages accepted by A whose
    # senders never heard back are still queued): at once, or once the survivor has seen the
    # same difference for three seconds running and corrected it.
    from mesh.redis_store import TOTAL
    from mesh.redis_store import connect as connect_redis

    raw = await connect_redis(store_url)
    try:
        async with connect(b.address, agent_id="admin", retry=NO_RETRY) as admin:
            async with asyncio.timeout(15):
                while True:
                    stats = (await admin.queue_stats("Sink")).for_agent("Sink")
                    assert stats is not None
                    held = stats.high + stats.medium + stats.low + stats.in_flight
                    if int(await raw.get(TOTAL) or 0) == held:
                        break
                    await asyncio.sleep(0.2)
    finally:
        await raw.aclose()


@pytest.fixture(params=["redis", "redis-cluster"])
def one_redis(request: pytest.FixtureRequest) -> str:
    return str(
        request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")
    )


def replica(url: str, sweep_interval: float = 0.2, store: RedisQueueStore | None = None) -> Broker:
    """A broker replica in this process on the Redis at ``url``."""
    return Broker(BrokerConfig(sweep_interval=sweep_interval), store=store or RedisQueueStore(url))


@contextlib.asynccontextmanager
async def running(*brokers: Broker) -> AsyncIterator[tuple[Broker, ...]]:
    """The brokers started, and stopped at the end."""
    started: list[Broker] = []
    try:
        for broker in brokers:
            await broker.start()
            started.append(broker)
        yield brokers
    finally:
        for broker in started:
            await broker.stop()


async def test_a_lease_another_replica_hands_back_is_delivered_again_through_the_first(
    one_redis: str,
) -> None:
    """A lease held through replica B ends while replica A sweeps first (A sweeps every
    50 ms, B every 30 s): A hands the message back, and B's subscriber, with one place in
    flight, gets it again at once. Before, B never heard of it: its subscription kept the
    place taken and was never woken, and the message waited in the queue for good."""
    async with running(replica(one_redis, 0.05), replica(one_redis, 30)) as (a, b):
        await b.register(AgentInfo(agent_id="Slow"))
        sub = await b.subscribe("Slow", max_in_flight=1, lease_seconds=1)
        sent = await a.send(Message(from_agent="S", to_agent="Slow", content={"action": "x"}))
        first = await asyncio.wait_for(sub.next(), 5)
        assert (first.message.message_id, first.attempt) == (sent.message.message_id, 1)
        # Not acked: the lease ends after 1 s, and A's sweep is the one that sees it.
        again = await asyncio.wait_for(sub.next(), 5)
        assert (again.message.message_id, again.attempt) == (sent.message.message_id, 2)
        assert sub.in_flight == {sent.message.message_id}  # the one place, taken once
        await b.ack("Slow", [again.message.message_id])
        await asyncio.sleep(0.1)
        assert sub.in_flight == set()
        await sub.close()


async def test_a_message_another_replica_hands_back_wakes_the_agents_subscriber_anywhere(
    one_redis: str,
) -> None:
    """The subscription a message was leased to is gone (its replica C stopped, its leases
    handed back by A); the agent's new subscriber is on B, idle: A's hand-back wakes it."""
    replicas = (replica(one_redis, 0.05), replica(one_redis, 30), replica(one_redis, 30))
    async with running(*replicas) as (a, b, c):
        await c.register(AgentInfo(agent_id="Mover"))
        leaving = await c.subscribe("Mover", lease_seconds=1)
        sent = await a.send(Message(from_agent="S", to_agent="Mover", content={"action": "x"}))
        assert (await asyncio.wait_for(leaving.next(), 5)).attempt == 1
        staying = await b.subscribe("Mover")
        assert not staying.in_flight
        # C goes quiet with the lease (no ack, no release): it ends after 1 s, A hands it back.
        again = await asyncio.wait_for(staying.next(), 5)
        assert (again.message.message_id, again.attempt) == (sent.message.message_id, 2)
        await staying.close()


async def test_a_delivery_nacked_for_later_comes_back_through_the_replica_that_sweeps(
    one_redis: str,
) -> None:
    """A nack with ``redeliver_after`` through replica B (whose sweep is 30 s away): B's
    subscription has its one place back at once and takes the next message; replica A's
    sweep puts the nacked one back when its delay ends, and wakes B's subscriber for it."""
    async with running(replica(one_redis, 0.05), replica(one_redis, 30)) as (a, b):
        await b.register(AgentInfo(agent_id="Later"))
        sub = await b.subscribe("Later", max_in_flight=1)
        first = await a.send(Message(from_agent="S", to_agent="Later", content={"action": "x"}))
        second = await a.send(Message(from_agent="S", to_agent="Later", content={"action": "y"}))
        got = await asyncio.wait_for(sub.next(), 5)
        assert (got.message.message_id, got.attempt) == (first.message.message_id, 1)
        assert await b.nack("Later", [first.message.message_id], redeliver_after=0.5) == (1, 0)
        nxt = await asyncio.wait_for(sub.next(), 5)
        assert (nxt.message.message_id, nxt.attempt) == (second.message.message_id, 1)
        await b.ack("Later", [second.message.message_id])
        back = await asyncio.wait_for(sub.next(), 5)
        assert (back.message.message_id, back.attempt) == (first.message.message_id, 2)
        await b.ack("Later", [first.message.message_id])
        await sub.close()


async def test_a_scheduled_message_reaches_a_subscriber_on_another_replica_when_due(
    one_redis: str,
) -> None:
    """A message scheduled through replica B (whose sweep is 30 s away) for 0.5 s from now:
    replica A's sweep puts it in its place when due, and wakes B's subscriber for it, its
    first delivery."""
    async with running(replica(one_redis, 0.05), replica(one_redis, 30)) as (_sweeping, b):
        await b.register(AgentInfo(agent_id="Reminded"))
        sub = await b.subscribe("Reminded")
        due = utc_now() + timedelta(seconds=0.5)
        sent = await b.send(
            Message(from_agent="S", to_agent="Reminded", content={"action": "x"}, deliver_at=due)
        )
        now = await b.send(Message(from_agent="S", to_agent="Reminded", content={"action": "y"}))
        got = await asyncio.wait_for(sub.next(), 5)
        assert got.message.message_id == now.message.message_id
        await b.ack("Reminded", [got.message.message_id])
        back = await asyncio.wait_for(sub.next(), 5)
        assert (back.message.message_id, back.attempt) == (sent.message.message_id, 1)
        assert utc_now() >= due
        await b.ack("Reminded", [back.message.message_id])
        await sub.close()


class CountingRedisStore(CountingLeases, RedisQueueStore):
    """The Redis store, counting its lease scripts."""


async def test_each_delivery_costs_the_replica_of_its_subscriber_one_lease(one_redis: str) -> None:
    """Messages sent one after another, through the subscriber's replica and through the
    other: each is one lease script on Redis, nothing more (no look at an emptied queue
    after a delivery or its ack, none on hearing this replica's own wake-up; before, three
    leases a message)."""
    store = CountingRedisStore(one_redis)
    async with running(replica(one_redis, store=store), replica(one_redis)) as (mine, other):
        await mine.register(AgentInfo(agent_id="Worker"))
        sub = await mine.subscribe("Worker")
        delivered: asyncio.Queue[Any] = asyncio.Queue()

        async def consume() -> None:
            # As a session's pump does for the SDK (which takes whatever is ready in one
            # frame): lease, hand on, lease again.
            while True:
                for delivery in await sub.next_batch(8):
                    delivered.put_nowait(delivery)

        consumer = asyncio.create_task(consume())
        for i in range(6):
            through = mine if i % 2 else other
            await through.send(
                Message(from_agent="S", to_agent="Worker", content={"action": f"task-{i}"})
            )
            delivery = await asyncio.wait_for(delivered.get(), 5)
            assert delivery.message.action == f"task-{i}"
            await mine.ack("Worker", [delivery.message.message_id])
            await asyncio.sleep(0.05)  # (any wake-up that would follow has come)
        assert store.leases == 1 + 6  # a look when it started, then one a message
        consumer.cancel()
        await sub.close()


async def one_place_taken(broker: Broker) -> tuple[Any, Any, asyncio.Task[Any]]:
    """Agent "Single" subscribed through ``broker`` with one place in flight, two messages
    queued ("one", "two"): the subscription, the delivery of "one", and the wait for "two"."""
    await broker.register(AgentInfo(agent_id="Single"))
    sub = await broker.subscribe("Single", max_in_flight=1)
    for text in ("one", "two"):
        await broker.send(Message(from_agent="S", to_agent="Single", content={"action": text}))
    first = await asyncio.wait_for(sub.next(), 5)
    return sub, first, asyncio.create_task(sub.next())


async def test_an_ack_through_another_replica_gives_the_subscription_its_place_back(
    one_redis: str,
) -> None:
    """A client may settle a delivery through another replica than the one its subscription
    is on (a unary Ack on another connection): the subscription, with one place in flight,
    gets the next message. Before, its place stayed taken for good."""
    async with running(replica(one_redis), replica(one_redis)) as (a, b):
        sub, first, second = await one_place_taken(b)
        await asyncio.sleep(0.2)
        assert not second.done()  # its one place is taken
        assert await a.ack("Single", [first.message.message_id]) == 1
        assert (await asyncio.wait_for(second, 5)).message.action == "two"
        await sub.close()


@pytest.mark.parametrize("found_by", ["the check in time", "following again"])
async def test_a_release_the_subscriptions_replica_never_heard_of_frees_its_place_soon(
    one_redis: str, monkeypatch: pytest.MonkeyPatch, found_by: str
) -> None:
    """The notice of a release published while the subscription's replica was not listening
    is lost: the replica's sweeps check its subscriptions' places in flight against Redis
    (every CREDIT_CHECK_SECONDS, made 0.3 s here; at once after it follows the others
    again, which is when notices go unheard) and free the place."""
    in_time = found_by == "the check in time"
    monkeypatch.setattr(broker_module, "CREDIT_CHECK_SECONDS", 0.3 if in_time else 3600)
    telling = RedisQueueStore(one_redis)
    told = telling._notify

    def lose_releases(channel: str, payload: str) -> None:
        if not channel.startswith("mesh:released:"):
            told(channel, payload)

    monkeypatch.setattr(telling, "_notify", lose_releases)
    async with running(replica(one_redis, store=telling), replica(one_redis, 0.05)) as (a, b):
        sub, first, second = await one_place_taken(b)
        assert await a.ack("Single", [first.message.message_id]) == 1  # B is not told
        if not in_time:
            await asyncio.sleep(0.3)
            assert not second.done()
            b.on_followed_again()  # (as its store calls it once subscribed again)
        assert (await asyncio.wait_for(second, 5)).message.action == "two"
        await sub.close()


async def test_a_replica_that_has_not_heard_of_a_registration_finds_it_in_redis(
    one_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent registered through replica A a moment ago, before B heard of it (here B
    hears nothing of the registry at all): through B it is registered all the same, as Redis
    keeps it, for its queue's stats, a subscription and a send. Before, B said it was not
    registered to the first two. An agent nobody registered is still not found."""
    async with running(replica(one_redis), replica(one_redis)) as (a, b):
        monkeypatch.setattr(b, "on_agent_changed", lambda agent_id, info: None)
        await a.register(AgentInfo(agent_id="Fresh"))
        [stats], _ = await b.queue_stats("Fresh")
        assert (stats.queue.agent_id, stats.queue.depth, stats.subscribers) == ("Fresh", 0, 0)
        sub = await b.subscribe("Fresh")
        await b.send(Message(from_agent="S", to_agent="Fresh", content={"action": "hello"}))
        assert (await asyncio.wait_for(sub.next(), 5)).message.action == "hello"
        await sub.close()
        with pytest.raises(AgentNotFoundError, match="agent Nobody is not registered"):
            await b.queue_stats("Nobody")
        with pytest.raises(AgentNotFoundError, match="agent Nobody is not registered"):
            await b.subscribe("Nobody")


async def test_the_instances_a_dead_replica_held_are_taken_off_by_the_other(
    redis_url: str,
) -> None:
    """An agent process subscribed through replica A naming its instance; A and that process
    die together (one machine lost). Replica B, seeing A stop beating, takes the instance off
    (nobody else could: A's end of the stream died with A); the agent stays registered."""
    a = await start_replica(redis_url)
    b = await start_replica(redis_url)
    channel = grpc.aio.insecure_channel(a.address)
    store = RedisQueueStore(redis_url)  # (to see that A's subscription holds the instance)
    try:
        on_a = broker_pb2_grpc.BrokerServiceStub(channel)
        await on_a.RegisterAgent(
            broker_pb2.RegisterAgentRequest(
                agent=message_pb2.AgentInfo(agent_id="Desk", address="10.0.0.1:7000")
            )
        )
        stream = on_a.Subscribe(
            broker_pb2.SubscribeRequest(agent_id="Desk", instance="10.0.0.1:7000")
        )
        async with connect(b.address, agent_id="watcher", retry=NO_RETRY) as watcher:
            async with asyncio.timeout(10):
                while True:
                    saved = await store.saved_agent("Desk")
                    if saved is not None and saved.subscribed:
                        break
                    await asyncio.sleep(0.05)
            await wait_killed(a)  # (the test's end of the stream is left as a dead host's)
            stream.cancel()
            async with asyncio.timeout(20):
                while True:
                    [desk] = [x for x in await watcher.list_agents() if x.agent_id == "Desk"]
                    if desk.instances == ():
                        break
                    await asyncio.sleep(0.1)
        said = "the instance at 10.0.0.1:7000 is gone (its broker replica"
        async with asyncio.timeout(10):  # (its log is written by a thread of its own)
            while not any(said in line for line in b.output):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        await channel.close()
        await store.close()
        await stop(a)
        await stop(b)


class RouteCountingStore(RedisQueueStore):
    """The Redis store, counting how requests' routes are claimed (on their own, or in the
    pipeline of a put) and the puts each of its put pipelines runs."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.alone = 0
        self.with_put = 0
        self.put_pipelines: list[int] = []

    async def claim_route(self, key: tuple[str, str], ttl: float) -> None:
        self.alone += 1
        await super().claim_route(key, ttl)

    async def _run_many(self, name: str, calls: list[Any], before: list[Any] | None = None) -> Any:
        routes = [c for c in before or () if c[0] == "SET" and c[1].startswith("mesh:route:")]
        self.with_put += len(routes)
        if name == "put":
            self.put_pipelines.append(len(calls))
        return await super()._run_many(name, calls, before)


async def test_a_request_claims_its_route_in_the_round_trip_of_its_put(one_redis: str) -> None:
    """On one Redis, which takes a connection's commands in order, the route of a request
    (which replica waits for its answer) travels in the pipeline of the request's put, before
    it: one round trip where there were two. On a cluster, whose route and queue are on
    different nodes, it is claimed first, on its own. The answer, through the other replica,
    finds its way either way."""
    store = RouteCountingStore(one_redis)
    async with running(replica(one_redis, store=store), replica(one_redis)) as (mine, other):
        await other.register(AgentInfo(agent_id="Worker"))
        sub = await other.subscribe("Worker")
        for n in range(4):
            if n == 1:  # (the first put reserves its place in the count first, on its own)
                store.alone = store.with_put = 0
            asking = asyncio.create_task(
                mine.request(
                    Message(from_agent="Asker", to_agent="Worker", content={"action": f"q{n}"}),
                    timeout=10,
                )
            )
            delivery = await asyncio.wait_for(sub.next(), 5)
            question = delivery.message
            key = ("Asker", question.correlation_id)
            assert await other.store.route_of(key) == store.replica_id
            await other.send(
                Message(
                    from_agent="Worker",
                    to_agent="Asker",
                    message_type=MessageType.RESPONSE,
                    correlation_id=question.correlation_id,
                    content={"action": f"q{n}", "n": n},
                )
            )
            answer = await asyncio.wait_for(asking, 5)
            assert answer.content["n"] == n
        cluster = store.cluster
        assert (store.alone, store.with_put) == ((3, 0) if cluster else (0, 3))
        await sub.close()


async def test_the_copies_of_a_broadcast_or_a_gather_go_to_redis_in_one_pipeline(
    one_redis: str,
) -> None:
    """A broadcast to five agents, and a gather from three, put their copies in one
    pipeline (on a cluster, one per node, side by side): one round trip where each copy took
    one of its own, one after the other."""
    store = RouteCountingStore(one_redis)
    async with running(replica(one_redis, store=store), replica(one_redis)) as (mine, other):
        workers = [f"Worker{n}" for n in range(5)]
        subs = []
        for agent_id in workers:
            await other.register(AgentInfo(agent_id=agent_id, agent_types=("worker",)))
            subs.append(await other.subscribe(agent_id))
        await mine.send(Message(from_agent="S", to_agent="Worker0", content={"action": "warm"}))
        await asyncio.wait_for(subs[0].next(), 5)
        for _ in range(500):  # (this replica hears of the other's registrations, soon)
            if len(mine.registry.of_types(["worker"])) == len(workers):
                break
            await asyncio.sleep(0.02)
        store.put_pipelines.clear()

        sent = await mine.broadcast(
            Message(from_agent="S", to_agent="broadcast", content={"action": "notice"}),
            agent_types=["worker"],
        )
        assert sorted(sent.recipients) == workers
        for sub in subs:
            assert (await asyncio.wait_for(sub.next(), 5)).message.action == "notice"
        assert store.put_pipelines == [5]

        store.put_pipelines.clear()
        asked = workers[:3]
        gathering = mine.gather(
            Message(from_agent="S", to_agent="broadcast", content={"action": "vote"}),
            agent_ids=asked,
            timeout=10,
        )
        first = asyncio.create_task(anext(gathering))
        for sub in subs[:3]:
            question = (await asyncio.wait_for(sub.next(), 5)).message
            await other.send(
                Message(
                    from_agent=question.to_agent,
                    to_agent="S",
                    message_type=MessageType.RESPONSE,
                    correlation_id=question.correlation_id,
                    content={"action": "vote", "yes": True},
                )
            )
        items = [await asyncio.wait_for(first, 5)]
        items += [item async for item in gathering]
        assert sorted(item.agent_id for item in items) == asked
        assert all(item.response is not None for item in items)
        assert store.put_pipelines == [3]
        for sub in subs:
            await sub.close()


async def test_a_requester_on_one_replica_hears_at_once_of_its_request_dead_lettered_on_another(
    one_redis: str,
) -> None:
    """The agent's subscriber is on replica B; the request, and a gather, wait on replica A.
    B dead-letters the message (the agent rejects it, or hands it back on its last attempt):
    A's requester hears so at once, as one on B would, not at its deadline."""
    async with running(replica(one_redis), replica(one_redis)) as (a, b):
        await b.register(AgentInfo(agent_id="Worker", agent_types=("worker",)))
        sub = await b.subscribe("Worker")

        async def refuse() -> None:
            while True:
                delivery = await sub.next()
                if delivery.message.action == "reject":
                    await b.nack("Worker", [delivery.message.message_id], dead_letter_reason="no")
                else:  # handed back until its attempts are spent
                    await b.nack("Worker", [delivery.message.message_id])

        refusing = asyncio.create_task(refuse())
        try:
            for action, why in (("reject", "(no)"), ("work", "(nacked after 4 delivery attempts)")):
                asking = a.request(
                    Message(from_agent="Asker", to_agent="Worker", content={"action": action}),
                    timeout=60,
                )
                answer = await asyncio.wait_for(asking, 10)  # (before: the 60 s deadline)
                assert answer.message_type.value == "ERROR"
                assert answer.content["reason"] == "DEAD_LETTERED"
                assert answer.content["error"].endswith(f"dead-lettered {why}")
            gathering = a.gather(
                Message(from_agent="Asker", to_agent="broadcast", content={"action": "reject"}),
                agent_types=["worker"],
                timeout=60,
            )
            [item] = await asyncio.wait_for(_all(gathering), 10)
            assert item.response is not None and item.response.content["reason"] == "DEAD_LETTERED"
        finally:
            refusing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refusing
            await sub.close()


async def test_a_request_that_expires_in_a_queue_shared_by_replicas_is_timed_out_then(
    one_redis: str,
) -> None:
    """The agent is registered through replica B and nobody consumes its queue; a request
    and a gather with a ttl of 1 s wait on replica A, with a deadline of 60 s: whichever
    replica finds the copy expired, A's requester is timed out as the ttl ends."""
    async with running(replica(one_redis), replica(one_redis)) as (a, b):
        await b.register(AgentInfo(agent_id="Worker", agent_types=("worker",)))
        asking = a.request(
            Message(from_agent="Asker", to_agent="Worker", content={"action": "x"}, ttl=1),
            timeout=60,
        )
        with pytest.raises(RequestTimeoutError, match=r"Worker did not take request .* ttl of 1 s"):
            await asyncio.wait_for(asking, 10)  # (before: the 60 s deadline)
        gathering = a.gather(
            Message(from_agent="Asker", to_agent="broadcast", content={"action": "x"}, ttl=1),
            agent_types=["worker"],
            timeout=60,
        )
        [item] = await asyncio.wait_for(_all(gathering), 10)
        assert isinstance(item.error, RequestTimeoutError) and item.agent_id == "Worker"


async def _all(items: Any) -> list[Any]:
    return [item async for item in items]


async def test_a_pushed_agent_deregistered_through_the_other_replica_is_told(
    replicas: tuple[Proc, Proc, str],
) -> None:
    """Registered for push through one replica, deregistered through the other: the one that
    took the deregistration finds the agent's pushed instances in the store and tells them."""
    a, b, _ = replicas

    @agent("ReplicaDesk")
    async def desk(message: Message, ctx: AgentContext) -> dict[str, str]:
        return {"served": "yes"}

    served = await serve(desk, a.address, delivery_mode="push")
    try:
        async with (
            connect(b.address, agent_id="admin", retry=NO_RETRY) as admin,
            watching(served.address, AGENT_SERVICE) as readiness,
        ):
            answer = await admin.request("ReplicaDesk", {"action": "ask"}, timeout=10)
            assert answer.content["served"] == "yes"
            assert await readiness.until(SERVING) == [SERVING]
            await admin.deregister("ReplicaDesk")
            assert await readiness.until(NOT_SERVING) == [NOT_SERVING]
            assert "ReplicaDesk" not in [x.agent_id for x in await admin.list_agents()]
    finally:
        await served.stop()


async def test_senders_on_two_replicas_filling_the_broker_wide_limit_hear_it_told_true(
    redis_url: str,
) -> None:
    """Sixteen senders on two replicas fill eight queues past the broker-wide limit (40): the
    store holds exactly 40, and every refusal says the brokers hold 40 of their 40. Before,
    the count a refusal quoted included places the other replica had reserved a moment
    before, for puts of its own that it was refused then: "hold 54 of their 40"."""
    config = BrokerConfig(store=redis_url, max_total_messages=40)
    _, a = await serve_broker(broker_config=config)
    _, b = await serve_broker(broker_config=config)
    said: list[str] = []

    async def sender(address: str, n: int) -> None:
        async with connect(address, agent_id=f"sender{n}", retry=NO_RETRY) as client:
            for _ in range(30):
                try:
                    await client.send(f"Full{n % 8}", {"action": "fill"})
                except MessageQueueFullError as error:
                    said.append(error.message)

    try:
        async with connect(a.address, agent_id="admin", retry=NO_RETRY) as admin:
            for n in range(8):
                await admin.register(f"Full{n}")
            await asyncio.gather(*(sender((a, b)[n % 2].address, n) for n in range(16)))
            stats = await admin.queue_stats()
            assert sum(s.depth for s in stats.agents) == 40
        assert len(said) == 16 * 30 - 40
        assert {re.sub(r"^Full\d", "Full", m) for m in said} == {
            "Full queue full: the brokers hold 40 of their 40 messages"
        }
    finally:
        await a.stop(0)
        await b.stop(0)

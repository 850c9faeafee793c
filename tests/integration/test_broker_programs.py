"""Random programs of client calls, through a broker on each store side by side.

Hypothesis writes programs of what clients do over gRPC: sends one at a time and many at
once on one session (ids sent again, as retries are; every priority), SendMessages batches,
receives, queue statistics, broadcasts to every agent or to one type, agents leaving and
coming back, hand-offs of a workflow, its ending and its status, subscriptions that take
what is waiting and ack, nack, reject or keep each delivery, dead letters listed and
requeued, insights written, read and deleted, shared state written (at a version or blind),
deleted and listed. A broker on the in-memory store and one on SQLite, Redis (alone, or two
replicas sharing it, each call to either) or a Redis Cluster run each program (the second
stopped and started again now and then: its store keeps it all), and every answer (what was
accepted, refused and why, what each agent received and in which order, the queue counts)
must be the same: a client cannot tell the stores apart. Capacities are small so that
programs fill them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mesh import LocalMesh, Message, connect
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.core.errors import MultiAgentCommunicationError
from mesh.core.model import Priority
from tests.helpers.programs import flush_mesh_keys, programs_settings

AGENTS = {"a": "worker", "b": "worker", "c": "auditor"}
IDS = tuple(f"m{i}" for i in range(6))
LIMITS: dict[str, Any] = {"max_messages_per_agent": 4, "max_total_messages": 7}

targets = st.sampled_from(["a", "a", "b", "c", "nobody"])
one = st.tuples(targets, st.sampled_from(IDS))
sends = st.one_of(
    st.tuples(st.just("send"), one),
    st.tuples(st.just("parallel"), st.lists(one, min_size=2, max_size=6)),
)
operations = st.one_of(  # (sends more often than the rest: the queues fill)
    sends,
    sends,
    sends,
    sends,
    st.tuples(st.just("batch"), st.lists(one, min_size=1, max_size=6)),
    st.tuples(st.just("receive"), st.sampled_from(list(AGENTS)), st.integers(0, 3)),
    st.tuples(st.just("stats")),
    st.tuples(st.just("broadcast"), st.sampled_from([(), ("worker",), ("auditor",)])),
    st.tuples(st.just("deregister"), st.sampled_from(list(AGENTS))),
    st.tuples(  # (what its senders' content must carry: a hand-off's has no "deadline")
        st.just("register"),
        st.sampled_from(list(AGENTS)),
        st.sampled_from([(), ("parameters",), ("deadline",)]),
    ),
    st.tuples(st.just("handoff"), targets, st.integers(1, 3)),
    st.tuples(st.just("end"), st.sampled_from(["COMPLETED", "FAILED"])),
    st.tuples(st.just("workflow")),
    st.tuples(
        st.just("take"),
        st.sampled_from(list(AGENTS)),
        st.lists(st.sampled_from(["ack", "nack", "reject", "keep"]), min_size=1, max_size=3),
    ),
    st.tuples(st.just("take"), st.sampled_from(list(AGENTS)), st.just(["ack", "ack", "ack"])),
    st.tuples(st.just("dead_letters")),
    st.tuples(st.just("insight"), st.sampled_from(["fares", "hotels"]), st.integers(0, 9)),
    st.tuples(st.just("insights"), st.sampled_from(["fares", "hotels"])),
    st.tuples(st.just("forget"), st.sampled_from(["fares", "hotels"])),
    st.tuples(
        st.just("put_state"),
        st.sampled_from(["plan/a", "plan/b", "other"]),
        st.integers(0, 9),
        st.sampled_from([None, 0, 1, 2]),
    ),
    st.tuples(st.just("delete_state"), st.sampled_from(["plan/a", "plan/b", "other"])),
    st.tuples(st.just("list_state"), st.sampled_from(["", "plan/"])),
    st.tuples(st.just("requeue"), st.sampled_from(list(AGENTS))),
)
programs = st.lists(operations, min_size=8, max_size=30)
restarting = st.lists(  # (a durable store's broker is also stopped and started again)
    st.one_of(*[operations] * 8, st.just(("restart",))), min_size=8, max_size=30
)


def message(to: str, mid: str, number: int) -> Message:
    """A message sent again has the same id and priority (what a client's retry sends)."""
    return Message(
        message_id=mid,
        from_agent="sender",
        to_agent=to,
        content={"action": "work", "parameters": {"n": number}},
        priority=list(Priority)[(ord(to[0]) + IDS.index(mid)) % 3],
    )


def outcome(result: Any) -> Any:
    if isinstance(result, MultiAgentCommunicationError):
        return (type(result).__name__, result.reason)
    assert isinstance(result, Message)
    return ("accepted", result.message_id)


def received(m: Message) -> tuple[Any, ...]:
    """What a receiver can compare: broadcast copies and hand-offs have ids of their own."""
    named = m.message_id if m.message_id in IDS else m.message_type.value
    return (named, m.from_agent, m.priority.value, dict(m.content))


async def take(client: Any, agent_id: str, verdicts: list[str]) -> list[Any]:
    """Subscribes as the agent, takes as many deliveries as there are verdicts (or as are
    waiting), acks, nacks, rejects or keeps each as told, and leaves (what it kept goes back);
    the deliveries, in the order they came."""
    [queue] = [q for q in (await client.queue_stats(agent_id)).agents if q.agent_id == agent_id]
    want = min(len(verdicts), queue.depth)
    if not want:
        return []
    subscription = await client.subscribe(
        agent_id, max_in_flight=len(verdicts), reconnect=False
    ).start()
    got = []
    try:
        async with asyncio.timeout(10):
            async for delivery in subscription:
                got.append((received(delivery.message), delivery.attempt))
                verdict = verdicts[len(got) - 1]
                if verdict == "ack":
                    await delivery.ack()
                elif verdict == "nack":
                    await delivery.nack()
                elif verdict == "reject":
                    await delivery.reject("poison")
                if len(got) == want:
                    break
    finally:
        await subscription.close()
    return got


def status(value: Any) -> Any:
    """A workflow's status, but for its times and the hand-off's message id (any other
    value as it is)."""
    if not isinstance(value, dict):
        return value
    return {
        k: v
        for k, v in value.items()
        if k not in ("handed_off_at", "finished_at", "message_id", "updated_at")
    }


class Broker:
    """A broker for a program, or several replicas of one sharing its store (each call goes
    to one of them, as ``turns`` says): their addresses, and what a restart does (by
    default nothing: a broker in memory keeps what it holds only while it runs)."""

    def __init__(
        self,
        config: BrokerConfig,
        *,
        restarts: bool = False,
        replicas: int = 1,
        turns: random.Random | None = None,
    ) -> None:
        self.config, self.restarts, self.replicas = config, restarts, replicas
        self.turns = turns or random.Random(0)
        self.meshes: list[LocalMesh] = []

    async def start(self) -> list[str]:
        self.meshes = [await LocalMesh(self.config).start() for _ in range(self.replicas)]
        return [mesh.address for mesh in self.meshes]

    async def restart(self) -> list[str]:
        if self.restarts:
            await self.stop()
            return await self.start()
        return [mesh.address for mesh in self.meshes]

    def turn(self) -> int:
        return self.turns.randrange(self.replicas)

    async def heard(self, clients: list[Any], agent_id: str, required: Any = None) -> None:
        """Waits for every replica to have heard that the agent registered (requiring
        ``required``) or, with ``required`` None, left: a change made through one replica
        holds through the others once they hear of it, a moment later (the client that
        made it is told before they do)."""
        if self.replicas == 1:
            return

        def holds(agents: list[Any]) -> bool:
            found = [a for a in agents if a.agent_id == agent_id]
            if required is None:
                return not found
            return bool(found) and found[0].required_fields == tuple(required)

        async with asyncio.timeout(10):
            for client in clients:
                while not holds(await client.list_agents()):  # noqa: ASYNC110
                    await asyncio.sleep(0.005)

    async def stop(self) -> None:
        for mesh in self.meshes:
            await mesh.stop()


async def run(program: list[tuple[Any, ...]], broker: Broker) -> list[Any]:
    """Runs the program against the broker; what its clients saw, step by step."""
    seen: list[Any] = []

    async def connected(stack: contextlib.AsyncExitStack, addresses: list[str]) -> list[Any]:
        return [
            await stack.enter_async_context(connect(a, agent_id="sender", retry=NO_RETRY))
            for a in addresses
        ]

    async with contextlib.AsyncExitStack() as stack:
        clients = await connected(stack, await broker.start())
        client = clients[0]
        for agent_id, agent_type in AGENTS.items():
            await client.register(agent_id, agent_types=[agent_type])
        await client.register("sender", agent_types=["sender"])
        for agent_id in [*AGENTS, "sender"]:
            await broker.heard(clients, agent_id, ())
        for number, (kind, *args) in enumerate(program):
            client = clients[broker.turn()]
            try:
                if kind == "restart":
                    await stack.aclose()
                    clients = await connected(stack, await broker.restart())
                    seen.append("restarted")
                elif kind == "send":
                    seen.append(outcome(await client.send_message(message(*args[0], number))))
                elif kind == "parallel":  # one session: its frames in the order written
                    results = await client.send_parallel(
                        [message(*m, number) for m in args[0]], return_exceptions=True
                    )
                    seen.append([outcome(r) for r in results])
                elif kind == "batch":
                    results = await client.send_batch([message(*m, number) for m in args[0]])
                    seen.append([outcome(r) for r in results])
                elif kind == "receive":
                    got = await client.receive(args[0], args[1])
                    seen.append([received(m) for m in got])
                elif kind == "stats":
                    report = await client.queue_stats()
                    seen.append(
                        sorted(
                            (
                                q.agent_id,
                                q.high,
                                q.medium,
                                q.low,
                                q.in_flight,
                                q.deferred,
                                q.dead_letters,
                            )
                            for q in report.agents
                            if q.depth or q.in_flight or q.deferred or q.dead_letters
                        )
                    )
                elif kind == "take":
                    seen.append(await take(client, args[0], args[1]))
                elif kind == "dead_letters":
                    seen.append(
                        sorted(
                            (
                                (d.message.to_agent, received(d.message), d.reason, d.attempts)
                                for d in await client.dead_letters()
                            ),
                            key=repr,
                        )
                    )
                elif kind == "insight":
                    await client.write_insight({"n": args[1]}, tags=[args[0]], importance=0.5)
                    seen.append("written")
                elif kind == "insights":
                    seen.append([i.content for i in await client.read_insights(tags=[args[0]])])
                elif kind == "forget":
                    seen.append(await client.delete_insights(tags=[args[0]]))
                elif kind == "put_state":
                    entry = await client.put_state(args[0], args[1], expected_version=args[2])
                    seen.append((entry.key, entry.value, entry.version))
                elif kind == "delete_state":
                    await client.delete_state(args[0])
                    seen.append("deleted")
                elif kind == "list_state":
                    seen.append(
                        [
                            (e.key, status(e.value), e.version, e.updated_by)
                            async for e in client.state_entries(args[0])
                        ]
                    )
                elif kind == "requeue":
                    requeued = await client.requeue_dead_letters(args[0])
                    seen.append((requeued.requeued, requeued.left))
                elif kind == "deregister":
                    await client.deregister(args[0])
                    await broker.heard(clients, args[0])
                    seen.append("deregistered")
                elif kind == "register":
                    await client.register(
                        args[0], agent_types=[AGENTS[args[0]]], required_fields=args[1]
                    )
                    await broker.heard(clients, args[0], args[1])
                    seen.append("registered")
                elif kind == "handoff":
                    sent = await client.handoff(
                        args[0], f"step {args[1]}", workflow_id="w1", step_number=args[1]
                    )
                    seen.append(("accepted", sent.to_agent))
                elif kind == "end":
                    ending = await client.end_workflow("w1", args[0])
                    seen.append(None if ending is None else status(ending.value))
                elif kind == "workflow":
                    entry = await client.get_state("workflow/w1")
                    seen.append(None if entry is None else status(entry.value))
                else:
                    result = await client.broadcast(
                        {"action": "notice", "parameters": {"n": number}}, agent_types=args[0]
                    )
                    seen.append((sorted(result.recipients), sorted(f[0] for f in result.failures)))
            except MultiAgentCommunicationError as error:
                seen.append(outcome(error))
    return seen


async def compare(program: list[tuple[Any, ...]], store: str) -> None:
    """Runs the program on a broker in memory and on one on ``store`` (restarted where the
    program says), and compares what their clients saw."""
    await compare_with(program, Broker(BrokerConfig(store=store, **LIMITS), restarts=True))


async def compare_with(program: list[tuple[Any, ...]], other: Broker) -> None:
    reference = Broker(BrokerConfig(**LIMITS))
    try:
        expected = await run(program, reference)
        got = await run(program, other)
    finally:
        for broker in (reference, other):
            await broker.stop()
    for number, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"step {number} {program[number]} of {program}: {have} != {want}"


FUZZ = programs_settings(60)


@FUZZ
@given(program=restarting)
def test_a_broker_on_sqlite_answers_clients_as_one_in_memory_does(
    program: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    path = tmp_path / f"queues-{secrets.token_hex(6)}.db"
    asyncio.run(compare(program, f"sqlite:///{path}"))


@FUZZ
@given(program=restarting)
def test_a_broker_on_redis_answers_clients_as_one_in_memory_does(
    program: list[tuple[Any, ...]], redis_server: str
) -> None:
    flush_mesh_keys(redis_server)
    asyncio.run(compare(program, redis_server))


@FUZZ
@given(program=restarting, seed=st.integers(0, 2**32))
def test_two_broker_replicas_on_one_redis_answer_clients_as_one_broker_does(
    program: list[tuple[Any, ...]], seed: int, redis_server: str
) -> None:
    """Each call reaches one of two replicas sharing the Redis, as a client's calls behind
    a load balancer do."""
    flush_mesh_keys(redis_server)
    other = Broker(
        BrokerConfig(store=redis_server, **LIMITS),
        restarts=True,
        replicas=2,
        turns=random.Random(seed),
    )
    asyncio.run(compare_with(program, other))


@programs_settings(30)
@given(program=restarting)
def test_a_broker_on_a_redis_cluster_answers_clients_as_one_in_memory_does(
    program: list[tuple[Any, ...]], local_redis_cluster: Any
) -> None:
    local_redis_cluster.flush()
    asyncio.run(compare(program, local_redis_cluster.urls[0]))

"""A durable broker under consumers that misbehave at random, killed and restarted mid-way.

Three consumers share one agent's queue and, for each delivery, ack it, nack it, reject it
(dead-letter at once), let its lease lapse, or drop the whole subscription with what it
holds; senders send one by one and in batches, in every priority; the broker is SIGKILLed
half-way and started again on its store. What must hold at the end: the queue drains (no
consumer is left hanging on a stream), and every message whose send was acknowledged was
acknowledged by a consumer or is in the dead-letter queue with a reason that says why.
(Written after such a run found a stream that died without a status when a subscription
ended in the middle of a write.)
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

import pytest

from mesh import MeshError, Message, Priority, connect
from tests.helpers.processes import BROKER_READY, free_port, start, stop, wait_killed

pytestmark = pytest.mark.processes

MESSAGES = 800
REASON = "the consumer cannot process it"


async def test_nothing_accepted_is_lost_under_misbehaving_consumers_and_a_crash(
    tmp_path: Path,
) -> None:
    rng = random.Random(20261123)
    port = free_port()
    address = f"127.0.0.1:{port}"
    args = ("broker", "--port", str(port), "--store", f"sqlite://{tmp_path / 'q.db'}")
    args += ("--sweep-interval", "0.05")
    broker = await start(*args, ready=BROKER_READY)
    accepted: set[str] = set()
    acked: set[str] = set()
    stopping = asyncio.Event()

    async def consumer(name: str) -> None:
        async with connect(address, agent_id=name) as client:
            while not stopping.is_set():
                try:
                    sub = client.subscribe("Worker", max_in_flight=8, lease_seconds=1)
                    async with sub:
                        async for delivery in sub:
                            choice = rng.random()
                            if choice < 0.70:
                                await delivery.ack()
                                acked.add(delivery.message.message_id)
                            elif choice < 0.80:
                                await delivery.nack()
                            elif choice < 0.85:
                                await delivery.reject(REASON)
                            elif choice < 0.95:
                                pass  # its lease lapses and it comes back
                            else:
                                break  # drops the subscription with what it holds
                except MeshError:
                    await asyncio.sleep(0.1)  # the broker is away; subscribe again

    async with connect(address, agent_id="Sender") as sender:
        await sender.register("Worker")
        consumers = [asyncio.create_task(consumer(f"Consumer{i}")) for i in range(3)]
        sent, restarted = 0, False
        while sent < MESSAGES:
            if not restarted and sent >= MESSAGES // 2:
                await wait_killed(broker)
                broker = await start(*args, ready=BROKER_READY)
                restarted = True
            priority = rng.choice(list(Priority))
            try:
                if rng.random() < 0.3:
                    batch = [
                        Message(
                            from_agent="Sender",
                            to_agent="Worker",
                            content={"action": "work", "i": sent + k},
                            priority=priority,
                            ttl=3600,
                        )
                        for k in range(10)
                    ]
                    results = await sender.send_batch(batch)
                    pairs = zip(batch, results, strict=True)
                    accepted |= {m.message_id for m, result in pairs if result is m}
                    sent += len(batch)
                else:
                    message = await sender.send("Worker", {"action": "work"}, priority=priority)
                    accepted.add(message.message_id)
                    sent += 1
            except MeshError:
                await asyncio.sleep(0.05)  # refused while the broker restarts: not accepted
        assert restarted and len(accepted) > MESSAGES // 2

        async with asyncio.timeout(60):
            while True:
                [queue] = (await sender.queue_stats("Worker")).agents
                if queue.depth + queue.in_flight == 0:
                    break
                await asyncio.sleep(0.1)
        stopping.set()
        dead = {d.message.message_id: d for d in await sender.dead_letters("Worker")}
        held = (await sender.queue_stats()).totals["held"]
    for task in consumers:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert await stop(broker) == 0

    lost = accepted - acked - set(dead)
    assert not lost, f"{len(lost)} accepted messages neither acknowledged nor dead-lettered"
    assert held == 0
    reasons = {d.reason.split(" after ")[0] for d in dead.values()}
    assert REASON in reasons
    assert reasons <= {REASON, "nacked", "lease expired", "subscriber left"}

"""Crashes: a durable broker killed with SIGKILL under traffic, an agent killed holding leases.

What is promised: every message whose send was acknowledged is delivered after the restart
(duplicates only as redeliveries of the same message_id); a dead agent's leased messages go
to its next instance; requests in flight end with a clear status instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from pathlib import Path

import pytest

from mesh import BrokerUnavailableError, MeshError, Priority, connect
from mesh.client import NO_RETRY, MeshClient
from tests.helpers.processes import BROKER_READY, Proc, free_port, start, stop, wait_killed

pytestmark = pytest.mark.processes

PRIORITIES = (Priority.HIGH, Priority.MEDIUM, Priority.LOW)


async def start_durable_broker(port: int, db: Path) -> Proc:
    return await start(
        "broker", "--port", str(port), "--store", f"sqlite://{db}", ready=BROKER_READY
    )


async def test_sigkilled_durable_broker_delivers_every_acknowledged_message(
    tmp_path: Path,
) -> None:
    port = free_port()
    db = tmp_path / "queues.db"
    broker = await start_durable_broker(port, db)
    address = f"127.0.0.1:{port}"
    acknowledged: set[str] = set()
    received: list[str] = []
    sink_ready = asyncio.Event()
    enough = asyncio.Event()

    async def sender(n: int) -> None:
        async with connect(address, agent_id=f"sender{n}", retry=NO_RETRY) as client:
            for i in itertools.count():
                message_id = f"s{n}-{i}"
                try:
                    await client.send(
                        "Sink",
                        {"action": "record", "parameters": {"i": i}},
                        message_id=message_id,
                        priority=PRIORITIES[i % 3],
                    )
                except MeshError:
                    return  # the broker is gone: what was acknowledged must survive
                acknowledged.add(message_id)
                if len(acknowledged) >= 300:
                    enough.set()

    async def consumer() -> None:
        """Acks half of what it takes, so the crash finds acked, leased and waiting messages."""
        async with connect(address, agent_id="Sink", retry=NO_RETRY) as client:
            sub = client.subscribe("Sink", max_in_flight=8, reconnect=False)
            await sub.start()
            sink_ready.set()
            with contextlib.suppress(MeshError):
                async for delivery in sub:
                    received.append(delivery.message.message_id)
                    if len(received) % 2:
                        await delivery.ack()

    async with connect(address, retry=NO_RETRY) as admin:
        await admin.register("Sink")
        await admin.register("Silent")
    consuming = asyncio.create_task(consumer())
    await sink_ready.wait()

    async def in_flight_request() -> BaseException | None:
        async with connect(address, agent_id="asker", retry=NO_RETRY) as client:
            try:
                await client.request("Silent", {"action": "never_answered"}, timeout=30)
            except MeshError as error:
                return error
        return None

    asking = asyncio.create_task(in_flight_request())
    senders = [asyncio.create_task(sender(n)) for n in range(4)]
    await asyncio.wait_for(enough.wait(), 30)
    await wait_killed(broker)
    await asyncio.gather(*senders)
    # The request in flight ended with a clear status when the broker died, long before its
    # 30-second deadline.
    failure = await asyncio.wait_for(asking, 5)
    assert isinstance(failure, BrokerUnavailableError)
    consuming.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await consuming
    before_crash = len(received)

    broker = await start_durable_broker(port, db)
    try:
        async with connect(address, agent_id="Sink", retry=NO_RETRY) as client:
            # The registration survived the restart too: no need to register again.
            assert "Sink" in [a.agent_id for a in await client.list_agents()]
            while batch := await client.receive("Sink"):
                received.extend(m.message_id for m in batch)
    finally:
        assert await stop(broker) == 0

    assert acknowledged, "no send was acknowledged before the crash"
    missing = acknowledged - set(received)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
    # Everything delivered was sent; repeats are redeliveries of the same ids.
    sent_ids = {f"s{n}-{i}" for n in range(4) for i in range(len(acknowledged) + 10)}
    assert set(received) <= sent_ids
    assert before_crash > 0 and len(received) > before_crash


async def in_flight(client: MeshClient, agent_id: str) -> int:
    stats = (await client.queue_stats(agent_id)).for_agent(agent_id)
    return stats.in_flight if stats else 0


async def test_leases_of_a_sigkilled_agent_go_to_its_next_instance(tmp_path: Path) -> None:
    broker = await start("broker", "--port", "0", ready=BROKER_READY)
    try:
        agent = await start(
            "agent",
            "tests.helpers.process_agents:Stuck",
            "--broker",
            broker.address,
            "--max-in-flight",
            "3",
            ready=r"serving on (\S+)",
        )
        async with connect(broker.address, agent_id="client", retry=NO_RETRY) as client:
            ids = [
                (
                    await client.send("StuckAgent", {"action": "work", "parameters": {"n": n}})
                ).message_id
                for n in range(5)
            ]
            async with asyncio.timeout(10):
                while (await in_flight(client, "StuckAgent")) < 3:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            await wait_killed(agent)
            # The replacement: the same agent id, subscribed again.
            sub = client.subscribe("StuckAgent", max_in_flight=10)
            got: dict[str, int] = {}
            async with asyncio.timeout(10):
                async for delivery in sub:
                    got[delivery.message.message_id] = delivery.attempt
                    await delivery.ack()
                    if len(got) == 5:
                        break
            await sub.close()
        assert sorted(got) == sorted(ids)
        # Three were leased by the dead instance: this is their second delivery.
        assert sorted(got.values()) == [1, 1, 2, 2, 2]
    finally:
        await stop(broker)


async def test_agents_and_subscriptions_reconnect_by_themselves_after_a_broker_restart(
    tmp_path: Path,
) -> None:
    port = free_port()
    db = tmp_path / "queues.db"
    broker = await start_durable_broker(port, db)
    address = f"127.0.0.1:{port}"
    # Two agents in one process, sharing one stream to the broker.
    agent = await start(
        "agent",
        "tests.helpers.process_agents:payment_desk",
        "--broker",
        address,
        ready=r"BackupPaymentAgent serving on (\S+)",
    )
    try:
        async with connect(address, agent_id="Listener") as client:
            await client.register("Listener", agent_types=("audit",))
            sub = client.subscribe("Listener")
            await sub.start()
            first = await client.request(
                "PaymentAgent", {"action": "process_payment", "parameters": {"amount": 1}}
            )
            await client.send("Listener", {"action": "note", "parameters": {"n": 1}})
            notes = aiter(sub)
            got = await asyncio.wait_for(anext(notes), 5)
            await got.ack()

            await wait_killed(broker)
            broker = await start_durable_broker(port, db)

            # The same subscription iterator goes on after the restart, and the agent process
            # is back in service, without anyone calling them again.
            await client.send("Listener", {"action": "note", "parameters": {"n": 2}})
            again = await asyncio.wait_for(anext(notes), 15)
            if again.message.message_id == got.message.message_id:
                # Its ack was not on disk yet when the broker died: delivered once more, with
                # the same id (its attempt count too may predate the crash).
                await again.ack()
                again = await asyncio.wait_for(anext(notes), 5)
            assert again.message.parameters == {"n": 2}
            await again.ack()
            assert sub.reconnects == 1
            async with asyncio.timeout(15):
                while True:
                    try:
                        second = await client.request(
                            "PaymentAgent",
                            {"action": "process_payment", "parameters": {"amount": 2}},
                            timeout=1,
                        )
                        break
                    except MeshError:
                        await asyncio.sleep(0.1)
            assert second.content["pid"] == first.content["pid"] == agent.process.pid
            backup = await client.request(
                "BackupPaymentAgent",
                {"action": "process_payment", "parameters": {"amount": 3}},
                timeout=15,
            )
            assert backup.content["pid"] == agent.process.pid
            await sub.close()
    finally:
        await stop(agent)
        await stop(broker)


async def test_shared_state_and_memory_of_a_sigkilled_durable_broker_survive(
    tmp_path: Path,
) -> None:
    """On SQLite the shared state (a workflow's status among it) and the memory pool are kept
    with the queues: what a write was acknowledged for is there after SIGKILL and a restart,
    at its version; what was deleted or lapsed stays gone; a lock does not outlive the
    broker; new insights go on from the last one's number."""
    port = free_port()
    db = tmp_path / "queues.db"
    address = f"127.0.0.1:{port}"
    broker = await start_durable_broker(port, db)
    try:
        async with connect(address, agent_id="Planner", retry=NO_RETRY) as client:
            await client.register("Planner")
            await client.register("Booker")
            await client.put_state("plan/trip", {"city": "Lisbon"})
            second = await client.put_state("plan/trip", {"city": "Porto"}, expected_version=1)
            await client.put_state("plan/gone", 1)
            await client.delete_state("plan/gone")
            await client.put_state("plan/short", "brief", ttl=0.5)
            await client.put_state("plan/kept", [1, 2], ttl=3600)
            await client.lock_state("plan/kept")
            await client.handoff("Booker", "book it", workflow_id="trip-1", step_number=2)
            kept = await client.write_insight({"fare": 120}, tags=["fares"], importance=0.9)
            dropped = await client.write_insight({"fare": 999}, tags=["fares"])
            await client.delete_insights(insight_ids=[dropped.insight_id])
            await client.write_insight({"fare": 1}, tags=["brief"], ttl=0.5)
        await wait_killed(broker)
        await asyncio.sleep(0.6)  # the short-lived ones lapse meanwhile
        broker = await start_durable_broker(port, db)
        async with connect(address, agent_id="Planner", retry=NO_RETRY) as client:
            trip = await client.get_state("plan/trip")
            assert trip is not None
            assert (trip.value, trip.version, trip.updated_by) == ({"city": "Porto"}, 2, "Planner")
            assert trip.updated_at == second.updated_at
            assert await client.get_state("plan/gone") is None
            assert await client.get_state("plan/short") is None
            assert (await client.get_state("plan/kept")).value == [1, 2]  # type: ignore[union-attr]
            await client.put_state("plan/kept", [3], agent_id="Planner")  # the lock went
            status = await client.get_state("workflow/trip-1")
            assert status is not None and status.value["step"] == 2  # type: ignore[index]
            fares = await client.read_insights(tags=["fares"])
            assert [(i.insight_id, i.content) for i in fares] == [(kept.insight_id, {"fare": 120})]
            assert await client.read_insights(tags=["brief"]) == []
            newer = await client.write_insight({"fare": 80}, tags=["fares"])
            assert newer.insight_id not in (kept.insight_id, dropped.insight_id)
    finally:
        await stop(broker)


async def test_a_new_client_reaches_a_restarted_broker_while_an_older_one_waits_to_reconnect() -> (
    None
):
    """Each client has its own connection: a client made once the broker is back is not held
    to the reconnect backoff of an older client of the process to the same address (through
    gRPC's process-wide pool its first call failed at once with "connection refused")."""
    from mesh.config import ServerConfig
    from mesh.server import serve_broker

    port = free_port()
    _, server = await serve_broker(server_config=ServerConfig(host="127.0.0.1", port=port))
    address = server.address
    async with connect(address, agent_id="Older", retry=NO_RETRY) as older:
        await older.register("Older")
        await server.stop(0)
        with pytest.raises(BrokerUnavailableError):
            await older.register("Older")
        await asyncio.sleep(1.0)  # (the older client's connection backs off meanwhile)
        _, server = await serve_broker(server_config=ServerConfig(host="127.0.0.1", port=port))
        try:
            for n in range(3):
                async with connect(address, agent_id=f"New{n}", retry=NO_RETRY) as new:
                    assert (await new.register(f"New{n}")).agent_id == f"New{n}"
        finally:
            await server.stop(0)

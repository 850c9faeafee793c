"""An agent deregistered while it is subscribed (`agentmesh deregister`, a DeregisterAgent of
an operator's): its open subscriptions end and say why (NOT_FOUND, reason
AGENT_DEREGISTERED), what they held goes back to its queue, and an SDK agent stops taking
messages and says so on its readiness, rather than registering itself again. Before, the
subscriptions stayed open on an agent nobody could send to, and its process went on reporting
that it served."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from mesh import (
    AgentContext,
    AgentNotFoundError,
    Message,
    MessageType,
    RequestTimeoutError,
    agent,
    serve,
    serve_all,
)
from mesh.agent import AGENT_SERVICE, AGENTS_SERVICE
from mesh.client import GatherResult, MeshClient
from mesh.config import BrokerConfig
from mesh.core.model import JSON
from mesh.testing import LocalMesh
from mesh.v1 import broker_pb2, broker_pb2_grpc
from tests.helpers.health import NOT_SERVING, SERVING, health_of, watching
from tests.helpers.stores import store_url


@pytest.fixture(params=["memory", "sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return store_url(request.param, request, tmp_path)


def _reason(error: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    [reason] = [info.reason for d in status.details if d.Unpack(info)]
    return reason


async def test_deregistering_an_agent_ends_its_subscriptions_and_keeps_what_they_held(
    store: str,
) -> None:
    async with (
        LocalMesh(BrokerConfig(store=store)) as mesh,
        mesh.client("admin") as admin,
        mesh.client("worker") as worker,
    ):
        await admin.register("Payment")
        await admin.register("Hotel")
        sent = [await admin.send("Payment", {"action": "pay", "n": n}) for n in range(3)]
        # Payment and Hotel share the worker's session; a plain Subscribe stream holds
        # Payment too.
        payment = worker.subscribe("Payment", max_in_flight=2)
        hotel = worker.subscribe("Hotel")
        await payment.start()
        await hotel.start()
        first = await anext(payment)
        assert first.message.message_id == sent[0].message_id
        channel = grpc.aio.insecure_channel(mesh.address)
        plain = broker_pb2_grpc.BrokerServiceStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(agent_id="Payment")
        )
        ready = await plain.read()  # the third message, to this subscriber
        assert ready.delivery.message.message_id == sent[2].message_id

        await admin.deregister("Payment")

        handed: list[str] = []  # (the second message, if it came before the end did)
        with pytest.raises(AgentNotFoundError) as ended:
            async with asyncio.timeout(10):
                while True:
                    handed.append((await anext(payment)).message.message_id)
        assert handed in ([], [sent[1].message_id])
        assert ended.value.reason == "AGENT_DEREGISTERED"
        assert ended.value.message == "agent Payment was deregistered: its subscription ended"
        with pytest.raises(grpc.aio.AioRpcError) as plain_ended:
            await asyncio.wait_for(plain.read(), 10)
        assert plain_ended.value.code() == grpc.StatusCode.NOT_FOUND
        assert plain_ended.value.details() == (
            "agent Payment was deregistered: its subscription ended"
        )
        assert _reason(plain_ended.value) == "AGENT_DEREGISTERED"
        await channel.close()
        await first.ack()  # (its lease went back with the subscription: it stays queued)

        # The session goes on: Hotel's subscription and the worker's calls.
        note = await admin.send("Hotel", {"action": "book"})
        assert (await anext(hotel)).message.message_id == note.message_id
        [stats] = [s for s in (await worker.queue_stats()).agents if s.agent_id == "Payment"]
        assert (stats.depth, stats.in_flight) == (3, 0)
        with pytest.raises(AgentNotFoundError):
            await admin.send("Payment", {"action": "pay"})

        # Registered again, the agent gets all three, in order, on the same session; the
        # two that were handed over count their attempt.
        await admin.register("Payment")
        again = []
        for _ in sent:
            again.append(await anext(payment))
            await again[-1].ack()
        assert [r.message.message_id for r in again] == [m.message_id for m in sent]
        assert [r.attempt for r in again] == [2, 2, 2]
        await payment.close()
        await hotel.close()


async def test_a_deregistered_sdk_agent_stops_taking_messages_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="mesh")
    handled: list[str] = []

    @agent("Payment", agent_types=["payment"])
    async def pay(message: Message, ctx: AgentContext) -> dict[str, str]:
        handled.append(message.message_id)
        return {"paid": "yes"}

    async with LocalMesh() as mesh, mesh.client("admin") as admin:
        served = await serve(pay, mesh.address)
        try:
            answer = await admin.request("Payment", {"action": "pay"}, timeout=5)
            assert answer.content["paid"] == "yes"
            async with watching(served.address, AGENT_SERVICE) as readiness:
                await readiness.until(SERVING)
                await admin.deregister("Payment")
                await readiness.until(NOT_SERVING)
            # It does not register again: not after the longest of its reconnect delays.
            await asyncio.sleep(2.5)
            assert [a.agent_id for a in await admin.list_agents()] == []
            with pytest.raises(AgentNotFoundError):
                await admin.send("Payment", {"action": "pay"})
            assert len(handled) == 1
        finally:
            await served.stop(1.0)
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert (
        "WARNING",
        "Payment was deregistered: it takes no more messages (start it again to register it again)",
    ) in said
    assert not [m for level, m in said if level == "ERROR"]


async def test_agents_served_together_are_ready_while_every_one_takes_its_messages() -> None:
    """A process serving several agents (a pod of `agentmesh agent` with a list) is ready,
    `agentmesh.agents` on each of its servers, while all of them take their messages: one of
    them deregistered takes the process out of rotation, though the others still serve; once
    it is stopped, the process is ready again."""

    @agent("Pay")
    async def pay(message: Message, ctx: AgentContext) -> dict[str, str]:
        return {"paid": "yes"}

    @agent("Refund")
    async def refund(message: Message, ctx: AgentContext) -> dict[str, str]:
        return {"refunded": "yes"}

    async with LocalMesh() as mesh, mesh.client("admin") as admin:
        served = await serve_all([pay, refund], mesh.address)
        first, second = (one.address for one in served)
        try:
            for address in (first, second):  # (ready as serve_all returns)
                assert await health_of(address, AGENTS_SERVICE) == SERVING
                assert await health_of(address, AGENT_SERVICE) == SERVING
            async with watching(first, AGENTS_SERVICE) as readiness:
                await readiness.until(SERVING)
                await admin.deregister("Refund")
                await readiness.until(NOT_SERVING)
            async with watching(second, AGENT_SERVICE) as refund_ready:
                await refund_ready.until(NOT_SERVING)
            assert await health_of(second, AGENTS_SERVICE) == NOT_SERVING
            assert await health_of(first, AGENT_SERVICE) == SERVING  # (Pay still takes them)
            answer = await admin.request("Pay", {"action": "pay"}, timeout=5)
            assert answer.content["paid"] == "yes"
            async with watching(first, AGENTS_SERVICE) as readiness:
                await served.servers[1].stop(1.0)  # (no longer one the process serves)
                await readiness.until(SERVING)
        finally:
            await served.stop(1.0)


async def answer_next(agent: MeshClient, content: dict[str, JSON]) -> None:
    """The agent (its client) takes the next message from its queue and answers it."""
    async with agent.subscribe() as inbox:
        async for delivery in inbox:
            asked = delivery.message
            await delivery.answer(
                Message(
                    from_agent=agent.agent_id,
                    to_agent=asked.from_agent,
                    message_type=MessageType.RESPONSE,
                    correlation_id=asked.correlation_id,
                    content=content,
                )
            )
            return


async def test_a_request_to_an_agent_that_leaves_waits_and_its_timeout_says_why() -> None:
    """A request waits in the queue while its agent is off the registry: a process that
    deregistered as it stopped (the agent's last instance) registers again as it restarts,
    and answers it. One whose agent stays away times out saying so."""
    async with (
        LocalMesh() as mesh,
        mesh.client("admin") as admin,
        mesh.client("Desk") as desk,
    ):
        await desk.register()
        asking = asyncio.create_task(admin.request("Desk", {"action": "pay"}, timeout=1))
        await asyncio.sleep(0.2)
        await admin.deregister("Desk")
        with pytest.raises(RequestTimeoutError) as timed_out:
            await asking
        assert timed_out.value.message == (
            "no response from Desk within 1 s"
            " (Desk is not registered: deregistered, or forgotten, since it was asked)"
        )

        await desk.register()
        asking = asyncio.create_task(admin.request("Desk", {"action": "pay"}, timeout=10))
        await asyncio.sleep(0.2)
        await desk.deregister()  # (its process stopping; the next one starts)
        await desk.register()
        await answer_next(desk, {"action": "pay", "paid": "yes"})
        answer = await asking
        assert answer.content == {"action": "pay", "paid": "yes"}


async def test_a_gather_says_why_an_agent_that_left_meanwhile_did_not_answer() -> None:
    async with (
        LocalMesh() as mesh,
        mesh.client("admin") as admin,
        mesh.client("Desk") as desk,
        mesh.client("Till") as till,
    ):
        for client in (desk, till):
            await client.register()

        async def gather() -> list[GatherResult]:
            asked = admin.gather({"action": "count"}, agent_ids=["Desk", "Till"], timeout=1)
            return [result async for result in asked]

        gathering = asyncio.create_task(gather())
        await asyncio.sleep(0.2)
        await admin.deregister("Till")
        await answer_next(desk, {"action": "count", "n": 3})
        answered, left = await gathering
    assert answered.agent_id == "Desk" and answered.response is not None
    assert answered.response.content["n"] == 3
    assert left.agent_id == "Till" and left.error is not None
    # Its copy's ttl is the gather's 1 s: the sweep that expires it, or the gather's own
    # deadline, whichever comes first, says why.
    why = " (Till is not registered: deregistered, or forgotten, since it was asked)"
    expired = r"Till did not take broadcast \S+ within its ttl of 1 s: it expired in the queue"
    said = left.error.message
    assert said == f"no response from Till within 1 s{why}" or re.fullmatch(
        expired + re.escape(why), said
    ), said

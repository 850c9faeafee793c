"""A handler may hand a request on instead of answering it: ``return ctx.forward("Back")``.

The next agent answers the requester in its place, under the request's correlation id; the
forward expires with the request, and a requester that gives up has it withdrawn from the
next agent too. The agent that forwarded is done with the request (acknowledged, never
delivered again).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from mesh import (
    Agent,
    AgentClient,
    AgentContext,
    AgentError,
    LocalMesh,
    Message,
    MessageType,
    Priority,
    RequestTimeoutError,
    on,
)
from mesh.agent import AgentServer, answer_to, forwards, serve
from mesh.client import NO_RETRY, connect
from mesh.config import SecurityConfig
from tests.helpers.processes import BROKER_READY, Proc, start, stop
from tests.integration.test_withdrawal import Thinker, withdrawn_count


class Desk(Agent):
    """Forwards ``ask`` and ``think`` to ``next_agent``, adding its name to the parameters'
    ``path``."""

    def __init__(self, agent_id: str, next_agent: str) -> None:
        super().__init__(agent_id)
        self.next_agent = next_agent
        self.handled: list[str] = []

    async def handle(self, message: Message, ctx: AgentContext) -> Message:
        self.handled.append(message.message_id)
        parameters = dict(message.parameters)
        parameters["path"] = [*parameters.get("path", []), self.agent_id]  # type: ignore[misc]
        return ctx.forward(self.next_agent, {"action": message.action, "parameters": parameters})


class Expert(Agent):
    """Answers ``ask`` with who it is, the path the request took and what it saw of it."""

    def __init__(self, agent_id: str = "Expert") -> None:
        super().__init__(agent_id)
        self.seen: list[Message] = []

    @on("ask")
    async def ask(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        self.seen.append(message)
        return {"by": self.agent_id, "path": message.parameters.get("path", [])}


async def test_the_next_agent_answers_a_forwarded_request(mesh: LocalMesh) -> None:
    """The requester gets the expert's answer, correlated with its request; the desk that
    forwarded is done with it: acknowledged, not delivered again once its lease is over."""
    desk, expert = Desk("Desk", "Expert"), Expert()
    await mesh.add_agent(desk, lease_seconds=0.5)
    await mesh.add_agent(expert)
    async with mesh.client("asker") as client:
        answer = await client.request(
            "Desk",
            {"action": "ask", "parameters": {"path": []}},
            message_id="q-1",
            priority=Priority.HIGH,
            metadata={"case": "c-7"},
            timeout=5,
        )
        assert answer.message_type is MessageType.RESPONSE
        assert (answer.from_agent, answer.to_agent, answer.correlation_id) == (
            "Expert",
            "asker",
            "q-1",
        )
        assert answer.content["by"] == "Expert" and answer.content["path"] == ["Desk"]
        (forwarded,) = expert.seen
        assert (forwarded.from_agent, forwarded.reply_to) == ("Desk", "asker")
        assert forwarded.priority is Priority.HIGH and forwarded.metadata == {"case": "c-7"}
        assert 0 < forwarded.ttl <= 5  # it expires with the request
        await asyncio.sleep(1.5)  # three of the desk's leases
        assert desk.handled == ["q-1"] and len(expert.seen) == 1
        stats = await client.queue_stats()
        for agent_id in ("Desk", "Expert"):
            view = stats.for_agent(agent_id)
            assert view is not None and (view.depth, view.in_flight) == (0, 0), agent_id
        assert stats.totals["redelivered_count"] == 0


async def test_a_request_is_forwarded_down_a_chain(mesh: LocalMesh) -> None:
    expert = Expert()
    for one in (Desk("Front", "Middle"), Desk("Middle", "Expert"), expert):
        await mesh.add_agent(one)
    async with mesh.client("asker") as client:
        answer = await client.request("Front", {"action": "ask"}, message_id="q-2", timeout=5)
    assert answer.from_agent == "Expert" and answer.content["path"] == ["Front", "Middle"]
    assert answer.correlation_id == "q-2" and expert.seen[0].reply_to == "asker"


async def test_a_forward_is_withdrawn_when_the_requester_gives_up(mesh: LocalMesh) -> None:
    """The expert is working on the forward when the requester's deadline passes: its handler
    is cancelled, as if it had been asked directly; a forward still waiting leaves the
    queue."""
    thinker = Thinker("Expert")
    await mesh.add_agent(Desk("Desk", "Expert"))
    await mesh.add_agent(thinker)
    async with mesh.client("asker") as client:
        with pytest.raises(RequestTimeoutError):
            await client.request("Desk", {"action": "think"}, timeout=0.5)
        await asyncio.wait_for(thinker.cancelled_event.wait(), 3)
        assert thinker.finished == []
        view = (await client.queue_stats("Expert")).for_agent("Expert")
        assert view is not None and (view.depth, view.in_flight) == (0, 0)
        assert withdrawn_count(mesh, "in_flight") == 1

        await client.register("Absent")  # registered, nobody takes its messages
        await mesh.add_agent(Desk("Door", "Absent"))
        with pytest.raises(RequestTimeoutError):
            await client.request("Door", {"action": "ask"}, ttl=3600, timeout=0.5)
        view = (await client.queue_stats("Absent")).for_agent("Absent")
        assert view is not None and view.depth == 0
        assert withdrawn_count(mesh, "waiting") == 1


async def test_a_forward_the_broker_refuses_reaches_the_requester_as_an_error(
    mesh: LocalMesh,
) -> None:
    """The next agent is not registered: the requester hears so at once (not at its
    deadline), and the desk is done with the request."""
    desk = Desk("Desk", "Nowhere")
    await mesh.add_agent(desk, lease_seconds=0.5)
    async with mesh.client("asker") as client:
        with pytest.raises(
            AgentError, match="Desk could not hand the request on to Nowhere: "
        ) as info:
            await client.request("Desk", {"action": "ask"}, timeout=20)
        assert info.value.reason == "AGENT_NOT_FOUND"
        await asyncio.sleep(1.0)  # two of the desk's leases
        assert len(desk.handled) == 1
        view = (await client.queue_stats("Desk")).for_agent("Desk")
        assert view is not None and (view.depth, view.in_flight) == (0, 0)


async def test_a_direct_call_to_an_agent_that_forwards_gets_the_next_agents_answer(
    mesh: LocalMesh,
) -> None:
    desk = await mesh.add_agent(Desk("Desk", "Expert"))
    await mesh.add_agent(Expert())
    async with AgentClient(desk.address) as direct:
        with pytest.raises(TypeError, match=r"handle takes Message objects \(mesh.Message\)"):
            await direct.handle({"action": "ask"})  # type: ignore[arg-type]
        answer = await direct.handle(
            Message(from_agent="caller", to_agent="Desk", content={"action": "ask"}),
            timeout=5,
        )
    assert answer is not None and answer.message_type is MessageType.RESPONSE
    assert (answer.from_agent, answer.to_agent) == ("Expert", "caller")
    assert answer.content["path"] == ["Desk"]


def _request(**fields: Any) -> Message:
    fields.setdefault("content", {"action": "ask"})
    return Message(from_agent="asker", to_agent="Desk", **fields)


def test_what_counts_as_a_forward() -> None:
    """A returned message that asks another agent hands a REQUEST on; one addressed to the
    requester, an answer, a broadcast or the return of anything but a REQUEST does not."""
    asked = _request()
    onward = Message(from_agent="Desk", to_agent="Expert", content={"action": "ask"})
    assert forwards(asked, onward)
    assert forwards(asked, onward.evolve(message_type=MessageType.HANDOFF))
    assert not forwards(asked, onward.evolve(to_agent="asker"))
    assert not forwards(asked, onward.evolve(to_agent=""))
    assert not forwards(asked, onward.evolve(to_agent="broadcast"))
    assert not forwards(asked, onward.evolve(message_type=MessageType.RESPONSE))
    assert not forwards(_request(message_type=MessageType.HANDOFF), onward)
    assert forwards(_request(reply_to="inbox"), onward.evolve(to_agent="asker"))


def test_a_forward_expires_with_its_request_unless_given_a_ttl() -> None:
    sent_at = datetime.now(UTC) - timedelta(seconds=3)
    asked = _request(ttl=10, timestamp=sent_at, correlation_id="c-1", reply_to="inbox")
    onward = Message(from_agent="", to_agent="Expert", content={"action": "ask"})
    forward = answer_to(asked, "Desk", onward)
    assert forward is not None
    assert (forward.from_agent, forward.reply_to, forward.correlation_id) == (
        "Desk",
        "inbox",
        "c-1",
    )
    assert (forward.ttl, forward.timestamp) == (10, sent_at)
    own = answer_to(asked, "Desk", onward.evolve(ttl=60))
    assert own is not None and own.ttl == 60 and own.timestamp != sent_at


async def test_only_a_request_can_be_forwarded(mesh: LocalMesh) -> None:
    broadcast = Message(
        from_agent="asker",
        to_agent="broadcast",
        message_type=MessageType.BROADCAST,
        content={"action": "ask"},
    )
    async with mesh.client("Desk") as client:
        ctx = AgentContext(Desk("Desk", "Expert"), client, broadcast)
        with pytest.raises(ValueError, match="only a REQUEST can be forwarded"):
            ctx.forward("Expert")


@pytest.mark.processes
async def test_a_forward_through_another_replica_is_withdrawn_with_its_request(
    redis_url: str,
) -> None:
    """Two broker processes on one Redis: the requester waits on one, the desk and the expert
    are served through the other. The requester gives up: the replica it waited on withdraws
    the forward the other replica took, and the expert's handler is cancelled."""
    a: Proc = await start("broker", "--port", "0", "--store", redis_url, ready=BROKER_READY)
    b: Proc = await start("broker", "--port", "0", "--store", redis_url, ready=BROKER_READY)
    thinker = Thinker("Expert")
    served: list[AgentServer] = []
    try:
        served.append(await serve(thinker, b.address, security=SecurityConfig()))
        served.append(await serve(Desk("Desk", "Expert"), b.address, security=SecurityConfig()))
        async with connect(a.address, agent_id="asker", retry=NO_RETRY) as via_a:
            with pytest.raises(RequestTimeoutError):
                await via_a.request("Desk", {"action": "think"}, timeout=1.0)
            await asyncio.wait_for(thinker.cancelled_event.wait(), 5)
            assert thinker.finished == [] and served[0].runtime.withdrawn == 1
            view = (await via_a.queue_stats("Expert")).for_agent("Expert")
            assert view is not None and (view.depth, view.in_flight) == (0, 0)
    finally:
        for one in served:
            await one.stop(0.5)
        await stop(a)
        await stop(b)

"""What a handler does as its agent through ``ctx``: broadcast and gather, besides send,
request, hand off and forward. Agents served together (``serve_all``) share a client that is
no agent of its own: each exchange must still come from the agent whose handler made it. And
a handler written as a generator, which has no one answer to give."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mesh import Agent, AgentContext, AgentError, LocalMesh, Message, on, serve_all


class Voter(Agent):
    agent_types = ("voter",)

    def __init__(self, agent_id: str, choice: str) -> None:
        super().__init__(agent_id)
        self.choice = choice
        self.notices: list[Message] = []
        self.noticed = asyncio.Event()

    @on("vote")
    async def vote(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        return {"choice": self.choice, "asked_by": message.from_agent}

    @on("notice")
    async def notice(self, message: Message, ctx: AgentContext) -> None:
        self.notices.append(message)
        self.noticed.set()


class Coordinator(Agent):
    agent_types = ("voter",)  # of the type it polls: its own copies would be its own votes

    def __init__(self) -> None:
        super().__init__("Coordinator")
        self.notices: list[Message] = []

    @on("poll")
    async def poll(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        votes = {
            item.agent_id: dict(item.response.content or {})
            async for item in ctx.gather({"action": "vote"}, agent_types=["voter"], timeout=5)
            if item.response is not None
        }
        told = await ctx.broadcast({"action": "notice", "votes": len(votes)}, agent_types=["voter"])
        return {"votes": votes, "told": sorted(told.recipients)}

    @on("notice")
    async def notice(self, message: Message, ctx: AgentContext) -> None:
        self.notices.append(message)

    @on("vote")
    async def vote(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        raise AssertionError("the coordinator was asked its own poll")


async def test_a_handler_gathers_and_broadcasts_as_its_agent(mesh: LocalMesh) -> None:
    """The coordinator polls the voters and tells them the outcome: the copies come from
    the coordinator (not from its shared client, which is no agent), and none goes back to
    it."""
    coordinator = Coordinator()
    voters = [Voter("Ann", "A"), Voter("Bob", "B")]
    async with (
        await serve_all([coordinator, *voters], mesh.address),
        mesh.client("asker") as client,
    ):
        answer = await client.request("Coordinator", {"action": "poll"}, timeout=10)
        assert answer.content == {
            "action": "poll",
            "votes": {
                "Ann": {"action": "vote", "choice": "A", "asked_by": "Coordinator"},
                "Bob": {"action": "vote", "choice": "B", "asked_by": "Coordinator"},
            },
            "told": ["Ann", "Bob"],
        }
        for voter in voters:
            await asyncio.wait_for(voter.noticed.wait(), 5)
            (notice,) = voter.notices
            assert notice.from_agent == "Coordinator" and notice.content["votes"] == 2
    assert coordinator.notices == []


class Yielder(Agent):
    """Handlers written as generators by mistake: each yields instead of returning."""

    @on("numbers")
    def numbers(self, message: Message, ctx: AgentContext) -> Any:
        yield 1
        yield 2

    @on("stream")
    async def stream(self, message: Message, ctx: AgentContext) -> Any:
        yield {"part": 1}


async def test_a_handler_written_as_a_generator_answers_with_an_error_saying_so(
    mesh: LocalMesh,
) -> None:
    """Its answer would have been the text "<generator object ...>": the requester hears
    what is wrong instead."""
    await mesh.add_agent(Yielder("Yielder"))
    async with mesh.client("asker") as client:
        for action in ("numbers", "stream"):
            with pytest.raises(AgentError, match=f"the handler of '{action}' is a generator"):
                await client.request("Yielder", {"action": action}, timeout=10)

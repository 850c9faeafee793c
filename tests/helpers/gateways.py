"""A gateway at its limit of runs: each place held by a group chat whose one agent answers
only when the test lets it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from gateway.client import GatewayClient
from gateway.server import GatewayServer, serve_gateway
from mesh import AgentContext, LocalMesh, Message, SecurityConfig, agent

SLOW_AGENT = "SlowExpert"


@dataclass
class FullGateway:
    gateway: GatewayServer
    release: asyncio.Event
    """Set: the agent answers what it was asked, and everything after at once."""
    asked: list[str] = field(default_factory=list)
    """The queries the agent was asked, in order."""
    held: list[asyncio.Task[list[dict[str, Any]]]] = field(default_factory=list)
    """The runs that hold the gateway's places: each ends with its events."""

    @property
    def address(self) -> str:
        return self.gateway.address

    def refused(self) -> float:
        """Group chats refused so far for TOO_MANY_RUNS."""
        counter = self.gateway.metrics.refusals.labels("GROUP_CHAT", "TOO_MANY_RUNS")
        return float(counter._value.get())

    async def refused_at_least(self, count: int) -> None:
        async with asyncio.timeout(20):
            while self.refused() < count:  # noqa: ASYNC110 - a counter, not an event
                await asyncio.sleep(0.01)


@asynccontextmanager
async def full_gateway(mesh: LocalMesh, max_runs: int = 1) -> AsyncIterator[FullGateway]:
    """A gateway on ``mesh`` that runs ``max_runs`` patterns at most, running as many group
    chats of SlowExpert (queries "held0", "held1", ...), each waiting for its answer."""
    release = asyncio.Event()
    asked: list[str] = []

    @agent(SLOW_AGENT)
    async def slow(message: Message, ctx: AgentContext) -> dict[str, Any]:
        asked.append(str(message.content.get("query")))
        await release.wait()
        return {"recommendation": "AAPL", "confidence": 0.9}

    await mesh.add_agent(slow)
    gateway = await serve_gateway(mesh.address, security=SecurityConfig(), max_runs=max_runs)
    full = FullGateway(gateway, release, asked)
    async with GatewayClient(gateway.address, security=SecurityConfig()) as client:
        try:
            for n in range(max_runs):
                chat = client.group_chat(agent_ids=[SLOW_AGENT], query=f"held{n}")
                full.held.append(asyncio.create_task(client.collect(chat)))
            async with asyncio.timeout(10):
                while len(asked) < max_runs:  # noqa: ASYNC110 - every run asked the agent
                    await asyncio.sleep(0.01)
            yield full
        finally:
            release.set()
            await asyncio.gather(*full.held, return_exceptions=True)
            await gateway.stop()

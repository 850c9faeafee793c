"""How patterns reach agents: a small Dispatcher protocol, over the broker core in-process or
over gRPC through the SDK."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Protocol

from gateway.patterns._common import GATEWAY_ID
from mesh.codec import message_size
from mesh.core import workflows
from mesh.core.broker import Broker, GatherItem
from mesh.core.model import AgentInfo, Message, utc_now

if TYPE_CHECKING:  # (the patterns import this module: they are not to load gRPC)
    from mesh.client import MeshClient


class Dispatcher(Protocol):
    """What a pattern needs from the mesh."""

    def gather(
        self, message: Message, agent_ids: Sequence[str], timeout: float
    ) -> AsyncGenerator[GatherItem, None]:
        """Sends copies of ``message`` to the agents; yields answers as they arrive, then the
        agents that did not answer in time. Close it (``contextlib.aclosing``) when done with
        it early: the broker stops waiting for the others then, not at the deadline."""
        ...

    async def ask(self, message: Message, timeout: float) -> Message:
        """Sends a REQUEST or HANDOFF and returns the correlated answer (RESPONSE or ERROR)."""
        ...

    async def agents(self) -> list[AgentInfo]:
        """The registered agents."""
        ...

    async def record_ending(
        self, workflow_id: str, outcome: str, *, failed_at_step: int | None, error_reason: str
    ) -> None:
        """Adds a workflow's ending to its status in the shared state (mesh.core.workflows),
        when its hand-offs recorded one."""
        ...


class BrokerDispatcher:
    """Dispatches straight into a broker core in this process (tests, embedded use). Each
    message is measured as it would be on the wire, so that the broker's message limit holds
    for a pattern here as it does for one whose gateway talks to the broker over gRPC."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def gather(
        self, message: Message, agent_ids: Sequence[str], timeout: float
    ) -> AsyncGenerator[GatherItem, None]:
        return self.broker.gather(
            message, agent_ids=agent_ids, timeout=timeout, size_bytes=message_size(message)
        )

    async def ask(self, message: Message, timeout: float) -> Message:
        return await self.broker.request(message, timeout, size_bytes=message_size(message))

    async def agents(self) -> list[AgentInfo]:
        return self.broker.list_agents()

    async def record_ending(
        self, workflow_id: str, outcome: str, *, failed_at_step: int | None, error_reason: str
    ) -> None:
        await workflows.record_ending(
            self.broker.state,
            workflow_id,
            outcome,
            GATEWAY_ID,
            utc_now(),
            failed_at_step=failed_at_step,
            error_reason=error_reason,
        )


class MeshDispatcher:
    """Dispatches through a broker over gRPC."""

    def __init__(self, client: MeshClient) -> None:
        self.client = client

    async def gather(
        self, message: Message, agent_ids: Sequence[str], timeout: float
    ) -> AsyncGenerator[GatherItem, None]:
        # Closed with this one: the client then tells the broker to give the gather up.
        items = self.client.gather(message, agent_ids=agent_ids, timeout=timeout)
        async with contextlib.aclosing(items):
            async for item in items:
                yield GatherItem(item.agent_id, item.response, item.error)

    async def ask(self, message: Message, timeout: float) -> Message:
        # The raw answer, ERROR included: patterns decide what an agent's error means.
        return await self.client.request_message(message, timeout=timeout, raise_on_error=False)

    async def agents(self) -> list[AgentInfo]:
        return await self.client.list_agents()

    async def record_ending(
        self, workflow_id: str, outcome: str, *, failed_at_step: int | None, error_reason: str
    ) -> None:
        await self.client.end_workflow(
            workflow_id, outcome, failed_at_step=failed_at_step, error_reason=error_reason
        )

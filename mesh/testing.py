"""An in-process mesh for tests: a real broker and real agent servers on 127.0.0.1, free ports.

async with LocalMesh() as mesh:
    await mesh.add_agent(MyAgent("PaymentAgent"))
    async with mesh.client("tester") as client:
        reply = await client.request("PaymentAgent", {"action": "pay"})
"""

from __future__ import annotations

from typing import Any

from mesh.agent import Agent, AgentServer, serve
from mesh.client import MeshClient, RetryPolicy
from mesh.config import BrokerConfig, SecurityConfig, ServerConfig
from mesh.core.broker import Broker
from mesh.core.tools import ToolHost
from mesh.server import serve_broker
from mesh.serving import MeshServer


class LocalMesh:
    """A broker server and any number of agent servers, all in this process."""

    def __init__(
        self,
        config: BrokerConfig | None = None,
        *,
        broker: Broker | None = None,
        metrics_port: int = -1,
        tool_host: ToolHost | None = None,
        security: SecurityConfig | None = None,
    ) -> None:
        self.config = broker.config if broker is not None else (config or BrokerConfig())
        self.metrics_port = metrics_port
        self.tool_host = tool_host
        self.security = security or SecurityConfig()
        """The broker server's TLS and credentials (clients bring their own)."""
        self.broker: Broker | None = broker
        self.server: MeshServer | None = None
        self.agents: dict[str, AgentServer] = {}
        self._clients: list[MeshClient] = []

    @property
    def address(self) -> str:
        if self.server is None:
            raise RuntimeError("the mesh is not started")
        return self.server.address

    async def start(self) -> LocalMesh:
        self.broker, self.server = await serve_broker(
            self.broker,
            server_config=ServerConfig(port=0, metrics_port=self.metrics_port),
            broker_config=self.config,
            tool_host=self.tool_host,
            security=self.security,
        )
        return self

    async def add_agent(self, agent: Agent, **options: Any) -> AgentServer:
        """Serves an agent on its own gRPC server, registered and subscribed."""
        options.setdefault("security", SecurityConfig())
        served = await serve(agent, self.address, **options)
        self.agents[agent.agent_id] = served
        return served

    async def stop_agent(self, agent_id: str, grace: float = 1.0) -> None:
        served = self.agents.pop(agent_id)
        await served.stop(grace)

    def client(
        self, agent_id: str = "", *, retry: RetryPolicy | None = None, **options: Any
    ) -> MeshClient:
        """A client of this mesh's broker, closed with the mesh."""
        options.setdefault("security", SecurityConfig())
        client = MeshClient(self.address, agent_id=agent_id, retry=retry, **options)
        self._clients.append(client)
        return client

    async def stop(self) -> None:
        for agent_id in list(self.agents):
            await self.stop_agent(agent_id)
        for client in self._clients:
            await client.close()
        if self.server is not None:
            await self.server.stop(0.5)
            self.server = None

    async def __aenter__(self) -> LocalMesh:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

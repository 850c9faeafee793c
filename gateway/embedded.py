"""The embedded default: broker, gateway and the sample agents on localhost, no external service."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from agents import sample_agents
from agents.research import research_agents, research_tool_host
from gateway.dashboard import DashboardServer, serve_dashboard
from gateway.server import MAX_RUNS, GatewayServer, serve_gateway
from mesh.agent import AgentServer, ServedAgents, serve_all
from mesh.config import BrokerConfig, ServerConfig
from mesh.server import serve_broker
from mesh.serving import MeshServer

logger = logging.getLogger("gateway.embedded")


@dataclass
class EmbeddedMesh:
    broker: MeshServer
    gateway: GatewayServer
    agents: list[AgentServer] = field(default_factory=list)
    dashboard: DashboardServer | None = None
    served: ServedAgents | None = None
    """The agents, served together: one client, one stream to the broker."""

    def describe(self) -> dict[str, object]:
        return {
            "broker": self.broker.address,
            "gateway": self.gateway.address,
            "metrics": (
                f"http://{self.broker.host}:{self.broker.metrics_port}/metrics"
                if self.broker.metrics_port
                else None
            ),
            "dashboard": self.dashboard.url if self.dashboard else None,
            "agents": {a.agent.agent_id: a.address for a in self.agents},
        }

    async def stop(self, grace: float = 2.0) -> None:
        """Agents first (they finish their work and deregister), then gateway, then broker."""
        if self.dashboard is not None:
            await self.dashboard.stop()
        if self.served is not None:
            await self.served.stop(grace)
        await self.gateway.stop(grace)
        await self.broker.stop(grace)


async def start_embedded(
    *,
    host: str = "127.0.0.1",
    broker_port: int = 0,
    gateway_port: int = 0,
    metrics_port: int = -1,
    data_dir: str | Path | None = None,
    broker_config: BrokerConfig | None = None,
    docs_dir: str | Path | None = None,
    reports_dir: str | Path = "research-reports",
    dashboard_port: int = -1,
    trace_dir: str | Path | None = None,
    max_runs: int = MAX_RUNS,
) -> EmbeddedMesh:
    """Starts everything; each agent on its own gRPC server, all of them on one client (one
    stream to the broker). Pattern metrics are exported beside the broker's on the broker's
    /metrics."""
    tools = research_tool_host(docs_dir, reports_dir)
    broker, broker_server = await serve_broker(
        server_config=ServerConfig(host=host, port=broker_port, metrics_port=metrics_port),
        broker_config=broker_config,
        tool_host=tools,
    )
    try:
        gateway = await serve_gateway(
            broker_server.address,
            host=host,
            port=gateway_port,
            registry=broker.metrics.registry,
            max_runs=max_runs,
        )
    except BaseException:
        await broker_server.stop(0)
        raise
    mesh = EmbeddedMesh(broker_server, gateway)
    try:
        mesh.served = await serve_all(
            [*sample_agents(data_dir), *research_agents()], broker_server.address, host=host
        )
        mesh.agents = list(mesh.served)
        if dashboard_port >= 0:
            try:
                mesh.dashboard = await serve_dashboard(
                    gateway, host=host, port=dashboard_port, trace_dir=trace_dir
                )
            except OSError as error:  # the default port is taken: any free one will do
                logger.warning("dashboard port %d unavailable (%s)", dashboard_port, error)
                mesh.dashboard = await serve_dashboard(
                    gateway, host=host, port=0, trace_dir=trace_dir
                )
    except BaseException:
        await mesh.stop(0)
        raise
    return mesh

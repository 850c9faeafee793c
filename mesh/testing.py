"""An in-process mesh for tests: a real broker and real agent servers on 127.0.0.1, free ports.

async with LocalMesh() as mesh:
    await mesh.add_agent(MyAgent("PaymentAgent"))
    async with mesh.client("tester") as client:
        reply = await client.request("PaymentAgent", {"action": "pay"})

For the Redis store: ``LocalRedis.start(folder)`` runs a redis-server on a free port, and
``LocalRedis.start_cluster(folder)`` a three-node Redis Cluster (both need the Debian package
redis-server); ``.urls`` names their nodes, ``.stop()`` ends them.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.agent import Agent, AgentServer, serve
from mesh.client import MeshClient, RetryPolicy
from mesh.config import BrokerConfig, SecurityConfig, ServerConfig
from mesh.core.broker import Broker
from mesh.core.tools import ToolHost
from mesh.loop import AsyncOnly
from mesh.server import serve_broker
from mesh.serving import MeshServer


class LocalMesh(AsyncOnly):
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


def free_ports(count: int) -> list[int]:
    """Ports free at this moment, all different (held together while they are picked)."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in held]
    finally:
        for sock in held:
            sock.close()


@dataclass
class LocalRedis:
    """redis-server processes of our own on 127.0.0.1: one server, or the nodes of a cluster."""

    urls: list[str]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.urls[0]

    @staticmethod
    def unavailable() -> str | None:
        """Why a local Redis cannot run here (None when it can)."""
        for tool, package in (("redis-server", "redis-server"), ("redis-cli", "redis-tools")):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (Debian package {package})"
        return None

    @classmethod
    def start(cls, folder: Path) -> LocalRedis:
        started = cls([])
        try:
            started._node(folder)
        except BaseException:
            started.stop()
            raise
        return started

    @classmethod
    def start_cluster(cls, folder: Path, nodes: int = 3, replicas: int = 0) -> LocalRedis:
        """A Redis Cluster of ``nodes`` primaries sharing the 16384 slots, each with
        ``replicas`` replicas, made by ``redis-cli --cluster create`` and ready
        (``cluster_state:ok`` on every node, every replica in sync with its primary)."""
        started = cls([])
        try:
            for n in range(nodes * (1 + replicas)):
                started._node(
                    folder / str(n),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    bus=True,
                )
            addresses = [url.removeprefix("redis://").removesuffix("/0") for url in started.urls]
            create = [
                *("redis-cli", "--cluster", "create", *addresses),
                *("--cluster-replicas", str(replicas)),
            ]
            subprocess.run(
                [*create, "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                timeout=60,
            )
            deadline = time.monotonic() + 30
            while not all(_cluster_ok(address) for address in addresses):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster did not come up")
                time.sleep(0.1)
            while replicas and not all(_replica_synced(a) for a in started.replicas()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster's replicas did not sync")
                time.sleep(0.1)
        except BaseException:
            started.stop()
            raise
        return started

    def _node(self, folder: Path, *options: str, port: int = 0, bus: bool = False) -> None:
        """Starts a redis-server on ``port`` (free ports when 0; ``bus``: a cluster node, with
        a bus port of its own, since port + 10000 may be out of range). A free port can be
        taken by another process before the server binds it: then it starts again on others."""
        folder.mkdir(parents=True, exist_ok=True)
        for _ in range(1 if port else 3):
            ports = [port] if port else free_ports(2 if bus else 1)
            extra = ["--cluster-port", str(ports[1])] if bus else []
            command = ["redis-server", "--port", str(ports[0]), "--bind", "127.0.0.1"]
            process = subprocess.Popen(
                [*command, "--save", "", "--dir", str(folder), *options, *extra],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._serving(process, ports[0]):
                break
            process.kill()
            process.wait()
        else:
            raise RuntimeError(f"redis-server did not start (last on port {ports[0]})")
        self.processes.append(process)
        url = f"redis://127.0.0.1:{ports[0]}/0"
        if url not in self.urls:
            self.urls.append(url)

    @staticmethod
    def _serving(process: subprocess.Popen[bytes], port: int) -> bool:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return True
            if time.monotonic() > deadline or process.poll() is not None:
                return False
            time.sleep(0.05)

    def primaries(self) -> list[str]:
        """The addresses (host:port) of the cluster's primaries, as the cluster sees them."""
        return [a for a, role in self._roles() if role == "master"]

    def replicas(self) -> list[str]:
        return [a for a, role in self._roles() if role == "slave"]

    def _roles(self) -> list[tuple[str, str]]:
        roles = []
        for index, url in enumerate(self.urls):
            if index < len(self.processes) and self.processes[index].poll() is not None:
                continue  # killed
            address = url.removeprefix("redis://").removesuffix("/0")
            host, _, port = address.rpartition(":")
            out = subprocess.run(
                ["redis-cli", "-h", host, "-p", port, "role"], capture_output=True, text=True
            ).stdout.split()
            if out:
                roles.append((address, out[0]))
        return roles

    def kill_node(self, address: str) -> None:
        """SIGKILLs the node at host:port, as in a crash."""
        index = self.urls.index(f"redis://{address}/0")
        self.processes[index].kill()
        self.processes[index].wait()

    def restart_node(self, address: str) -> None:
        """Starts the node at host:port, killed, again as it was (on a cluster, it joins
        again with the slots it had, holding nothing: nothing is saved)."""
        index = self.urls.index(f"redis://{address}/0")
        killed = self.processes[index]
        if killed.poll() is None:
            raise RuntimeError(f"the node at {address} is still running")
        process = subprocess.Popen(
            killed.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.processes[index] = process
        if not self._serving(process, int(address.rpartition(":")[2])):
            raise RuntimeError(f"redis-server did not start again at {address}")

    def slot_holder(self, key: str) -> str:
        """The address (host:port) of the primary that holds ``key``'s slot."""
        host, _, port = self.url.removeprefix("redis://").removesuffix("/0").rpartition(":")
        slot = subprocess.run(
            ["redis-cli", "-h", host, "-p", port, "cluster", "keyslot", key],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        nodes = subprocess.run(
            ["redis-cli", "-h", host, "-p", port, "cluster", "nodes"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for line in nodes.splitlines():
            fields = line.split()
            if "master" not in fields[2]:
                continue
            for held in fields[8:]:
                first, _, last = held.partition("-")
                if first.isdigit() and int(first) <= int(slot) <= int(last or first):
                    return fields[1].split("@")[0]
        raise RuntimeError(f"no primary holds slot {slot}")

    def kill(self) -> None:
        """SIGKILL every node, as in a crash (what they held is gone: nothing is saved)."""
        for process in self.processes:
            process.kill()
            process.wait()
        self.processes.clear()

    def restart(self, folder: Path) -> None:
        """Starts a killed single server again on its port (empty)."""
        self._node(folder, port=int(self.url.rsplit(":", 1)[1].split("/")[0]))

    def flush(self) -> None:
        """Empties every node."""
        for url in self.urls:
            subprocess.run(
                ["redis-cli", "-u", url, "flushall"], check=True, stdout=subprocess.DEVNULL
            )

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _replica_synced(address: str) -> bool:
    host, _, port = address.rpartition(":")
    info = subprocess.run(
        ["redis-cli", "-h", host, "-p", port, "info", "replication"],
        capture_output=True,
        text=True,
    ).stdout
    return "master_link_status:up" in info


def _cluster_ok(address: str) -> bool:
    host, _, port = address.rpartition(":")
    info = subprocess.run(
        ["redis-cli", "-h", host, "-p", port, "cluster", "info"], capture_output=True, text=True
    ).stdout
    return "cluster_state:ok" in info

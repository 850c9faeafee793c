"""Broker and agent on different hosts: Linux network namespaces joined by a veth pair.

The test builds the namespace itself (it needs root and iproute2, and says so when it cannot),
runs the broker in the root namespace and an agent inside the other one, then cuts the
agent's link: the broker notices within its keepalive, its leased messages go back to the
queue, and once the link is restored the agent reconnects by itself and takes them again.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from mesh import connect
from mesh.client import NO_RETRY, MeshClient
from tests.helpers.processes import start, stop

pytestmark = pytest.mark.processes

KEEPALIVE = {"AGENTMESH_KEEPALIVE_SECONDS": "0.5", "AGENTMESH_KEEPALIVE_TIMEOUT_SECONDS": "1"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _why_not() -> str | None:
    if not shutil.which("ip"):
        return "needs iproute2 (the `ip` command) to build network namespaces"
    if os.geteuid() != 0:
        return "needs root to create network namespaces and veth links"
    probe = f"amprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as error:
        return f"cannot create a network namespace here: {error.stderr.decode().strip()}"
    _ip("netns", "delete", probe)
    return None


@pytest.fixture
def netns() -> Iterator[dict[str, str]]:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    ns, host_if, agent_if = f"amtest{tag}", f"amh{tag}", f"ama{tag}"
    subnet = 100 + int(tag[:2], 16) % 100
    host_ip, agent_ip = f"10.231.{subnet}.1", f"10.231.{subnet}.2"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", agent_if)
        _ip("link", "set", agent_if, "netns", ns)
        _ip("addr", "add", f"{host_ip}/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{agent_ip}/24", "dev", agent_if)
        _ip("-n", ns, "link", "set", agent_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield {"ns": ns, "host_if": host_if, "host_ip": host_ip, "agent_ip": agent_ip}
    finally:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "delete", host_if], capture_output=True, timeout=10)


async def stats_of(client: MeshClient, agent_id: str) -> tuple[int, int]:
    """(waiting, in flight) for one agent."""
    stats = (await client.queue_stats(agent_id)).for_agent(agent_id)
    return (stats.high + stats.medium + stats.low, stats.in_flight) if stats else (0, 0)


async def wait_for(
    client: MeshClient, agent_id: str, wanted: tuple[int, int], within: float
) -> None:
    async with asyncio.timeout(within):
        while await stats_of(client, agent_id) != wanted:  # noqa: ASYNC110 - broker state
            await asyncio.sleep(0.1)


async def test_cut_link_returns_leases_and_the_agent_reconnects_when_restored(
    netns: dict[str, str],
) -> None:
    broker = await start(
        "broker",
        "--host",
        netns["host_ip"],
        "--port",
        "0",
        ready=r"listening on (\S+?)[,\s]",
        env=KEEPALIVE,
    )
    agent = None
    try:
        agent = await start(
            "agent",
            "tests.helpers.process_agents:Stuck",
            "--broker",
            broker.address,
            "--host",
            netns["agent_ip"],
            "--max-in-flight",
            "3",
            ready=r"serving on (\S+)",
            env=KEEPALIVE,
            prefix=("ip", "netns", "exec", netns["ns"]),
        )
        assert agent.address.startswith(netns["agent_ip"])
        async with connect(broker.address, agent_id="client", retry=NO_RETRY) as client:
            [info] = await client.list_agents()
            assert info.address.startswith(netns["agent_ip"])
            for n in range(5):
                await client.send("StuckAgent", {"action": "work", "parameters": {"n": n}})
            await wait_for(client, "StuckAgent", (2, 3), within=10)

            _ip("link", "set", netns["host_if"], "down")
            # The broker stops hearing the agent: its three leases go back to the queue.
            await wait_for(client, "StuckAgent", (5, 0), within=15)

            _ip("link", "set", netns["host_if"], "up")
            # The agent finds its connection dead, reconnects and takes them again.
            await wait_for(client, "StuckAgent", (2, 3), within=30)
            assert agent.process.returncode is None
    finally:
        if agent is not None:
            await stop(agent)
        await stop(broker)

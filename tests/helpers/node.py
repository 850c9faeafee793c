"""The Node.js client's example agents (clients/node/examples), each in a process of its own."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"


async def start_node_example(
    script: str, agent_id: str, broker: str, *args: str, env: dict[str, str] | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    """``node examples/<script> AGENT_ID ARGS...`` against ``broker`` (with ``env`` added to
    its environment): the process and the address of the agent's server once it serves."""
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("clients/node dependencies are missing: run `make setup`")
    node = await asyncio.create_subprocess_exec(
        "node",
        f"examples/{script}",
        agent_id,
        *args,
        cwd=NODE_DIR,
        env={**os.environ, "AGENTMESH_BROKER": broker, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert node.stdout is not None
    try:
        async with asyncio.timeout(30):
            line = (await node.stdout.readline()).decode()
            while (line.startswith("(") and "Warning" in line) or line.startswith("(Use `node"):
                line = (await node.stdout.readline()).decode()  # (Node's own warnings)
        assert f"{agent_id} serving on 127.0.0.1:" in line, line
    except BaseException:
        node.kill()
        await node.wait()
        raise
    return node, line.rsplit(" ", 1)[-1].strip()


async def kill_if_running(node: asyncio.subprocess.Process | None) -> None:
    """SIGKILL for a Node process a test leaves running (it failed before stopping it)."""
    if node is not None and node.returncode is None:
        node.kill()
        await node.wait()

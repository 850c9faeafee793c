"""The Node.js client and agent (clients/node) against a real mesh, with Node's test runner."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from gateway.embedded import EmbeddedMesh

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
async def test_node_client_and_agent_pass_their_tests(embedded: EmbeddedMesh) -> None:
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("clients/node dependencies are missing: run `make setup`")
    env = {
        **os.environ,
        "AGENTMESH_BROKER": embedded.broker.address,
        "AGENTMESH_GATEWAY": embedded.gateway.address,
    }
    process = await asyncio.create_subprocess_exec(
        "node",
        "--test",
        "--test-reporter=spec",
        "test/",
        cwd=NODE_DIR,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(120):
        out, _ = await process.communicate()
    text = out.decode()
    assert process.returncode == 0, text
    assert "a Node agent takes part in a group chat beside the Python agents" in text
    assert "CONTRIBUTION NodeExpertAgent: Buy AAPL (confidence 0.75)" in text

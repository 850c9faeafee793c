"""docs/grpc.md: every `bcurl` command runs, in order, against a real mesh and succeeds."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

from gateway.embedded import EmbeddedMesh

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "grpc.md"
BUF = str(Path(sys.executable).parent / "buf")


def command_blocks() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), flags=re.S)
    return [b for b in blocks if "bcurl" in b and "alias bcurl" not in b]


def commands(block: str) -> list[str]:
    """Splits a block into commands: continuation lines and open JSON quotes join lines."""
    out, current = [], ""
    for line in block.splitlines():
        current = f"{current}\n{line}" if current else line
        if current.rstrip().endswith("\\") or current.count("'") % 2:
            continue
        if current.strip():
            out.append(current)
        current = ""
    return out


async def test_every_documented_call_works(embedded: EmbeddedMesh) -> None:
    agents = embedded.describe()["agents"]
    assert isinstance(agents, dict)
    env = {
        **os.environ,
        "BROKER": embedded.broker.address,
        "GATEWAY": embedded.gateway.address,
        "AGENT": agents["PriceAgent"],
    }
    prelude = f'bcurl() {{ {BUF} curl --protocol grpc --http2-prior-knowledge "$@"; }}\n'
    ran = []
    for block in command_blocks():
        for command in commands(block):
            process = await asyncio.create_subprocess_exec(
                "bash",
                "-c",
                prelude + command,
                env=env,
                cwd=ROOT,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            async with asyncio.timeout(60):
                out, err = await process.communicate()
            assert process.returncode == 0, f"{command}\n{out.decode()}\n{err.decode()}"
            ran.append((command, out.decode()))
    assert len(ran) >= 25
    by_rpc = {}
    for command, out in ran:
        match = re.search(r"/([\w.]+/\w+)\s*$", command.strip())
        by_rpc[match.group(1) if match else command] = out
    received = json.loads(by_rpc["mesh.v1.BrokerService/ReceiveMessages"])["messages"]
    assert [m["fromAgent"] for m in received] == ["HotelAgent", "CarAgent", "FlightAgent"]
    route_events = [
        json.loads(doc)
        for doc in re.findall(
            r"^\{.*?^\}", by_rpc["mesh.v1.GatewayService/Route"], flags=re.S | re.M
        )
    ]
    assert route_events[-1]["event"]["data"]["error_reason"] == "Payment failed"

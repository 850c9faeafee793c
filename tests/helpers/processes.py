"""`agentmesh` commands run as OS processes by the tests, and a free port to give them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


SCRIPT = (str(Path(sys.executable).parent / "agentmesh"),)
"""The `agentmesh` script that installing the project puts beside the interpreter."""


class Proc:
    """A running `agentmesh` process and the address its ready line named."""

    def __init__(self, process: asyncio.subprocess.Process, address: str) -> None:
        self.process = process
        self.address = address
        self.output: list[str] = []
        self.reader: asyncio.Task[None] | None = None

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind, as in a crash."""
        signal_process(self.process, signal.SIGKILL)


def signal_process(process: asyncio.subprocess.Process, sig: int) -> None:
    """Sends ``sig`` to a child still running. (os.kill, not Popen.send_signal: that one
    reaps a child that has just exited itself, racing the event loop's child watcher, which
    then reports 255 for a process it can no longer find.)"""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)


async def start(
    *args: str,
    ready: str,
    env: dict[str, str] | None = None,
    prefix: tuple[str, ...] = (),
    cwd: Path = ROOT,
    program: tuple[str, ...] = (sys.executable, "-m", "mesh"),
) -> Proc:
    """Starts `agentmesh ARGS` (after ``prefix``, e.g. `ip netns exec NS`) in ``cwd`` and
    waits for its ready line, which names its address. ``program`` is how agentmesh is run:
    `python -m mesh`, or the `agentmesh` script as a user's shell runs it (SCRIPT)."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    process = await asyncio.create_subprocess_exec(
        *prefix,
        *program,
        *args,
        cwd=cwd,
        env=environ,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    seen: list[str] = []
    async with asyncio.timeout(30):
        while True:
            line = (await process.stdout.readline()).decode()
            if not line:
                raise RuntimeError(
                    f"agentmesh {args[0]} exited before it was ready:\n" + "".join(seen)
                )
            seen.append(line)
            match = re.search(ready, line)
            if match:
                proc = Proc(process, match.group(1))
                proc.output = seen
                # Keep reading, or a chatty process blocks once the pipe is full.
                proc.reader = asyncio.create_task(_drain(process.stdout, seen))
                return proc


async def _drain(stream: asyncio.StreamReader, lines: list[str]) -> None:
    while line := await stream.readline():
        if len(lines) < 10_000:
            lines.append(line.decode(errors="replace"))


async def stop(proc: Proc) -> int:
    """SIGTERM, and its exit code; a process still running 15 s later is killed (so that no
    test leaves one behind) and the test fails with what it printed."""
    signal_process(proc.process, signal.SIGTERM)
    try:
        async with asyncio.timeout(15):
            return await proc.process.wait()
    except TimeoutError:
        proc.kill()
        await proc.process.wait()
        raise AssertionError(
            f"pid {proc.process.pid} did not exit within 15 s of SIGTERM; it printed:\n"
            + "".join(proc.output[-50:])
        ) from None


async def wait_killed(proc: Proc) -> None:
    proc.kill()
    async with asyncio.timeout(15):
        await proc.process.wait()


async def request_once_back(
    client: Any, agent_id: str, content: dict[str, Any], within: float = 20.0
) -> Any:
    """The answer of ``agent_id`` to ``content`` once it is back in service: asked again (by
    a client without retries) while it is not registered yet or the channel reconnects."""
    from mesh.core.errors import MeshError

    async with asyncio.timeout(within):
        while True:
            try:
                return await client.request(agent_id, content, timeout=1)
            except MeshError:
                await asyncio.sleep(0.2)


def free_port() -> int:
    """A port free now, for a process that must listen on a port known before it starts (or
    come back on it). Not one the kernel picks for port 0: it would hand the same port to the
    next server bound to port 0, another test's, before this one's process binds it."""
    return free_ports_in_a_row(1)


def free_ports_in_a_row(count: int) -> int:
    """The first of ``count`` ports in a row that are free now (for `agentmesh agent`, whose
    agents' ports, and health ports, count up from the first), away from the ports the
    kernel hands out for port 0 (32768 and up), which a test's other servers take meanwhile."""
    start = random.randrange(20000, 31000)  # (test processes side by side start apart)
    for first in [*range(start, 32000 - count, count), *range(20000, start, count)]:
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return first
    raise RuntimeError(f"no {count} free ports in a row")


@contextlib.asynccontextmanager
async def tries_counted(port: int) -> AsyncIterator[list[float]]:
    """Where a server was: a listener on ``port`` that closes each connection as it comes,
    and the list of when (loop time) each came, for a test of how often clients try again."""
    tries: list[float] = []
    loop = asyncio.get_running_loop()

    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tries.append(loop.time())
        writer.close()

    listener = await asyncio.start_server(closing, "127.0.0.1", port, reuse_address=True)
    async with listener:
        yield tries


def gaps_between(start: float, tries: list[float]) -> list[float]:
    """The waits from ``start`` to the first try and between tries, in seconds, rounded."""
    return [round(b - a, 2) for a, b in zip([start, *tries], tries, strict=False)]


BROKER_READY = r"listening on (\S+?)[,\s]"


async def instances_become(
    client: Any, agent_id: str, expected: tuple[str, ...], within: float = 10.0
) -> Any:
    """The agent as ListAgents names it once its instances are ``expected`` (an instance's
    process that died is taken off as the broker notices its stream end)."""
    async with asyncio.timeout(within):
        while True:
            [info] = [a for a in await client.list_agents() if a.agent_id == agent_id]
            if info.instances == expected:
                return info
            await asyncio.sleep(0.02)

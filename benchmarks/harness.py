"""The benchmark harness: a real mesh in separate OS processes, measured side by side with a raw
grpc.aio baseline, reported as Markdown, JSON and a PNG plot."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import itertools
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.sdk.trace.sampling import Sampler, SamplingResult

from benchmarks.baseline import ContractClient, StreamClient, stamps
from gateway.client import GatewayClient
from mesh import MessageType, Priority, connect
from mesh.codec import message_to_pb
from mesh.core.model import Message
from mesh.loop import run as run_loop
from mesh.testing import LocalRedis
from mesh.v1.broker_pb2 import ConnectRequest, ConnectResponse

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAYLOAD = {"action": "process_payment", "parameters": {"flight": "Flight A", "amount": 450}}


@dataclass(frozen=True)
class Settings:
    quick: bool
    repetitions: int
    operations: int
    warmup: int
    throughput_seconds: float
    fill_messages: int
    """How many messages ``roundtrip_filling`` puts into a queue nobody consumes."""
    jit_warmup: int
    """Requests a Node.js process makes or serves before its first measured one. V8 compiles
    the hot code over the first few thousand: a Node.js echo agent's p99 is 2-5 ms over its
    first 3,000 requests, 1.2-1.4 ms (as the Python agent's) from about 4,000 on."""

    @classmethod
    def from_env(cls, quick: bool = False) -> Settings:
        if quick or os.environ.get("BENCH_QUICK"):
            return cls(True, 1, 200, 30, 0.5, 10_000, 2_000)
        return cls(False, 3, 2000, 200, 3.0, 40_000, 5_000)


# -- processes --------------------------------------------------------------------------------


_spawned = itertools.count(1)


@dataclass
class Proc:
    process: asyncio.subprocess.Process
    address: str = ""
    drain: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid


_logs: list[Path] = []


def logs_folder() -> Path:
    """Where the processes' logs (stderr) go: files, not a pipe the driver would have to read
    (its CPU is measured). One folder per run, removed when the run succeeds."""
    if not _logs:
        _logs.append(Path(tempfile.mkdtemp(prefix="agentmesh-bench-logs-")))
    return _logs[0]


async def spawn(
    *args: str,
    ready: str,
    env_extra: dict[str, str] | None = None,
    program: str = sys.executable,
) -> Proc:
    """Starts a process and waits for the line that says it is ready; a process that exits
    first, or is not ready within 60 s, or whose start is cancelled, is killed (no process
    outlives a failed start)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    name = "-".join(a for a in args[:4] if not a.startswith("-")).replace("/", "_")
    log = logs_folder() / f"{next(_spawned):02d}-{name}.log"
    with log.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            program,
            *args,
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )
    assert process.stdout is not None
    try:
        async with asyncio.timeout(60):
            while True:
                line = (await process.stdout.readline()).decode()
                if not line:
                    tail = log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{' '.join(args)} exited before it was ready:\n{tail}")
                match = re.search(ready, line)
                if match:
                    address = match.group(1) if match.groups() else ""
                    return Proc(process, address, asyncio.create_task(_drain(process)))
    except BaseException:
        if process.returncode is None:
            process.kill()
            await process.wait()
        raise


async def spawn_into(procs: list[Proc], *args: str, **options: Any) -> Proc:
    """:func:`spawn`, the process then added to ``procs`` (what is stopped at the end), so
    that processes started together are all stopped, whichever of them failed."""
    proc = await spawn(*args, **options)
    procs.append(proc)
    return proc


async def _drain(process: asyncio.subprocess.Process) -> None:
    assert process.stdout is not None
    while await process.stdout.readline():
        pass


async def stop_all(procs: list[Proc]) -> None:
    """Stops the processes, last started first (agents before the broker they deregister from)."""
    procs = list(reversed(procs))
    for proc in procs:
        if proc.process.returncode is None:
            proc.process.send_signal(signal.SIGTERM)
    for proc in procs:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(15):
                await proc.process.wait()
        if proc.process.returncode is None:
            proc.process.kill()


NODE_CLIENT = ROOT / "clients" / "node"
NODE_FLAGS = ("--no-memory-reducer",)
"""How the bench runs its Node.js processes, as README advises for a Node.js agent or client
whose latency matters: after half a minute without work V8's memory reducer shrinks the heap,
and the next 2,000 requests or so pay to grow it back (p99 4.5-4.7 ms, 1.1-1.2 with the
flag; the bench's figures follow one another with such pauses between)."""


def node_available() -> bool:
    """Node.js and the Node.js client's packages (`make setup` installs them with npm)."""
    return shutil.which("node") is not None and (NODE_CLIENT / "node_modules" / "@grpc").is_dir()


GO_CLIENT = ROOT / "clients" / "go"


def go_available() -> bool:
    """Go, the generators and the Go packages of gRPC (the Debian packages `make test`
    installs)."""
    tools = ("go", "protoc-gen-go", "protoc-gen-go-grpc")
    deps = Path(os.environ.get("GO_DEPS", "/usr/share/gocode"))
    grpc_go = deps / "src" / "google.golang.org" / "grpc" / "health"
    return all(shutil.which(t) is not None for t in tools) and grpc_go.is_dir()


def build_meshgo(work: Path) -> Path:
    """Builds ``meshgo`` (clients/go/build.sh) in ``work``; its path. Raises RuntimeError
    with the build's output when it fails."""
    binary = work / "meshgo"
    built = subprocess.run(
        [str(GO_CLIENT / "build.sh"), str(binary)],
        env={**os.environ, "GO_BUILD_DIR": str(work / "build"), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if built.returncode != 0:
        raise RuntimeError(f"clients/go did not build:\n{built.stdout}{built.stderr[-4000:]}")
    return binary


BENCH_GO = ROOT / "benchmarks" / "results" / "tmp" / "go"
"""Where a run builds ``meshgo`` (its ``meshgo``, and the build's work in ``build/``)."""


def current_meshgo(
    candidates: Sequence[Path] = (BENCH_GO / "meshgo", GO_CLIENT / "bin" / "meshgo"),
    sources: Sequence[Path] = (GO_CLIENT / "meshgo", GO_CLIENT / "build.sh", ROOT / "proto"),
) -> Path | None:
    """The first of ``candidates`` built since any of ``sources`` (files, or every file in
    a folder) last changed: what a run built, then what `make go-client` built; else None."""
    files = [f for s in sources for f in ([s] if s.is_file() else s.rglob("*")) if f.is_file()]
    changed = max((f.stat().st_mtime for f in files), default=0.0)
    for program in candidates:
        if program.is_file() and program.stat().st_mtime >= changed:
            return program
    return None


def go_agent_program(build: bool = True) -> Path | None:
    """``meshgo``: built for the run when :func:`go_available` (None when Go is not here or
    the build fails: said, and the run goes on without the go_agent figure); with ``build``
    False (a quick run), one already built and current, if any (:func:`current_meshgo`): a
    first build compiles gRPC's Go packages, some 30 s of CPU on the run's two cores, which
    would take a quick run past its minute."""
    if not build:
        program = current_meshgo()
        if program is None:
            print(
                "(no go_agent figure: a quick run builds no meshgo, and none is built since "
                "clients/go or proto/ last changed; `make go-client` or a full run builds it)"
            )
        return program
    if not go_available():
        return None
    try:
        return build_meshgo(BENCH_GO)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"{error}\n(no go_agent figure)")
        return None


class NodeDriver:
    """``benchmarks/node_driver.js``: the Node.js client's request() through the broker,
    timed in Node; told on stdin what to measure, so that the CPU read around it covers the
    measured requests alone."""

    def __init__(self, process: asyncio.subprocess.Process, log: Path) -> None:
        self.process = process
        self.log = log
        self._count = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def start(cls, broker: str, agent: str) -> NodeDriver:
        log = logs_folder() / f"{next(_spawned):02d}-node-driver.log"
        with log.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                "node",
                *NODE_FLAGS,
                str(ROOT / "benchmarks" / "node_driver.js"),
                broker,
                agent,
                cwd=ROOT,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
            )
        driver = cls(process, log)
        try:
            await driver._expect("node driver ready")
        except BaseException:
            await driver.close()
            raise
        return driver

    async def _line(self) -> str:
        assert self.process.stdout is not None
        async with asyncio.timeout(120):
            line = (await self.process.stdout.readline()).decode()
        if not line:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the Node.js driver exited:\n{tail}")
        return line.strip()

    async def _expect(self, wanted: str) -> None:
        if (line := await self._line()) != wanted:
            raise RuntimeError(f"the Node.js driver said {line!r}, not {wanted!r}")

    async def _say(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n".encode())
        await self.process.stdin.drain()

    async def warm(self, count: int, warmup: int) -> None:
        """Makes ``warmup`` requests (:data:`JIT_WARMUP_IN_FLIGHT` at a time) and waits, ready
        to time ``count`` more when :meth:`measure` says go."""
        await self._say(f"{warmup} {count} {JIT_WARMUP_IN_FLIGHT}")
        await self._expect("warm")
        self._count = count

    async def measure(self, meter: CpuMeter) -> dict[str, Any]:
        """The figure of the requests :meth:`warm` readied, timed in Node."""
        before = meter.read()
        await self._say("go")
        samples = json.loads(await self._line())["samples"]
        figure: dict[str, Any] = stats(samples)
        figure["cpu_us_per_op"] = CpuMeter.cost(before, meter.read(), self._count)
        return figure

    async def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()  # the end of its stdin ends it
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await self.process.wait()
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


JIT_WARMUP_IN_FLIGHT = 16
"""How many of a Node.js figure's warm-up requests are in flight at a time."""


def jit_warmup(warm: set[str], figure: str, s: Settings) -> int:
    """The warm-up before a Node.js figure: ``s.jit_warmup`` requests the first time (its
    process then counted in ``warm``), and as the other polyglot figures after."""
    if figure in warm:
        return s.warmup // 2
    warm.add(figure)
    return max(s.jit_warmup, s.warmup // 2)


@dataclass
class Mesh:
    broker: Proc
    gateway: Proc
    echo: Proc
    relay: Proc
    fanout: Proc
    """Raw gRPC: forwards each frame to the five stampers (the broadcast's physical limit)."""
    contract_echo: Proc
    contract_relay: Proc
    """Raw gRPC speaking the mesh's Connect frames (the least a broker on the contract costs)."""
    stampers: list[Proc] = field(default_factory=list)
    agents: list[Proc] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    raw_agent: Proc | None = None
    """An agent of the broker in raw grpc.aio (no SDK): the broker's share of a roundtrip."""
    raw_b5: list[Proc] = field(default_factory=list)
    """Five raw agents in five processes: the broker's share of broadcast5."""
    pattern_agents: Proc | None = None
    """The sample and research agents, in one process: what the patterns run on."""
    pattern_gateway: Proc | None = None
    """A gateway with the default routing table, for the pattern figures."""
    node_agent: Proc | None = None
    """An echo agent in Node.js (clients/node), when Node.js is here."""
    node_driver: NodeDriver | None = None
    """The Node.js client, asking the Python echo agent, when Node.js is here."""
    go_agent: Proc | None = None
    """An echo agent in Go on plain gRPC (clients/go), when Go is here."""
    push_agent: Proc | None = None
    """An echo agent taking its messages by push: a plain AgentService server, no SDK."""
    jit_warm: set[str] = field(default_factory=set)
    """The Node.js figures whose process has had its JIT warm-up (see :func:`jit_warmup`)."""

    def pattern_meter(self) -> CpuMeter:
        """The CPU of the processes a pattern run crosses (and the driver's)."""
        assert self.pattern_agents is not None and self.pattern_gateway is not None
        return CpuMeter(
            {
                "broker": [self.broker.pid],
                "agents": [self.pattern_agents.pid],
                "gateway": [self.pattern_gateway.pid],
            }
        )

    def meter(self) -> CpuMeter:
        """The CPU of the mesh's processes (and the driver's)."""
        return CpuMeter(
            {
                "broker": [self.broker.pid],
                "agents": [a.pid for a in self.agents],
                "gateway": [self.gateway.pid],
            }
        )


async def start_mesh(build_go: bool = True) -> Mesh:
    """Every process of the run, started together where one does not need another's address
    (the broker's dependents once it listens, each raw relay once its echo does): on two cores
    the processes' imports overlap instead of following one another. ``build_go``: see
    :func:`go_agent_program`."""
    procs: list[Proc] = []  # in the order they came up (stop_all stops the last first)
    drivers: list[NodeDriver] = []

    started = functools.partial(spawn_into, procs)

    async def node_driver(broker: str) -> None:
        drivers.append(await NodeDriver.start(broker, "echo-0"))

    go_build = asyncio.create_task(asyncio.to_thread(go_agent_program, build_go))

    async def go_echo(broker: str) -> Proc | None:
        program = await go_build
        if program is None:
            return None
        return await started(
            "agent",
            *("-broker", broker, "-id", "go-echo"),
            ready=r"go-echo serving on (\S+)",
            program=str(program),
        )

    async def echo_and_relay(*flags: str) -> tuple[Proc, Proc]:
        echo = await started(
            "-m", "benchmarks.baseline", "echo", *flags, ready=r"listening on (\S+)"
        )
        relay = await started(
            *("-m", "benchmarks.baseline", "relay", *flags, "--upstream", echo.address),
            ready=r"listening on (\S+)",
        )
        return echo, relay

    async def stampers_and_fanout() -> tuple[list[Proc], Proc]:
        async with asyncio.TaskGroup() as group:
            starting = [
                group.create_task(
                    started(
                        "-m", "benchmarks.baseline", "echo", "--stamp", ready=r"listening on (\S+)"
                    )
                )
                for _ in range(5)
            ]
        stampers = [task.result() for task in starting]
        fanout = await started(
            *("-m", "benchmarks.baseline", "fanout"),
            *(arg for stamper in stampers for arg in ("--upstream", stamper.address)),
            ready=r"listening on (\S+)",
        )
        return stampers, fanout

    try:
        async with asyncio.TaskGroup() as group:
            raw_pair = group.create_task(echo_and_relay())
            contract_pair = group.create_task(echo_and_relay("--contract"))
            fan_out = group.create_task(stampers_and_fanout())
            broker = await started(
                "-m",
                "mesh.cli",
                "broker",
                "--port",
                "0",
                "--max-messages-per-agent",
                "100000",
                "--max-total-messages",
                "400000",
                # The research subagents' tools (the pattern figures run research too), writing
                # their reports beside the processes' logs.
                "--tools",
                "agents.research:tool_host",
                ready=r"listening on (\S+?)[,\s]",
                env_extra={"AGENTMESH_REPORTS_DIR": str(logs_folder() / "research-reports")},
            )
            agent_sets = (
                [("echo", 0, 1, "bench"), ("sink", 0, 1, "sink:consume")]
                + [("b5", i, 1, "b5") for i in range(5)]
                + [("b100", i * 25, 25, "b100") for i in range(4)]
            )
            agents = [
                group.create_task(
                    started(
                        *("-m", "benchmarks.agents", "--broker", broker.address),
                        *("--prefix", prefix, "--start", str(start), "--count", str(count)),
                        *("--types", types.removesuffix(":consume")),
                        *(["--consume-only"] if types.endswith(":consume") else []),
                        ready=r"agents ready",
                    )
                )
                for prefix, start, count, types in agent_sets
            ]
            raw_agents = [
                group.create_task(
                    started(
                        *("-m", "benchmarks.baseline", "agent", "--broker", broker.address),
                        *("--agent-id", agent_id, *types),
                        ready=r"baseline agent \S+ ready",
                    )
                )
                for agent_id, types in [
                    ("raw-0", ()),
                    *((f"rawb5-{i}", ("--types", "rawb5")) for i in range(5)),
                ]
            ]
            push_agent = group.create_task(
                started(
                    *("-m", "benchmarks.baseline", "push-agent", "--broker", broker.address),
                    *("--agent-id", "push-0"),
                    ready=r"baseline agent \S+ ready",
                )
            )
            gateway = group.create_task(
                started(
                    *("-m", "mesh.cli", "gateway", "--broker", broker.address, "--port", "0"),
                    *("--routes", str(ROOT / "benchmarks" / "routes.json")),
                    ready=r"listening on (\S+?)[,\s]",
                )
            )
            # The patterns as the demo runs them: the sample and research agents in one
            # process (one client, one stream, as `agentmesh up` serves them) and a gateway
            # of their own with the default routing table.
            pattern_agents = group.create_task(
                started(
                    *("-m", "mesh.cli", "agent"),
                    *("agents:sample_agents", "agents.research:research_agents"),
                    *("--broker", broker.address),
                    ready=r"agentmesh agent \S+ serving",
                )
            )
            pattern_gateway = group.create_task(
                started(
                    *("-m", "mesh.cli", "gateway", "--broker", broker.address, "--port", "0"),
                    ready=r"listening on (\S+?)[,\s]",
                )
            )
            # Polyglot: an agent and a client in Node.js (@grpc/grpc-js, the same .proto files).
            node_agent = None
            if node_available():
                node_agent = group.create_task(
                    started(
                        *NODE_FLAGS,
                        str(NODE_CLIENT / "examples" / "echo-agent.js"),
                        "node-echo",
                        ready=r"node-echo serving on (\S+)",
                        env_extra={"AGENTMESH_BROKER": broker.address},
                        program="node",
                    )
                )
                group.create_task(node_driver(broker.address))
            # ... and an agent in Go, on plain gRPC (clients/go).
            go_agent = group.create_task(go_echo(broker.address))
        echo, relay = raw_pair.result()
        contract_echo, contract_relay = contract_pair.result()
        stampers, fanout = fan_out.result()
        raw_agent, *raw_b5 = [task.result() for task in raw_agents]
        return Mesh(
            broker,
            gateway.result(),
            echo,
            relay,
            fanout,
            contract_echo,
            contract_relay,
            stampers,
            [task.result() for task in agents],
            procs,
            raw_agent,
            raw_b5,
            pattern_agents.result(),
            pattern_gateway.result(),
            None if node_agent is None else node_agent.result(),
            drivers[0] if drivers else None,
            go_agent.result(),
            push_agent.result(),
        )
    except BaseException:
        for driver in drivers:
            await driver.close()
        await stop_all(procs)
        raise


# -- CPU cost ---------------------------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
ROLES = ("driver", "relay", "echo", "broker", "agents", "gateway")
"""The processes a CPU figure may name, in the order the report shows them."""


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of a process, all its threads, from /proc (None without it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_memory_mb(pid: int) -> tuple[float, float] | None:
    """(resident now, peak resident) of a process in MiB, from /proc (None without it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = dict(line.split(":", 1) for line in status.splitlines() if line.startswith("Vm"))
    if "VmRSS" not in found or "VmHWM" not in found:
        return None
    return int(found["VmRSS"].split()[0]) / 1024, int(found["VmHWM"].split()[0]) / 1024


def memory_by_role(roles: dict[str, list[int]]) -> dict[str, float] | None:
    """Each role's resident memory in MiB (its largest process), and the broker's peak: read
    after each repetition, memory that grows from one to the next is held by what passed."""
    out: dict[str, float] = {}
    for role, pids in roles.items():
        read = [process_memory_mb(pid) for pid in pids]
        if not read or any(r is None for r in read):
            return None
        out[f"{role}_mb"] = round(max(r[0] for r in read if r is not None), 1)
        if role == "broker":
            out["broker_peak_mb"] = round(max(r[1] for r in read if r is not None), 1)
    return out


class CpuMeter:
    """The CPU time processes spend over a measurement, per operation and by role: what each
    process of a path costs, a figure that noise on a shared machine moves far less than
    latency. The driver is this process; the others are read from /proc (to 1/CLK_TCK s, so
    a figure needs a few hundred operations to be exact to a few percent)."""

    def __init__(self, roles: dict[str, list[int]]) -> None:
        self.roles = roles

    def read(self) -> dict[str, float] | None:
        """CPU seconds so far by role; None where /proc cannot be read."""
        out = {"driver": time.process_time()}
        for role, pids in self.roles.items():
            seconds = [process_cpu_seconds(pid) for pid in pids]
            if any(s is None for s in seconds):
                return None
            out[role] = sum(s for s in seconds if s is not None)
        return out

    @staticmethod
    def cost(
        before: dict[str, float] | None, after: dict[str, float] | None, operations: float
    ) -> dict[str, float] | None:
        """Microseconds of CPU per operation by role, and their total."""
        if before is None or after is None:
            return None
        return CpuMeter.per_op({role: after[role] - before[role] for role in after}, operations)

    @staticmethod
    def per_op(spent: dict[str, float] | None, operations: float) -> dict[str, float] | None:
        """Microseconds per operation by role, and their total, of CPU seconds spent."""
        if spent is None or operations <= 0:
            return None
        cost = {role: seconds / operations * 1e6 for role, seconds in spent.items()}
        cost["total"] = sum(cost.values())
        return {role: round(us, 1) for role, us in cost.items()}


# -- measuring --------------------------------------------------------------------------------


def percentile_ms(ordered: Sequence[float], p: float) -> float:
    """The ``p``th percentile (nearest rank) in milliseconds of sorted samples in seconds:
    the 0th is the least, the 100th the greatest."""
    n = len(ordered)
    return ordered[min(n - 1, max(0, round(p / 100 * n + 0.5) - 1))] * 1000


def stats(samples: list[float]) -> dict[str, float]:
    """p50/p95/p99/max/mean in milliseconds of samples in seconds."""
    ordered = sorted(samples)
    return {
        "p50_ms": percentile_ms(ordered, 50),
        "p95_ms": percentile_ms(ordered, 95),
        "p99_ms": percentile_ms(ordered, 99),
        "max_ms": ordered[-1] * 1000,
        "mean_ms": statistics.fmean(ordered) * 1000,
        "n": len(ordered),
    }


def quantiles_ms(samples: list[float]) -> list[float]:
    """The 0th to 100th percentiles of samples in seconds, in milliseconds: the whole
    distribution in 101 numbers (``latest.png`` draws it)."""
    ordered = sorted(samples)
    return [percentile_ms(ordered, p) for p in range(101)]


async def timed(
    op: Callable[[], Awaitable[Any]], count: int, warmup: int, *, own_latency: bool = False
) -> list[float]:
    """The latency of ``count`` operations after ``warmup``: each one's duration, or with
    ``own_latency`` the seconds the operation returns (a latency it measured itself)."""
    for _ in range(warmup):
        await op()
    # As the mesh's processes do once serving: the driver's own heap (results so far) is not
    # walked by a full collection in the middle of a sample, for the baseline and mesh alike.
    gc.freeze()
    samples = []
    clock = time.perf_counter
    for _ in range(count):
        start = clock()
        result = await op()
        samples.append(result if own_latency else clock() - start)
    return samples


async def warm_up(op: Callable[[], Awaitable[Any]], count: int, in_flight: int) -> None:
    """``count`` operations, ``in_flight`` at a time: a JIT counts the calls, not how far
    apart they come, so a Node.js process's thousands of warm-up requests take a fraction of
    the time concurrently."""
    left = iter(range(count))

    async def worker() -> None:
        for _ in left:
            await op()

    await asyncio.gather(*(worker() for _ in range(min(in_flight, count))))


PROFILES = RESULTS / "profiles"
_profiled: set[str] = set()


@contextlib.asynccontextmanager
async def profiled(name: str, meter: CpuMeter) -> AsyncIterator[None]:
    """With ``BENCH_PROFILE=ROLE`` (broker, agents, gateway, driver, relay, echo): py-spy
    samples that process (the first of a role that has several) while the figure ``name`` is
    measured, once per run, into benchmarks/results/profiles/NAME.ROLE.svg (a flame graph)."""
    role = os.environ.get("BENCH_PROFILE", "")
    pids = [os.getpid()] if role == "driver" else meter.roles.get(role, [])
    beside = Path(sys.executable).parent / "py-spy"  # installed in the same environment
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if not role or not pids or name in _profiled or spy is None:
        if role and spy is None and not _profiled:
            _profiled.add(name)
            print("BENCH_PROFILE: py-spy is not installed (pip install py-spy)", file=sys.stderr)
        yield
        return
    _profiled.add(name)
    PROFILES.mkdir(parents=True, exist_ok=True)
    output = PROFILES / f"{name}.{role}.svg"
    process = await asyncio.create_subprocess_exec(
        spy,
        *("record", "--pid", str(pids[0]), "--rate", "500", "--format", "flamegraph"),
        *("--output", str(output), "--nonblocking", "--duration", "600"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    await asyncio.sleep(1.0)  # attached and sampling
    try:
        yield
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)  # py-spy writes the graph on SIGINT
        _, err = await process.communicate()
        if not output.exists():
            print(f"BENCH_PROFILE: py-spy wrote nothing: {err.decode()[-300:]}", file=sys.stderr)


async def measured(
    name: str,
    op: Callable[[], Awaitable[Any]],
    count: int,
    warmup: int,
    meter: CpuMeter,
    *,
    own_latency: bool = False,
) -> dict[str, Any]:
    """The latency figures of ``count`` operations after ``warmup``, with their CPU cost (and
    a profile of one process when ``BENCH_PROFILE`` asks for one)."""
    await warm_up(op, warmup, 1)
    async with profiled(name, meter):
        before = meter.read()
        samples = await timed(op, count, 0, own_latency=own_latency)
        figure: dict[str, Any] = stats(samples)
        figure["cpu_us_per_op"] = CpuMeter.cost(before, meter.read(), count)
    return figure


async def rate(op: Callable[[], Awaitable[int]], in_flight: int, seconds: float) -> float:
    """Operations per second with ``in_flight`` workers running ``op`` for ``seconds``."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            finished = await op()  # not `done += await op()`: that loses concurrent updates
            done += finished

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return done / seconds


async def rate_with_cost(
    op: Callable[[], Awaitable[int]], in_flight: int, seconds: float, meter: CpuMeter
) -> dict[str, Any]:
    """``throughput_<in_flight>`` and the CPU cost per operation at that load."""
    before = meter.read()
    throughput = await rate(op, in_flight, seconds)
    return {
        f"throughput_{in_flight}": throughput,
        f"cpu_us_per_op_{in_flight}": CpuMeter.cost(before, meter.read(), throughput * seconds),
    }


def paired(figures: dict[str, dict[str, Any]]) -> None:
    """Sets each figure measured beside the relay against it: ``x_relay2_p50`` and
    ``x_relay2_p95`` of one repetition (over the repetitions, their median and spread)."""
    relay = figures["baseline.relay2"]
    for name, figure in figures.items():
        if name != "baseline.relay2":
            figure.update(latency_ratios(figure, relay))


def latency_ratios(figure: dict[str, Any], relay: dict[str, Any]) -> dict[str, float]:
    """``x_relay2_p50`` and ``x_relay2_p95``: a latency figure against the relay's."""
    return {
        "x_relay2_p50": figure["p50_ms"] / relay["p50_ms"],
        "x_relay2_p95": figure["p95_ms"] / relay["p95_ms"],
    }


Turn = tuple[Callable[[], Awaitable[Any]], CpuMeter]
"""An operation to measure, and the processes whose CPU it costs."""
TURN = 100
"""Operations of each in a turn, measuring side by side."""


async def measured_in_turns(
    ops: dict[str, Turn],
    count: int,
    warmup: int,
    *,
    block: int = TURN,
) -> dict[str, dict[str, Any]]:
    """The figures of several operations measured side by side: ``block`` of each in turn
    until each has ``count``, each with its CPU cost. Whatever the machine does meanwhile
    (another tenant, the clock's frequency) falls on all of them alike, so their ratio holds
    to a few percent where figures measured one after the other, seconds apart, drift 10%
    and more from run to run. Profiled (``BENCH_PROFILE``) under the last one's name."""
    for op, _ in ops.values():
        await timed(op, 0, warmup)
    samples: dict[str, list[float]] = {name: [] for name in ops}
    spent: dict[str, dict[str, float] | None] = {name: {} for name in ops}
    roles = {role: pids for _, meter in ops.values() for role, pids in meter.roles.items()}
    async with profiled(list(ops)[-1], CpuMeter(roles)):
        for done in range(0, count, block):
            size = min(block, count - done)
            for name, (op, meter) in ops.items():
                before = meter.read()
                samples[name] += await timed(op, size, 0)
                after, total = meter.read(), spent[name]
                if before is None or after is None or total is None:
                    spent[name] = None
                    continue
                for role in after:
                    total[role] = total.get(role, 0.0) + after[role] - before[role]
    figures = {}
    for name in ops:
        figure: dict[str, Any] = stats(samples[name])
        figure["quantiles_ms"] = quantiles_ms(samples[name])
        figure["cpu_us_per_op"] = CpuMeter.per_op(spent[name], count)
        figures[name] = figure
    return figures


async def delivered_rate(
    op: Callable[[], Awaitable[int]],
    in_flight: int,
    seconds: float,
    client: Any,
    sink: str,
    meter: CpuMeter,
) -> dict[str, Any]:
    """One-way throughput end to end: messages sent for ``seconds`` by ``in_flight`` workers,
    divided by the time until the sink's consumer has received and acknowledged every one
    (``throughput``); ``accepted_throughput`` is the rate the broker accepted them at, and
    ``cpu_us_per_op`` what a message cost the processes, sender to consumer."""
    before = meter.read()
    started = time.perf_counter()
    accepted = await rate(op, in_flight, seconds)
    async with asyncio.timeout(120):
        while True:
            [queue] = (await client.queue_stats(sink)).agents
            if queue.depth + queue.in_flight == 0:
                break
            await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    return {
        "throughput": accepted * seconds / elapsed,
        "accepted_throughput": accepted,
        "cpu_us_per_op": CpuMeter.cost(before, meter.read(), accepted * seconds),
    }


async def while_filling(client: Any, total: int) -> dict[str, Any]:
    """Roundtrips to echo-0, one after another, for as long as four senders take to fill the
    queue of an agent nobody consumes with ``total`` messages (batches of 100): what traffic
    that still flows sees of a broker under a growing backlog (the batches it takes in between,
    the collector walking what the queues hold). ``fill_throughput``: the messages/s the
    backlog grew by. The queue is emptied afterwards."""
    await client.register("fill-0", agent_types=["fill"])
    filled = 0

    async def fill() -> None:
        nonlocal filled
        while filled < total:
            batch = [
                Message(
                    from_agent="driver",
                    to_agent="fill-0",
                    content={"action": "fill", "parameters": {"i": i}},
                    ttl=600,
                )
                for i in range(100)
            ]
            for result in await client.send_batch(batch):
                if not isinstance(result, Message):
                    raise RuntimeError(f"filling a queue: {result}")
                filled += 1

    samples = []
    started = time.perf_counter()
    fillers = asyncio.gather(*(fill() for _ in range(4)))
    while not fillers.done():
        sent = time.perf_counter()
        await client.request("echo-0", PAYLOAD)
        samples.append(time.perf_counter() - sent)
    await fillers
    figure: dict[str, Any] = stats(samples)
    figure["fill_throughput"] = filled / (time.perf_counter() - started)
    while await client.receive("fill-0", 2_000):
        pass
    await client.deregister("fill-0")
    return figure


async def drain(client: Any, agent_id: str) -> None:
    """Empties an agent's queue (what was sent to an agent nobody consumes must not hold
    capacity or load the machine during the next figures)."""
    async with asyncio.timeout(60):
        while True:
            await client.receive(agent_id)
            [queue] = (await client.queue_stats(agent_id)).agents
            if queue.depth + queue.in_flight == 0:
                return
            await asyncio.sleep(0.05)  # leased messages come back when acked


# -- the figures ------------------------------------------------------------------------------


async def run_once(mesh: Mesh, s: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n, w = s.operations, s.warmup
    sample_message = Message(from_agent="driver", to_agent="echo-0", content=PAYLOAD)
    payload = message_to_pb(sample_message).SerializeToString()

    hop1_meter = CpuMeter({"echo": [mesh.echo.pid]})
    relay_meter = CpuMeter({"relay": [mesh.relay.pid], "echo": [mesh.echo.pid]})
    meter = mesh.meter()
    relay1 = StreamClient(mesh.echo.address)
    contract2 = StreamClient(mesh.contract_relay.address)
    fanout = StreamClient(mesh.fanout.address)
    try:
        out["baseline.hop1"] = await measured(
            "baseline.hop1", lambda: relay1.roundtrip(payload), n, w, hop1_meter
        )

        # (Measured below, side by side with the mesh's roundtrip; here for the table's order.)
        out["baseline.relay2"] = {}
        # The same two hops speaking the mesh's Connect frames: what the contract itself costs.
        request = ConnectRequest(seq=1)
        message_to_pb(sample_message, request.request.message)
        request_frame = request.SerializeToString()

        async def contract_op() -> None:
            ConnectResponse.FromString(await contract2.roundtrip(request_frame))

        out["baseline.contract2"] = await measured(
            "baseline.contract2",
            contract_op,
            n,
            w,
            CpuMeter({"relay": [mesh.contract_relay.pid], "echo": [mesh.contract_echo.pid]}),
        )
        # The physical limit of broadcast5: one frame to five processes through a raw relay,
        # until the last has it (each answers with the time it got it) and until every answer
        # is back (the shape of the gather around broadcast5).
        fanned: list[float] = []

        async def fanout_op() -> float:
            sent_at, started = time.time(), time.perf_counter()
            answer = await fanout.roundtrip(payload)
            fanned.append(time.perf_counter() - started)
            return max(stamps(answer)) - sent_at

        fanout_meter = CpuMeter(
            {"relay": [mesh.fanout.pid], "echo": [p.pid for p in mesh.stampers]}
        )
        out["baseline.fanout5"] = await measured(
            "baseline.fanout5", fanout_op, n // 4, w // 4, fanout_meter, own_latency=True
        )
        out["baseline.fanout5_gather"] = stats(fanned[-(n // 4) :])
    finally:
        await relay1.close()
        await contract2.close()
        await fanout.close()

    async with contextlib.AsyncExitStack() as stack:
        relay2 = StreamClient(mesh.relay.address)
        stack.push_async_callback(relay2.close)
        client = await stack.enter_async_context(connect(mesh.broker.address, agent_id="driver"))
        await client.register()
        out["send"] = await measured(
            "send",
            lambda: client.send("sink-0", {"action": "sink", "parameters": PAYLOAD["parameters"]}),
            n,
            w,
            meter,
        )
        await client.register("parked")
        for _ in range(10):
            await client.send("parked", PAYLOAD)

        # Receive: the time of the ReceiveMessages call alone (a message is put back untimed).
        receive_samples = []
        for i in range(n + w):
            await client.send("parked", PAYLOAD)
            started = time.perf_counter()
            await client.receive("parked", max_messages=1)
            if i >= w:
                receive_samples.append(time.perf_counter() - started)
        out["receive"] = stats(receive_samples)
        # The roundtrip, the relay it is set against, and the same roundtrip through the same
        # broker between ends in raw grpc.aio on the contract (no SDK at either end: the
        # broker's share of it), side by side: their ratios are what this run is for, and
        # measured minutes apart they would move with the machine.
        turns: dict[str, Turn] = {
            "baseline.relay2": (lambda: relay2.roundtrip(payload), relay_meter)
        }
        if mesh.raw_agent is not None:
            raw_request = message_to_pb(
                Message(from_agent="raw-driver", to_agent="raw-0", content=PAYLOAD)
            )
            raw_request.ClearField("message_id")  # each one gets its own from the broker
            raw_request.ClearField("timestamp")
            raw_client = ContractClient(mesh.broker.address)
            stack.push_async_callback(raw_client.close)
            turns["roundtrip_raw_ends"] = (
                lambda: raw_client.request(raw_request),
                CpuMeter({"broker": [mesh.broker.pid], "agents": [mesh.raw_agent.pid]}),
            )
        turns["roundtrip"] = (lambda: client.request("echo-0", PAYLOAD), meter)
        side_by_side = await measured_in_turns(turns, n, w)
        paired(side_by_side)
        out.update(side_by_side)

        # Then each at 64 in flight, one after the other.
        async def relay_op() -> int:
            await relay2.roundtrip(payload)
            return 1

        async def roundtrip_op() -> int:
            await client.request("echo-0", PAYLOAD)
            return 1

        for name, op, op_meter in (
            ("baseline.relay2", relay_op, relay_meter),
            ("roundtrip", roundtrip_op, meter),
        ):
            out[name].update(await rate_with_cost(op, 64, s.throughput_seconds, op_meter))

        def handoff_message() -> Message:
            return Message(
                from_agent="driver",
                to_agent="echo-0",
                message_type=MessageType.HANDOFF,
                content={
                    "action": "execute_handoff",
                    "parameters": {
                        "task_description": "Approve refund",
                        "context": {"order": 1},
                        "previous_result": None,
                        "constraints": {},
                    },
                },
                metadata={"workflow_id": "wf_bench", "step_number": 2},
            )

        out["handoff"] = await measured(
            "handoff", lambda: client.request_message(handoff_message()), n, w, meter
        )

        # Polyglot: the same roundtrip to echo agents of other kinds (in Node.js, in Go on
        # plain gRPC, and a raw grpc.aio server taking its messages by push), and from the
        # Node.js client to the Python echo agent (timed in Node). The two Node.js processes
        # warm up together (nothing is measured meanwhile), then each is measured alone.
        warming = []
        if mesh.node_agent is not None:
            to_node = functools.partial(client.request, "node-echo", PAYLOAD)
            jit = jit_warmup(mesh.jit_warm, "node_agent.roundtrip", s)
            warming.append(warm_up(to_node, jit, JIT_WARMUP_IN_FLIGHT))
        if mesh.node_driver is not None:
            jit = jit_warmup(mesh.jit_warm, "node_client.roundtrip", s)
            warming.append(mesh.node_driver.warm(n // 2, jit))
        await asyncio.gather(*warming)
        for name, agent_id, proc, warmup in (
            ("node_agent.roundtrip", "node-echo", mesh.node_agent, 0),
            ("go_agent.roundtrip", "go-echo", mesh.go_agent, w // 2),
            ("push_agent.roundtrip", "push-0", mesh.push_agent, w // 2),
        ):
            if proc is not None:
                out[name] = await measured(
                    name,
                    functools.partial(client.request, agent_id, PAYLOAD),
                    n // 2,
                    warmup,
                    CpuMeter({"broker": [mesh.broker.pid], "agents": [proc.pid]}),
                )
        if mesh.node_driver is not None:
            out["node_client.roundtrip"] = await mesh.node_driver.measure(
                CpuMeter(
                    {
                        "driver": [mesh.node_driver.pid],
                        "broker": [mesh.broker.pid],
                        "agents": [mesh.agents[0].pid],  # (echo-0's process)
                    }
                ),
            )

        # A broadcast's latency is the time until the last of its agents has it: each agent
        # answers with the wall-clock time its handler got the message (one clock for every
        # process of this machine), so one gather gives both that and the scatter-gather
        # roundtrip (until every answer is back, kept as broadcastN_gather).
        gathered: list[float] = []

        async def broadcast_to(types: str, expected: int) -> float:
            sent_at, started = time.time(), time.perf_counter()
            stamps = [
                float(item.response.content["received_at"])  # type: ignore[index]
                async for item in client.gather({"query": "q"}, agent_types=[types], timeout=5)
                if item.response is not None
            ]
            gathered.append(time.perf_counter() - started)
            if len(stamps) != expected:
                raise RuntimeError(f"broadcast to {types} reached {len(stamps)}/{expected}")
            return max(stamps) - sent_at

        for name, types, expected, count, warmup in (
            ("broadcast5", "b5", 5, n // 4, w // 4),
            ("broadcast100", "b100", 100, max(20, n // 40), max(5, w // 20)),
        ):
            out[name] = await measured(
                name,
                lambda: broadcast_to(types, expected),  # noqa: B023 (awaited in this turn)
                count,
                warmup,
                meter,
                own_latency=True,
            )
            out[f"{name}_gather"] = stats(gathered[-count:])
            gathered.clear()
        # The same broadcast between ends in raw grpc.aio (a driver and five agents in five
        # processes on the contract alone): the broker's share of broadcast5.
        if mesh.raw_b5:
            raw_gather = message_to_pb(
                Message(from_agent="raw-driver", to_agent="broadcast", content={"query": "q"})
            )
            raw_gather.ClearField("message_id")
            raw_gather.ClearField("timestamp")
            raw_gather.ClearField("message_type")  # (unset in a gather: BROADCAST copies)
            raw_client = ContractClient(mesh.broker.address)

            async def raw_broadcast() -> float:
                sent_at = time.time()
                answers = await raw_client.gather(raw_gather, ["rawb5"])
                if len(answers) != 5:
                    raise RuntimeError(f"a raw broadcast reached {len(answers)}/5")
                return max(a.content.fields["received_at"].number_value for a in answers) - sent_at

            try:
                out["broadcast5_raw_ends"] = await measured(
                    "broadcast5_raw_ends",
                    raw_broadcast,
                    n // 4,
                    w // 4,
                    CpuMeter({"broker": [mesh.broker.pid], "agents": [p.pid for p in mesh.raw_b5]}),
                    own_latency=True,
                )
            finally:
                await raw_client.close()
        out["broadcast5_send"] = await measured(
            "broadcast5_send",
            lambda: client.broadcast({"action": "sink"}, agent_types=["b5"]),
            n // 4,
            w // 4,
            meter,
        )

        for in_flight in (1, 16, 64):

            async def one_way() -> int:
                await client.send("sink-0", {"action": "sink", "parameters": {"i": 1}})
                return 1

            out[f"oneway_{in_flight}"] = await delivered_rate(
                one_way, in_flight, s.throughput_seconds, client, "sink-0", meter
            )
        # Batches as a client sends them: new messages each time, the three priorities
        # mixed and a TTL set, into a queue with a capacity (the broker's flags above).
        priorities = (Priority.HIGH, Priority.MEDIUM, Priority.LOW)

        async def batch_op() -> int:
            fresh = [
                Message(
                    from_agent="driver",
                    to_agent="sink-0",
                    content={"action": "sink", "parameters": {"i": i}},
                    priority=priorities[i % 3],
                    ttl=60,
                )
                for i in range(100)
            ]
            results = await client.send_batch(fresh)
            return sum(isinstance(r, Message) for r in results)

        # 16 batches in flight, as for single sends: with 4 the broker sat idle for a third
        # of the time between batches, and a throughput is the rate of a busy mesh.
        out["oneway_batch100"] = await delivered_rate(
            batch_op, 16, s.throughput_seconds, client, "sink-0", meter
        )
        out["roundtrip_filling"] = await while_filling(client, s.fill_messages)

    async with GatewayClient(mesh.gateway.address) as gw:

        async def first_event() -> None:
            stream = gw.route("bench_group_chat")
            async for _ in stream:
                break
            await stream.aclose()  # type: ignore[attr-defined]

        async def group_chat() -> None:
            events = await gw.collect(
                gw.group_chat(agent_ids=["b5-0", "b5-1", "b5-2"], query="What stock should I buy?")
            )
            if events[-1]["data"]["status"] != "COMPLETED":
                raise RuntimeError("group chat did not complete")

        out["routing"] = await measured("routing", first_event, n // 4, w // 4, meter)
        out["group_chat"] = await measured("group_chat", group_chat, n // 4, w // 4, meter)
    out.update(await measure_patterns(mesh, s))
    return out


async def measure_patterns(mesh: Mesh, s: Settings) -> dict[str, Any]:
    """Every pattern run of the demo (gateway.demo.SCENARIOS) end to end, from the call to
    the gateway until its RESULT, on the sample and research agents: ``pattern.<name>``."""
    from gateway.demo import SCENARIOS

    count, warmup = max(5, s.operations // 40), max(2, s.warmup // 20)
    meter = mesh.pattern_meter()
    out: dict[str, Any] = {}
    assert mesh.pattern_gateway is not None
    async with GatewayClient(mesh.pattern_gateway.address) as gw:
        for scenario in SCENARIOS:

            async def run_pattern(scenario: Any = scenario) -> None:
                events = await gw.collect(gw.run(scenario.rpc, scenario.request))
                last = events[-1] if events else {}
                status = last.get("data", {}).get("status")
                if last.get("kind") != "RESULT" or status != scenario.expect:
                    raise RuntimeError(
                        f"pattern {scenario.name} ended {last.get('kind')} {status}, "
                        f"not RESULT {scenario.expect}"
                    )

            name = f"pattern.{scenario.name}"
            out[name] = await measured(name, run_pattern, count, warmup, meter)
    return out


class SwitchedSampler(Sampler):
    """A sampler whose choice changes between blocks of one run (``current``)."""

    def __init__(self, current: Sampler) -> None:
        self.current = current

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return self.current.should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return f"Switched{{{self.current.get_description()}}}"


async def measure_tracing_cost(s: Settings) -> dict[str, Any]:
    """Roundtrip p50 with tracing on vs off, side by side: two brokers with an echo agent
    each, one set writing spans (JSON lines) and one not, measured in alternating blocks so
    that the machine's load falls on both alike. With tracing on every request is sampled,
    then 10% of them (head sampling, as production runs it): the driver's sampler decides,
    the traced broker and agent follow its decision (OpenTelemetry's default sampler).

    Each repetition starts its processes afresh (on two cores, where the scheduler puts four
    processes moves one set's p50 against the other's by more than tracing costs); the
    overheads are the median of the repetitions', with their spread."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from mesh.tracing import configure_tracing

    folder = tempfile.mkdtemp(prefix="agentmesh-bench-traces-")
    # A tracer keeps the sampler its provider had when the tracer was made: the driver's
    # sampler is switched between blocks inside one sampler of the provider's.
    switch = SwitchedSampler(ALWAYS_OFF)
    provider = TracerProvider(
        sampler=switch, resource=Resource.create({"service.name": "bench-driver"})
    )
    trace.set_tracer_provider(provider)
    if configure_tracing("bench-driver", folder) is not provider:
        raise RuntimeError("the driver's tracer provider was set before the tracing bench")
    pooled: dict[str, list[float]] = {"off": [], "on": [], "sampled": []}
    overheads: dict[str, list[float]] = {"overhead": [], "sampled_10pct_overhead": []}
    for _ in range(s.repetitions):
        samples = await _tracing_round(s, folder, switch)
        provider.force_flush()
        p50 = {key: stats(values)["p50_ms"] for key, values in samples.items()}
        overheads["overhead"].append(p50["on"] / p50["off"] - 1)
        overheads["sampled_10pct_overhead"].append(p50["sampled"] / p50["off"] - 1)
        for key, values in samples.items():
            pooled[key] += values
    off, sampled = stats(pooled["off"]), stats(pooled["sampled"])
    out: dict[str, Any] = {
        **stats(pooled["on"]),
        "untraced_p50_ms": off["p50_ms"],
        "sampled_10pct_p50_ms": sampled["p50_ms"],
    }
    for key, values in overheads.items():
        out[key] = statistics.median(values)
        out[f"{key}_spread"] = [min(values), max(values)]
    return out


async def _tracing_round(
    s: Settings, folder: str, switch: SwitchedSampler
) -> dict[str, list[float]]:
    """One repetition of :func:`measure_tracing_cost`: roundtrip latencies with tracing off,
    on, and sampled at 10%, from processes of its own."""
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_OFF,
        ALWAYS_ON,
        ParentBased,
        TraceIdRatioBased,
    )

    procs: list[Proc] = []
    brokers: dict[str, str] = {}

    async def broker_and_agent(name: str, env: dict[str, str]) -> None:
        broker = await spawn_into(
            procs,
            *("-m", "mesh.cli", "broker", "--port", "0"),
            env_extra=env,
            ready=r"listening on (\S+?)[,\s]",
        )
        await spawn_into(
            procs,
            *("-m", "benchmarks.agents", "--broker", broker.address),
            *("--prefix", name, "--count", "1"),
            env_extra=env,
            ready=r"agents ready",
        )
        brokers[name] = broker.address

    try:
        async with asyncio.TaskGroup() as group:  # (both sets start together)
            group.create_task(broker_and_agent("plain", {}))
            group.create_task(broker_and_agent("traced", {"AGENTMESH_TRACE_DIR": folder}))
        samples: dict[str, list[float]] = {"off": [], "on": [], "sampled": []}
        block = max(25, s.operations // 10)
        async with (
            connect(brokers["plain"], agent_id="driver") as plain,
            connect(brokers["traced"], agent_id="driver") as traced,
        ):
            for client, agent in ((plain, "plain-0"), (traced, "traced-0")):
                await timed(functools.partial(client.request, agent, PAYLOAD), 0, s.warmup)
            for _ in range(max(1, s.operations // block)):
                for key, client, agent, sampler in (
                    ("off", plain, "plain-0", ALWAYS_OFF),
                    ("on", traced, "traced-0", ALWAYS_ON),
                    ("sampled", traced, "traced-0", ParentBased(TraceIdRatioBased(0.1))),
                ):
                    switch.current = sampler
                    samples[key] += await timed(
                        functools.partial(client.request, agent, PAYLOAD), block, 0
                    )
        switch.current = ALWAYS_OFF
    finally:
        await stop_all(procs)
    return samples


@contextlib.asynccontextmanager
async def local_redis(folder: str) -> Any:
    """A redis-server and a three-node Redis Cluster of our own on free ports (None, None when
    Redis is not installed)."""
    if LocalRedis.unavailable():
        yield None, None
        return
    # (started together: each waits on its servers' start-up, not on the CPU)
    starting = [
        asyncio.create_task(asyncio.to_thread(LocalRedis.start, Path(folder) / "redis")),
        asyncio.create_task(asyncio.to_thread(LocalRedis.start_cluster, Path(folder) / "cluster")),
    ]
    await asyncio.wait(starting)
    try:
        single, cluster = (task.result() for task in starting)
        yield single.url, cluster.url
    finally:
        for task in starting:
            if not task.cancelled() and task.exception() is None:
                await asyncio.to_thread(task.result().stop)


def store_urls(folder: str, redis_url: str | None, cluster_url: str | None) -> dict[str, str]:
    """The queue stores compared side by side."""
    urls = {"memory": "memory://", "sqlite": f"sqlite://{folder}/queues.db"}
    if redis_url:
        urls["redis"] = redis_url
    if cluster_url:
        urls["redis_cluster"] = cluster_url
    return urls


async def spawn_broker(url: str, procs: list[Proc]) -> Proc:
    """A broker on the queue store at ``url``, added to ``procs`` (see :func:`spawn_into`)."""
    return await spawn_into(
        procs,
        "-m",
        "mesh.cli",
        "broker",
        "--port",
        "0",
        "--store",
        url,
        "--max-messages-per-agent",
        "100000",
        "--max-total-messages",
        "100000",
        ready=r"listening on (\S+?)[,\s]",
    )


async def measure_stores(s: Settings) -> dict[str, Any]:
    """The same sends against a broker on each queue store, one store at a time: what
    durability and sharing cost. The durable store commits before it acknowledges, so its
    latency includes a commit (concurrent and batched sends share commits); the Redis store
    runs a script in Redis per operation (on a single Redis, and on a three-node Redis
    Cluster where each agent's queue lives on one node). Each store's roundtrip: a request
    to an echo agent and its answer, the store's writes on its way (the request's put, its
    lease, the answer's ack; with Redis, the request's route). Each store's broadcast to 20
    agents: its 20 puts (one pipeline on Redis). Then one-way throughput with one broker
    replica and with two on the same Redis."""
    folder = tempfile.mkdtemp(prefix="agentmesh-bench-store-")
    async with local_redis(folder) as (redis_url, cluster_url):
        out = await _measure_stores(s, store_urls(folder, redis_url, cluster_url))
        if redis_url:
            out.update(await _measure_replicas(s, redis_url))
    return out


async def _measure_replicas(s: Settings, redis_url: str) -> dict[str, Any]:
    """Two clients with 16 sends in flight each: both through one replica, then one client
    per replica (two broker processes on one Redis)."""
    from mesh.redis_store import RedisQueueStore

    out: dict[str, Any] = {}
    brokers: list[Proc] = []
    try:
        async with asyncio.TaskGroup() as group:  # (the two start together)
            group.create_task(spawn_broker(redis_url, brokers))
            group.create_task(spawn_broker(redis_url, brokers))
        for name, targets in (
            ("replicas1", [brokers[0].address, brokers[0].address]),
            ("replicas2", [brokers[0].address, brokers[1].address]),
        ):
            clients = [connect(t, agent_id=f"driver{i}") for i, t in enumerate(targets)]
            try:
                await clients[0].register("sink")
                rates = await asyncio.gather(
                    *(
                        rate(
                            functools.partial(_send_one, c),
                            16,
                            s.throughput_seconds,
                        )
                        for c in clients
                    )
                )
                out[f"store.redis.{name}.oneway_32"] = {"throughput": sum(rates)}
                await drain(clients[0], "sink")
            finally:
                for c in clients:
                    await c.close()
    finally:
        await stop_all(brokers)
        store = RedisQueueStore(redis_url)
        await store.flush()
        await store.close()
    return out


async def _send_one(client: Any) -> int:
    await client.send("sink", {"action": "sink", "parameters": {"i": 1}})
    return 1


async def _measure_stores(s: Settings, urls: dict[str, str]) -> dict[str, Any]:
    """Each store's broker, measured one at a time; they start together (their start-ups
    overlap on the two cores), and each stops once measured."""
    out: dict[str, Any] = {}
    n, w = max(200, s.operations // 2), s.warmup
    brokers: list[Proc] = []  # (every one that came up, stopped at the end whatever happens)
    try:
        async with asyncio.TaskGroup() as group:
            starting = {
                name: group.create_task(spawn_broker(url, brokers)) for name, url in urls.items()
            }
        for name, task in starting.items():
            broker = task.result()
            echo: list[Proc] = []
            try:
                await spawn_into(
                    echo,
                    *("-m", "benchmarks.agents", "--broker", broker.address, "--count", "1"),
                    ready=r"agents ready",
                )
                async with connect(broker.address, agent_id="driver") as client:
                    await client.register("sink")

                    async def send() -> int:
                        await client.send("sink", {"action": "sink", "parameters": {"i": 1}})
                        return 1

                    out[f"store.{name}.send"] = stats(await timed(send, n, w))

                    async def ask() -> int:
                        await client.request("echo-0", PAYLOAD)
                        return 1

                    # (a fresh agent process: its first requests pay for its cold start)
                    out[f"store.{name}.roundtrip"] = stats(await timed(ask, n, max(w, 300)))
                    await drain(client, "sink")

                    # A broadcast to 20 agents of a type (their queues, nobody consuming):
                    # the broker takes the call once every copy is queued.
                    fanned = [f"fan-{i}" for i in range(20)]
                    for agent_id in fanned:
                        await client.register(agent_id, agent_types=["fan"])

                    async def broadcast() -> int:
                        await client.broadcast({"action": "notice"}, agent_types=["fan"])
                        return 1

                    out[f"store.{name}.broadcast20"] = stats(await timed(broadcast, n // 2, w))
                    for agent_id in fanned:
                        await drain(client, agent_id)
                    out[f"store.{name}.oneway_16"] = {
                        "throughput": await rate(send, 16, s.throughput_seconds)
                    }
                    await drain(client, "sink")

                    async def batch_op() -> int:
                        fresh = [
                            Message(
                                from_agent="driver", to_agent="sink", content={"action": "sink"}
                            )
                            for _ in range(100)
                        ]
                        results = await client.send_batch(fresh)
                        return sum(isinstance(r, Message) for r in results)

                    out[f"store.{name}.batch100"] = {
                        "throughput": await rate(batch_op, 4, s.throughput_seconds)
                    }
                    await drain(client, "sink")
            finally:
                await stop_all([broker, *echo])
    finally:
        await stop_all(brokers)
    return out


SPREAD = ("p50_ms", "throughput", "throughput_64", "x_relay2_p50", "x_relay2_p95")
"""The figures whose spread over the repetitions is kept beside their median."""


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each figure over the repetitions, with the spread (min, max) of the medians;
    of a distribution's quantiles, the median of each."""
    combined: dict[str, Any] = {}
    for name in runs[0]:
        combined[name] = {}
        for key in runs[0][name]:
            values = [run[name][key] for run in runs]
            if key.startswith("cpu_us_per_op"):
                combined[name][key] = median_cost(values)
                continue
            if key == "quantiles_ms":
                combined[name][key] = [statistics.median(q) for q in zip(*values, strict=True)]
                continue
            combined[name][key] = statistics.median(values)
            if len(values) > 1 and key in SPREAD:
                combined[name][f"{key}_spread"] = [min(values), max(values)]
    return combined


def median_cost(costs: list[dict[str, float] | None]) -> dict[str, float] | None:
    """The median of each role's CPU cost over the repetitions (None if one was not read)."""
    if any(c is None for c in costs):
        return None
    known = [c for c in costs if c is not None]
    return {role: round(statistics.median(c[role] for c in known), 1) for role in known[0]}


# -- targets and reports ------------------------------------------------------------------------

TARGETS: list[tuple[str, str, str, float, str]] = [
    # figure, key, comparison, limit, what it stands for
    ("send", "p95_ms", "<", 1.0, "RT-011 send p95 < 10 ms, with a 10x margin"),
    ("receive", "p95_ms", "<", 1.0, "RT-011 receive p95 < 10 ms, with a 10x margin"),
    ("roundtrip", "p95_ms", "<", 5.0, "RT-011 roundtrip p95 < 50 ms, with a 10x margin"),
    ("handoff", "p95_ms", "<", 20.0, "RT-011 hand-off p95 < 200 ms, with a 10x margin"),
    ("broadcast5_send", "p50_ms", "<", 5.0, "RT-011 broadcast_send p50 < 50 ms, with a 10x margin"),
    (
        "broadcast5",
        "p50_ms",
        "<",
        10.0,
        "RT-011 broadcast_delivery (every agent has it) < 100 ms, with a 10x margin",
    ),
    ("broadcast5", "p50_ms", "<=", 1.5, "broadcast to 5 agents in 5 processes p50 <= 1.5 ms"),
    ("broadcast100", "p50_ms", "<=", 20.0, "broadcast to 100 agents p50 <= 20 ms"),
    ("routing", "p95_ms", "<", 10.0, "RT-011 routing p95 < 100 ms, with a 10x margin"),
    (
        "pattern.group_chat",
        "mean_ms",
        "<",
        1000.0,
        "RF-010 group chat duration avg < 10 s, with a 10x margin",
    ),
    (
        "pattern.handoff",
        "mean_ms",
        "<",
        1500.0,
        "RF-010 hand-off duration avg < 15 s, with a 10x margin",
    ),
    (
        "pattern.handoff",
        "p95_ms",
        "<",
        2000.0,
        "RF-010 hand-off workflow of 4 agents < 20 s, with a 10x margin",
    ),
    (
        "pattern.collaborative_filtering",
        "p95_ms",
        "<",
        500.0,
        "RF-010 collaborative filtering total latency < 5 s, with a 10x margin",
    ),
]
PATTERN_SWITCH_IMPACT_MS = 200.0
"""RF-010 17: a pattern switch costs the workflow < 2 s, with a 10x margin (the p50 of the
refund with a group chat at step 2 over the p50 of the plain refund)."""
PATTERN_P95_MS = 2000.0
"""RF-010: pattern execution latency p95 < 20 s, with a 10x margin (every pattern run)."""
RATIO_TARGETS: list[tuple[str, str, float, str]] = [
    ("roundtrip", "p50", 1.5, "roundtrip p50 <= 1.5x relay"),
    ("roundtrip", "p95", 2.0, "roundtrip p95 <= 2x relay"),
]
"""Ratios to the two-hop relay (``x_relay2_p50``, ``x_relay2_p95``: see :func:`with_ratios`)."""


def check(
    figure: str,
    value: float,
    op: str,
    limit: float,
    what: str,
    *,
    unit: str = "",
    spread: list[float] | None = None,
) -> dict[str, Any]:
    """One target's check: ``value`` ``op`` (<, <= or >=) ``limit``."""
    ok = {"<": value < limit, "<=": value <= limit, ">=": value >= limit}[op]
    found: dict[str, Any] = {"figure": figure, "value": value}
    if spread is not None:
        found["spread"] = spread
    return {**found, "target": f"{op} {limit:g}{unit}", "pass": ok, "what": what}


def evaluate(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target's check on ``figures`` with their ratios to the relay (:func:`with_ratios`)."""
    checks = [
        check(f"{name}.{key}", figures[name][key], op, limit, what)
        for name, key, op, limit, what in TARGETS
    ]
    for name, percentile, limit, what in RATIO_TARGETS:
        checks.append(
            check(
                f"{name}.{percentile}_ms / baseline.relay2.{percentile}_ms",
                figures[name][f"x_relay2_{percentile}"],
                "<=",
                limit,
                what,
                unit="x",
                spread=figures[name].get(f"x_relay2_{percentile}_spread"),
            )
        )
    checks.append(
        check(
            "roundtrip.throughput_64 / baseline.relay2.throughput_64",
            figures["roundtrip"]["x_relay2_throughput_64"],
            ">=",
            0.75,
            "request/response throughput at 64 in flight vs relay",
            unit="x",
        )
    )
    for key, what in (
        ("overhead", "cost of tracing every request (spans in every process)"),
        ("sampled_10pct_overhead", "cost of tracing with 10% head sampling"),
    ):
        checks.append(
            check(
                f"roundtrip_traced.{key}",
                figures["roundtrip_traced"][key],
                "<",
                0.15,
                f"{what}, on the roundtrip p50",
                spread=figures["roundtrip_traced"].get(f"{key}_spread"),
            )
        )
    checks.append(
        check(
            "pattern.pattern_switch.p50_ms - pattern.handoff.p50_ms",
            figures["pattern.pattern_switch"]["p50_ms"] - figures["pattern.handoff"]["p50_ms"],
            "<",
            PATTERN_SWITCH_IMPACT_MS,
            "RF-010 pattern switch latency impact < 2 s, with a 10x margin",
        )
    )
    slowest = max(
        (name for name in figures if name.startswith("pattern.")),
        key=lambda name: figures[name]["p95_ms"],
    )
    checks.append(
        check(
            f"{slowest}.p95_ms",
            figures[slowest]["p95_ms"],
            "<",
            PATTERN_P95_MS,
            "RF-010 pattern execution latency p95 < 20 s (the slowest pattern), with a 10x margin",
        )
    )
    checks.append(
        check(
            "oneway_batch100.throughput",
            figures["oneway_batch100"]["throughput"],
            ">=",
            20_000,
            "one-way batched throughput with priority, TTL and capacity",
            unit="/s",
        )
    )
    return checks


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "grpcio": grpc.__version__,
    }


def with_ratios(figures: dict[str, Any]) -> dict[str, Any]:
    """Each latency figure with its ratios to the two-hop relay measured in the same run
    (x_relay2_p50, x_relay2_p95: for those measured beside it, the median of each
    repetition's ratio), and each throughput at 64 in flight with the relay's."""
    base = figures["baseline.relay2"]
    out = {}
    for name, v in figures.items():
        v = dict(v)
        if "p50_ms" in v:
            for key, ratio in latency_ratios(v, base).items():
                v.setdefault(key, ratio)  # (those measured beside it keep their own)
        if "throughput_64" in v and base.get("throughput_64"):
            v["x_relay2_throughput_64"] = v["throughput_64"] / base["throughput_64"]
        out[name] = v
    return out


def by_name(figures: dict[str, Any]) -> dict[str, Any]:
    """Every number of every figure under its plain dotted name, as the checks name them
    (``roundtrip.p95_ms``, ``baseline.relay2.p95_ms``, ``roundtrip.cpu_us_per_op.broker``,
    ``oneway_batch100.throughput``): the report holds them at its top level, beside the same
    numbers grouped by figure under ``figures``."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}", inner)
        else:
            out[prefix] = value

    for name, figure in figures.items():
        walk(name, figure)
    return out


def to_markdown(report: dict[str, Any]) -> str:
    f = report["figures"]
    base = f["baseline.relay2"]
    lines = [
        f"# agentmesh benchmark — {report['timestamp']}",
        "",
        f"Machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs, "
        f"Python {report['machine']['python']}, grpcio {report['machine']['grpcio']}. "
        f"{report['settings']['repetitions']} repetition(s) of "
        f"{report['settings']['operations']} operations after "
        f"{report['settings']['warmup']} warm-up; medians shown. baseline.relay2, roundtrip "
        f"and roundtrip_raw_ends are measured side by side, {TURN} of each in turn.",
        "",
        "| figure | p50 ms | p95 ms | p99 ms | max ms | x relay p50 | throughput/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, v in f.items():
        if "p50_ms" in v:
            thr = v.get("throughput_64")
            lines.append(
                f"| {name} | {v['p50_ms']:.3f} | {v['p95_ms']:.3f} | {v['p99_ms']:.3f} | "
                f"{v['max_ms']:.3f} | {v['x_relay2_p50']:.2f} | "
                f"{f'{thr:,.0f} (64 in flight)' if thr else ''} |"
            )
        else:
            lines.append(f"| {name} | | | | | | {v['throughput']:,.0f} |")
    lines += cpu_table(f)
    lines += memory_lines(report.get("memory"))
    lines += [
        "",
        "Targets; a figure measured beside its reference (a ratio to the relay, the cost of "
        "tracing) is the median of the repetitions' (their least and greatest in brackets).",
        "",
        "| target | value | limit | result |",
        "| --- | ---: | ---: | --- |",
    ]
    for c in report["checks"]:
        spread = f" ({c['spread'][0]:.2f} to {c['spread'][1]:.2f})" if c.get("spread") else ""
        lines.append(
            f"| {c['what']} (`{c['figure']}`) | {c['value']:.3f}{spread} | {c['target']} | "
            f"{'PASS' if c['pass'] else 'FAIL'} |"
        )
    if (limit := f.get("baseline.fanout5")) and (b5 := f.get("broadcast5")):
        lines += [
            "",
            f"The physical limit of a broadcast to 5 processes on this machine: raw grpc.aio, "
            f"one frame relayed to five processes, is with the last of them at p50 "
            f"{limit['p50_ms']:.3f} ms (`baseline.fanout5`); broadcast5 takes "
            f"{b5['p50_ms'] / limit['p50_ms']:.2f}x that.",
        ]
        if raw_b5 := f.get("broadcast5_raw_ends"):
            lines[-1] += (
                f" Through the same broker to five agents in raw grpc.aio (no SDK), the last "
                f"has it at p50 {raw_b5['p50_ms']:.3f} ms (`broadcast5_raw_ends`): the broker's "
                f"share; the SDK's agents add {b5['p50_ms'] - raw_b5['p50_ms']:.3f} ms."
            )
    if (floor := f.get("baseline.contract2")) and (rt := f.get("roundtrip")):
        lines += [
            "",
            f"The least a roundtrip through a broker on the mesh's contract costs on this "
            f"machine: the two-hop relay speaking its Connect frames (parsing and building each, "
            f"nothing more) is at p50 {floor['p50_ms']:.3f} ms (`baseline.contract2`, "
            f"{floor['p50_ms'] / base['p50_ms']:.2f}x the relay); roundtrip takes "
            f"{rt['p50_ms'] / floor['p50_ms']:.2f}x that.",
        ]
    if hot := report.get("hotpath"):
        gather5 = (  # (a result of before it was measured has none)
            f" (of a gather to five agents, the shape of broadcast5, "
            f"{hot['broker_gather5_us']:.1f} µs)"
            if "broker_gather5_us" in hot
            else ""
        )
        batched = (
            f"; a message of a batch of 100, in, delivered and acked, "
            f"{hot['broker_batched_us']:.1f} µs (the shape of oneway_batch100)"
            if "broker_batched_us" in hot
            else ""
        )
        lines += [
            "",
            f"The mesh's own Python per operation, without gRPC (`python -m benchmarks.hotpath`: "
            f"each path in one process against in-memory streams): the broker's part of a "
            f"roundtrip {hot['broker_roundtrip_us']:.1f} µs{gather5}{batched}; the SDK agent's "
            f"per message "
            f"{hot['agent_message_us']:.1f} µs, the SDK's request() {hot['client_request_us']:.1f}"
            f" µs, against {hot['raw_loop_us']:.1f} µs for a bare read-and-write loop "
            f"(`hotpath.*`).",
        ]
    if (node_client := f.get("node_client.roundtrip")) and (
        node_agent := f.get("node_agent.roundtrip")
    ):
        rt = f["roundtrip"]
        lines += [
            "",
            f"Polyglot, through the same broker: the Node.js client (@grpc/grpc-js) asking the "
            f"Python echo agent, p50 {node_client['p50_ms']:.3f} ms (`node_client.roundtrip`, "
            f"timed in Node), and the Python SDK asking an echo agent in Node.js, p50 "
            f"{node_agent['p50_ms']:.3f} ms (`node_agent.roundtrip`), beside "
            f"{rt['p50_ms']:.3f} ms with Python at both ends (`roundtrip`). Each Node.js "
            f"process answers or makes {report['settings']['jit_warmup']:,} requests "
            f"first, {JIT_WARMUP_IN_FLIGHT} at a time, while V8 compiles its hot code.",
        ]
    elif "roundtrip" in f:
        lines += [
            "",
            "Node.js or the Node.js client's packages were not found: no `node_*` figures.",
        ]
    if (go_agent := f.get("go_agent.roundtrip")) and "roundtrip" in f:
        lines += [
            "",
            f"The Python SDK asking an echo agent in Go on plain gRPC (clients/go), p50 "
            f"{go_agent['p50_ms']:.3f} ms (`go_agent.roundtrip`), beside "
            f"{f['roundtrip']['p50_ms']:.3f} ms with the SDK's agent (`roundtrip`).",
        ]
    if (push := f.get("push_agent.roundtrip")) and "roundtrip" in f:
        lines += [
            "",
            f"The Python SDK asking an echo agent that takes its messages by push (a plain "
            f"AgentService server in raw grpc.aio, the broker calling HandleMessage once per "
            f"message), p50 {push['p50_ms']:.3f} ms (`push_agent.roundtrip`), beside "
            f"{f['roundtrip']['p50_ms']:.3f} ms with the SDK's agent on its stream.",
        ]
    if patterns := [name for name in f if name.startswith("pattern.")]:
        lines += [
            "",
            f"The {len(patterns)} `pattern.*` figures: each pattern run of `agentmesh demo` "
            "(`gateway.demo.SCENARIOS`), from the call to a gateway until its RESULT event, "
            "on the sample and research agents (one process) through the same broker. The "
            "sample agents read their JSON data files on every request (in a worker thread, "
            "so that edits show without a restart), and research's web pages come from a "
            "snapshot that simulates each page's latency: part of each figure is theirs.",
        ]
    if filling := f.get("roundtrip_filling"):
        lines += [
            "",
            f"`roundtrip_filling`: roundtrips to the echo agent, one after another, while four "
            f"senders fill the queue of an agent nobody consumes with "
            f"{report['settings']['fill_messages']:,} messages in batches of 100 (it grew by "
            f"{filling['fill_throughput']:,.0f} messages/s): the latency of traffic that "
            f"still flows through a broker whose backlog grows.",
        ]
    if (raw := f.get("roundtrip_raw_ends")) and (rt := f.get("roundtrip")):
        lines += [
            "",
            f"The broker's share of a roundtrip: between a driver and an agent in raw grpc.aio "
            f"on the contract (no SDK at either end), through the same broker, a roundtrip is "
            f"at p50 {raw['p50_ms']:.3f} ms (`roundtrip_raw_ends`, "
            f"{raw['x_relay2_p50']:.2f}x the relay); the "
            f"SDK's driver and agent add "
            f"{rt['p50_ms'] - raw['p50_ms']:.3f} ms to that (`roundtrip`).",
        ]
    return "\n".join(lines) + "\n"


def memory_lines(memory: dict[str, Any] | None) -> list[str]:
    """Resident memory after each repetition: what stays flat holds only what it holds now."""
    if not memory:
        return []
    after = memory["after_each_repetition"]
    roles = [key.removesuffix("_mb") for key in after[0] if key.endswith("_mb")]
    lines = [
        "",
        "Resident memory in MiB after each repetition (agents: the largest of their processes;"
        " broker_peak: the most the broker held so far).",
        "",
        f"| after | {' | '.join(roles)} |",
        f"| --- | {' | '.join('---:' for _ in roles)} |",
    ]
    for i, read in enumerate(after, 1):
        cells = " | ".join(f"{read[f'{role}_mb']:,.1f}" for role in roles)
        lines.append(f"| repetition {i} | {cells} |")
    return lines


def cpu_table(figures: dict[str, Any]) -> list[str]:
    """CPU per operation by process, beside the relay's: where a path's time goes."""
    relay = figures.get("baseline.relay2", {})
    rows = [
        (f"{name}{suffix}", cost, (relay.get(key) or {}).get("total"))
        for name, v in figures.items()
        for key, suffix in (
            ("cpu_us_per_op", ""),
            ("cpu_us_per_op_64", " (64 in flight)"),
        )
        if (cost := v.get(key))
    ]
    if not rows:
        return []
    roles = [r for r in ROLES if any(r in cost for _, cost, _ in rows)]
    lines = [
        "",
        "CPU per operation in µs, each process's threads summed (one-way figures: per message;"
        " x relay: against the relay's roundtrip at the same load).",
        "",
        f"| figure | total | x relay | {' | '.join(roles)} |",
        f"| --- | ---: | ---: | {' | '.join('---:' for _ in roles)} |",
    ]
    for name, cost, base in rows:
        ratio = f"{cost['total'] / base:.2f}" if base else ""
        cells = " | ".join(f"{cost[r]:,.1f}" if r in cost else "" for r in roles)
        lines.append(f"| {name} | {cost['total']:,.1f} | {ratio} | {cells} |")
    return lines


SIDE_BY_SIDE = ("baseline.relay2", "roundtrip_raw_ends", "roundtrip")
"""The figures measured in turns (:func:`measured_in_turns`), drawn whole in ``latest.png``."""


def plot(report: dict[str, Any], path: Path) -> bool:
    """``latest.png`` (:func:`draw`); False without matplotlib (the bench extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = draw(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def draw(report: dict[str, Any]) -> Any:
    """The latency distributions: on top, as cumulative distributions, the roundtrip beside
    the relay and the broker between raw ends (measured side by side, when their quantiles
    are there), with the ratio targets marked; below, p50, p95 and p99 of every figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda x, _: f"{x:g}")  # (0.6, 1, 2: not 6x10^-1)
    # Between powers of ten, 2, 3 and 5 times one (more would run into one another).
    some = FuncFormatter(lambda x, _: f"{x:g}" if f"{x:.0e}"[0] in "235" else "")
    f = report["figures"]
    names = [name for name, v in f.items() if "p50_ms" in v]
    whole = {n: f[n]["quantiles_ms"] for n in SIDE_BY_SIDE if "quantiles_ms" in f.get(n, {})}
    height = 0.5 * len(names) + 1.5
    if whole:
        fig, (cdf, ax) = plt.subplots(2, 1, figsize=(10, height + 5), height_ratios=[4.5, height])
        levels = [p / 100 for p in range(101)]
        for name, quantiles in whole.items():
            cdf.step(quantiles, levels, where="post", label=name)
        relay = f["baseline.relay2"]
        targets = {p: limit for name, p, limit, _ in RATIO_TARGETS if name == "roundtrip"}
        cdf.scatter(
            [targets[p] * relay[f"{p}_ms"] for p in targets],
            [int(p.removeprefix("p")) / 100 for p in targets],
            marker="x",
            color="black",
            zorder=3,
            label="roundtrip targets: "
            + ", ".join(f"{p} <= {limit:g}x the relay's" for p, limit in targets.items()),
        )
        cdf.set_xscale("log")
        cdf.xaxis.set_major_formatter(plain)
        cdf.xaxis.set_minor_formatter(some)
        cdf.set_ylim(0, 1.01)
        cdf.set_xlabel("latency (ms, log scale)")
        cdf.set_ylabel("share of requests at most")
        cdf.set_title("A request/response roundtrip beside the raw gRPC relay, side by side")
        cdf.legend(loc="lower right", fontsize="small")
        cdf.grid(True, which="both", alpha=0.3)
    else:
        fig, ax = plt.subplots(figsize=(10, height))
    for i, name in enumerate(names):
        v = f[name]
        ax.plot([v["p50_ms"], v["p95_ms"], v["p99_ms"]], [i, i, i], "-", color="0.7")
        ax.scatter([v["p50_ms"]], [i], color="tab:blue", label="p50" if i == 0 else None)
        ax.scatter([v["p95_ms"]], [i], color="tab:orange", label="p95" if i == 0 else None)
        ax.scatter([v["p99_ms"]], [i], color="tab:red", label="p99" if i == 0 else None)
    ax.set_yticks(range(len(names)), names)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(plain)
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_title("p50, p95 and p99 of every figure (the raw gRPC baselines at the bottom)")
    ax.legend(loc="lower right")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    return fig


MACHINE_MOVED = 0.2
"""How far the relay's p50 moves between two results before the comparison says that the
machine differs (on one machine, run to run, it moves by about a tenth)."""


def compare(report: dict[str, Any], earlier: dict[str, Any]) -> list[str]:
    """What got faster or slower (p50, throughput), cheaper or dearer (CPU per operation)
    by 5% or more since ``earlier``; and each latency's ratio to the relay of its own run
    (``x_relay2_p50``), which is what to read when the two ran on different machines."""
    lines = []
    relay, old_relay = (
        r.get("figures", {}).get("baseline.relay2", {}).get("p50_ms") for r in (report, earlier)
    )
    if relay and old_relay and abs(relay - old_relay) / old_relay >= MACHINE_MOVED:
        lines.append(
            f"the raw relay itself moved {(relay - old_relay) / old_relay:+.0%} "
            f"(baseline.relay2.p50_ms {old_relay:.3f} -> {relay:.3f}): another machine, or a "
            "busier one; the x_relay2_p50 lines set the mesh beside the relay of each run"
        )
    for name, v in report["figures"].items():
        old = earlier.get("figures", {}).get(name)
        if not old:
            continue
        key = "p50_ms" if "p50_ms" in v else "throughput"
        if key not in old or not old[key]:
            continue
        change = (v[key] - old[key]) / old[key]
        better = change < 0 if key == "p50_ms" else change > 0
        if abs(change) >= 0.05:
            lines.append(
                f"{name}.{key}: {old[key]:.3f} -> {v[key]:.3f} "
                f"({change:+.0%}, {'faster' if better else 'slower'})"
            )
        ratio, old_ratio = v.get("x_relay2_p50"), old.get("x_relay2_p50")
        if name != "baseline.relay2" and ratio and old_ratio:
            change = (ratio - old_ratio) / old_ratio
            if abs(change) >= 0.05:
                lines.append(
                    f"{name}.x_relay2_p50: {old_ratio:.2f} -> {ratio:.2f} ({change:+.0%}, "
                    f"{'faster' if change < 0 else 'slower'} beside the relay)"
                )
        cost, old_cost = v.get("cpu_us_per_op"), old.get("cpu_us_per_op")
        if cost and old_cost and old_cost.get("total"):
            change = (cost["total"] - old_cost["total"]) / old_cost["total"]
            if abs(change) >= 0.05:
                lines.append(
                    f"{name}.cpu_us_per_op.total: {old_cost['total']:.1f} -> "
                    f"{cost['total']:.1f} ({change:+.0%}, {'cheaper' if change < 0 else 'dearer'})"
                )
    return lines or ["no figure moved by 5% or more"]


async def measure_all(settings: Settings) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Every figure, and the memory of the mesh's processes after each repetition (None
    where /proc cannot be read)."""
    mesh = await start_mesh(build_go=not settings.quick)
    try:
        runs, memory = [], []
        for i in range(settings.repetitions):
            print(f"repetition {i + 1}/{settings.repetitions} ...", flush=True)
            runs.append(await run_once(mesh, settings))
            memory.append(memory_by_role(mesh.meter().roles))
    finally:
        if mesh.node_driver is not None:
            await mesh.node_driver.close()
        await stop_all(mesh.procs)
    figures = combine(runs)
    figures["roundtrip_traced"] = await measure_tracing_cost(settings)
    print("queue stores ...", flush=True)
    figures.update(await measure_stores(settings))
    return figures, ({"after_each_repetition": memory} if all(memory) else None)


async def measure_hotpath(count: int, repetitions: int = 5) -> dict[str, float]:
    """benchmarks.hotpath in a process of its own: this one has tracing set up by now (and a
    heap of results), which would be measured with the mesh's code."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.hotpath",
        *("--count", str(count), "--repetitions", str(repetitions)),
        "--json",
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"benchmarks.hotpath failed: {err.decode()[-2000:]}")
    figures: dict[str, float] = json.loads(out)
    return figures


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The run's options; a mistake in them ends it at once, before minutes of measuring."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Starts a mesh in separate processes on 127.0.0.1 and measures its latency "
        "and throughput beside a raw grpc.aio baseline; writes latest.json, latest.md and "
        "latest.png.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one short repetition, under a minute (as BENCH_QUICK=1)",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        metavar="FILE",
        help="an earlier result (a latest.json) to compare with; by default the one the run "
        "replaces",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=RESULTS,
        metavar="DIR",
        help=f"where the results are written (default: {RESULTS.relative_to(ROOT)})",
    )
    args = parser.parse_args(argv)
    if args.compare is not None:
        try:
            earlier = json.loads(args.compare.read_text())
        except (OSError, ValueError) as error:
            parser.error(f"--compare: cannot read {args.compare}: {error}")
        if not isinstance(earlier, dict) or not isinstance(earlier.get("figures"), dict):
            parser.error(f"--compare: {args.compare} is not a benchmark result (no figures)")
        args.earlier = earlier
        args.earlier_name = str(args.compare)
    else:
        previous = args.output / "latest.json"
        args.earlier = json.loads(previous.read_text()) if previous.exists() else None
        args.earlier_name = "the previous result"
    return args


async def main(args: argparse.Namespace) -> int:
    settings = Settings.from_env(quick=args.quick)
    output: Path = args.output
    started = time.perf_counter()
    try:
        figures, memory = await measure_all(settings)
    except BaseException:
        if _logs:
            print(f"the processes' logs are in {_logs[0]}", file=sys.stderr)
        raise
    print("python per operation, without gRPC ...", flush=True)
    python_cost = await measure_hotpath(*((500, 2) if settings.quick else (20_000, 5)))
    if _logs:
        shutil.rmtree(_logs[0], ignore_errors=True)
    ratios = with_ratios(figures)
    report: dict[str, Any] = {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": settings.__dict__,
        "figures": ratios,
        "memory": memory,
        "checks": evaluate(ratios),
        "hotpath": python_cost,
        "duration_s": round(time.perf_counter() - started, 1),
    }
    report.update(by_name({**report["figures"], "hotpath": python_cost}))
    (output / "latest.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = to_markdown(report)
    (output / "latest.md").write_text(markdown)
    plotted = plot(report, output / "latest.png")
    print(markdown)
    if args.earlier:
        print(f"Compared with {args.earlier_name}:")
        for line in compare(report, args.earlier):
            print(f"  {line}")
    print(
        f"wrote {output / 'latest.json'}, latest.md{', latest.png' if plotted else ''} "
        f"in {report['duration_s']} s"
    )
    return 0


def run() -> None:
    args = parse_args(sys.argv[1:])
    args.output.mkdir(parents=True, exist_ok=True)
    sys.exit(run_loop(main(args)))

"""The agentmesh command line: run a broker or an agent, and poke at a running mesh."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mesh.agent import Agent, serve_all
from mesh.client import connect
from mesh.config import (
    DEFAULT_BROKER,
    BrokerConfig,
    SecurityConfig,
    ServerConfig,
    check_environment,
)
from mesh.core.errors import MeshError, MessageValidationError
from mesh.core.model import (
    BROADCAST_TARGET,
    AgentInfo,
    Message,
    MessageType,
    Priority,
    QueuedState,
)
from mesh.core.state import StateEntry
from mesh.core.tools import ToolHost
from mesh.core.workflows import WORKFLOW_KEY_PREFIX
from mesh.logs import EVENT_LOG_DAYS, configure_logging, stop_logging
from mesh.loop import loop_name, started_before, stop_on_signals
from mesh.loop import run as run_loop
from mesh.security import authenticator_for, check_security_files

TRACED = {
    "broker": "agentmesh-broker",
    "gateway": "agentmesh-gateway",
    "agent": "agentmesh-agent",
    "up": "agentmesh",
    "demo": "agentmesh-demo",
    "research": "agentmesh-research",
    "send": "agentmesh-cli",
}


def _env(name: str, default: str) -> str:
    return os.environ.get(f"AGENTMESH_{name}", default)


def port(value: str) -> int:
    """A port flag (or its AGENTMESH_* variable): 0 to 65535, 0 for any free one."""
    return _port(value, 0)


def port_or_off(value: str) -> int:
    """A port flag of a server that may be off: -1 (off), or 0 to 65535."""
    return _port(value, -1)


def non_negative_seconds(value: str) -> float:
    """A flag of seconds (or its AGENTMESH_* variable): a finite number, 0 or more."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 <= seconds < math.inf:  # (NaN too)
        raise argparse.ArgumentTypeError(f"{value!r}: seconds must be 0 or more, and finite")
    return seconds


def add_wait_flag(parser: argparse.ArgumentParser, what: str, waits_for: str) -> None:
    """--wait-for-WHAT (AGENTMESH_WAIT_FOR_WHAT): seconds to wait for what the command needs
    as it starts, 60 by default; 0 fails at once."""
    parser.add_argument(
        f"--wait-for-{what}",
        type=non_negative_seconds,
        default=_env(f"WAIT_FOR_{what.upper()}", "60"),
        metavar="SECONDS",
        help=f"how long to wait for {waits_for}; 0: fail at once (default 60, env"
        f" AGENTMESH_WAIT_FOR_{what.upper()})",
    )


def add_health_port_flag(parser: argparse.ArgumentParser, env: str, what: str = "") -> None:
    """--health-port (AGENTMESH_<env>): a plaintext grpc.health.v1 server beside a TLS
    one, for probes that cannot speak TLS."""
    parser.add_argument(
        "--health-port",
        type=port_or_off,
        default=_env(env, "-1"),
        help="port of a plaintext server of grpc.health.v1 alone, for probes that cannot "
        f"speak TLS (a kubelet's gRPC probe){what}: -1 none (default), 0 any free port "
        f"(env AGENTMESH_{env})",
    )


def served_on(host: str, server: Any) -> str:
    """What a start-up line says of a server's /metrics and health ports, if any."""
    said = ""
    if server.metrics_port:
        said += f", metrics on http://{host}:{server.metrics_port}/metrics"
    if server.health_port:
        said += f", health on {host}:{server.health_port}"
    return said


def _port(value: str, least: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or not least <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port ({least}..65535)")
    return number


# CPython's full collection walks every object alive, the event loop standing still until
# it is done. It runs once ten younger collections have run and a quarter more objects have
# come to stay: while a broker's queues fill (seven objects a queued message), every second
# or so, each as long as the queues are deep (180-270 ms at 160,000 queued messages; the p99
# of roundtrips beside them 52-62 ms). After a hundred younger collections: a tenth as many
# (p99 23 ms); cyclic garbage is collected as surely, a little later (docs/performance.md).
FULL_COLLECTION_AFTER = 100


def settle_heap() -> None:
    """What the process built to get here lives as long as it does: gc.freeze() takes it
    out of the collector's sight, so that a full collection no longer walks it (tens of
    milliseconds, otherwise, in the middle of a request); and full collections, which walk
    what the queues hold, come ten times more rarely than CPython's default."""
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_AFTER)


async def _until_signalled(stop: asyncio.Event | None = None) -> None:
    """Serves until ``stop`` (:func:`stop_on_signals`; by default, the signals from now on),
    the heap settled (:func:`settle_heap`)."""
    if stop is None:
        stop = stop_on_signals()
    settle_heap()
    await stop.wait()


def _print(line: str) -> None:
    print(line, flush=True)


# -- broker ----------------------------------------------------------------------------------


def _add_broker_config_flags(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(BrokerConfig):
        flag = "--" + f.name.replace("_", "-")
        kind: type = str
        if str(f.type).startswith("float"):
            kind = float
        elif str(f.type).startswith("int"):
            kind = int
        parser.add_argument(
            flag,
            type=kind,
            default=None,
            help=f"(env AGENTMESH_{f.name.upper()}; default {f.default})",
        )


def add_security_flags(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """TLS and credential flags; each defaults to its AGENTMESH_* variable."""
    group = parser.add_argument_group("security (flags override AGENTMESH_* variables)")
    if server:
        group.add_argument("--tls-cert", help="server certificate, PEM (AGENTMESH_TLS_CERT)")
        group.add_argument("--tls-key", help="its private key, PEM (AGENTMESH_TLS_KEY)")
        group.add_argument(
            "--tls-client-auth",
            choices=["require", "none"],
            help="with --tls-ca, whether this server requires its callers' certificates "
            "(require, the default: mutual TLS) or asks for none, its CA then only the one it "
            "checks the servers it calls with (AGENTMESH_TLS_CLIENT_AUTH)",
        )
        group.add_argument(
            "--credentials-file",
            help="JSON of principals and tokens; calls then need a credential "
            "(AGENTMESH_CREDENTIALS_FILE)",
        )
    group.add_argument(
        "--tls-ca",
        help="CA bundle: a server requires client certificates signed by it (mutual TLS); "
        "a client verifies the server with it (AGENTMESH_TLS_CA)",
    )
    group.add_argument("--tls-client-cert", help="client certificate for mutual TLS")
    group.add_argument("--tls-client-key", help="its private key")
    group.add_argument("--tls-server-name", help="name to expect in the server's certificate")
    group.add_argument(
        "--token-file",
        help="file holding the bearer token to send, read again when it changes (or "
        "AGENTMESH_TOKEN_FILE, AGENTMESH_TOKEN; never on the command line, where other users "
        "could read it)",
    )


def security_config(args: argparse.Namespace) -> SecurityConfig:
    config = SecurityConfig.from_env()
    changes = {
        name: getattr(args, name)
        for name in (
            "tls_cert",
            "tls_key",
            "tls_ca",
            "credentials_file",
            "tls_client_cert",
            "tls_client_key",
            "tls_server_name",
            "tls_client_auth",
        )
        if getattr(args, name, None)
    }
    token_file = getattr(args, "token_file", None)
    if token_file:
        changes["token_file"] = token_file
    try:
        config = config.evolve(**changes)
        # A credentials file that cannot be used (not JSON, a principal without its list of
        # agents), a certificate, key or token file that is none: said in a line before
        # anything starts.
        authenticator_for(config)
        check_security_files(config)
    except ValueError as error:
        raise SystemExit(f"security settings: {error}") from None
    return config


class UsageError(Exception):
    """A flag or AGENTMESH_* variable with a value the command cannot take."""


def _broker_config(args: argparse.Namespace) -> BrokerConfig:
    changes = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(BrokerConfig)
        if getattr(args, f.name, None) is not None
    }
    try:
        return BrokerConfig.from_env().evolve(**changes)
    except ValueError as error:
        raise UsageError(str(error)) from None


async def _run_broker(args: argparse.Namespace) -> int:
    from mesh.server import serve_broker

    stop = stop_on_signals()
    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
    )
    broker_config = _broker_config(args)
    tool_host = load_tool_host(args.tools) if args.tools else None
    starting = asyncio.create_task(
        serve_broker(
            server_config=server_config,
            broker_config=broker_config,
            tool_host=tool_host,
            security=security_config(args),
            wait_for_store=args.wait_for_store,
        )
    )
    if not await started_before(starting, stop):
        _print("agentmesh broker stopped before its queue store could be reached")
        return 0
    _, server = starting.result()
    tools = f"; tools {', '.join(sorted(tool_host.tools))}" if tool_host else ""
    _print(
        f"agentmesh broker listening on {server.address}{served_on(args.host, server)} "
        f"({server.security}; "
        f"store {broker_config.store}{tools})"
    )
    await _until_signalled(stop)
    _print("agentmesh broker shutting down")
    await server.stop(server_config.grace_seconds)
    return 0


def import_spec(spec: str, what: str) -> Any:
    """What ``module:attribute`` or ``path/to/file.py:attribute`` names; ``what`` (a flag, an
    argument) names it in the errors. A module is looked for in the working directory first,
    as ``python -m`` looks (the ``agentmesh`` script's own folder is what Python would look in
    otherwise); a file is loaded as the module its name makes, its folder searched for what
    it imports, as ``python file.py`` does."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise UsageError(f"{what} must be module:attribute, got {spec!r}")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            module = _import_file(Path(module_name))
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"{what} {spec}: {error}") from None


def _import_file(path: Path) -> Any:
    """The module of a Python file, imported under its name."""
    if not path.is_file():
        raise ImportError(f"no file {path}")
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == path.resolve():
            return loaded
        raise ImportError(f"a module named {name} is imported already: rename {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python module")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: its dataclasses look themselves up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_tool_host(spec: str) -> ToolHost:
    """Loads ``module:attr``: a ToolHost, or a factory returning one (the tools the broker's
    Tool service runs for agents, and which agent may use which)."""
    target = import_spec(spec, "--tools")
    if not isinstance(target, ToolHost) and callable(target):
        try:
            target = target()
        except (ValueError, OSError) as error:  # (e.g. a folder it was told of that is none)
            raise UsageError(f"--tools {spec}: {error}") from None
    if not isinstance(target, ToolHost):
        raise UsageError(f"--tools {spec} is not a ToolHost (nor a factory of one)")
    return target


# -- agent -----------------------------------------------------------------------------------


def load_agents(spec: str, agent_id: str | None = None) -> list[Agent]:
    """Loads ``module:attr``: an Agent instance or class, or a factory returning one agent or a
    list of agents."""
    target = import_spec(spec, "an agent spec")
    is_class = isinstance(target, type) and issubclass(target, Agent)
    if is_class or (not isinstance(target, Agent) and callable(target)):
        given = (agent_id,) if agent_id and is_class else ()
        try:
            inspect.signature(target).bind(*given)
        except TypeError as error:  # (the user's __init__ or factory wants arguments)
            raise UsageError(
                f"an agent spec {spec}: {getattr(target, '__name__', spec)}"
                f"({', '.join(map(repr, given))}) cannot be called: {error}; name an agent "
                "made already, or a function that makes the agents"
            ) from None
        except ValueError:  # (no signature to read: it is called as it is)
            pass
        target = target(*given)
    found = list(target) if isinstance(target, list | tuple) else [target]
    if not found or not all(isinstance(a, Agent) for a in found):
        raise SystemExit(f"{spec} is not an agent")
    if agent_id:
        if len(found) != 1:
            raise SystemExit("--id needs a spec that names exactly one agent")
        found[0].agent_id = agent_id
    return found


def load_agent(spec: str, agent_id: str | None = None) -> Agent:
    [agent] = load_agents(spec, agent_id)
    return agent


async def _run_agent(args: argparse.Namespace) -> int:
    stop = stop_on_signals()
    agents = [a for spec in args.spec for a in load_agents(spec, args.id)]
    security = security_config(args)
    ports = [args.port + i if args.port else 0 for i in range(len(agents))]
    health = args.health_port
    # The agents of this process share one client, so one stream to the broker.
    starting = asyncio.create_task(
        serve_all(
            agents,
            args.broker,
            host=args.host,
            ports=ports,
            health_ports=[health + i if health > 0 else health for i in range(len(agents))],
            advertise=[
                f"{args.advertise_host}:{port}" if args.advertise_host and port else None
                for port in ports
            ],
            max_in_flight=args.max_in_flight,
            security=security,
            delivery_mode=args.delivery,
            wait_for_broker=args.wait_for_broker,
        )
    )
    if not await started_before(starting, stop):
        _print("agentmesh agent stopped before its broker could be reached")
        return 0
    served = starting.result()
    for one in served:
        _print(
            f"agentmesh agent {one.agent.agent_id} serving on {one.address}"
            f"{served_on(args.host, one.server)}, broker {args.broker} ({one.server.security})"
        )
    await _until_signalled(stop)
    await served.stop()
    return 0


# -- debugging commands ------------------------------------------------------------------------


def _json_arg(text: str | None, what: str) -> Any:
    if text is None:
        return None
    try:
        value: Any = json.loads(text)
        return value
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{what} is not valid JSON: {exc}") from None


def _message_line(m: Message) -> str:
    return (
        f"{m.timestamp.isoformat()}  {m.priority.value:<6} {m.message_type.value:<9} "
        f"{m.from_agent} -> {m.to_agent}  {m.message_id}  "
        f"{json.dumps(m.content, separators=(',', ':'))}"
    )


def _content(args: argparse.Namespace) -> dict[str, Any] | None:
    content: dict[str, Any] | None = _json_arg(args.content, "--content")
    if content is not None and not isinstance(content, dict):
        raise SystemExit("--content must be a JSON object")
    params = _json_arg(args.params, "--params")
    if params is not None and not isinstance(params, dict):
        raise SystemExit("--params must be a JSON object")
    if content is None and (args.action or params is not None):
        content = {"action": args.action} if args.action else {}
        if params is not None:
            content["parameters"] = params
    return content


async def _send(args: argparse.Namespace) -> int:
    if args.agent_types and args.to != BROADCAST_TARGET:
        raise UsageError("send: --types is for a broadcast (--to broadcast)")
    async with connect(args.broker, agent_id=args.sender, security=security_config(args)) as client:
        message = client.build(
            args.to,
            _content(args),
            message_type=MessageType(args.type),
            priority=Priority(args.priority),
            ttl=args.ttl,
            correlation_id=args.correlation_id or "",
            ack_required=args.ack_required,
            delay=args.delay,
        )
        due = ""
        if message.deliver_at is not None:
            due = f" (due {message.deliver_at.isoformat(timespec='seconds')})"
        if args.to == BROADCAST_TARGET:
            if args.request:
                raise UsageError("send: a broadcast is not a request (drop --request)")
            result = await client.broadcast(
                dict(message.content or {}),
                agent_types=args.agent_types,
                priority=message.priority,
                ttl=message.ttl,
                correlation_id=message.correlation_id,
                deliver_at=message.deliver_at,
            )
            failed = [f"{agent_id} ({error.message})" for agent_id, error in result.failures]
            _print(
                f"broadcast {result.message_id}{due} to {len(result.recipients)} agents: "
                + (", ".join(result.recipients) or "none")
                + (f"; refused by {', '.join(failed)}" if failed else "")
            )
        elif args.request:
            response = await client.request_message(message, timeout=args.timeout)
            _print(
                json.dumps(response.to_dict(), indent=2) if args.json else _message_line(response)
            )
        else:
            sent = await client.send_message(message)
            _print(
                json.dumps(sent.to_dict(), indent=2)
                if args.json
                else f"sent {sent.message_id}{due}"
            )
    return 0


async def _receive(args: argparse.Namespace) -> int:
    agent_id = args.agent or args.agent_id
    if not agent_id or (args.agent and args.agent_id and args.agent != args.agent_id):
        raise UsageError("receive: name one agent (AGENT or --agent AGENT)")
    async with connect(args.broker, agent_id=agent_id, security=security_config(args)) as client:
        messages = await client.receive(agent_id, args.max)
    if args.json:
        _print(json.dumps([m.to_dict() for m in messages], indent=2))
    elif not messages:
        _print(f"no messages for {agent_id}")
    else:
        for m in messages:
            _print(_message_line(m))
    return 0


async def _queue(args: argparse.Namespace) -> int:
    """What an agent's queue holds, left there: the messages waiting, in the order they will
    be delivered, then those in flight or deferred."""
    async with connect(args.broker, security=security_config(args)) as client:
        queued = await client.list_messages(args.agent)
    if args.json:
        listed = [
            {
                "message": q.message.to_dict(),
                "state": q.state.value,
                "attempts": q.attempts,
                "accepted_at": q.accepted_at.isoformat(),
                "expires_at": q.expires_at.isoformat(),
                "until": q.until.isoformat() if q.until else None,
            }
            for q in queued
        ]
        _print(json.dumps(listed, indent=2))
        return 0
    if not queued:
        _print(f"no messages for {args.agent}")
        return 0
    now = datetime.now(UTC)
    rows = [
        (
            "MESSAGE",
            "STATE",
            "PRIORITY",
            "TYPE",
            "FROM",
            "ACTION",
            "ATTEMPTS",
            "AGE",
            "EXPIRES IN",
            "UNTIL",
        )
    ]
    for q in queued:
        m = q.message
        rows.append(
            (
                m.message_id,
                q.state.value,
                m.priority.value,
                m.message_type.value,
                m.from_agent,
                m.action or "-",
                str(q.attempts),
                _span((now - q.accepted_at).total_seconds()),
                _span((q.expires_at - now).total_seconds()),
                _span((q.until - now).total_seconds()) if q.until else "-",
            )
        )
    _table(rows)
    counts = {state: sum(q.state is state for q in queued) for state in QueuedState}
    _print(
        f"{args.agent}: "
        + ", ".join(f"{n} {state.value.lower().replace('_', ' ')}" for state, n in counts.items())
    )
    return 0


def _span(seconds: float) -> str:
    """A length of time as it is read at a glance: 4.2s, 3m05s, 2h10m, 1d3h."""
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600}h"


async def _agents(args: argparse.Namespace) -> int:
    async with connect(args.broker, security=security_config(args)) as client:
        agents = await client.list_agents(args.type or "")
        stats = await client.queue_stats()
    if args.json:
        _print(
            json.dumps(
                [
                    {
                        "agent_id": a.agent_id,
                        "agent_types": list(a.agent_types),
                        "address": a.address,
                        "instances": list(a.instances),
                        "capabilities": list(a.capabilities),
                        "lost_at": a.lost_at.isoformat() if a.lost_at else None,
                        "delivery_mode": a.delivery_mode.value,
                        "push_instances": list(a.push_instances),
                    }
                    for a in agents
                ],
                indent=2,
            )
        )
        return 0
    depth = {s.agent_id: s for s in stats.agents}
    rows = [("AGENT", "TYPES", "ADDRESS", "QUEUED", "IN FLIGHT", "CAPABILITIES")]
    for a in agents:
        s = depth.get(a.agent_id)
        rows.append(
            (
                a.agent_id,
                ",".join(a.agent_types) or "-",
                _where(a),
                str(s.depth if s else 0),
                str(s.in_flight if s else 0),
                ",".join(a.capabilities) or "-",
            )
        )
    _table(rows)
    _print(f"{len(agents)} agents; broker holds {stats.totals['held']} messages")
    return 0


def _where(info: AgentInfo) -> str:
    """Its latest instance (and how many more), or since when none serves it."""
    if info.lost_at is not None and not info.instances:
        return f"- (none since {info.lost_at.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z)"
    more = f" (+{len(info.instances) - 1} more)" if len(info.instances) > 1 else ""
    pushed = len(info.push_instances)
    if pushed and pushed == len(info.instances):
        how = " (push)"
    elif pushed:
        how = f" (push: {pushed} of {len(info.instances)})"
    else:
        how = ""
    return (info.address or "-") + more + how


def _table(rows: Sequence[Sequence[str]], *, numbers: bool = False) -> None:
    """Columns as wide as their widest cell; with ``numbers``, every column after the first
    is right-aligned, as counts are read."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [
            cell.rjust(w) if numbers and i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ]
        _print("  ".join(cells).rstrip())


def _figure(value: float) -> str:
    """A count as it is, a measurement (milliseconds, a rate) to three decimals."""
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"


async def _workflows(args: argparse.Namespace) -> int:
    """The hand-off workflows, from their status in the shared state: the latest hand-off
    first."""
    async with connect(args.broker, security=security_config(args)) as client:
        entries = [e async for e in client.state_entries(WORKFLOW_KEY_PREFIX)]
    statuses = [e.value for e in entries if isinstance(e.value, dict)]
    statuses.sort(key=lambda v: str(v.get("handed_off_at", "")), reverse=True)
    if args.status:
        statuses = [v for v in statuses if v.get("status") == args.status]
    if args.json:
        _print(json.dumps(statuses, indent=2, sort_keys=True))
        return 0
    rows = [("WORKFLOW", "STATUS", "STEP", "AGENT", "FROM", "HANDED OFF", "TASK")]
    for v in statuses:
        status = str(v.get("status") or "IN_PROGRESS")
        failed_at = v.get("failed_at_step")
        if status == "FAILED" and isinstance(failed_at, int):
            # failed_at_step is the step's index (RF-010 scenario 10); STEP counts from 1.
            status += f" at step {failed_at + 1}: {v.get('error_reason')}"
        rows.append(
            (
                str(v.get("workflow_id", "")),
                status,
                str(v.get("step", "")),
                str(v.get("current_agent", "")),
                str(v.get("from_agent", "")),
                str(v.get("handed_off_at", "")),
                str(v.get("task_description", "")),
            )
        )
    _table(rows)
    _print(f"{len(statuses)} workflows")
    return 0


async def _stats(args: argparse.Namespace) -> int:
    async with connect(args.broker, security=security_config(args)) as client:
        report = await client.queue_stats(args.agent or "")
        dead = await client.dead_letters(args.agent or "")
    if args.json:
        _print(
            json.dumps(
                {
                    "agents": [dataclasses.asdict(a) for a in report.agents],
                    "totals": report.totals,
                    "dead_letters": [
                        {
                            "message_id": d.message.message_id,
                            "to_agent": d.message.to_agent,
                            "reason": d.reason,
                        }
                        for d in dead
                    ],
                },
                indent=2,
            )
        )
        return 0
    header = (
        "AGENT",
        "DEPTH",
        "HIGH",
        "MEDIUM",
        "LOW",
        "IN FLIGHT",
        "DEFERRED",
        "DEAD",
        "SUBSCRIBERS",
    )
    rows: list[tuple[str, ...]] = [header]
    for a in report.agents:
        values = (
            a.depth,
            a.high,
            a.medium,
            a.low,
            a.in_flight,
            a.deferred,
            a.dead_letters,
            a.subscribers,
        )
        rows.append((a.agent_id, *map(str, values)))
    _table(rows, numbers=True)
    _print("totals: " + ", ".join(f"{k}={_figure(v)}" for k, v in report.totals.items()))
    for d in dead:
        _print(f"dead letter {d.message.message_id} to {d.message.to_agent}: {d.reason}")
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    """Takes back messages a sender sent, not delivered yet."""
    async with connect(args.broker, agent_id=args.sender, security=security_config(args)) as client:
        taken = await client.cancel_messages(args.agent, args.message_ids)
    asked = len(dict.fromkeys(args.message_ids))
    _print(f"{len(taken)} of {asked} messages from {args.sender} to {args.agent} cancelled")
    for message_id in taken:
        _print(f"cancelled {message_id}")
    return 0


async def _requeue(args: argparse.Namespace) -> int:
    """Puts an agent's dead letters (all, or those named) back in its queue."""
    async with connect(args.broker, agent_id=args.agent, security=security_config(args)) as client:
        result = await client.requeue_dead_letters(args.agent, args.message_ids)
    left = f"; {result.left} left as dead letters (the queue is full)" if result.left else ""
    _print(f"{result.requeued} dead letters of {args.agent} requeued{left}")
    return 0


async def _deregister(args: argparse.Namespace) -> int:
    """Takes an agent off the mesh, or (with --address) one instance of it."""
    async with connect(args.broker, security=security_config(args)) as client:
        await client.deregister(args.agent, address=args.address)
        left = [a for a in await client.list_agents() if a.agent_id == args.agent]
    if not left:
        _print(f"deregistered {args.agent}")
    else:
        serving = ", ".join(left[0].instances) or left[0].address or "-"
        _print(f"the instance at {args.address} of {args.agent} left; serving it still: {serving}")
    return 0


def _entry_json(entry: StateEntry) -> dict[str, Any]:
    return {
        "key": entry.key,
        "value": entry.value,
        "version": entry.version,
        "updated_by": entry.updated_by,
        "updated_at": entry.updated_at.isoformat(),
        "expires_at": entry.expires_at.isoformat() if entry.expires_at else None,
    }


def _entry_line(entry: StateEntry) -> str:
    """One line; the value's keys sorted (a JSON object comes back in no particular order)."""
    lapses = f"  until {entry.expires_at.isoformat()}" if entry.expires_at else ""
    return (
        f"{entry.key}  version {entry.version}  by {entry.updated_by}  at "
        f"{entry.updated_at.isoformat()}{lapses}  "
        f"{json.dumps(entry.value, separators=(',', ':'), sort_keys=True)}"
    )


async def _state(args: argparse.Namespace) -> int:
    """Reads, writes or deletes one entry of the shared state, or lists entries by prefix."""
    if args.prefix is not None:
        if args.key is not None or args.delete or args.ttl is not None:
            raise MessageValidationError.for_field(
                "prefix", "--prefix lists entries: give no KEY, VALUE, --delete or --ttl with it"
            )
        return await (_state_watch(args) if args.watch else _state_list(args))
    if args.watch:
        raise MessageValidationError.for_field("watch", "--watch goes with --prefix")
    if args.key is None:
        raise MessageValidationError.for_field("key", "give a KEY, or --prefix to list entries")
    if args.ttl is not None and (args.delete or args.value is None):
        raise MessageValidationError.for_field("ttl", "--ttl goes with a VALUE to write")
    async with connect(args.broker, agent_id=args.agent, security=security_config(args)) as client:
        if args.delete:
            entry = await client.delete_state(args.key, expected_version=args.expect_version)
            _print(f"deleted {entry.key} at version {entry.version}")
            return 0
        if args.value is not None:
            try:
                value = json.loads(args.value)
            except json.JSONDecodeError as error:
                text = args.value.lstrip()[:1] not in ("{", "[")
                hint = f" (a text is quoted in JSON: '{json.dumps(args.value)}')" if text else ""
                raise MessageValidationError.for_field(
                    "value", f"value is not JSON: {error}{hint}"
                ) from None
            entry = await client.put_state(
                args.key, value, expected_version=args.expect_version, ttl=args.ttl
            )
        else:
            found = await client.get_state(args.key)
            if found is None:
                print(f"no shared state named {args.key!r}", file=sys.stderr)
                return 1
            entry = found
    _print(json.dumps(_entry_json(entry), indent=2) if args.json else _entry_line(entry))
    return 0


async def _state_list(args: argparse.Namespace) -> int:
    """Every entry whose key starts with the prefix, a line (or a JSON object) each."""
    async with connect(args.broker, agent_id=args.agent, security=security_config(args)) as client:
        entries = [entry async for entry in client.state_entries(args.prefix)]
    if args.json:
        _print(json.dumps([_entry_json(e) for e in entries], indent=2))
    elif not entries:
        print(f"no shared state entries under {args.prefix!r}", file=sys.stderr)
    else:
        for entry in entries:
            _print(_entry_line(entry))
    return 0


async def _state_watch(args: argparse.Namespace) -> int:
    """The entries under the prefix, then each change as it is made (a line, or a JSON
    object, each: what happened, then the entry), until interrupted; a broker that restarts
    meanwhile is watched again, and what changed while it was away printed as changes."""
    async with connect(args.broker, agent_id=args.agent, security=security_config(args)) as client:
        synced = False
        async for change in client.watch_state(args.prefix, send_initial=True, resume=True):
            if change.entry is None:  # SYNCED: what follows are changes
                said = "again" if synced else "(Ctrl-C to stop)"
                print(f"watching {args.prefix!r} {said}", file=sys.stderr, flush=True)
                synced = True
            elif args.json:
                _print(
                    json.dumps(
                        {"kind": change.kind.value, "entry": _entry_json(change.entry)},
                        separators=(",", ":"),
                    )
                )
            else:
                _print(f"{change.kind.value:<7} {_entry_line(change.entry)}")
    return 0


async def _insights(args: argparse.Namespace) -> int:
    """Lists the shared memory pool's insights matching the filters, its statistics, or
    deletes the matching ones."""
    async with connect(args.broker, agent_id="cli", security=security_config(args)) as client:
        if args.delete:
            deleted = await client.delete_insights(
                insight_ids=args.id, tags=args.tag, segment=args.segment, agent_id=args.agent
            )
            _print(f"deleted {deleted} insights")
            return 0
        if args.stats:
            stats = await client.memory_stats()
            _print(
                json.dumps(
                    {
                        "total_insights": stats.total_insights,
                        "capacity": stats.capacity,
                        "agents_involved": stats.agents_involved,
                        "segment_distribution": stats.segment_distribution,
                        "tag_distribution": stats.tag_distribution,
                    },
                    indent=2,
                )
            )
            return 0
        found = await client.read_insights(
            tags=args.tag, segment=args.segment, agent_id=args.agent, limit=args.limit
        )
    if args.id:
        found = [i for i in found if i.insight_id in set(args.id)]
    if args.json:
        _print(
            json.dumps(
                [
                    {
                        "insight_id": i.insight_id,
                        "agent_id": i.agent_id,
                        "segment": i.segment,
                        "tags": list(i.tags),
                        "importance": i.importance,
                        "content": i.content,
                        "created_at": i.created_at.isoformat() if i.created_at else None,
                        "expires_at": i.expires_at.isoformat() if i.expires_at else None,
                    }
                    for i in found
                ],
                indent=2,
            )
        )
        return 0
    for i in found:
        until = f"  until {i.expires_at.isoformat()}" if i.expires_at else ""
        _print(
            f"{i.insight_id}  {i.segment}  by {i.agent_id}  [{','.join(i.tags)}]  "
            f"{i.importance:g}{until}  {json.dumps(i.content, separators=(',', ':'))}"
        )
    _print(f"{len(found)} insights")
    return 0


async def _trace(args: argparse.Namespace) -> int:
    from mesh.tracing import find_trace, load_spans, render_tree, render_waterfall

    spans = await asyncio.to_thread(load_spans, args.dir)
    found = find_trace(spans, args.id)
    if not found:
        print(f"no trace matches {args.id!r} in {args.dir}", file=sys.stderr)
        return 1
    for trace_id in dict.fromkeys(s["trace_id"] for s in found):
        for line in render_tree([s for s in found if s["trace_id"] == trace_id]):
            _print(line)
    if args.png:
        drawn = await asyncio.to_thread(render_waterfall, found, Path(args.png))
        _print(
            f"wrote {args.png}"
            if drawn
            else "no PNG: matplotlib is not installed (pip install 'agentmesh[bench]')"
        )
    return 0


async def _certs(args: argparse.Namespace) -> int:
    from mesh.certs import write_dev_certificates

    files = await asyncio.to_thread(
        write_dev_certificates, args.dir, hosts=args.host, clients=args.client, days=args.days
    )
    for role, path in files.items():
        _print(f"{role:<24} {path}")
    return 0


def _agents_named(item: str) -> list[str]:
    """The agent ids ``NAME=ITEMS`` gives a principal: each item an agent id, or a
    module:attribute spec of agents (the ids it serves)."""
    ids: list[str] = []
    for part in filter(None, (p.strip() for p in item.split(","))):
        ids += [a.agent_id for a in load_agents(part)] if ":" in part else [part]
    return ids


def _write_private(path: Path, text: str) -> None:
    """Written whole (a server reading the file meanwhile sees the old or the new), 0600."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    spare = path.with_name(f".{path.name}.new")
    spare.unlink(missing_ok=True)
    with os.fdopen(os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(text)  # (0600 from its first byte: no moment others could read a token)
    spare.replace(path)


async def _credentials(args: argparse.Namespace) -> int:
    for line in await asyncio.to_thread(_write_credentials, args):
        _print(line)
    return 0


def _write_credentials(args: argparse.Namespace) -> list[str]:
    """Writes (or changes) DIR/credentials.json and DIR/tokens/NAME; what it did, said."""
    from mesh.core.auth import Authenticator, new_token, principal_entry, retired, rotated

    if not (args.principal or args.admin or args.rotate or args.retire):
        raise UsageError("nothing to write: give --principal, --admin, --rotate or --retire")
    folder = Path(args.dir)
    path, tokens = folder / "credentials.json", folder / "tokens"
    data: dict[str, Any] = {"principals": []}
    if path.exists():
        try:
            data = json.loads(path.read_text())
            Authenticator.from_mapping(data)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read {path}: {error}") from None
        data = {**data, "principals": list(data.get("principals") or [])}
    elif args.rotate or args.retire:
        raise UsageError(f"{path} does not exist: nothing to rotate or retire")
    if both := set(args.rotate) & set(args.retire):
        raise UsageError(
            f"--rotate and --retire {', '.join(sorted(both))}: one at a time (retire once its "
            "clients send the new token)"
        )
    names = {str(p.get("name")) for p in data["principals"]}
    written: dict[str, str] = {}
    said: list[str] = []
    for given, admin in [(p, False) for p in args.principal] + [(a, True) for a in args.admin]:
        name, _, agents = given.partition("=") if not admin else (given, "", "")
        if not name or (not admin and not agents):
            raise UsageError(f"--principal must be NAME=AGENTS, got {given!r}")
        if name in names:
            raise UsageError(
                f"{name} is a principal already (--rotate {name} gives it a new token)"
            )
        names.add(name)
        written[name] = new_token()
        entry = principal_entry(name, _agents_named(agents), admin=admin, token=written[name])
        data = {**data, "principals": [*data["principals"], entry]}
        said.append(f"{name}: a new principal" + (" (admin)" if admin else f" of {agents}"))
    for name in args.rotate:
        written[name] = new_token()
        try:
            data = rotated(data, name, written[name])
        except KeyError:
            raise UsageError(f"--rotate {name}: no principal is so named") from None
        said.append(f"{name}: a new token beside the old (--retire {name} once its clients use it)")
    for name in args.retire:
        try:
            keep = (tokens / name).read_text().strip()
            data, gone = retired(data, name, keep)
        except (OSError, KeyError):
            raise UsageError(
                f"--retire {name}: {tokens / name} does not hold one of its tokens"
            ) from None
        said.append(f"{name}: older tokens taken out: {gone}")
    Authenticator.from_mapping(data)  # (what the servers will read)
    for name, token in written.items():
        _write_private(tokens / name, token + "\n")
    _write_private(path, json.dumps(data, indent=2) + "\n")
    files = "".join(f", {tokens / name}" for name in written)
    return [*said, f"wrote {path} (tokens: {len(data['principals'])}){files}"]


# -- parser ------------------------------------------------------------------------------------


def _add_process_options(parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """How a process logs and traces. Taken before the command (`agentmesh --log-level INFO
    broker`) or after it (`agentmesh broker --log-level INFO`): the command's own parser has
    them with no defaults, so that only what is given there replaces the others."""

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        default=default(_env("LOG_LEVEL", "WARNING").upper()),
        help="WARNING (default) writes warnings, errors and the structured events (hand-offs,"
        " broadcasts, registrations, retries, ...); ERROR leaves the events out (env"
        " AGENTMESH_LOG_LEVEL)",
    )
    parser.add_argument(
        "--trace-dir",
        default=default(_env("TRACE_DIR", "") or None),
        help="write spans as JSON lines to this folder (env AGENTMESH_TRACE_DIR;"
        " `up` defaults to ./traces); OTLP via OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    parser.add_argument(
        "--event-log",
        default=default(_env("EVENT_LOG", "") or None),
        help="also write the structured events (hand-offs, broadcasts, registrations,"
        " expiries, ...) as JSON lines to this file, whatever --log-level: a new file every"
        " day at midnight UTC, the earlier ones kept --event-log-days (env"
        " AGENTMESH_EVENT_LOG; `up` defaults to ./logs/events.jsonl)",
    )
    parser.add_argument(
        "--event-log-days",
        type=int,
        default=default(_env("EVENT_LOG_DAYS", str(EVENT_LOG_DAYS))),
        help=f"days of events the event log keeps (env AGENTMESH_EVENT_LOG_DAYS;"
        f" {EVENT_LOG_DAYS}, as RF-009 keeps hand-off logs)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentmesh", description=__doc__)
    _add_process_options(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    broker_default = _env("BROKER", DEFAULT_BROKER)

    p = sub.add_parser("broker", help="run the broker")
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=port, default=_env("PORT", "50051"))
    p.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=_env("METRICS_PORT", "-1"),
        help="HTTP port of /metrics (-1 off, 0 any free port)",
    )
    add_health_port_flag(p, "HEALTH_PORT")
    add_wait_flag(
        p,
        "store",
        "a queue store that cannot be reached yet (Redis) as the broker starts, before it serves",
    )
    p.add_argument(
        "--tools",
        default=_env("TOOLS", "") or None,
        metavar="MODULE:ATTR",
        help="serve the Tool service with this ToolHost (or a factory of one), e.g. "
        "agents.research:tool_host for the research subagents (env AGENTMESH_TOOLS)",
    )
    _add_broker_config_flags(p)
    add_security_flags(p, server=True)
    p.set_defaults(run=_run_broker)

    p = sub.add_parser(
        "agent", help="run agents from module:attribute (or path/to/file.py:attribute) specs"
    )
    p.add_argument(
        "spec",
        nargs="+",
        help="module:attribute (a module of the working directory, or installed) or "
        "path/to/file.py:attribute naming an Agent (instance, class, or a factory of one "
        "or a list), e.g. agents.stocks:stock_experts or ./my_agent.py:MyAgent",
    )
    p.add_argument("--id", help="agent id to use instead of the agent's own")
    p.add_argument("--broker", default=broker_default)
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument(
        "--port",
        type=port,
        default=_env("AGENT_PORT", "0"),
        help="port of the first agent, the next ones count up (0: free ports)",
    )
    add_health_port_flag(p, "AGENT_HEALTH_PORT", ", the first agent's; the next ones count up")
    p.add_argument(
        "--advertise-host",
        default=_env("ADVERTISE_HOST", "") or None,
        help="host others reach the agents at (e.g. the pod IP)",
    )
    p.add_argument("--max-in-flight", type=int, default=16)
    add_wait_flag(
        p,
        "broker",
        "a broker that cannot be reached yet as the agents start, their"
        " servers up and not ready meanwhile",
    )
    p.add_argument(
        "--delivery",
        choices=["pull", "push"],
        default=_env("DELIVERY", "pull"),
        help="pull: the agents subscribe to their queues (default); push: the broker calls"
        " each agent's server with its messages (env AGENTMESH_DELIVERY)",
    )
    add_security_flags(p, server=True)
    p.set_defaults(run=_run_agent)

    p = sub.add_parser(
        "send", help="send a message (a request with --request, a broadcast with --to broadcast)"
    )
    p.add_argument("--broker", default=broker_default)
    p.add_argument("--from", dest="sender", default="cli")
    p.add_argument("--to", required=True, help='an agent id, or "broadcast" for every agent')
    p.add_argument(
        "--types",
        dest="agent_types",
        action="append",
        default=[],
        help="broadcast to the agents of this type only (repeatable)",
    )
    p.add_argument("--action")
    p.add_argument("--params", help="JSON object for content.parameters")
    p.add_argument("--content", help="the whole content as a JSON object")
    # (any case, as the SDK takes them: --priority high)
    p.add_argument(
        "--type", default="REQUEST", type=str.upper, choices=[t.value for t in MessageType]
    )
    p.add_argument(
        "--priority", default="MEDIUM", type=str.upper, choices=[x.value for x in Priority]
    )
    p.add_argument("--ttl", type=int, default=0)
    p.add_argument(
        "--delay",
        type=float,
        metavar="SECONDS",
        help="deliver it this many seconds from now, not before (the broker holds it)",
    )
    p.add_argument("--correlation-id")
    p.add_argument("--ack-required", action="store_true")
    p.add_argument("--request", action="store_true", help="wait for the response")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--json", action="store_true")
    add_security_flags(p, server=False)
    p.set_defaults(run=_send)

    p = sub.add_parser("receive", help="take an agent's queued messages")
    p.add_argument("agent_id", nargs="?", metavar="AGENT")
    p.add_argument("--broker", default=broker_default)
    p.add_argument("--agent", help="the agent (or as AGENT)")
    p.add_argument("--max", type=int, default=0)
    p.add_argument("--json", action="store_true")
    add_security_flags(p, server=False)
    p.set_defaults(run=_receive)

    p = sub.add_parser(
        "queue",
        help="what an agent's queue holds (waiting in delivery order, in flight, deferred),"
        " not taken",
    )
    p.add_argument("agent", metavar="AGENT")
    p.add_argument("--broker", default=broker_default)
    p.add_argument("--json", action="store_true")
    add_security_flags(p, server=False)
    p.set_defaults(run=_queue)

    p = sub.add_parser("agents", help="list registered agents")
    p.add_argument("--broker", default=broker_default)
    p.add_argument("--type")
    p.add_argument("--json", action="store_true")
    add_security_flags(p, server=False)
    p.set_defaults(run=_agents)

    p = sub.add_parser(
        "workflows", help="the hand-off workflows, as their status in the shared state says"
    )
    p.add_argument("--status", choices=["IN_PROGRESS", "COMPLETED", "FAILED"], help="only these")
    p.add_argument("--broker", default=broker_default)
    p.add_argument("--json", action="store_true")
    add_security_flags(p, server=False)
    p.set_defaults(run=_workflows)

    p = sub.add_parser(
        "state",
        help="read, write (VALUE as JSON) or delete a shared state entry, or list entries by "
        "key prefix (--prefix)",
    )
    p.add_argument("key", nargs="?", help="the entry's key (not with --prefix)")
    p.add_argument("value", nargs="?", help="the new value, as JSON; omitted: read the entry")
    p.add_argument("--agent", default="cli", help="the writing agent (default cli)")
    p.add_argument(
        "--expect-version",
        type=int,
        help="write or delete only if the entry is at this version (0: only if absent)",
    )
    p.add_argument(
        "--ttl", type=float, help="with VALUE: the entry lapses this many seconds after the write"
    )
    p.add_argument("--delete", action="store_true")
    p.add_argument(
        "--prefix",
        help="list every entry whose key starts with this, in key order ('' for all entries)",
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="with --prefix: the entries, then each change as it is made, until interrupted"
        " (a broker that restarts is watched again)",
    )
    p.add_argument("--broker", default=broker_default)
    p.add_argument("--json", action="store_true")
    add_security_flags(p, server=False)
    p.set_defaults(run=_state)

    p = sub.add_parser(
        "insights", help="list, count (--stats) or delete (--delete) shared memory insights"
    )
    p.add_argument("--tag", action="append", default=[], help="carrying this tag (repeatable)")
    p.add_argument("--segment", default="", help="of this segment")
    p.add_argument("--agent", default="", help="written by this agent")
    p.add_argument("--id", action="append", default=[], help="this insight (repeatable)")
    p.add_argument("--limit", type=int, default=0, help="at most this many (default 100)")
    p.add_argument("--delete", action="store_true", help="delete the insights matching")
    p.add_argument("--stats", action="store_true", help="the pool's statistics")
    p.add_argument("--broker", default=broker_default)
    p.add_argument("--json", action="store_true")
    add_security_flags(p, server=False)
    p.set_defaults(run=_insights)

    p = sub.add_parser("trace", help="print a trace (by trace, workflow, group or run id)")
    p.add_argument("id", help="a trace id (or its start), or a workflow/group/run id")
    p.add_argument("--dir", default=_env("TRACE_DIR", "traces"), help="the folder of spans")
    p.add_argument("--png", help="also draw the trace as a waterfall PNG here")
    p.set_defaults(run=_trace)

    p = sub.add_parser("certs", help="write development TLS certificates (CA, server, clients)")
    p.add_argument("dir", help="folder to write the PEM files to")
    p.add_argument("--host", action="append", default=[], help="extra server name or IP")
    p.add_argument(
        "--client", action="append", default=[], help="a client certificate for this name (CN)"
    )
    p.add_argument("--days", type=int, default=365)
    p.set_defaults(run=_certs)

    p = sub.add_parser(
        "credentials",
        help="write a credentials file and a token file per principal; rotate or retire "
        "a principal's tokens",
    )
    p.add_argument("dir", help="folder of credentials.json and tokens/NAME")
    p.add_argument(
        "--principal",
        action="append",
        default=[],
        metavar="NAME=AGENTS",
        help="a principal acting as these agents: agent ids or module:attribute specs, "
        "comma-separated",
    )
    p.add_argument("--admin", action="append", default=[], metavar="NAME", help="an admin")
    p.add_argument(
        "--rotate", action="append", default=[], metavar="NAME", help="a new token beside the old"
    )
    p.add_argument(
        "--retire",
        action="append",
        default=[],
        metavar="NAME",
        help="take out its tokens but the one tokens/NAME holds",
    )
    p.set_defaults(run=_credentials)

    p = sub.add_parser("stats", help="queue depths, counters and dead letters")
    p.add_argument("--broker", default=broker_default)
    p.add_argument("--agent")
    p.add_argument("--json", action="store_true")
    add_security_flags(p, server=False)
    p.set_defaults(run=_stats)

    p = sub.add_parser(
        "requeue", help="put an agent's dead letters (all, or those named) back in its queue"
    )
    p.add_argument("agent")
    p.add_argument("message_ids", nargs="*", metavar="MESSAGE_ID")
    p.add_argument("--broker", default=broker_default)
    add_security_flags(p, server=False)
    p.set_defaults(run=_requeue)

    p = sub.add_parser(
        "cancel",
        help="take back messages a sender sent to an agent, not delivered yet (waiting or"
        " scheduled)",
    )
    p.add_argument("agent", help="the agent the messages were sent to")
    p.add_argument("message_ids", nargs="+", metavar="MESSAGE_ID")
    p.add_argument("--from", dest="sender", default="cli", help="their sender (default: cli)")
    p.add_argument("--broker", default=broker_default)
    add_security_flags(p, server=False)
    p.set_defaults(run=_cancel)

    p = sub.add_parser(
        "deregister",
        help="take an agent off the mesh (every instance), or with --address one instance of it",
        description="Takes an agent off the mesh (every instance), or with --address one"
        " instance of it. What waits in its queue stays there until its ttl ends. A process"
        " of the agent still subscribed learns of it as its subscription ends: it takes no more"
        " messages and says NOT_SERVING until it is started again.",
    )
    p.add_argument("agent")
    p.add_argument(
        "--address", default="", help="only the instance serving at HOST:PORT (a process gone)"
    )
    p.add_argument("--broker", default=broker_default)
    add_security_flags(p, server=False)
    p.set_defaults(run=_deregister)

    _add_gateway_commands(sub, broker_default)
    for command in sub.choices.values():
        _add_process_options(command, defaults=False)
    return parser


def _add_gateway_commands(sub: Any, broker_default: str) -> None:
    """`up` and `demo` live with the gateway; they are added when it is installed."""
    try:
        from gateway.cli import add_commands
    except ImportError:
        return
    add_commands(sub, broker_default)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    event_log = args.event_log or ("logs/events.jsonl" if args.command == "up" else None)
    try:
        configure_logging(
            args.log_level, event_log_path=event_log, event_log_days=args.event_log_days
        )
    except ValueError as error:  # AGENTMESH_LOG_LEVEL names no level, or too few days
        parser.error(str(error))
    except OSError as error:  # (the level and the days were taken: only the file failed)
        if args.event_log:  # asked for: refused
            parser.error(f"cannot write the event log {event_log}: {error}")
        # `up`'s own default, in a folder it cannot write (a read-only image): without
        configure_logging(args.log_level, event_log_days=args.event_log_days)
        logging.getLogger("mesh.cli").warning(
            "no event log: cannot write %s (%s); --event-log names another", event_log, error
        )
    try:
        loop_name()
        check_environment()
    except ValueError as error:
        parser.error(str(error))
    if args.command in TRACED:
        from mesh.tracing import configure_tracing

        trace_dir = args.trace_dir or ("traces" if args.command == "up" else None)
        try:
            configure_tracing(TRACED[args.command], trace_dir)
        except OSError as error:
            parser.error(f"cannot write traces to {trace_dir}: {error}")
    try:
        return int(run_loop(args.run(args)) or 0)
    except MeshError as error:
        stop_logging()  # what was logged before it comes first
        print(f"error: {error.code}: {error.message}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went (`agentmesh agents | head`): quietly, as `ls` does
        # Python would report the pipe again flushing stdout at exit: it goes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # (128 + SIGPIPE, what a shell reports for a tool the signal ended)
    except OSError as error:  # a port in use, a file that is not there: said, not traced
        stop_logging()
        print(f"error: {error}", file=sys.stderr)
        return 1
    except UsageError as error:
        parser.error(str(error))
    except KeyboardInterrupt:
        return 130
    finally:
        from mesh.tracing import shutdown_tracing

        shutdown_tracing()
        stop_logging()


if __name__ == "__main__":
    sys.exit(main())

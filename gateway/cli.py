"""`agentmesh up` and `agentmesh demo`: the embedded mesh and its demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any


def _env(name: str, default: str) -> str:
    return os.environ.get(f"AGENTMESH_{name}", default)


async def _up(args: argparse.Namespace) -> int:
    from gateway.embedded import start_embedded
    from mesh.cli import _print, _until_signalled
    from mesh.config import BrokerConfig
    from mesh.loop import stop_on_signals

    stop = stop_on_signals()
    mesh = await start_embedded(
        docs_dir=args.docs,
        reports_dir=args.reports_dir,
        host=args.host,
        broker_port=args.port,
        gateway_port=args.gateway_port,
        metrics_port=args.metrics_port,
        data_dir=args.data_dir,
        dashboard_port=args.dashboard_port,
        trace_dir=args.trace_dir or "traces",
        broker_config=BrokerConfig.from_env(),  # AGENTMESH_STORE and the other limits
        max_runs=args.max_runs,
    )
    info = mesh.describe()
    _print(
        f"agentmesh up: broker {info['broker']}, gateway {info['gateway']}, "
        f"{len(mesh.agents)} agents (insecure, plaintext, localhost)"
    )
    if info["metrics"]:
        _print(f"metrics: {info['metrics']}")
    if info["dashboard"]:
        _print(f"dashboard: {info['dashboard']}")
    for served in mesh.agents:
        _print(f"  agent {served.agent.agent_id:<26} {served.address}")
    if args.ready_file:
        text = json.dumps(info, indent=2)
        await asyncio.to_thread(Path(args.ready_file).write_text, text, encoding="utf-8")
    _print("ready; Ctrl-C to stop")
    await _until_signalled(stop)
    _print("agentmesh up: shutting down")
    await mesh.stop()
    _print("agentmesh up: stopped")
    return 0


async def _gateway(args: argparse.Namespace) -> int:
    from gateway.patterns.orchestrator import ROUTES_FILE, Router
    from gateway.server import RoutesError, serve_gateway
    from mesh.cli import (
        UsageError,
        _print,
        _until_signalled,
        security_config,
        served_on,
    )
    from mesh.loop import stop_on_signals

    try:
        router = Router.from_file(Path(args.routes)) if args.routes else None
    except ValueError as error:
        raise UsageError(f"--routes: {error}") from None
    stop = stop_on_signals()
    try:
        gateway = await serve_gateway(
            args.broker,
            host=args.host,
            port=args.port,
            router=router,
            metrics_port=args.metrics_port,
            health_port=args.health_port,
            security=security_config(args),
            max_runs=args.max_runs,
        )
    except RoutesError as error:
        raise UsageError(f"--routes: {args.routes or ROUTES_FILE}: {error}") from None
    dashboard = None
    if args.dashboard_port >= 0:
        from gateway.dashboard import serve_dashboard

        try:
            dashboard = await serve_dashboard(
                gateway,
                host=args.host,
                port=args.dashboard_port,
                trace_dir=args.trace_dir,
                allow_runs=args.dashboard_runs,
                security=security_config(args),
            )
        except ValueError as error:
            await gateway.stop(0)
            raise UsageError(f"--dashboard-runs: {error}") from None
    _print(
        f"agentmesh gateway listening on {gateway.address}{served_on(args.host, gateway.server)}"
        f", broker {args.broker} "
        f"({gateway.server.security})"
    )
    if dashboard is not None:
        _print(f"dashboard: {dashboard.url}")
    await _until_signalled(stop)
    if dashboard is not None:
        await dashboard.stop()
    await gateway.stop()
    return 0


async def _research(args: argparse.Namespace) -> int:
    from gateway.client import GatewayClient
    from mesh.cli import _print

    mesh = None
    gateway_address = args.gateway
    if not gateway_address:
        from gateway.embedded import start_embedded

        mesh = await start_embedded(docs_dir=args.docs, reports_dir=args.out)
        gateway_address = mesh.gateway.address
    try:
        async with GatewayClient(gateway_address, timeout=args.timeout) as client:
            result: dict[str, Any] = {}
            async for event in client.research(
                query=args.query,
                documents=bool(args.docs),
                max_iterations=args.max_iterations,
                report_name=args.name or "",
            ):
                _print(f"[{event['elapsed_ms']:8.1f} ms] {event['kind']:<13} {event['summary']}")
                if event["kind"] == "RESULT":
                    result = event["data"]
    finally:
        if mesh is not None:
            await mesh.stop()
    _print("")
    _print(str(result.get("summary") or ""))
    for gap in result.get("gaps") or []:
        _print(f"open gap: {gap}")
    for path in (result.get("report") or {}).get("files") or []:
        _print(f"wrote {path}")
    return 0 if result.get("status") in ("COMPLETED", "PARTIAL") else 1


async def _demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    if args.gateway:
        return await run_demo(args.gateway)
    from gateway.embedded import start_embedded

    mesh = await start_embedded(data_dir=args.data_dir)
    try:
        return await run_demo(mesh.gateway.address)
    finally:
        await mesh.stop()


def _folder(value: str) -> str:
    """A flag naming a folder to read from: refused at once, saying so, when it is none (the
    mesh would otherwise start and find nothing there, or fail on each request)."""
    if not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"{value} is not a folder")
    return value


def _runs_limit(value: str) -> int:
    """--max-runs (or AGENTMESH_GATEWAY_MAX_RUNS): a whole number of runs, at least 1."""
    number = int(value) if value.isascii() and value.isdigit() else 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of runs (1 or more)")
    return number


def _add_max_runs(parser: argparse.ArgumentParser) -> None:
    from gateway.server import MAX_RUNS

    parser.add_argument(
        "--max-runs",
        type=_runs_limit,
        default=_env("GATEWAY_MAX_RUNS", str(MAX_RUNS)),
        help="pattern runs the gateway holds at once; more are refused with "
        f"RESOURCE_EXHAUSTED (reason TOO_MANY_RUNS) to retry (default {MAX_RUNS})",
    )


def add_commands(sub: Any, broker_default: str) -> None:
    from mesh.cli import add_health_port_flag, add_security_flags, port, port_or_off

    p = sub.add_parser("up", help="run broker, gateway and the sample agents on localhost")
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=port, default=_env("PORT", "50051"), help="broker port")
    p.add_argument("--gateway-port", type=port, default=_env("GATEWAY_PORT", "50052"))
    p.add_argument(
        "--dashboard-port",
        type=port_or_off,
        default=_env("DASHBOARD_PORT", "8080"),
        help="HTTP port of the live dashboard (-1 off, 0 any free port)",
    )
    p.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=_env("METRICS_PORT", "9464"),
        help="HTTP port of /metrics (-1 off, 0 any free port)",
    )
    p.add_argument(
        "--data-dir",
        type=_folder,
        default=_env("DATA_DIR", "") or None,
        help="folder of the sample agents' JSON data",
    )
    p.add_argument("--ready-file", help="write the addresses as JSON here once ready")
    _add_max_runs(p)
    p.add_argument(
        "--docs",
        type=_folder,
        default=_env("DOCS_DIR", "") or None,
        help="local documents for research (default: the shipped sample documents)",
    )
    p.add_argument(
        "--reports-dir",
        default=_env("REPORTS_DIR", "research-reports"),
        help="where the report agent writes research reports",
    )
    p.set_defaults(run=_up)

    p = sub.add_parser("gateway", help="run the gateway against a broker")
    p.add_argument("--broker", default=broker_default)
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=port, default=_env("GATEWAY_PORT", "50052"))
    p.add_argument("--metrics-port", type=port_or_off, default=_env("GATEWAY_METRICS_PORT", "-1"))
    add_health_port_flag(p, "GATEWAY_HEALTH_PORT")
    p.add_argument(
        "--routes",
        default=_env("ROUTES", "") or None,
        help="routing table JSON (default: gateway/data/routes.json)",
    )
    p.add_argument(
        "--dashboard-port",
        type=port_or_off,
        default=_env("DASHBOARD_PORT", "-1"),
        help="HTTP port of the live dashboard (-1 off, 0 any free port)",
    )
    p.add_argument(
        "--dashboard-runs",
        action="store_true",
        help="let the dashboard start patterns (read-only otherwise; with security on, "
        "starting needs the gateway credential)",
    )
    _add_max_runs(p)
    add_security_flags(p, server=True)
    p.set_defaults(run=_gateway)

    p = sub.add_parser("research", help="research a question with the hub-and-spoke agents")
    p.add_argument("query")
    p.add_argument(
        "--docs",
        type=_folder,
        help="folder of local documents (.txt, .md; pages split by form "
        "feeds, and every 16,000 characters at most) to search besides the web snapshot",
    )
    p.add_argument(
        "--out",
        default=_env("REPORTS_DIR", "research-reports"),
        help="folder the report agent writes the Markdown and JSON report to",
    )
    p.add_argument("--name", help="base name of the report files")
    p.add_argument("--max-iterations", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument(
        "--gateway",
        default=None,
        help="a running gateway (its mesh's tool host decides docs and output)",
    )
    p.set_defaults(run=_research)

    p = sub.add_parser("demo", help="run every pattern through the gateway and report")
    p.add_argument(
        "--gateway",
        default=_env("GATEWAY", "") or None,
        help="address of a running gateway; without it an embedded mesh is started",
    )
    p.add_argument("--data-dir", type=_folder, default=_env("DATA_DIR", "") or None)
    p.set_defaults(run=_demo)

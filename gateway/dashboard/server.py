"""The live dashboard: an HTTP server beside the gateway (aiohttp), pushing to the page by
server-sent events.

It reads the mesh through the same gRPC the rest of the world uses (agents and queue depths
from the broker, each agent's health from the agent itself, the hand-off workflows by watching
their status in the shared state), follows every pattern run through
the gateway servicer's observers, reads traces from the span files, and starts patterns by
calling the gateway like any client would. Read-only unless runs are allowed; with security
on, starting a run needs a credential the gateway accepts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import GatewayClient
from gateway.events import PatternEvent
from gateway.server import GatewayServer
from mesh.agent import AGENT_SERVICE
from mesh.client import CLIENT_OPTIONS, MeshClient
from mesh.config import SecurityConfig
from mesh.core.auth import Authenticates
from mesh.core.errors import MeshError
from mesh.core.model import AgentInfo
from mesh.core.state import ChangeKind, StateEntry
from mesh.core.workflows import WORKFLOW_KEY_PREFIX
from mesh.security import authenticator_for, https_context, open_channel

logger = logging.getLogger("gateway.dashboard")

STATIC = Path(__file__).parent / "static"
SAMPLE_SECONDS = 1.0
HISTORY = 300
"""Samples kept for the charts: five minutes at one per second."""
MAX_RUNS = 50
MAX_WORKFLOWS = 100
"""Hand-off workflows shown: those handed off most recently."""
REWATCH_SECONDS = 1.0
MAX_EVENTS_PER_RUN = 500
HEALTH_CHECKS_AT_ONCE = 32
"""Agents asked for their health at the same moment, at most, each sample."""
MAX_CLIENTS = 64
CLIENT_QUEUE = 256
RPCS = {
    "group_chat": "RunGroupChat",
    "handoff_workflow": "RunHandoffWorkflow",
    "collaborative_filtering": "RunCollaborativeFiltering",
    "consensus": "RunConsensus",
    "research": "RunResearch",
    "route": "Route",
    "parallel": "RunParallel",
}
_END = {"RESULT", "FAILURE", "DECISION", "REPORT"}


def event_json(event: PatternEvent) -> dict[str, Any]:
    return {
        "run_id": event.run_id,
        "pattern": event.pattern.value,
        "kind": event.kind.value,
        "summary": event.summary,
        "agent_id": event.agent_id,
        "step": event.step,
        "round": event.round,
        "elapsed_ms": round(event.elapsed_ms, 3),
        "timestamp": event.timestamp.isoformat(),
        "data": event.data,
    }


def workflow_row(entry: StateEntry) -> dict[str, Any]:
    """A workflow's status (``workflow/<id>`` in the shared state) as the page shows it."""
    value = entry.value if isinstance(entry.value, dict) else {}
    return {
        "key": entry.key,
        "workflow_id": value.get("workflow_id") or entry.key.removeprefix(WORKFLOW_KEY_PREFIX),
        "step": value.get("step"),
        "status": value.get("status") or "IN_PROGRESS",
        "error_reason": value.get("error_reason") or "",
        "current_agent": value.get("current_agent"),
        "from_agent": value.get("from_agent"),
        "task_description": value.get("task_description"),
        "handed_off_at": value.get("handed_off_at") or entry.updated_at.isoformat(),
        "version": entry.version,
    }


@dataclass
class RunRecord:
    run_id: str
    pattern: str
    started: str
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS_PER_RUN))
    status: str = "RUNNING"

    def summary(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "pattern": self.pattern,
            "started": self.started,
            "status": self.status,
            "events": len(self.events),
        }


class Dashboard:
    """State the page shows, kept current, and the clients to push it to."""

    def __init__(
        self,
        client: MeshClient,
        gateway: GatewayServer,
        *,
        trace_dir: str | Path | None = None,
        allow_runs: bool = True,
        security: SecurityConfig | None = None,
    ) -> None:
        self.client = client
        self.gateway = gateway
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self.security = security or SecurityConfig()
        self.authenticator: Authenticates | None = authenticator_for(self.security)
        self.allow_runs = allow_runs
        self.runs: dict[str, RunRecord] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.snapshot: dict[str, Any] = {"agents": [], "totals": {}}
        self.workflows: dict[str, dict[str, Any]] = {}
        """By key, the one handed off last at the end."""
        self._clients: set[asyncio.Queue[str]] = set()
        self._last: tuple[float, dict[str, Any]] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._health: dict[str, grpc.aio.Channel] = {}
        """A channel to each agent address the registry names now (closed as it leaves)."""
        self._health_checks = asyncio.Semaphore(HEALTH_CHECKS_AT_ONCE)
        if gateway.servicer is not None:
            gateway.servicer.observers.append(self.on_event)

    # -- following the mesh ----------------------------------------------------------------

    def on_event(self, event: PatternEvent) -> None:
        record = self.runs.get(event.run_id)
        if record is None:
            if len(self.runs) >= MAX_RUNS:
                oldest = next(iter(self.runs))
                del self.runs[oldest]
            record = self.runs[event.run_id] = RunRecord(
                event.run_id, event.pattern.value, event.timestamp.isoformat()
            )
        data = event_json(event)
        record.events.append(data)
        if event.kind.value in _END:
            status = str(event.data.get("status") or "COMPLETED")
            # (a workflow's FAILURE is its end; a group chat's, a round it could not run,
            # is not: its RESULT says how it ended)
            failed = event.kind.value == "FAILURE" and event.pattern.value == "HAND_OFF"
            if event.kind.value != "FAILURE" or failed:
                record.status = "FAILED" if failed else status
        self.publish("event", {"run": record.summary(), "event": data})

    def publish(self, kind: str, payload: Any) -> None:
        frame = f"event: {kind}\ndata: {json.dumps(payload, default=str)}\n\n"
        for queue in list(self._clients):
            try:
                queue.put_nowait(frame)
            except asyncio.QueueFull:  # a client that does not read loses live updates
                self._clients.discard(queue)

    async def start(self) -> None:
        self._sampler = asyncio.create_task(self._sample_forever(), name="dashboard-sampler")
        watching = asyncio.create_task(self._follow_workflows(), name="dashboard-workflows")
        self._tasks.add(watching)
        watching.add_done_callback(self._tasks.discard)

    async def _follow_workflows(self) -> None:
        """Watches the workflows' status in the shared state: the ones there when the watch
        begins, then each hand-off as it happens; a watch that ends (its broker restarted,
        or it fell behind) is begun again and the list read afresh."""
        failures = 0
        while True:
            fresh: dict[str, dict[str, Any]] = {}
            try:
                async for change in self.client.watch_state(WORKFLOW_KEY_PREFIX, send_initial=True):
                    failures = 0
                    entry = change.entry
                    if change.kind is ChangeKind.SYNCED:
                        self.workflows = dict(sorted(fresh.items(), key=_handed_off))
                        self._trim_workflows()
                        self.publish("workflows", list(self.workflows.values()))
                    elif entry is None:
                        continue
                    elif change.kind is ChangeKind.CURRENT:
                        fresh[entry.key] = workflow_row(entry)
                    elif change.kind is ChangeKind.PUT:
                        self.workflows.pop(entry.key, None)  # (to the end: the latest)
                        row = self.workflows[entry.key] = workflow_row(entry)
                        self._trim_workflows()
                        self.publish("workflow", {"key": entry.key, "row": row})
                    elif self.workflows.pop(entry.key, None) is not None:  # DELETE, LAPSE
                        self.publish("workflow", {"key": entry.key, "row": None})
            except MeshError as error:
                failures += 1
                logger.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "dashboard: watching the workflows failed: %s",
                    error.message,
                )
            await asyncio.sleep(REWATCH_SECONDS)

    def _trim_workflows(self) -> None:
        while len(self.workflows) > MAX_WORKFLOWS:
            del self.workflows[next(iter(self.workflows))]

    async def stop(self) -> None:
        for task in [self._sampler, *self._tasks]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for channel in self._health.values():
            await channel.close()

    async def _sample_forever(self) -> None:
        while True:
            try:
                await self.sample()
            except MeshError as error:
                logger.warning("dashboard sample failed: %s", error.message)
            except Exception:
                logger.exception("dashboard sample failed")
            await asyncio.sleep(SAMPLE_SECONDS)

    async def _forget_addresses(self, live: set[str]) -> None:
        """Closes the channels to addresses no agent has any more (agents come and go, on
        new addresses: a pod's, a port of the moment), so that they do not pile up."""
        for address in [a for a in self._health if a not in live]:
            await self._health.pop(address).close()

    async def _health_of(self, info: AgentInfo) -> str:
        """What the agent's latest instance says (grpc.health.v1) for its Agent service, its
        readiness: NOT_SERVING while it has lost its queue (the whole server's, "", for a
        server that reports no service of its own); NO_HEALTH for a server that answers but
        has no health service; NO_INSTANCE while none serves it since its last died; UNKNOWN
        when it never named one."""
        if info.lost_at is not None and not info.instances:
            return "NO_INSTANCE"
        address = info.address
        if not address:
            return "UNKNOWN"
        channel = self._health.get(address)
        if channel is None:  # (with the mesh's TLS and credentials: agents serve with them,
            # and tried again as the mesh's clients do: an agent back on its address is seen
            # within 2 s, not after gRPC's default backoff of up to 120 s)
            channel = self._health[address] = open_channel(address, self.security, CLIENT_OPTIONS)
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            async with self._health_checks:
                try:
                    reply = await stub.Check(
                        health_pb2.HealthCheckRequest(service=AGENT_SERVICE), timeout=0.5
                    )
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                return "NO_HEALTH"  # (it answers: a plain server without grpc.health.v1)
            return "UNREACHABLE"
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    async def sample(self) -> dict[str, Any]:
        agents = await self.client.list_agents()
        stats = await self.client.queue_stats()
        health = await asyncio.gather(*(self._health_of(a) for a in agents))
        await self._forget_addresses({a.address for a in agents})
        queues = {q.agent_id: q for q in stats.agents}
        rows = []
        for info, status in zip(agents, health, strict=True):
            q = queues.get(info.agent_id)
            rows.append(
                {
                    "agent_id": info.agent_id,
                    "agent_types": list(info.agent_types),
                    "address": info.address,
                    "health": status,
                    "lost_at": info.lost_at.isoformat() if info.lost_at else None,
                    "delivery_mode": info.delivery_mode.value,
                    "instances": len(info.instances),
                    "push_instances": len(info.push_instances),
                    "high": q.high if q else 0,
                    "medium": q.medium if q else 0,
                    "low": q.low if q else 0,
                    "in_flight": q.in_flight if q else 0,
                    "deferred": q.deferred if q else 0,
                    "dead_letters": q.dead_letters if q else 0,
                }
            )
        now = time.time()
        totals = dict(stats.totals)
        point: dict[str, Any] = {
            "t": now,
            "send_p50_ms": totals.get("send_latency_p50_ms", 0.0),
            "send_p95_ms": totals.get("send_latency_p95_ms", 0.0),
            "send_p99_ms": totals.get("send_latency_p99_ms", 0.0),
            "roundtrip_p50_ms": totals.get("roundtrip_latency_p50_ms", 0.0),
            "roundtrip_p95_ms": totals.get("roundtrip_latency_p95_ms", 0.0),
            "roundtrip_p99_ms": totals.get("roundtrip_latency_p99_ms", 0.0),
            "sent_per_s": 0.0,
            "delivered_per_s": 0.0,
        }
        if self._last is not None:
            then, before = self._last
            elapsed = max(now - then, 1e-6)
            point["sent_per_s"] = (totals["sent_count"] - before["sent_count"]) / elapsed
            point["delivered_per_s"] = (
                totals["delivered_count"] - before["delivered_count"]
            ) / elapsed
        self._last = (now, totals)
        self.history.append(point)
        self.snapshot = {"agents": rows, "totals": totals, "point": point}
        self.publish("snapshot", self.snapshot)
        return self.snapshot

    # -- what the page asks for ------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            **self.snapshot,
            "history": list(self.history),
            "runs": [r.summary() for r in reversed(self.runs.values())],
            "workflows": list(self.workflows.values()),
            "allow_runs": self.allow_runs,
            "credential_required": self.authenticator is not None,
            "patterns": sorted(RPCS),
        }

    def trace(self, wanted: str) -> dict[str, Any]:
        from mesh.tracing import critical_path, find_trace, load_spans

        with contextlib.suppress(Exception):
            from opentelemetry import trace as otel_trace

            provider: Any = otel_trace.get_tracer_provider()
            if hasattr(provider, "force_flush"):
                provider.force_flush(2000)
        if self.trace_dir is None or not self.trace_dir.is_dir():
            return {"spans": [], "critical_path": [], "note": "tracing is off"}
        spans = find_trace(load_spans(self.trace_dir), wanted)
        if not spans:
            return {"spans": [], "critical_path": [], "note": f"no trace for {wanted}"}
        first = min(s["start_ns"] for s in spans)
        return {
            "spans": [
                {
                    "span_id": s["span_id"],
                    "parent_span_id": s["parent_span_id"],
                    "name": s["name"],
                    "service": s["service"],
                    "offset_ms": round((s["start_ns"] - first) / 1e6, 3),
                    "duration_ms": s["duration_ms"],
                    "status": s["status"],
                }
                for s in spans
            ],
            "critical_path": critical_path(spans),
            "total_ms": round((max(s["end_ns"] for s in spans) - first) / 1e6, 3),
        }

    def _authorize_run(self, request: web.Request) -> SecurityConfig:
        """The credential to start a run with: none when security is off, else the caller's
        bearer token, which the gateway itself checks (and this server checks first)."""
        if not self.allow_runs:
            raise web.HTTPForbidden(
                text="this dashboard is read-only (a gateway's dashboard starts patterns only "
                "with --dashboard-runs)"
            )
        if self.authenticator is None:
            return self._client_security()
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise web.HTTPUnauthorized(text="starting a pattern needs the gateway credential")
        try:
            self.authenticator.authenticate(token.strip())
        except MeshError as error:
            raise web.HTTPUnauthorized(text=error.message) from None
        return self._client_security(token.strip())

    def _client_security(self, token: str = "") -> SecurityConfig:
        """How this server calls its gateway: the same TLS, the caller's token (if any)."""
        return SecurityConfig(
            tls_ca=self.security.tls_ca,
            tls_client_cert=self.security.tls_client_cert,
            tls_client_key=self.security.tls_client_key,
            tls_server_name=self.security.tls_server_name,
            token=token,
        )

    @property
    def _gateway_target(self) -> str:
        """Where this server calls its gateway: its address, or this machine's loopback
        when it listens on every interface (0.0.0.0 is no name a certificate holds)."""
        host, _, port = self.gateway.address.rpartition(":")
        return f"127.0.0.1:{port}" if host in ("0.0.0.0", "[::]", "::") else self.gateway.address

    async def start_run(self, name: str, body: dict[str, Any], security: SecurityConfig) -> str:
        """Starts a pattern through the gateway; returns its run id once its first event
        arrives (validation errors come back before that, as MeshError)."""
        rpc = RPCS.get(name)
        if rpc is None:
            raise web.HTTPNotFound(text=f"no pattern {name!r}; one of {', '.join(sorted(RPCS))}")
        first: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                async with GatewayClient(self._gateway_target, security=security) as gateway:
                    events = gateway.run(rpc, body)
                    async for event in events:
                        if not first.done():
                            first.set_result(str(event.get("run_id", "")))
            except MeshError as error:
                if not first.done():
                    first.set_exception(error)
                else:
                    logger.warning("dashboard run %s failed: %s", name, error.message)
            except Exception as error:  # a fault of ours: said at once, not after 30 s
                logger.exception("dashboard run %s failed", name)
                if not first.done():
                    first.set_exception(error)

        task = asyncio.create_task(run(), name=f"dashboard-run-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        async with asyncio.timeout(30):
            return await first

    async def rate_run(self, run_id: str, satisfied: bool, security: SecurityConfig) -> Any:
        """Tells the gateway whether a run's outcome satisfied the user (RecordFeedback)."""
        async with GatewayClient(self._gateway_target, security=security) as gateway:
            return await gateway.feedback(run_id, satisfied)

    async def stream(self) -> AsyncIterator[str]:
        if len(self._clients) >= MAX_CLIENTS:
            raise web.HTTPServiceUnavailable(text="too many dashboard clients")
        queue: asyncio.Queue[str] = asyncio.Queue(CLIENT_QUEUE)
        self._clients.add(queue)
        try:
            yield f"event: state\ndata: {json.dumps(self.state(), default=str)}\n\n"
            while True:
                try:
                    async with asyncio.timeout(15):
                        frame = await queue.get()
                except TimeoutError:
                    frame = ": keep-alive\n\n"
                yield frame
        finally:
            self._clients.discard(queue)


def _handed_off(item: tuple[str, dict[str, Any]]) -> str:
    return str(item[1]["handed_off_at"])


# -- HTTP ------------------------------------------------------------------------------------


FEEDBACK_STATUS = {"NOT_FOUND": 404, "FAILED_PRECONDITION": 409, "UNAUTHENTICATED": 401}
"""How the gateway's refusals of a rating read over HTTP."""
REQUEUE_STATUS = {"PERMISSION_DENIED": 403, "UNAUTHENTICATED": 401, "UNAVAILABLE": 503}
"""How the broker's refusals of a requeue read over HTTP (the rest: 400)."""


REQUEUE_BODY = 'the body must be {"agent_id": "...", "message_ids": ["...", ...]}'
FEEDBACK_BODY = 'the body must be {"satisfied": true or false}'


async def json_body(request: web.Request, shape: str = "the body must be a JSON object") -> Any:
    """The request's body as JSON, or 400: not JSON (saying ``shape``), or nested past what
    the parser can read."""
    try:
        return await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text=shape) from None
    except RecursionError:
        raise web.HTTPBadRequest(text=f"the body nests too deep to read; {shape}") from None


def make_app(dashboard: Dashboard) -> web.Application:
    app = web.Application(client_max_size=256 * 1024)
    routes = web.RouteTableDef()

    @routes.get("/")
    async def index(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html")

    @routes.get("/api/state")
    async def state(request: web.Request) -> web.Response:
        return web.json_response(dashboard.state(), dumps=lambda v: json.dumps(v, default=str))

    @routes.get("/api/runs/{run_id}")
    async def run(request: web.Request) -> web.Response:
        record = dashboard.runs.get(request.match_info["run_id"])
        if record is None:
            raise web.HTTPNotFound(text="no such run (the dashboard keeps the last 50)")
        return web.json_response(
            {**record.summary(), "events": list(record.events)},
            dumps=lambda v: json.dumps(v, default=str),
        )

    @routes.get("/api/traces/{wanted}")
    async def trace(request: web.Request) -> web.Response:
        found = await asyncio.to_thread(dashboard.trace, request.match_info["wanted"])
        return web.json_response(found)

    @routes.get("/api/dead-letters")
    async def dead_letters(request: web.Request) -> web.Response:
        letters = await dashboard.client.dead_letters()
        return web.json_response(
            [
                {
                    "message_id": d.message.message_id,
                    "from_agent": d.message.from_agent,
                    "to_agent": d.message.to_agent,
                    "action": d.message.action,
                    "reason": d.reason,
                    "attempts": d.attempts,
                    "dead_lettered_at": d.dead_lettered_at.isoformat(),
                }
                for d in letters[-200:]
            ]
        )

    @routes.post("/api/dead-letters/requeue")
    async def requeue(request: web.Request) -> web.Response:
        dashboard._authorize_run(request)  # an action, as starting a pattern is
        body = await json_body(request, REQUEUE_BODY)
        ids = body.get("message_ids", []) if isinstance(body, dict) else None
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("agent_id"), str)
            or not isinstance(ids, list)
            or not all(isinstance(i, str) for i in ids)
        ):
            raise web.HTTPBadRequest(text=REQUEUE_BODY)
        try:
            result = await dashboard.client.requeue_dead_letters(body["agent_id"], ids)
        except MeshError as error:
            status = REQUEUE_STATUS.get(error.code, 400)
            return web.json_response({"code": error.code, "message": error.message}, status=status)
        return web.json_response({"requeued": result.requeued, "left": result.left})

    @routes.post("/api/patterns/{name}")
    async def start(request: web.Request) -> web.Response:
        security = dashboard._authorize_run(request)
        body = await json_body(request)
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="the body must be a JSON object")
        try:
            run_id = await dashboard.start_run(request.match_info["name"], body, security)
        except MeshError as error:
            status = 401 if error.code == "UNAUTHENTICATED" else 400
            return web.json_response({"code": error.code, "message": error.message}, status=status)
        except TimeoutError:
            return web.json_response({"message": "the pattern did not start"}, status=504)
        return web.json_response({"run_id": run_id}, status=202)

    @routes.post("/api/runs/{run_id}/feedback")
    async def feedback(request: web.Request) -> web.Response:
        security = dashboard._authorize_run(request)
        body = await json_body(request, FEEDBACK_BODY)
        if not isinstance(body, dict) or not isinstance(body.get("satisfied"), bool):
            raise web.HTTPBadRequest(text=FEEDBACK_BODY)
        run_id = request.match_info["run_id"]
        try:
            stats = await dashboard.rate_run(run_id, body["satisfied"], security)
        except MeshError as error:
            status = FEEDBACK_STATUS.get(error.code, 400)
            return web.json_response({"code": error.code, "message": error.message}, status=status)
        return web.json_response({"run_id": run_id, **stats})

    @routes.get("/api/events")
    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
            async for frame in dashboard.stream():
                await response.write(frame.encode())
        return response

    routes.static("/static", STATIC)
    app.add_routes(routes)
    return app


@dataclass
class DashboardServer:
    dashboard: Dashboard
    runner: web.AppRunner
    url: str

    async def stop(self) -> None:
        await self.dashboard.stop()
        await self.runner.cleanup()


async def serve_dashboard(
    gateway: GatewayServer,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    trace_dir: str | Path | None = None,
    allow_runs: bool = True,
    security: SecurityConfig | None = None,
) -> DashboardServer:
    """Serves the dashboard of ``gateway`` on http://host:port/ (0 picks a free port); on
    https:// when ``security`` has a certificate (the gateway's), renewed in place as the
    gateway's is."""
    tls = https_context(security) if security is not None else None
    if allow_runs and security is not None and security.tls_cert and not security.tls_ca:
        # (it starts them through the gateway, whose certificate it must be able to check)
        raise ValueError(
            "a dashboard that starts runs calls its gateway over TLS: give the CA of the "
            "gateway's certificate too (--tls-ca; --tls-client-auth none if its callers "
            "present no certificate)"
        )
    dashboard = Dashboard(
        gateway.client,
        gateway,
        trace_dir=trace_dir,
        allow_runs=allow_runs,
        security=security,
    )
    runner = web.AppRunner(make_app(dashboard), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls)
    await site.start()
    bound = int(runner.addresses[0][1])
    await dashboard.start()
    return DashboardServer(dashboard, runner, f"{'https' if tls else 'http'}://{host}:{bound}/")

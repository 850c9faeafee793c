"""One way to run a gRPC server of the mesh: health checking and reflection always on,
graceful shutdown (NOT_SERVING first, then stop with a grace period), optional /metrics."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, text_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from mesh._status import abort
from mesh.config import SecurityConfig, check_environment, seconds_from_env
from mesh.core.errors import MeshError, MessageValidationError
from mesh.core.tasks import cancel_and_wait
from mesh.headroom import parser_for
from mesh.security import AuthInterceptor, authenticator_for, server_credentials

logger = logging.getLogger("mesh.serving")

T = TypeVar("T")

MAX_GRPC_MESSAGE_BYTES = 8 * 1024 * 1024
"""gRPC's own frame limit, above the mesh's message limit so that oversize messages
reach validation and get a clear error instead of a transport failure."""

ANSWER_BYTES = 3 * 1024 * 1024
"""What one frame the mesh fills with several things holds at most (a batch of session
frames, a ReceiveMessages answer, a page of a listing, a pattern event): under the 4 MiB a gRPC
client takes by default (the Node.js client, grpcurl), so that every client takes it; over a
limit, a frame fails in transit with all it carries. One message is at most 1 MiB."""


_EXPIRY: weakref.WeakKeyDictionary[CollectorRegistry, Gauge] = weakref.WeakKeyDictionary()


def certificate_expiry(registry: CollectorRegistry) -> Gauge:
    """The gauge of when the TLS certificate each server of ``registry`` presents expires
    (one per registry: servers sharing one, as the embedded mesh's do, share it): what the
    AgentmeshCertificateExpiresSoon alert reads, so that a renewal that stopped working
    is seen before clients are refused."""
    gauge = _EXPIRY.get(registry)
    if gauge is None:
        gauge = _EXPIRY[registry] = Gauge(
            "agentmesh_tls_certificate_expiry_timestamp_seconds",
            "When the TLS certificate the server presents expires (Unix time); updated as it "
            "is renewed",
            ["server"],
            registry=registry,
        )
    return gauge


def fill_page(
    out: Any, items: Sequence[T], start: int, page_size: int, encode: Callable[[T, Any], Any]
) -> int:
    """Encodes ``items`` from ``start`` into the repeated field ``out`` while the answer has
    room: ``page_size`` of them at most (0: no count), ANSWER_BYTES in all (the first whatever
    its size). Returns where the next page starts."""
    if page_size < 0:
        raise MessageValidationError.for_field("page_size", "page_size must not be negative")
    room, end = ANSWER_BYTES, start
    while end < len(items) and not (page_size and len(out) >= page_size):
        size = encode(items[end], out.add()).ByteSize()
        if len(out) > 1 and size > room:
            del out[-1]  # the next page's first
            break
        room, end = max(0, room - size), end + 1
    return end


def offset_page(
    out: Any, items: Sequence[T], start: int, page_size: int, encode: Callable[[T, Any], Any]
) -> str:
    """:func:`fill_page` for a listing whose next_page_token is an offset (``start``, from
    :func:`page_offset`): the next page's token, empty after the last page."""
    end = fill_page(out, items, start, page_size, encode)
    return str(end) if end < len(items) else ""


def page_offset(token: str) -> int:
    """Where a page given by a page_token starts, for a listing whose next_page_token is an
    offset."""
    if not token:
        return 0
    if not (token.isascii() and token.isdigit()):  # ("¹" is a digit to isdigit)
        raise MessageValidationError.for_field(
            "page_token", "page_token is not a next_page_token of this listing"
        )
    return int(token)


KEEPALIVE_MS = seconds_from_env("AGENTMESH_KEEPALIVE_SECONDS", 20.0)
"""How often each side pings an idle connection; a peer that does not answer within
AGENTMESH_KEEPALIVE_TIMEOUT_SECONDS is gone: its streams end, its leases go back to the
queue (broker side), its client reconnects (agent side)."""
KEEPALIVE_TIMEOUT_MS = seconds_from_env("AGENTMESH_KEEPALIVE_TIMEOUT_SECONDS", 10.0)

GRPC_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.min_ping_interval_without_data_ms", min(5_000, KEEPALIVE_MS)),
    # Peers ping as often as the keepalive says; do not take that for abuse.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", min(5_000, KEEPALIVE_MS)),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]

PENDING_CALLS = 10_000
"""Calls a server holds that it has not yet taken up (gRPC's pending queue: a grpc.aio server
takes one call per turn of its loop, so a burst of calls waits there). gRPC's own default
starts refusing at 1,000, at random and with a bare CANCELLED that a client cannot tell from
its own cancel (of 3,000 SendMessage calls at once, a fifth were so). Past this many, calls are
refused likewise, more and more of them, and all past twice as many: the queue stays bounded
(10,000 calls of a burst took a server about 130 MiB while they ran)."""

SERVER_OPTIONS: list[tuple[str, Any]] = [
    *GRPC_OPTIONS,
    ("grpc.server.max_pending_requests", PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * PENDING_CALLS),
]

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")

_LINUX_NR_OPEN = 1_048_576
"""Linux's own ceiling of open files per process (fs.nr_open's default): where an unlimited
hard limit is taken to end."""


def open_files_to_the_hard_limit() -> None:
    """Raises the process's soft limit of open files to its hard limit, as Go's runtime does
    at start: each connection a server holds is a file, and the soft limit many systems give
    (1,024) would cap a broker at about a thousand clients and agents, gRPC then accepting no
    more connections and the newcomers waiting out their deadlines. Where it cannot be
    raised, it stays."""
    try:
        import resource
    except ImportError:  # (not a POSIX system)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _LINUX_NR_OPEN if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as error:
            logger.debug("open files: the soft limit stays at %d (%s)", soft, error)


class Malformed:
    """Bytes that did not decode as the request type: stands in for a request so that the
    call is answered INVALID_ARGUMENT (by the method, or frame by frame on a stream) rather
    than gRPC's INTERNAL "Exception deserializing request". ``data``: the bytes, for what can
    still be read from them (a stream frame's seq)."""

    __slots__ = ("data", "error", "type_name")

    def __init__(self, type_name: str, error: Exception, data: bytes = b"") -> None:
        self.type_name = type_name
        self.error = error
        self.data = data

    def to_error(self) -> MessageValidationError:
        return MessageValidationError.for_field(
            "request", f"the request is not a valid {self.type_name}: {self.error}"
        )


def lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """``deserializer`` (a request type's FromString) reading with headroom, and answering
    :class:`Malformed` for what it cannot read."""
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    type_name = getattr(descriptor, "full_name", "request")
    # A request of the contract is read with room to spare (mesh.headroom).
    parse = parser_for(owner) if descriptor is not None else deserializer

    def decode(data: bytes) -> Any:
        try:
            return parse(data) if parse else data
        except Exception as error:  # DecodeError and anything else from the parser
            return Malformed(type_name, error, data)

    return decode


_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
"""The behaviours of a grpc.RpcMethodHandler, one of which a method's handler has."""


async def _written(result: Any, context: Any) -> Any:
    """What a handler's call returns, awaited: a streaming handler's async generator has its
    items written one by one; any other (a unary handler, or a streaming one that writes
    itself) gives its own result."""
    if hasattr(result, "__aiter__"):
        async for item in result:
            await context.write(item)
        return None
    return await result


async def _fail(context: Any, method: str, error: Exception) -> NoReturn:
    """Ends a call whose handler raised ``error``: an abort goes on as it is, a MeshError
    says its status; anything else is a fault of the server's own (a bug), logged with its
    traceback and answered INTERNAL "internal error", nothing of it told the caller (whose
    gRPC would otherwise send the exception's text, as UNKNOWN). A call its client already
    ended is left to end."""
    if isinstance(error, grpc.aio.AbortError) or context.done():
        raise error
    if isinstance(error, MeshError):
        await abort(context, error)
    logger.error("%s failed", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error")
    raise AssertionError("unreachable")  # (abort always raises)


class ContractInterceptor(grpc.aio.ServerInterceptor):
    """Answers undecodable requests with INVALID_ARGUMENT. Streams receive
    :class:`Malformed` items and answer them one by one (the Connect session does), and so
    do the unary methods named in ``reads_malformed`` (full names, "/package.Service/Method":
    what can still be read of such a call matters to someone, and they refuse it
    themselves). ``on_malformed`` counts the refusals of the other unary calls (the broker's
    validation errors)."""

    def __init__(
        self,
        on_malformed: Callable[[], None] | None = None,
        reads_malformed: Collection[str] = (),
    ) -> None:
        self.on_malformed = on_malformed
        self.reads_malformed = frozenset(reads_malformed)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(("/grpc.health.", "/grpc.reflection.")):
            return handler
        method = details.method
        decode = lenient(handler.request_deserializer)
        refuses = not (handler.request_streaming or method in self.reads_malformed)
        kind = next(k for k in _HANDLER_KINDS if getattr(handler, k) is not None)
        inner = getattr(handler, kind)

        async def guarded(request: Any, context: Any) -> Any:
            try:
                if refuses and isinstance(request, Malformed):
                    await self._refuse(context, request)
                return await _written(inner(request, context), context)
            except Exception as error:
                await _fail(context, method, error)

        return handler._replace(**{kind: guarded}, request_deserializer=decode)

    async def _refuse(self, context: Any, malformed: Malformed) -> None:
        if self.on_malformed is not None:
            self.on_malformed()
        await abort(context, malformed.to_error())


@dataclass
class MeshServer:
    """A running gRPC server with its health service."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    host: str
    port: int
    service_names: Sequence[str]
    metrics_port: int | None = None
    health_port: int | None = None
    """The port of its plaintext health server (:func:`start_server`'s ``health_port``)."""
    security: str = ""
    """What protects the server, for start-up lines."""
    _metrics_http: Any = field(default=None, repr=False)
    _health_server: grpc.aio.Server | None = field(default=None, repr=False)
    _on_stop: list[Callable[[], Any]] = field(default_factory=list, repr=False)
    _on_drain: list[Callable[[float], Awaitable[Any]]] = field(default_factory=list, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        """The health of the server as a whole (service "") and of every service of it."""
        for name in ("", *self.service_names):
            await self.set_service_serving(name, serving)

    async def set_service_serving(self, name: str, serving: bool) -> None:
        """The health of one service of this server ("": the server as a whole, which
        liveness probes ask); ignored once the server is stopping."""
        await self.health.set(
            name,
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING,
        )

    def follow(self, names: Sequence[str], serving: Callable[[], bool]) -> Callable[[], None]:
        """Ties the health of the services ``names`` to ``serving()``, what they need from
        outside this process (the broker's queue store): call the function returned when it
        may have changed, and their health follows, in order, until the server stops."""
        changed = asyncio.Event()

        async def follow() -> None:
            said: bool | None = None
            while True:
                await changed.wait()
                changed.clear()
                now = serving()
                if now is not said:
                    said = now
                    for name in names:
                        await self.set_service_serving(name, now)

        task = asyncio.create_task(follow(), name=f"health-follows-{'+'.join(names)}")
        self._on_stop.append(lambda: cancel_and_wait(task))
        return changed.set

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING first, so balancers stop sending; then the services drain (refusing new
        work, finishing what is in flight) within the grace period; then the server stops,
        cancelling what is left."""
        await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        started = loop.time()
        for drain in self._on_drain:
            await _stopping_step(drain, grace or 0.0)
        if grace is not None and self._on_drain:
            # Drained: what remains open are idle streams (sessions, subscriptions), which
            # would otherwise hold the server for the whole grace period.
            grace = min(0.5, max(0.0, grace - (loop.time() - started)))
        await self.server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(0)
            self._health_server = None
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None
        for callback in self._on_stop:
            await _stopping_step(callback)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def _stopping_step(step: Callable[..., Any], *args: Any) -> None:
    """Runs one step of stopping a server; a step that fails is logged, and the steps after
    it still run (a broker whose store is away stops all the same)."""
    try:
        result = step(*args)
        if hasattr(result, "__await__"):
            await result
    except Exception:
        logger.exception("stopping: %s failed", getattr(step, "__qualname__", step))


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
"""Server reflection as current clients ask for it first (grpcurl, buf curl, Postman). Its
messages are those of v1alpha field for field, so grpcio-reflection's servicer (which knows
only v1alpha) answers both."""


def _describe_reflection_v1() -> None:
    """Puts grpc/reflection/v1/reflection.proto into the default pool, so that a client that
    lists the services and describes each finds the v1 service too. grpcio-reflection ships
    only v1alpha's; v1's is the same file under another package."""
    pool = descriptor_pool.Default()
    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(alpha)
    text = text_format.MessageToString(alpha)
    v1 = text_format.Parse(
        text.replace("grpc.reflection.v1alpha", "grpc.reflection.v1"),
        descriptor_pb2.FileDescriptorProto(),
    )
    v1.name = name
    v1.options.ClearField("deprecated")
    v1.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    pool.Add(v1)


def _enable_reflection(names: Sequence[str], server: grpc.aio.Server) -> None:
    _describe_reflection_v1()
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                REFLECTION_V1,
                {
                    "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                        servicer.ServerReflectionInfo,
                        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                    )
                },
            ),
        )
    )


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_registry: CollectorRegistry | None = None,
    metrics_port: int = -1,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    security: SecurityConfig | None = None,
    on_malformed: Callable[[], None] | None = None,
    reads_malformed: Collection[str] = (),
    on_refused: Callable[[str], None] | None = None,
    health_port: int = -1,
) -> MeshServer:
    """Starts a grpc.aio server with the given services, health and reflection (and the
    process's soft limit of open files raised to its hard limit, for its connections).

    ``port`` 0 picks a free port; the chosen one is on the returned server. ``metrics_port``
    -1 serves no /metrics, 0 picks a free port. ``on_malformed`` counts each request
    refused because it could not be read; the unary methods in ``reads_malformed`` are given
    such a request as a :class:`Malformed` and refuse it themselves. ``on_refused`` counts
    each call refused for its credential, by status code name.

    ``health_port`` (-1: none, 0: any free port) serves grpc.health.v1 alone (and reflection
    of it), in plaintext and without credentials, on a second port: the same statuses as the
    server's own health service, for probes that cannot speak TLS (a kubelet's gRPC probe).
    Nothing else is served there, and nothing said there is secret.
    """
    check_environment()
    open_files_to_the_hard_limit()
    security = security or SecurityConfig()
    chain: list[grpc.aio.ServerInterceptor] = [
        ContractInterceptor(on_malformed, reads_malformed),
        *interceptors,
    ]
    authenticator = authenticator_for(security)
    if authenticator is not None:
        chain.insert(1, AuthInterceptor(authenticator, on_refused))
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=chain)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    _enable_reflection([*names, REFLECTION_V1, reflection.SERVICE_NAME], server)
    expiry = None
    if metrics_registry is not None:
        expiry = certificate_expiry(metrics_registry).labels(server=service_names[0])
    credentials = server_credentials(security, on_served=expiry.set if expiry else None)
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:  # (grpcio's way of saying it; older releases answered 0)
        bound = 0
    if bound == 0:
        raise OSError(
            f"cannot listen on {host}:{port}: the port is in use (another mesh?) or the "
            "address is not one of this machine's (port 0 takes any free port)"
            + (", or its TLS certificate and key are not usable" if credentials else "")
        )
    await server.start()
    mesh_server = MeshServer(server, health_servicer, host, bound, list(service_names))
    mesh_server.security = security.describe()
    if not security.tls_cert and not security.secured and host not in _LOOPBACK:
        logger.warning(
            "%s listens on %s without TLS or credentials: anyone who reaches it may use it",
            ", ".join(service_names) or "server",
            mesh_server.address,
        )
    await mesh_server.set_serving(True)
    if health_port >= 0:
        try:
            mesh_server._health_server, mesh_server.health_port = await _serve_health(
                health_servicer, host, health_port
            )
        except OSError:
            await server.stop(0)
            raise
    if metrics_registry is not None and metrics_port >= 0:
        try:
            httpd, _ = start_http_server(metrics_port, addr=host, registry=metrics_registry)
        except OSError as error:
            await server.stop(0)
            if mesh_server._health_server is not None:
                await mesh_server._health_server.stop(0)
            raise OSError(
                f"cannot serve /metrics on {host}:{metrics_port}: {error.strerror or error}"
            ) from None
        mesh_server._metrics_http = httpd
        mesh_server.metrics_port = httpd.server_port
    return mesh_server


async def _serve_health(
    servicer: health.aio.HealthServicer, host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """A plaintext server of ``servicer`` alone (its statuses are the main server's) on
    host:port, started; and the port it took."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    # (Reflection too, of health alone: buf curl and grpcurl call it as they call any server.)
    name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    _enable_reflection([name, REFLECTION_V1, reflection.SERVICE_NAME], server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot serve health on {host}:{port}: the port is in use")
    await server.start()
    return server, bound

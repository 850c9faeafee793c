"""TLS, mutual TLS and per-call identity on the wire.

Servers: :func:`server_credentials` for the listening port, and :class:`AuthInterceptor`,
which authenticates every call of the mesh's own services (health and reflection stay open,
as load balancers and tools expect) and checks the agent a request acts as against the
caller's identity (rules in :data:`ACTING`). Connect sessions are checked frame by frame by
the broker's session with :func:`check_frame`, using the principal the interceptor found.

Clients: :func:`open_channel` makes a plaintext or TLS channel and, with a token, adds it
to every call as ``authorization: Bearer <token>``.
"""

from __future__ import annotations

import contextvars
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from mesh._status import abort
from mesh.config import SecurityConfig, check_environment
from mesh.core.auth import ANONYMOUS, Authenticator, Principal
from mesh.core.errors import MeshError
from mesh.core.registry import address_problem
from mesh.v1 import broker_pb2, memory_pb2, tools_pb2

logger = logging.getLogger("mesh.security")

current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "current_principal", default=ANONYMOUS
)
"""The caller of the RPC being served (ANONYMOUS when security is off)."""

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

Acting = Callable[[Any], Iterable[tuple[str, str]]]

ACTING: dict[type, Acting] = {
    broker_pb2.RegisterAgentRequest: lambda r: [(r.agent.agent_id, "register")],
    broker_pb2.DeregisterAgentRequest: lambda r: [(r.agent_id, "deregister")],
    broker_pb2.SendMessageRequest: lambda r: [(r.message.from_agent, "send")],
    broker_pb2.SendMessagesRequest: lambda r: [(m.from_agent, "send") for m in r.messages],
    broker_pb2.ReceiveMessagesRequest: lambda r: [(r.agent_id, "receive")],
    broker_pb2.SubscribeRequest: lambda r: [(r.agent_id, "receive")],
    broker_pb2.AckRequest: lambda r: [(r.agent_id, "acknowledge")],
    broker_pb2.NackRequest: lambda r: [(r.agent_id, "acknowledge")],
    broker_pb2.ExtendLeaseRequest: lambda r: [(r.agent_id, "acknowledge")],
    broker_pb2.BroadcastRequest: lambda r: [(r.message.from_agent, "broadcast")],
    broker_pb2.GatherRequest: lambda r: [(r.message.from_agent, "gather")],
    broker_pb2.SendRequestRequest: lambda r: [(r.message.from_agent, "send")],
    broker_pb2.HandoffRequest: lambda r: [(r.from_agent, "hand off")],
    broker_pb2.ListDeadLettersRequest: lambda r: [(r.agent_id, "read the dead letters")],
    broker_pb2.RequeueDeadLettersRequest: lambda r: [(r.agent_id, "requeue the dead letters")],
    memory_pb2.WriteInsightRequest: lambda r: [(r.insight.agent_id, "write insights")],
    memory_pb2.DeleteInsightsRequest: lambda r: [(r.agent_id, "delete insights")],
    memory_pb2.PutStateRequest: lambda r: [(r.agent_id, "write shared state")],
    memory_pb2.DeleteStateRequest: lambda r: [(r.agent_id, "write shared state")],
    memory_pb2.LockStateRequest: lambda r: [(r.agent_id, "lock shared state")],
    tools_pb2.InvokeToolRequest: lambda r: [(r.agent_id, "call tools")],
    tools_pb2.ListToolsRequest: lambda r: [(r.agent_id, "list tools")],
}
"""For each request type, the agents it acts as and what it does as them. Requests not
listed (listing agents, queue statistics, reading insights and shared state, releasing a
lock by its token, gateway calls) need only an authenticated caller."""


def check(principal: Principal, request: Any) -> None:
    rule = ACTING.get(type(request))
    if rule is None:
        return
    for agent_id, what in rule(request):
        principal.require_agent(agent_id, what)


def check_frame(principal: Principal, frame: broker_pb2.ConnectRequest) -> None:
    """Checks one frame of a Connect session (acks may omit the subscribed agent)."""
    if principal.admin:
        return
    kind = frame.WhichOneof("frame")
    if kind == "send":
        principal.require_agent(frame.send.from_agent, "send")
    elif kind == "request":
        principal.require_agent(frame.request.message.from_agent, "send")
    elif kind == "gather":
        principal.require_agent(frame.gather.message.from_agent, "gather")
    elif kind == "broadcast":
        principal.require_agent(frame.broadcast.message.from_agent, "broadcast")
    elif kind == "subscribe":
        principal.require_agent(frame.subscribe.agent_id, "receive")
    elif kind == "receive":
        principal.require_agent(frame.receive.agent_id, "receive")
    elif kind in ("ack", "nack", "extend_lease"):
        agent_id = getattr(frame, kind).agent_id
        if agent_id:
            principal.require_agent(agent_id, "acknowledge")


def _bearer(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _certificate_names(context: Any) -> list[str]:
    auth = context.auth_context() or {}
    names = [n.decode() for n in auth.get("x509_common_name", [])]
    names += [n.decode() for n in auth.get("x509_subject_alternative_name", [])]
    return names


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates each call and checks what it acts as; sets :data:`current_principal`."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        token = _bearer(details.invocation_metadata)
        authenticator = self.authenticator

        def identify(request: Any, context: Any) -> Principal:
            principal = authenticator.authenticate(token, _certificate_names(context))
            if request is not None:
                check(principal, request)
            current_principal.set(principal)
            return principal

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                try:
                    identify(request, context)
                except MeshError as error:
                    await _refuse(context, method, error)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                try:
                    identify(request, context)
                except MeshError as error:
                    await _refuse(context, method, error)
                async for item in inner_us(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream:
            inner_ss = handler.stream_stream

            async def stream_stream(requests: Any, context: Any) -> Any:
                try:
                    identify(None, context)
                except MeshError as error:
                    await _refuse(context, method, error)
                # Connect checks each frame itself (see check_frame).
                result = inner_ss(requests, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        await context.write(item)
                    return None
                return await result

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


async def _refuse(context: Any, method: str, error: MeshError) -> None:
    # The reason is logged, never the credential.
    logger.warning(
        "refused %s: %s",
        method,
        error.message,
        extra={"event": {"category": "auth", "method": method, "code": error.code}},
    )
    await abort(context, error)


# -- credentials -----------------------------------------------------------------------------


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None


def check_tls_files(config: SecurityConfig) -> None:
    """Raises ValueError naming a certificate, key or CA file of ``config`` that cannot be
    read or is not what TLS can use (not PEM, a key that is not the certificate's): said
    before a server or client starts, where gRPC would fail later with less to go on."""
    pairs = (
        ("--tls-cert", config.tls_cert, "--tls-key", config.tls_key, ssl.PROTOCOL_TLS_SERVER),
        (
            "--tls-client-cert",
            config.tls_client_cert,
            "--tls-client-key",
            config.tls_client_key,
            ssl.PROTOCOL_TLS_CLIENT,
        ),
    )
    for cert_flag, cert, key_flag, key, protocol in pairs:
        if not cert:
            continue
        for path in (cert, key):
            _read(path)
        try:
            ssl.SSLContext(protocol).load_cert_chain(cert, key)
        except ssl.SSLError as error:
            raise ValueError(
                f"{cert_flag} {cert} and {key_flag} {key} are not a PEM certificate and its "
                f"private key: {error.reason or 'unreadable as PEM'}"
            ) from None
    if config.tls_ca:
        _read(config.tls_ca)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=config.tls_ca)
        except ssl.SSLError as error:
            raise ValueError(
                f"--tls-ca {config.tls_ca} is not a PEM certificate: "
                f"{error.reason or 'unreadable as PEM'}"
            ) from None


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS for a server when it has a certificate; mutual TLS when it also has a CA."""
    if not config.tls_cert:
        return None
    return grpc.ssl_server_credentials(
        [(_read(config.tls_key), _read(config.tls_cert))],
        root_certificates=_read(config.tls_ca) if config.tls_ca else None,
        require_client_auth=bool(config.tls_ca),
    )


def authenticator_for(config: SecurityConfig) -> Authenticator | None:
    """Who may call a server: None (everyone) when it has neither credentials nor mTLS."""
    mutual = bool(config.tls_cert and config.tls_ca)
    if config.credentials_file:
        return Authenticator.from_file(config.credentials_file, certificate_names=mutual)
    if mutual:
        return Authenticator(certificate_names=True)
    return None


class _WithToken:
    """A channel's multi-callable that adds the bearer token to the metadata of each call."""

    def __init__(self, call: Any, token: tuple[str, str]) -> None:
        self._call = call
        self._token = token

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._call(*args, metadata=(*(metadata or ()), self._token), **kwargs)


class _TokenChannel(grpc.aio.Channel):
    """A channel that sends the bearer token with every call. (Client interceptors would do
    it through grpc.aio's interceptor machinery, which puts a task and a queue between a
    stream and its writes, and leaves them pending behind a call refused as it opens.)"""

    def __init__(self, channel: grpc.aio.Channel, token: str) -> None:
        self._channel = channel
        self._token = ("authorization", f"Bearer {token}")

    async def __aenter__(self) -> _TokenChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._channel.close()

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._token)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._token)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._token)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._token)


def open_channel(
    target: str, config: SecurityConfig | None = None, options: Iterable[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A channel to ``target``: TLS when a CA is configured (with the client certificate, for
    mutual TLS, when one is), and the bearer token on every call when one is."""
    check_environment()
    problem = address_problem(target)  # (gRPC dials port 99999 as 34463; "" fails UNKNOWN)
    if problem is not None:
        raise MeshError(problem, code="INVALID_ARGUMENT", reason="BAD_ADDRESS")
    config = config or SecurityConfig()
    opts = list(options)
    if config.tls_server_name:
        opts.append(("grpc.ssl_target_name_override", config.tls_server_name))
    if config.tls_ca:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(config.tls_ca),
            private_key=_read(config.tls_client_key) if config.tls_client_key else None,
            certificate_chain=_read(config.tls_client_cert) if config.tls_client_cert else None,
        )
        channel = grpc.aio.secure_channel(target, credentials, options=opts)
    else:
        channel = grpc.aio.insecure_channel(target, options=opts)
    return _TokenChannel(channel, config.token) if config.token else channel

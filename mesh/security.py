"""TLS, mutual TLS and per-call identity on the wire.

Servers: :func:`server_credentials` for the listening port, and :class:`AuthInterceptor`,
which authenticates every call of the mesh's own services (health and reflection stay open,
as load balancers and tools expect) and checks the agent a request acts as against the
caller's identity (rules in :data:`ACTING`). Connect sessions are checked frame by frame by
the broker's session with :func:`check_frame`, using the principal the interceptor found.

Clients: :func:`open_channel` makes a plaintext or TLS channel and, with a token, adds it
to every call as ``authorization: Bearer <token>``.

Every file of it is read again when it changes (:mod:`mesh.watched`), so that certificates
are renewed and tokens rotated or revoked without a restart: a server's certificate, key and
CA before each connection's handshake (:func:`server_credentials`), its credentials file as
calls are authenticated (:class:`CredentialsFile`, which also ends the streams a change
took the credential of), a client's CA, certificate and token file as its calls start.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from mesh._status import abort
from mesh.config import SecurityConfig, check_environment
from mesh.core.auth import ANONYMOUS, Authenticates, Authenticator, Principal
from mesh.core.errors import BrokerUnavailableError, MeshError
from mesh.core.registry import address_problem
from mesh.v1 import agent_pb2, broker_pb2, memory_pb2, tools_pb2
from mesh.watched import WatchedFiles, read_file, read_pair, read_roots, valid_until

logger = logging.getLogger("mesh.security")

current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "current_principal", default=ANONYMOUS
)
"""The caller of the RPC being served (ANONYMOUS when security is off)."""

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

RENEWAL_LOOK_SECONDS = 1.0
"""How often, at most, a client looks at its TLS files again (a ``stat`` of each)."""
RENEWED_KEPT = 4
"""The channels a client keeps open for calls begun before its TLS files were renewed."""

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
    broker_pb2.ListMessagesRequest: lambda r: [(r.agent_id, "read the queue")],
    broker_pb2.CancelMessagesRequest: lambda r: [(r.from_agent, "cancel messages")],
    memory_pb2.WriteInsightRequest: lambda r: [(r.insight.agent_id, "write insights")],
    memory_pb2.DeleteInsightsRequest: lambda r: [(r.agent_id, "delete insights")],
    memory_pb2.PutStateRequest: lambda r: [(r.agent_id, "write shared state")],
    memory_pb2.DeleteStateRequest: lambda r: [(r.agent_id, "write shared state")],
    memory_pb2.LockStateRequest: lambda r: [(r.agent_id, "lock shared state")],
    tools_pb2.InvokeToolRequest: lambda r: [(r.agent_id, "call tools")],
    tools_pb2.ListToolsRequest: lambda r: [(r.agent_id, "list tools")],
    # An agent's own server: a direct call is sent as its from_agent (the broker, pushing the
    # messages of every sender, is an admin), and only the broker, or the agent's own
    # principal, says it was deregistered.
    agent_pb2.HandleMessageRequest: lambda r: [(r.message.from_agent, "send")],
    agent_pb2.NotifyDeregisteredRequest: lambda r: [(r.agent_id, "deregister")],
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


class _Held:
    """A stream, with the credential and principal it was authenticated with."""

    __slots__ = ("names", "principal", "revoked", "task", "token")

    def __init__(self, token: str | None, names: list[str], principal: Principal) -> None:
        self.token = token
        self.names = names
        self.principal = principal
        self.task: asyncio.Task[Any] | None = None
        self.revoked: MeshError | None = None


class CredentialsFile:
    """The principals of a credentials file, read again when it changes: looked at, at most
    once every RENEWAL_LOOK_SECONDS, as a call is authenticated, and every
    RENEWAL_LOOK_SECONDS while a stream it authenticated is open. A principal added, or a
    token taken out (rotated, or leaked), counts from the next call on, without a restart. A
    stream whose credential no longer names the same principal (taken out, or its rights
    changed) ends UNAVAILABLE, which clients take as a cue to connect again: with the
    credential and rights they have now, or refused, UNAUTHENTICATED, if they have none. A
    file changed into one that cannot be read is said once, and the principals read before
    stay."""

    def __init__(self, path: str, *, certificate_names: bool) -> None:
        self.path = path
        self._files = WatchedFiles(
            f"the credentials file {path}",
            [path],
            lambda: Authenticator.from_file(path, certificate_names=certificate_names),
        )
        self._held: set[_Held] = set()
        self._looking: asyncio.Task[None] | None = None

    def authenticate(self, token: str | None, certificate_names: Iterable[str] = ()) -> Principal:
        self._look()
        return self._files.current.authenticate(token, certificate_names)

    def _look(self, every: float | None = None) -> None:
        renewed = self._files.changed(RENEWAL_LOOK_SECONDS if every is None else every)
        if renewed is None:
            return
        ended = 0
        for held in list(self._held):
            try:
                if renewed.authenticate(held.token, held.names) == held.principal:
                    continue
            except MeshError:
                pass
            # UNAVAILABLE: a client whose credential was rotated connects again with the one
            # it has now; one whose credential was revoked is refused as it does.
            held.revoked = BrokerUnavailableError(
                f"the credentials of {held.principal.name} changed: connect again"
            )
            if held.task is not None:
                held.task.cancel()
            ended += 1
        logger.info(
            "the credentials file %s was read again: it counts from now on (streams ended, "
            "their credential changed: %d)",
            self.path,
            ended,
            extra={"event": {"category": "auth", "file": self.path, "ended": ended}},
        )

    def hold(self, held: _Held) -> None:
        self._held.add(held)
        if self._looking is None:
            self._looking = asyncio.create_task(self._keep_looking(), name="credentials-look")

    def release(self, held: _Held) -> None:
        self._held.discard(held)
        if not self._held and self._looking is not None:
            self._looking.cancel()
            self._looking = None

    async def _keep_looking(self) -> None:
        while True:
            await asyncio.sleep(RENEWAL_LOOK_SECONDS)
            self._look(every=0.0)  # (a look each time: the sleep is what spaces them)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates each call and checks what it acts as; sets :data:`current_principal`.
    A stream authenticated by a :class:`CredentialsFile` is held by it while it lasts, and
    ends when the file is renewed and its credential no longer names the same principal."""

    def __init__(
        self, authenticator: Authenticates, on_refused: Callable[[str], None] | None = None
    ) -> None:
        self.authenticator = authenticator
        self.on_refused = on_refused
        """Told of each call refused for its credential, by status code name
        (UNAUTHENTICATED, PERMISSION_DENIED): the server's metrics count them."""

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

        def identify(request: Any, context: Any) -> _Held:
            names = _certificate_names(context)
            principal = authenticator.authenticate(token, names)
            if request is not None:
                check(principal, request)
            current_principal.set(principal)
            return _Held(token, names, principal)

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                try:
                    identify(request, context)
                except MeshError as error:
                    await self._refuse(context, method, error)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                try:
                    held = identify(request, context)
                except MeshError as error:
                    await self._refuse(context, method, error)
                with self._holding(held):
                    try:
                        async for item in inner_us(request, context):
                            yield item
                    except asyncio.CancelledError:
                        if held.revoked is None:
                            raise
                await self._revoked(held, context, method)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream:
            inner_ss = handler.stream_stream

            async def stream_stream(requests: Any, context: Any) -> Any:
                try:
                    held = identify(None, context)
                except MeshError as error:
                    await self._refuse(context, method, error)
                # Connect checks each frame itself (see check_frame).
                with self._holding(held):
                    try:
                        result = inner_ss(requests, context)
                        if hasattr(result, "__aiter__"):
                            async for item in result:
                                await context.write(item)
                            result = None
                        else:
                            result = await result
                    except asyncio.CancelledError:
                        if held.revoked is None:
                            raise
                await self._revoked(held, context, method)
                return result

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler

    @contextlib.contextmanager
    def _holding(self, held: _Held) -> Iterator[None]:
        if not isinstance(self.authenticator, CredentialsFile):
            yield
            return
        held.task = asyncio.current_task()
        self.authenticator.hold(held)
        try:
            yield
        finally:
            self.authenticator.release(held)

    async def _refuse(self, context: Any, method: str, error: MeshError) -> None:
        if self.on_refused is not None:
            self.on_refused(error.code)
        await _refuse(context, method, error)

    @staticmethod
    async def _revoked(held: _Held, context: Any, method: str) -> None:
        if held.revoked is not None:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                task.uncancel()
            await _refuse(context, method, held.revoked)


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


@dataclass(frozen=True)
class _ServerTls:
    cert: bytes
    key: bytes
    roots: bytes | None

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], self.roots)


@dataclass(frozen=True)
class _ClientTls:
    roots: bytes
    cert: bytes | None = None
    key: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.roots, self.key, self.cert)


def _server_tls(config: SecurityConfig) -> _ServerTls:
    cert, key = read_pair(config.tls_cert, config.tls_key, "--tls-cert", "--tls-key")
    return _ServerTls(cert, key, read_roots(config.tls_ca) if config.mutual else None)


def _client_tls(config: SecurityConfig) -> _ClientTls:
    roots = read_roots(config.tls_ca)
    if not config.tls_client_cert:
        return _ClientTls(roots)
    cert, key = read_pair(
        config.tls_client_cert, config.tls_client_key, "--tls-client-cert", "--tls-client-key"
    )
    return _ClientTls(roots, cert, key)


def _token_metadata(path: str) -> tuple[str, str]:
    try:
        token = read_file(path).decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"--token-file {path} is not text") from None
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return ("authorization", f"Bearer {token}")


def check_security_files(config: SecurityConfig) -> None:
    """Raises ValueError naming a certificate, key, CA or token file of ``config`` that
    cannot be read or is not what it should be (not PEM, a key that is not the
    certificate's, an empty token): said before a server or client starts, where gRPC would
    fail later with less to go on."""
    if config.token_file:
        _token_metadata(config.token_file)
    if config.tls_cert:
        _server_tls(config)
    if config.tls_ca:
        read_roots(config.tls_ca)
    if config.tls_client_cert:
        _client_tls(config)


def server_credentials(
    config: SecurityConfig, on_served: Callable[[float], object] | None = None
) -> grpc.ServerCredentials | None:
    """TLS for a server when it has a certificate; mutual TLS when it also has a CA (and
    ``tls_client_auth`` is not ``"none"``). The
    files are looked at again before each connection's handshake: a renewed certificate,
    key or CA is used from the next connection on, without a restart. ``on_served`` hears
    when the certificate served expires (Unix time), at start and at each renewal."""
    if not config.tls_cert:
        return None
    paths = [config.tls_cert, config.tls_key, *([config.tls_ca] if config.mutual else [])]
    files = WatchedFiles("the server's TLS files", paths, lambda: _server_tls(config))

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # (gRPC's own thread, before a handshake: a failure here would fail the handshake)
        try:
            renewed = files.changed()
        except Exception:
            logger.exception("could not look at %s", ", ".join(paths))
            return None
        if renewed is None:
            return None
        until = valid_until(renewed.cert)
        logger.info(
            "the server's TLS certificate %s was renewed (valid until %s): new connections use it",
            config.tls_cert,
            until.isoformat(),
            extra={"event": {"category": "tls", "files": paths}},
        )
        if on_served is not None:
            on_served(until.timestamp())
        return renewed.configuration()

    if on_served is not None:
        on_served(valid_until(files.current.cert).timestamp())
    return grpc.dynamic_ssl_server_credentials(
        files.current.configuration(),
        fetch,  # type: ignore[arg-type]  # (None is "no change", as gRPC documents)
        require_client_authentication=config.mutual,
    )


def https_context(config: SecurityConfig, what: str = "the dashboard") -> ssl.SSLContext | None:
    """TLS for an HTTP server beside a gRPC one (the dashboard beside the gateway) when
    ``config`` has a certificate: the same certificate and key, looked at again (at most
    every RENEWAL_LOOK_SECONDS) as a connection's handshake begins, so that a renewed one
    serves the connections made after it, as the gRPC server's does. Callers are asked for no
    certificate: the dashboard's own credential, to start runs, is a token."""
    if not config.tls_cert:
        return None
    cert, key = config.tls_cert, config.tls_key
    files = WatchedFiles(
        f"{what}'s TLS files", [cert, key], lambda: read_pair(cert, key, "--tls-cert", "--tls-key")
    )

    def made() -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        return context

    listening = current = made()

    def renewed(connection: Any, server_name: str | None, context: ssl.SSLContext) -> None:
        # (The handshake's first step, with or without a name the client asked for: the
        # connection may still be handed another context, the one made of renewed files.)
        nonlocal current
        if files.changed(RENEWAL_LOOK_SECONDS) is not None:
            try:
                current = made()
            except (OSError, ssl.SSLError) as error:  # (changed again since it was checked)
                logger.warning("%s's renewed TLS files cannot be used: %s", what, error)
            else:
                logger.info(
                    "%s's TLS certificate %s was renewed: new connections use it", what, cert
                )
        if current is not listening:
            connection.context = current

    listening.sni_callback = renewed
    return listening


def authenticator_for(config: SecurityConfig) -> Authenticates | None:
    """Who may call a server: None (everyone) when it has neither credentials nor mTLS."""
    if config.credentials_file:
        return CredentialsFile(config.credentials_file, certificate_names=config.mutual)
    if config.mutual:
        return Authenticator(certificate_names=True)
    return None


class _TokenFile:
    """The bearer token of a token file, read again when it changes (looked at, at most once
    every RENEWAL_LOOK_SECONDS, as a call starts): a rotated token is sent from the next call
    on, without a restart."""

    def __init__(self, path: str) -> None:
        self._files = WatchedFiles(f"the token file {path}", [path], lambda: _token_metadata(path))

    def __call__(self) -> tuple[str, str]:
        if self._files.changed(RENEWAL_LOOK_SECONDS) is not None:
            logger.info(
                "the token file %s was renewed: new calls send its token",
                self._files.paths[0],
                extra={"event": {"category": "auth", "file": self._files.paths[0]}},
            )
        return self._files.current


class _WithToken:
    """A channel's multi-callable that adds the bearer token to the metadata of each call."""

    def __init__(self, call: Any, token: Callable[[], tuple[str, str]]) -> None:
        self._call = call
        self._token = token

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._call(*args, metadata=(*(metadata or ()), self._token()), **kwargs)


class _TokenChannel(grpc.aio.Channel):
    """A channel that sends the bearer token with every call. (Client interceptors would do
    it through grpc.aio's interceptor machinery, which puts a task and a queue between a
    stream and its writes, and leaves them pending behind a call refused as it opens.)"""

    def __init__(self, channel: grpc.aio.Channel, token: Callable[[], tuple[str, str]]) -> None:
        self._channel = channel
        self._token = token

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


def _client_files(config: SecurityConfig) -> WatchedFiles[_ClientTls]:
    paths = [config.tls_ca]
    if config.tls_client_cert:
        paths += [config.tls_client_cert, config.tls_client_key]
    return WatchedFiles("the client's TLS files", paths, lambda: _client_tls(config))


class _OnCurrent:
    """A multi-callable of a :class:`_RenewingChannel`: each call goes over its current
    channel."""

    def __init__(self, owner: _RenewingChannel, kind: str, args: Any, kwargs: Any) -> None:
        self._owner = owner
        self._kind = kind
        self._args = args
        self._kwargs = kwargs
        self._made: tuple[grpc.aio.Channel, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        made = self._made
        if made is None or made[0] is not channel:
            call = getattr(channel, self._kind)(*self._args, **self._kwargs)
            made = self._made = (channel, call)
        return made[1](*args, **kwargs)


class _RenewingChannel(grpc.aio.Channel):
    """A TLS channel whose CA and client certificate files are looked at again (at most once
    every RENEWAL_LOOK_SECONDS, as a call starts): once they changed, calls go over a new
    channel made with them, while the calls open on the one before go on over it. (gRPC's
    channel credentials are fixed when made; a renewed client certificate would otherwise
    reach the server only after a restart, and an expired one would fail every reconnection.)
    The RENEWED_KEPT channels before the current one are kept open; an older one closes."""

    def __init__(
        self, target: str, files: WatchedFiles[_ClientTls], options: list[tuple[str, Any]]
    ) -> None:
        self._target = target
        self._files = files
        self._options = options
        self._channel = self._open(files.current)
        self._before: list[grpc.aio.Channel] = []
        self._closing: set[asyncio.Task[None]] = set()

    def _open(self, tls: _ClientTls) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(self._target, tls.credentials(), options=self._options)

    def current(self) -> grpc.aio.Channel:
        renewed = self._files.changed(RENEWAL_LOOK_SECONDS)
        if renewed is not None:
            logger.info(
                "the TLS files of the channel to %s were renewed: new calls use them",
                self._target,
                extra={"event": {"category": "tls", "files": list(self._files.paths)}},
            )
            self._before.append(self._channel)
            self._channel = self._open(renewed)
            if len(self._before) > RENEWED_KEPT:
                task = asyncio.create_task(self._before.pop(0).close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        return self._channel

    async def __aenter__(self) -> _RenewingChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self, grace: float | None = None) -> None:
        channels, self._before = [*self._before, self._channel], []
        await asyncio.gather(*(c.close(grace) for c in channels), *self._closing)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.current().wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _OnCurrent(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _OnCurrent(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _OnCurrent(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _OnCurrent(self, "stream_stream", args, kwargs)


def check_target(target: str) -> None:
    """MeshError (INVALID_ARGUMENT, BAD_ADDRESS) for an address gRPC would not dial as meant,
    and a ValueError for a setting of the environment that is none: what making a channel to
    ``target`` would refuse, said before one is made."""
    check_environment()
    problem = address_problem(target)  # (gRPC dials port 99999 as 34463; "" fails UNKNOWN)
    if problem is not None:
        raise MeshError(problem, code="INVALID_ARGUMENT", reason="BAD_ADDRESS")


def open_channel(
    target: str, config: SecurityConfig | None = None, options: Iterable[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A channel to ``target``: TLS when a CA is configured (with the client certificate, for
    mutual TLS, when one is), and the bearer token on every call when one is."""
    check_target(target)
    config = config or SecurityConfig()
    opts = list(options)
    if config.tls_server_name:
        opts.append(("grpc.ssl_target_name_override", config.tls_server_name))
    if config.tls_ca:
        channel: grpc.aio.Channel = _RenewingChannel(target, _client_files(config), opts)
    else:
        channel = grpc.aio.insecure_channel(target, options=opts)
    if config.token_file:
        return _TokenChannel(channel, _TokenFile(config.token_file))
    if config.token:
        metadata = ("authorization", f"Bearer {config.token}")
        return _TokenChannel(channel, lambda: metadata)
    return channel

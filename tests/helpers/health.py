"""What a probe or a balancer asks a server of the mesh: its grpc.health.v1 status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health_of(address: str, service: str = "") -> int:
    """The status a Check of ``service`` answers ("": the server as a whole)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)


async def tls_health(
    address: str, ca: Path, cert: Path | None = None, key: Path | None = None
) -> int | str:
    """The health of the server at ``address`` over TLS trusting ``ca`` (a new connection),
    presenting ``cert`` and ``key`` when given (mutual TLS), or the name of the status code
    that refused it."""

    def read(path: Path | None) -> bytes | None:
        return path.read_bytes() if path is not None else None

    roots, chain, private = await asyncio.to_thread(lambda: (read(ca), read(cert), read(key)))
    credentials = grpc.ssl_channel_credentials(roots, private, chain)
    async with grpc.aio.secure_channel(address, credentials) as channel:
        try:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as error:
            return error.code().name
    return int(answer.status)


class Watch:
    """A Health.Watch stream, read a status at a time."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:  # type: ignore[type-arg]
        self.call = call

    async def until(self, wanted: int, seconds: float = 10.0) -> list[int]:
        """The statuses said from here up to the first ``wanted`` one."""
        seen: list[int] = []
        async with asyncio.timeout(seconds):
            while True:
                reply = await self.call.read()
                if reply is grpc.aio.EOF:
                    raise AssertionError(f"the watch ended after {seen}")
                seen.append(reply.status)
                if reply.status == wanted:
                    return seen


@asynccontextmanager
async def watching(
    address: str, service: str = "", *, wait_for_ready: bool = False
) -> AsyncIterator[Watch]:
    """A Health.Watch of ``service`` on the server at ``address``, cancelled at the end;
    ``wait_for_ready``: made once that server is up (its process may start it later)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service), wait_for_ready=wait_for_ready
        )
        try:
            yield Watch(call)
        finally:
            call.cancel()

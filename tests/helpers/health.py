"""What a probe or a balancer asks a server of the mesh: its grpc.health.v1 status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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
async def watching(address: str, service: str = "") -> AsyncIterator[Watch]:
    """A Health.Watch of ``service`` on the server at ``address``, cancelled at the end."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service)
        )
        try:
            yield Watch(call)
        finally:
            call.cancel()

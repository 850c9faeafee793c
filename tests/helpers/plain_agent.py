"""A plain gRPC agent server (AgentService, no SDK), as any language would write one: the
broker pushes messages to it (DELIVERY_MODE_PUSH)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from mesh.v1 import agent_pb2, agent_pb2_grpc, message_pb2

Handler = Callable[[message_pb2.Message, Any], Any]


class PlainAgent(agent_pb2_grpc.AgentServiceServicer):
    """An agent as any language would write it: one unary method, no SDK."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.seen: list[message_pb2.Message] = []
        self.called_at: list[float] = []
        """When (loop time) each call came."""
        self.metadata: list[dict[str, str]] = []
        """Each call's metadata."""
        self._arrived = asyncio.Condition()

    async def until_seen(self, count: int, timeout: float = 15.0) -> None:
        """Waits until ``count`` messages have come (each call counts, a redelivery too)."""
        async with asyncio.timeout(timeout), self._arrived:
            await self._arrived.wait_for(lambda: len(self.seen) >= count)

    async def HandleMessage(
        self, request: agent_pb2.HandleMessageRequest, context: Any
    ) -> agent_pb2.HandleMessageResponse:
        async with self._arrived:
            self.seen.append(request.message)
            self.called_at.append(asyncio.get_running_loop().time())
            self.metadata.append(dict(context.invocation_metadata() or ()))
            self._arrived.notify_all()
        answer = await self.handler(request.message, context)
        response = agent_pb2.HandleMessageResponse()
        if answer is not None:
            response.response.CopyFrom(answer)
        return response


async def start_plain(agent: PlainAgent, port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(agent, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{bound}"


@contextlib.contextmanager
def port_kept(address: str) -> Iterator[int]:
    """Around a server stopped to be started again on its port: keeps the port from being
    handed to a server another test binds to port 0 meanwhile (the kernel gives out no port a
    socket is bound to), by a socket bound beside the server's. It shares the port as gRPC's
    servers do (SO_REUSEPORT), so the server binds it again beside it; it never listens."""
    host, _, port = address.rpartition(":")
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind((host, int(port)))
        yield int(port)


async def echo(message: message_pb2.Message, context: Any) -> message_pb2.Message:
    """Answers with the request's parameters, its envelope written carelessly: the broker
    knows whom it called and what for."""
    answer = message_pb2.Message(
        message_type=message_pb2.MESSAGE_TYPE_RESPONSE,
        from_agent="Impostor",
        to_agent="Somebody",
        correlation_id="my-own-id",
    )
    answer.content.update({"action": "echo", "echo": dict(message.content["parameters"])})
    return answer

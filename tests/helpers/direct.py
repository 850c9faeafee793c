"""Bad direct calls to an agent's own server (HandleMessage), as a client that is no SDK may
make them, and what a server answers: every agent, whatever its language, must refuse each
INVALID_ARGUMENT, saying what the Python agents say."""

from __future__ import annotations

import time
from typing import Any

import grpc
from google.protobuf import struct_pb2

from mesh import AgentContext, LocalMesh, Message, agent
from mesh.v1 import agent_pb2, message_pb2

UNREADABLE = "the request is not a valid mesh.v1.HandleMessageRequest: "


def bad_direct_calls(agent_id: str) -> dict[str, bytes]:
    """Requests to ``agent_id``'s HandleMessage that its server must refuse, by what is
    wrong: their bytes."""

    def call(**fields: Any) -> bytes:
        content = fields.pop("content", {"action": "echo"})
        message = message_pb2.Message(from_agent="Caller", to_agent=agent_id, **fields)
        if content is not None:
            message.content.update(content)
        return agent_pb2.HandleMessageRequest(message=message).SerializeToString()

    nan = struct_pb2.Struct()
    nan.update({"action": "echo", "scores": [1, float("nan")]})
    late = message_pb2.Message(from_agent="Caller", to_agent=agent_id)
    late.content.update({"action": "echo"})
    late.timestamp.seconds = 2**44  # (past what a JavaScript Date holds)

    def scheduled(seconds: int) -> bytes:
        message = message_pb2.Message(from_agent="Caller", to_agent=agent_id)
        message.content.update({"action": "echo"})
        message.deliver_at.seconds = seconds
        return agent_pb2.HandleMessageRequest(message=message).SerializeToString()

    return {
        "garbage": b"\xff\xff\x07 not protobuf",
        "no message": b"",
        "no content": call(content=None),
        "an undefined type": call(message_type=99),
        "an undefined priority": call(priority=77),
        "a timestamp out of range": agent_pb2.HandleMessageRequest(
            message=late
        ).SerializeToString(),
        "a deliver_at out of range": scheduled(2**44),
        "a deliver_at more than a day ahead": scheduled(int(time.time()) + 2 * 86400),
        "a ttl past a day": call(ttl=86401),
        "a negative ttl": call(ttl=-1),
        "over 1 MiB": call(content={"action": "echo", "blob": "x" * (1 << 20)}),
        "NaN": agent_pb2.HandleMessageRequest(
            message=message_pb2.Message(from_agent="Caller", to_agent=agent_id, content=nan)
        ).SerializeToString(),
    }


async def answers_to_bad_direct_calls(address: str, agent_id: str) -> dict[str, tuple[str, str]]:
    """What the server at ``address`` answers each of ``bad_direct_calls(agent_id)``: its
    status code's name and details ("OK" when it took it)."""
    said = {}
    async with grpc.aio.insecure_channel(address) as channel:
        handle = channel.unary_unary("/mesh.v1.AgentService/HandleMessage")
        for what, request in bad_direct_calls(agent_id).items():
            try:
                await handle(request, timeout=10)
                said[what] = ("OK", "")
            except grpc.aio.AioRpcError as error:
                said[what] = (error.code().name, error.details() or "")
    return said


async def python_agent_answers(mesh: LocalMesh, agent_id: str) -> dict[str, tuple[str, str]]:
    """What a Python echo agent's server answers the bad calls, served as ``agent_id`` on
    ``mesh`` for them, then stopped (so that the other agent may take the id)."""

    @agent(agent_id)
    async def echo(message: Message, ctx: AgentContext) -> dict[str, Any]:
        return {"echo": message.content}

    served = await mesh.add_agent(echo)
    try:
        return await answers_to_bad_direct_calls(served.address, agent_id)
    finally:
        await mesh.stop_agent(agent_id, 0.5)


def assert_said_alike(
    other: dict[str, tuple[str, str]], python: dict[str, tuple[str, str]]
) -> None:
    """Every bad call refused INVALID_ARGUMENT by both, with the same words (garbage aside:
    each side's protobuf library says why in its own)."""
    assert {what: code for what, (code, _) in other.items()} == dict.fromkeys(
        python, "INVALID_ARGUMENT"
    )
    assert {what: code for what, (code, _) in python.items()} == dict.fromkeys(
        python, "INVALID_ARGUMENT"
    )
    for what, (_, details) in other.items():
        if what == "garbage":
            assert details.startswith(UNREADABLE) and python[what][1].startswith(UNREADABLE)
        else:
            assert details == python[what][1], what

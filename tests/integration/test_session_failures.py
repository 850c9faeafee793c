"""How the SDK reads the end of its streams (its Connect session, a state watch): a status
gRPC gives a stream that broke under the broker (INTERNAL or UNKNOWN without the broker's error
details, as a connection lost mid-frame sometimes ends) is a broker to reach again, like
UNAVAILABLE; an error the broker itself sent keeps its code."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_status import rpc_status

from mesh import BrokerUnavailableError, LocalMesh, connect
from mesh._status import to_rpc_status
from mesh.client import NO_RETRY
from mesh.core.errors import MeshError, SessionClosedError
from mesh.core.model import utc_now
from mesh.core.state import ChangeKind, StateEntry
from mesh.memory_server import CHANGE_KINDS, entry_to_pb
from mesh.v1 import memory_pb2, memory_pb2_grpc

CONNECT = "/mesh.v1.BrokerService/Connect"


async def ending_with(abort: object) -> AsyncIterator[str]:
    """A server whose Connect streams all end at once as ``abort`` says; its address."""

    async def connect_handler(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        if isinstance(abort, MeshError):
            await context.abort_with_status(rpc_status.to_status(to_rpc_status(abort)))
        else:
            await context.abort(grpc.StatusCode.INTERNAL, str(abort))
        yield b""  # never reached: an async generator, as grpc.aio wants

    async with serving_connect(connect_handler) as address:
        yield address


@contextlib.asynccontextmanager
async def serving_connect(connect_handler: Any) -> AsyncIterator[str]:
    """A gRPC server whose BrokerService has only Connect, served by ``connect_handler``;
    its address."""
    handler: Any = grpc.stream_stream_rpc_method_handler(connect_handler)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("mesh.v1.BrokerService", {"Connect": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def session_failure(address: str) -> MeshError:
    async with connect(address, agent_id="probe", retry=NO_RETRY) as client:
        session = await client._open_session()
        async with asyncio.timeout(5):
            while not session.closed:  # noqa: ASYNC110 (the reader task sets it)
                await asyncio.sleep(0.01)
        assert session.failure is not None
        return session.failure


async def test_a_stream_broken_under_the_broker_is_worth_a_new_session() -> None:
    async for address in ending_with("Internal error from Core"):
        failure = await session_failure(address)
        assert isinstance(failure, BrokerUnavailableError)
        assert failure.code == "UNAVAILABLE"
        assert "Internal error from Core" in failure.message


@pytest.mark.parametrize("code", ["INTERNAL", "PERMISSION_DENIED"])
async def test_an_error_the_broker_sent_keeps_its_code(code: str) -> None:
    sent = MeshError("no such thing here", code=code, reason="SOMETHING_SPECIFIC")
    async for address in ending_with(sent):
        failure = await session_failure(address)
        assert not isinstance(failure, BrokerUnavailableError)
        assert (failure.code, failure.reason) == (code, "SOMETHING_SPECIFIC")


async def test_a_stream_the_broker_stops_answering_on_is_given_up() -> None:
    """A Connect stream that takes frames and answers none (a broker that lost track of it):
    a subscription does not wait on it for ever but fails as UNAVAILABLE (so it reconnects),
    and the client's next call opens a new stream."""
    opened = 0

    async def silent(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        nonlocal opened
        opened += 1
        async for _ in requests:
            pass
        yield b""  # never reached while the client keeps the stream open

    async with (
        serving_connect(silent) as address,
        connect(address, agent_id="probe", retry=NO_RETRY, default_timeout=0.3) as client,
    ):
        first = await client._open_session()
        with pytest.raises(BrokerUnavailableError, match="did not answer the subscription"):
            await client.subscribe("Worker", reconnect=False).start()
        assert first.closed and isinstance(first.failure, BrokerUnavailableError)
        second = await client._open_session()
        assert second is not first and not second.closed
        async with asyncio.timeout(5):
            while opened < 2:  # noqa: ASYNC110 (the server counts the streams)
                await asyncio.sleep(0.01)


async def test_a_closed_client_says_so(mesh: LocalMesh) -> None:
    """Used after ``close`` (a client closed by the ``async with`` it was opened in, still
    held by a task): each call says the client is closed, a MeshError like every other,
    instead of grpc's bare UsageError from the closed channel."""
    client = connect(mesh.address, agent_id="late")
    await client.register()
    await client.close()
    assert client.closed
    calls = {
        "send": lambda: client.send("late", {"action": "a"}),
        "request": lambda: client.request("late", {"action": "a"}, timeout=1),
        "register": lambda: client.register(),
        "queue_stats": lambda: client.queue_stats(),
        "gather": lambda: anext(aiter(client.gather({"action": "a"}, timeout=1))),
        "call_tool": lambda: client.call_tool("search", {"q": "x"}),
    }
    for name, call in calls.items():
        with pytest.raises(SessionClosedError, match="this client is closed") as info:
            await call()
        assert info.value.code == "CANCELLED", name
    with pytest.raises(SessionClosedError, match="this client is closed"):
        client.subscribe()
    await client.close()  # closing again is harmless


class BreakingWatches(memory_pb2_grpc.MemoryServiceServicer):
    """A memory service whose first state watch tells an entry and SYNCED, then breaks as
    gRPC reports some connections lost mid-stream (UNKNOWN "Stream removed", without the
    broker's error details); the next tells the entry's newer version and stays open."""

    def __init__(self) -> None:
        self.watches = 0

    async def WatchState(
        self, request: memory_pb2.WatchStateRequest, context: Any
    ) -> AsyncIterator[memory_pb2.WatchStateResponse]:
        self.watches += 1
        version = self.watches
        current = memory_pb2.WatchStateResponse(kind=CHANGE_KINDS[ChangeKind.CURRENT])
        entry_to_pb(
            StateEntry("parcel/1", {"n": version}, version, "Tracker", utc_now()), current.entry
        )
        yield current
        yield memory_pb2.WatchStateResponse(kind=CHANGE_KINDS[ChangeKind.SYNCED])
        if version == 1:
            await context.abort(grpc.StatusCode.UNKNOWN, "Stream removed")
        await asyncio.Event().wait()  # (open until the watcher leaves)


async def test_a_state_watch_broken_under_the_broker_is_watched_again() -> None:
    """Before, the watch with ``resume`` raised the UNKNOWN: `agentmesh state --watch` ended
    with the broker it watched restarting (once, in a loaded run)."""
    server = grpc.aio.server()
    servicer = BreakingWatches()
    memory_pb2_grpc.add_MemoryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with connect(f"127.0.0.1:{port}", agent_id="Watcher", retry=NO_RETRY) as client:
            changes = client.watch_state("parcel/", send_initial=True, resume=True)
            told = []
            async with asyncio.timeout(10):
                for _ in range(4):
                    change = await anext(changes)
                    entry = change.entry
                    told.append((change.kind.value, entry.value if entry else None))
            await changes.aclose()
        assert told == [
            ("current", {"n": 1}),
            ("synced", None),
            ("put", {"n": 2}),  # what changed while it was away
            ("synced", None),
        ]
        assert servicer.watches == 2
    finally:
        await server.stop(0)

"""The physical limit on this machine: raw grpc.aio bidirectional streams carrying bytes.

`python -m benchmarks.baseline echo` serves an echo stream; `... relay --upstream ADDR` serves a
stream that forwards every frame to the echo server and relays the answer back: the shape of a
brokered round trip (client -> relay -> echo -> relay -> client).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from mesh.cli import _until_signalled
from mesh.loop import run as run_loop

METHOD = "/bench.Echo/Stream"


def _identity(data: bytes) -> bytes:
    return data


async def _echo(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for frame in requests:
        yield frame


def _relay(upstream: str) -> Any:
    channel = grpc.aio.insecure_channel(upstream)

    async def relay(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        call = channel.stream_stream(
            METHOD, request_serializer=_identity, response_deserializer=_identity
        )()

        async def forward() -> None:
            async for frame in requests:
                await call.write(frame)
            await call.done_writing()

        task = asyncio.create_task(forward())
        try:
            while (frame := await call.read()) is not grpc.aio.EOF:
                yield frame
        finally:
            task.cancel()

    return relay


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["echo", "relay"])
    parser.add_argument("--upstream")
    args = parser.parse_args()
    handler = _echo if args.role == "echo" else _relay(args.upstream)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "bench.Echo",
                {
                    "Stream": grpc.stream_stream_rpc_method_handler(
                        handler, request_deserializer=_identity, response_serializer=_identity
                    )
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"baseline {args.role} listening on 127.0.0.1:{port}", flush=True)
    await _until_signalled()
    await server.stop(0.5)


class StreamClient:
    """A pipelined client of the echo/relay stream: FIFO answers, many in flight."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.call = self.channel.stream_stream(
            METHOD, request_serializer=_identity, response_deserializer=_identity
        )()
        self.waiting: asyncio.Queue[asyncio.Future[bytes]] = asyncio.Queue()
        self.lock = asyncio.Lock()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
            while (frame := await self.call.read()) is not grpc.aio.EOF:
                self.waiting.get_nowait().set_result(frame)

    async def roundtrip(self, payload: bytes) -> bytes:
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        async with self.lock:
            self.waiting.put_nowait(future)
            await self.call.write(payload)
        return await future

    async def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader
        await self.channel.close()


if __name__ == "__main__":
    run_loop(main())

"""The physical limit on this machine: raw grpc.aio bidirectional streams carrying bytes.

`python -m benchmarks.baseline echo` serves an echo stream; `... relay --upstream ADDR` serves a
stream that forwards every frame to the echo server and relays the answer back: the shape of a
brokered round trip (client -> relay -> echo -> relay -> client). `... echo --stamp` answers
each frame with the wall-clock time it got it instead (8 bytes), and `... fanout --upstream A
--upstream B ...` forwards every frame to each of its upstreams and answers with their answers
together, in upstream order: the shape of a broadcast to agents in several processes, and of
the gather that collects their answers. `... relay --contract --upstream ADDR` and `... echo
--contract` are the relay and echo speaking the mesh's Connect frames: the relay parses each
request frame and writes the echo a delivery, the echo answers with a RESPONSE message, the relay
parses that and writes the response frame. They do what any broker and agent on this contract
must do for a roundtrip, and nothing of the mesh's own (queues, leases, validation, correlation):
the least a roundtrip through a broker speaking this contract costs on this machine.

`... agent --broker ADDR --agent-id ID` is an agent of the real broker written in raw grpc.aio
on the contract alone (no SDK): it registers, subscribes on a Connect stream and answers every
delivery on that stream with a RESPONSE built from the request in place. With the raw driver
(:class:`ContractClient`) at the other end, a roundtrip through the broker measures the broker
and nothing of the SDKs': where the time of a mesh roundtrip goes, the broker or its clients.
`... push-agent --broker ADDR --agent-id ID` is an agent taking its messages by push: a plain
server of AgentService.HandleMessage in raw grpc.aio, registered with DELIVERY_MODE_PUSH, that
answers each call with the request's content (a unary call per message, where the others
share a stream).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import struct
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc

from mesh.cli import _until_signalled
from mesh.loop import run as run_loop
from mesh.v1 import agent_pb2, broker_pb2, message_pb2

METHOD = "/bench.Echo/Stream"
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]
"""Each channel keeps its connection to itself, as the mesh's clients do (it changes nothing
on a message's path): in gRPC's process-wide pool a new channel shared the connection, and
the reconnect backoff, of any other channel of the process to the same address (in a test
process, one left to a port whose server had gone, that the kernel gave a new server since),
and its first call failed at once with "connection refused"."""


def _identity(data: bytes) -> bytes:
    return data


async def _echo(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for frame in requests:
        yield frame


async def _stamp(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for _ in requests:
        yield struct.pack("<d", time.time())


async def _contract_echo(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for data in requests:  # a delivery; answered as an agent answers a request
        delivery = broker_pb2.ConnectResponse.FromString(data).delivery
        frame = broker_pb2.ConnectRequest()
        answer = frame.send
        answer.CopyFrom(delivery.message)
        answer.message_type = message_pb2.MESSAGE_TYPE_RESPONSE
        answer.correlation_id = delivery.message.message_id
        answer.from_agent, answer.to_agent = delivery.message.to_agent, delivery.message.from_agent
        yield frame.SerializeToString()


async def _register(channel: grpc.aio.Channel, agent: message_pb2.AgentInfo) -> None:
    await channel.unary_unary(
        "/mesh.v1.BrokerService/RegisterAgent",
        request_serializer=broker_pb2.RegisterAgentRequest.SerializeToString,
        response_deserializer=broker_pb2.RegisterAgentResponse.FromString,
    )(broker_pb2.RegisterAgentRequest(agent=agent))


async def serve_raw_agent(
    broker: str, agent_id: str, ready: Any, agent_types: tuple[str, ...] = ()
) -> None:
    """The raw agent: answers each delivery on the stream it came on until the stream ends,
    with the request's content and ``received_at``, the wall-clock time it read the delivery
    (for a broadcast's latency, as the SDK's echo agent answers)."""
    async with grpc.aio.insecure_channel(broker, options=CHANNEL_OPTIONS) as channel:
        await _register(channel, message_pb2.AgentInfo(agent_id=agent_id, agent_types=agent_types))
        call = channel.stream_stream(
            "/mesh.v1.BrokerService/Connect",
            request_serializer=broker_pb2.ConnectRequest.SerializeToString,
            response_deserializer=broker_pb2.ConnectResponse.FromString,
        )()
        subscribe = broker_pb2.ConnectRequest(seq=1)
        subscribe.subscribe.agent_id = agent_id
        subscribe.subscribe.max_in_flight = 128
        await call.write(subscribe)
        first = cast(broker_pb2.ConnectResponse, await call.read())
        if first.WhichOneof("frame") != "accepted":
            raise RuntimeError(f"the broker refused the subscription of {agent_id}")
        ready()
        while (frame := await call.read()) is not grpc.aio.EOF:
            received_at = time.time()
            request = cast(broker_pb2.ConnectResponse, frame).delivery.message
            out = broker_pb2.ConnectRequest()  # seq 0: fire-and-forget; it acks the delivery
            answer = out.send
            answer.CopyFrom(request)
            fields = answer.content.fields
            fields["received_at"].number_value = received_at
            if "action" not in fields:  # (a broadcast may have none; an answer must)
                fields["action"].string_value = "response"
            answer.ClearField("message_id")  # the broker assigns one
            answer.message_type = message_pb2.MESSAGE_TYPE_RESPONSE
            answer.correlation_id = request.correlation_id or request.message_id
            answer.from_agent, answer.to_agent = agent_id, request.reply_to or request.from_agent
            await call.write(out)


class _Pipelined:
    """A client of one long-lived stream with a task reading its answers."""

    channel: grpc.aio.Channel
    call: Any
    reader: asyncio.Task[None]

    async def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader
        await self.channel.close()


class ContractClient(_Pipelined):
    """The raw driver of the real broker: `request` frames on one Connect stream, answers
    matched by seq, nothing else."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.call = self.channel.stream_stream(
            "/mesh.v1.BrokerService/Connect",
            request_serializer=broker_pb2.ConnectRequest.SerializeToString,
            response_deserializer=broker_pb2.ConnectResponse.FromString,
        )()
        self.seq = 0
        self.waiting: dict[int, asyncio.Future[broker_pb2.ConnectResponse]] = {}
        self.gathering: dict[int, asyncio.Queue[broker_pb2.ConnectResponse]] = {}
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
            while (frame := await self.call.read()) is not grpc.aio.EOF:
                answer = cast(broker_pb2.ConnectResponse, frame)
                gathered = self.gathering.get(answer.seq)
                if gathered is not None:
                    gathered.put_nowait(answer)
                    continue
                waiter = self.waiting.pop(answer.seq, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(answer)

    async def gather(
        self, message: message_pb2.Message, agent_types: list[str], timeout: float = 5.0
    ) -> list[message_pb2.Message]:
        """Asks every agent of ``agent_types`` (a `gather` frame); their answers, once all are
        in (the broker's `accepted` ends them)."""
        self.seq += 1
        seq = self.seq
        frames: asyncio.Queue[broker_pb2.ConnectResponse] = asyncio.Queue()
        self.gathering[seq] = frames
        frame = broker_pb2.ConnectRequest(seq=seq)
        frame.gather.message.CopyFrom(message)
        frame.gather.agent_types.extend(agent_types)
        frame.gather.timeout.FromSeconds(int(timeout))
        answers = []
        try:
            await self.call.write(frame)
            while (got := await frames.get()).WhichOneof("frame") == "gathered":
                if got.gathered.HasField("response"):
                    answers.append(got.gathered.response)
            if got.WhichOneof("frame") != "accepted":
                raise RuntimeError(f"the broker ended the gather with {got}")
        finally:
            del self.gathering[seq]
        return answers

    async def request(self, message: message_pb2.Message) -> message_pb2.Message:
        self.seq += 1
        waiter: asyncio.Future[broker_pb2.ConnectResponse] = (
            asyncio.get_running_loop().create_future()
        )
        self.waiting[self.seq] = waiter
        frame = broker_pb2.ConnectRequest(seq=self.seq)
        frame.request.message.CopyFrom(message)
        await self.call.write(frame)
        answer = await waiter
        if not answer.HasField("response"):
            raise RuntimeError(f"the broker did not answer with a response: {answer}")
        return answer.response


def stamps(answer: bytes) -> list[float]:
    """The wall-clock times in a fan-out's answer (one per upstream)."""
    return [t for (t,) in struct.iter_unpack("<d", answer)]


def _fanout(upstreams: list[str]) -> Any:
    channels = [
        grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for address in upstreams
    ]

    async def fanout(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        calls = [
            channel.stream_stream(
                METHOD, request_serializer=_identity, response_deserializer=_identity
            )()
            for channel in channels
        ]
        answers: asyncio.Queue[bytes] = asyncio.Queue()

        async def forward() -> None:
            async for frame in requests:  # to every upstream at once
                await asyncio.gather(*(call.write(frame) for call in calls))
            for call in calls:
                await call.done_writing()

        async def collect() -> None:
            while True:
                got = [await call.read() for call in calls]
                if any(frame is grpc.aio.EOF for frame in got):
                    return
                answers.put_nowait(b"".join(f for f in got if isinstance(f, bytes)))

        tasks = [asyncio.create_task(forward()), asyncio.create_task(collect())]
        try:
            while True:
                yield await answers.get()
        finally:
            for task in tasks:
                task.cancel()

    return fanout


def _contract_relay(upstream: str) -> Any:
    channel = grpc.aio.insecure_channel(upstream, options=CHANNEL_OPTIONS)

    async def relay(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        call = channel.stream_stream(
            METHOD, request_serializer=_identity, response_deserializer=_identity
        )()
        seqs: asyncio.Queue[int] = asyncio.Queue()  # answered in order, as the echo answers

        async def forward() -> None:
            async for data in requests:  # a request frame: to the echo as a delivery
                request = broker_pb2.ConnectRequest.FromString(data)
                seqs.put_nowait(request.seq)
                frame = broker_pb2.ConnectResponse()
                frame.delivery.message.CopyFrom(request.request.message)
                frame.delivery.delivery_attempt = 1
                frame.delivery.lease_expires_at.GetCurrentTime()
                await call.write(frame.SerializeToString())
            await call.done_writing()

        task = asyncio.create_task(forward())
        try:
            while (data := await call.read()) is not grpc.aio.EOF:
                answer = broker_pb2.ConnectRequest.FromString(cast(bytes, data)).send
                frame = broker_pb2.ConnectResponse(seq=seqs.get_nowait())
                frame.response.CopyFrom(answer)
                yield frame.SerializeToString()
        finally:
            task.cancel()

    return relay


def _relay(upstream: str) -> Any:
    channel = grpc.aio.insecure_channel(upstream, options=CHANNEL_OPTIONS)

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
                yield cast(bytes, frame)
        finally:
            task.cancel()

    return relay


async def _push_echo(data: bytes, context: Any) -> bytes:
    """HandleMessage of the push agent: the request's content back, with ``received_at``, as a
    RESPONSE whose envelope the broker fills in."""
    request = agent_pb2.HandleMessageRequest.FromString(data)
    response = agent_pb2.HandleMessageResponse()
    answer = response.response
    answer.message_type = message_pb2.MESSAGE_TYPE_RESPONSE
    answer.content.CopyFrom(request.message.content)
    fields = answer.content.fields
    fields["received_at"].number_value = time.time()
    if "action" not in fields:
        fields["action"].string_value = "response"
    return response.SerializeToString()


async def serve_push_agent(broker: str, agent_id: str, ready: Any) -> None:
    """The push agent: a plain server of AgentService.HandleMessage in raw grpc.aio (no SDK, no
    stream of its own), registered for push delivery: the broker calls it with each message."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "mesh.v1.AgentService",
                {
                    "HandleMessage": grpc.unary_unary_rpc_method_handler(
                        _push_echo, request_deserializer=_identity, response_serializer=_identity
                    )
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(broker, options=CHANNEL_OPTIONS) as channel:
            await _register(
                channel,
                message_pb2.AgentInfo(
                    agent_id=agent_id,
                    address=f"127.0.0.1:{port}",
                    delivery_mode=message_pb2.DELIVERY_MODE_PUSH,
                ),
            )
        ready()
        await server.wait_for_termination()
    finally:
        await server.stop(0.5)


async def start(handler: Any, host: str = "127.0.0.1") -> tuple[grpc.aio.Server, str]:
    """A server of the bench.Echo stream with ``handler``, on a free port; and its address."""
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
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, f"{host}:{port}"


def handler_for(
    role: str, upstreams: list[str], *, stamp: bool = False, contract: bool = False
) -> Any:
    if role == "echo":
        return _contract_echo if contract else _stamp if stamp else _echo
    if role == "relay":
        return _contract_relay(upstreams[0]) if contract else _relay(upstreams[0])
    return _fanout(upstreams)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["echo", "relay", "fanout", "agent", "push-agent"])
    parser.add_argument("--upstream", action="append", default=[])
    parser.add_argument("--broker", help="agent: the broker to serve")
    parser.add_argument("--agent-id", default="raw-0", help="agent: its id")
    parser.add_argument("--types", default="", help="agent: its agent types, comma-separated")
    parser.add_argument("--stamp", action="store_true", help="echo: answer with the time")
    parser.add_argument(
        "--contract", action="store_true", help="relay, echo: speak the mesh's Connect frames"
    )
    args = parser.parse_args()
    if args.role in ("agent", "push-agent"):
        if not args.broker:
            parser.error(f"{args.role} needs --broker")
        ready = functools.partial(print, f"baseline agent {args.agent_id} ready", flush=True)
        serving = asyncio.create_task(
            serve_raw_agent(
                args.broker,
                args.agent_id,
                ready,
                tuple(t for t in args.types.split(",") if t),
            )
            if args.role == "agent"
            else serve_push_agent(args.broker, args.agent_id, ready)
        )
        signalled = asyncio.create_task(_until_signalled())
        await asyncio.wait({serving, signalled}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            serving.result()  # (raises what ended it)
        serving.cancel()
        return
    server, address = await start(
        handler_for(args.role, args.upstream, stamp=args.stamp, contract=args.contract)
    )
    print(f"baseline {args.role} listening on {address}", flush=True)
    await _until_signalled()
    await server.stop(0.5)


class StreamClient(_Pipelined):
    """A pipelined client of the echo/relay stream: FIFO answers, many in flight."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.call = self.channel.stream_stream(
            METHOD, request_serializer=_identity, response_deserializer=_identity
        )()
        self.waiting: asyncio.Queue[asyncio.Future[bytes]] = asyncio.Queue()
        self.lock = asyncio.Lock()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
            while (frame := await self.call.read()) is not grpc.aio.EOF:
                self.waiting.get_nowait().set_result(cast(bytes, frame))

    async def roundtrip(self, payload: bytes) -> bytes:
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        async with self.lock:
            self.waiting.put_nowait(future)
            await self.call.write(payload)
        return await future


if __name__ == "__main__":
    run_loop(main())

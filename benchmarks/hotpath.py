"""The Python each hot path costs, without gRPC: `python -m benchmarks.hotpath`.

The mesh's code on a roundtrip runs between gRPC reads and writes; on this machine its share is
what separates a mesh roundtrip from the raw relay (the kernel and gRPC's own work are the same
on both). Here each path runs in one process against in-memory streams that stand where the
gRPC calls are (a write completes at the loop's next turn, as grpc.aio's do), so what is timed
is the mesh's Python alone, steady from run to run where the multi-process figures are not:

- ``broker_roundtrip``: a request frame into the broker's servicer (its real sessions, broker
  and queues), the delivery out, the answer frame in, the response out;
- ``broker_gather5``: a gather frame into the broker's servicer for five agents of a type
  (the shape of broadcast5), its five deliveries out, their five answers in, each answer and
  the end of the gather out;
- ``broker_batched``: per message, batches of 100 (priorities mixed, a ttl) into the
  broker's ``SendMessages``, delivered in ``deliveries`` frames to a subscribed agent that
  acks each frame at once (the shape of ``oneway_batch100``; the time of the SDK's encoding
  is left out);
- ``agent_message``: the SDK's agent (its session, subscription and runtime, with the echo
  agent of the benchmarks) from a delivery frame to the answer it writes;
- ``client_request``: the SDK's ``request()`` from the call to the decoded answer;
- ``raw_loop``: a bare read-then-write loop on the same in-memory stream, the floor.

Microseconds per operation, the best of five runs (what the machine adds is only ever more
time: the least is the code's own, as timeit reports it). On the real mesh each costs about 2.5x
this (its processes share two cores and find their caches cold); the ratios between them hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from benchmarks.agents import EchoAgent
from mesh import Message, MessageType, Priority, connect
from mesh.agent import AgentRuntime
from mesh.codec import message_to_pb
from mesh.config import BrokerConfig
from mesh.core.broker import Broker
from mesh.core.model import AgentInfo
from mesh.loop import run as run_loop
from mesh.server import BrokerServicer
from mesh.streams import BATCH_HEADER
from mesh.v1 import broker_pb2, message_pb2

PAYLOAD: dict[str, Any] = {
    "action": "process_payment",
    "parameters": {"flight": "Flight A", "amount": 450},
}
ANSWER: dict[str, Any] = {
    "received_at": 1.7e9,
    "echo": PAYLOAD["parameters"],
    "recommendation": "Buy AAPL",
    "confidence": 0.8,
    "reasoning": "echo-0",
    "action": "process_payment",
}


def _frames(frame: Any) -> list[Any]:
    return list(frame.batch.frames) if frame.WhichOneof("frame") == "batch" else [frame]


class MemoryStream:
    """Where a gRPC stream would be: ``read()`` takes what was put in, ``write()`` hands the
    frame to ``on_write`` at the loop's next turn."""

    def __init__(self, on_write: Callable[[MemoryStream, Any], None]) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.on_write = on_write

    async def read(self) -> Any:
        return await self.inbox.get()

    async def write(self, frame: Any) -> None:
        await asyncio.sleep(0)
        self.on_write(self, frame)

    async def frames(self) -> AsyncIterator[Any]:
        while (frame := await self.inbox.get()) is not grpc.aio.EOF:
            yield frame

    # What the SDK's session and the broker's servicer ask of a call or context besides.
    def cancel(self) -> bool:
        return True

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """(The stream never ends with a status: nothing to call back.)"""

    async def done_writing(self) -> None:
        self.inbox.put_nowait(grpc.aio.EOF)  # the other side ends the stream in turn

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((BATCH_HEADER, "1"),)


class MemoryStub:
    """The broker's stub for an SDK client: Connect opens a MemoryStream."""

    def __init__(self, on_write: Callable[[MemoryStream, Any], None]) -> None:
        self.on_write = on_write
        self.streams: list[MemoryStream] = []

    def Connect(self, metadata: Any = None) -> MemoryStream:
        stream = MemoryStream(self.on_write)
        self.streams.append(stream)
        return stream


async def per_op(op: Callable[[], Awaitable[None]], count: int, warmup: int) -> float:
    for _ in range(warmup):
        await op()
    started = time.perf_counter()
    for _ in range(count):
        await op()
    return (time.perf_counter() - started) / count * 1e6


async def through_broker(
    count: int, agents: dict[str, str], frame: broker_pb2.ConnectRequest, ends_with: str
) -> float:
    """``frame`` (numbered anew each time) into the broker's servicer, from a driver's
    session, until the driver reads a frame of kind ``ends_with``; ``agents`` (id: type) are
    subscribed on sessions of their own and answer each delivery as a raw agent would."""
    broker = Broker(BrokerConfig(max_messages_per_agent=count + 1000))
    servicer = BrokerServicer(broker)
    ended = asyncio.Event()
    answer_content = message_to_pb(Message(from_agent="a", to_agent="b", content=ANSWER)).content

    def agent_read(stream: MemoryStream, frame: Any) -> None:
        for inner in _frames(frame):
            if inner.WhichOneof("frame") != "delivery":
                continue
            request = inner.delivery.message
            out = broker_pb2.ConnectRequest()
            answer = out.send
            answer.from_agent, answer.to_agent = request.to_agent, request.from_agent
            answer.message_type = message_pb2.MESSAGE_TYPE_RESPONSE
            answer.correlation_id = request.correlation_id or request.message_id
            answer.content.CopyFrom(answer_content)
            stream.inbox.put_nowait(out)

    def driver_read(stream: MemoryStream, frame: Any) -> None:
        if any(inner.WhichOneof("frame") == ends_with for inner in _frames(frame)):
            ended.set()

    streams = []
    for agent_id, agent_type in agents.items():
        await broker.register(AgentInfo(agent_id=agent_id, agent_types=(agent_type,)))
        agent = MemoryStream(agent_read)
        subscribe = broker_pb2.ConnectRequest(seq=1)
        subscribe.subscribe.agent_id = agent_id
        subscribe.subscribe.max_in_flight = 128
        subscribe.subscribe.max_batch = 128
        agent.inbox.put_nowait(subscribe)
        streams.append(agent)
    driver = MemoryStream(driver_read)
    sessions = [asyncio.create_task(servicer.Connect(s.frames(), s)) for s in [*streams, driver]]
    seq = 1

    async def one() -> None:
        nonlocal seq
        seq += 1
        numbered = broker_pb2.ConnectRequest()
        numbered.CopyFrom(frame)
        numbered.seq = seq
        ended.clear()
        driver.inbox.put_nowait(numbered)
        await ended.wait()

    try:
        return await per_op(one, count, count // 10)
    finally:
        for session in sessions:
            session.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)


async def broker_roundtrip(count: int) -> float:
    request = broker_pb2.ConnectRequest()
    message_to_pb(
        Message(from_agent="driver", to_agent="echo-0", content=PAYLOAD), request.request.message
    )
    request.request.message.ClearField("message_id")
    request.request.message.ClearField("timestamp")
    return await through_broker(count, {"echo-0": "bench"}, request, ends_with="response")


async def broker_gather5(count: int) -> float:
    gather = broker_pb2.ConnectRequest()
    message_to_pb(
        Message(from_agent="driver", to_agent="broadcast", content={"query": "q"}),
        gather.gather.message,
    )
    for name in ("message_id", "timestamp", "message_type"):  # (unset: BROADCAST copies)
        gather.gather.message.ClearField(name)
    gather.gather.agent_types.append("b5")
    # The gather ends with `accepted` on its seq, after every agent's `gathered`.
    agents = {f"b5-{i}": "b5" for i in range(5)}
    return await through_broker(count, agents, gather, ends_with="accepted")


async def broker_batched(count: int) -> float:
    """Per message: batches of 100 (the three priorities mixed, a ttl set) into the broker's
    ``SendMessages``, delivered to a subscribed agent in ``deliveries`` frames and acked by it
    in one frame per delivery frame (the shape of ``oneway_batch100``)."""
    broker = Broker(BrokerConfig(max_messages_per_agent=1000))
    servicer = BrokerServicer(broker)
    delivered, settled = 0, asyncio.Event()

    def agent_read(stream: MemoryStream, frame: Any) -> None:
        nonlocal delivered
        ack = broker_pb2.ConnectRequest()
        ack.ack.agent_id = "sink-0"
        ids = ack.ack.message_ids
        for inner in _frames(frame):
            if inner.WhichOneof("frame") == "deliveries":
                ids.extend(d.message.message_id for d in inner.deliveries.deliveries)
        if ids:
            delivered += len(ids)
            stream.inbox.put_nowait(ack)
            if delivered % BATCH == 0:
                settled.set()

    await broker.register(AgentInfo(agent_id="sink-0", agent_types=("sink",)))
    agent = MemoryStream(agent_read)
    subscribe = broker_pb2.ConnectRequest(seq=1)
    subscribe.subscribe.agent_id = "sink-0"
    subscribe.subscribe.max_in_flight = 2 * BATCH
    subscribe.subscribe.max_batch = 128
    agent.inbox.put_nowait(subscribe)
    session = asyncio.create_task(servicer.Connect(agent.frames(), agent))
    priorities = (Priority.HIGH, Priority.MEDIUM, Priority.LOW)

    async def one() -> None:
        request = broker_pb2.SendMessagesRequest()
        for i in range(BATCH):  # (new ids each time, as a client's messages have)
            message = Message(
                from_agent="driver",
                to_agent="sink-0",
                content={"action": "sink", "parameters": {"i": i}},
                priority=priorities[i % 3],
                ttl=60,
            )
            message_to_pb(message, request.messages.add())
        encoded = request.SerializeToString()
        started = time.perf_counter()
        settled.clear()
        context: Any = agent  # (where the call's context would be: unread unless it fails)
        await servicer.SendMessages(broker_pb2.SendMessagesRequest.FromString(encoded), context)
        await settled.wait()
        spent.append(time.perf_counter() - started)

    spent: list[float] = []
    try:
        await per_op(one, count, count // 10)
        measured = spent[len(spent) - count :]
        return sum(measured) / (count * BATCH) * 1e6
    finally:
        session.cancel()
        await asyncio.gather(session, return_exceptions=True)


BATCH = 100


async def agent_message(count: int) -> float:
    answered = asyncio.Event()

    def broker_read(stream: MemoryStream, frame: Any) -> None:
        for inner in _frames(frame):
            kind = inner.WhichOneof("frame")
            if kind in ("subscribe", "unsubscribe"):
                accepted = broker_pb2.ConnectResponse(seq=inner.seq)
                accepted.accepted.SetInParent()
                stream.inbox.put_nowait(accepted)
            elif kind == "send":
                answered.set()

    client = connect("127.0.0.1:1", agent_id="echo-0")  # (no connection is ever made)
    stub = MemoryStub(broker_read)
    client._stub = stub  # type: ignore[assignment]
    runtime = AgentRuntime(EchoAgent("echo-0", agent_types=["bench"]), client, max_in_flight=128)
    consumer = asyncio.create_task(runtime._consume())
    await runtime.subscribed.wait()
    stream = stub.streams[0]
    sent = Message(from_agent="driver", to_agent="echo-0", content=PAYLOAD)
    delivery = broker_pb2.ConnectResponse()
    message_to_pb(sent.evolve(correlation_id=sent.message_id), delivery.delivery.message)
    delivery.delivery.delivery_attempt = 1
    delivery.delivery.lease_expires_at.GetCurrentTime()

    async def one() -> None:
        frame = broker_pb2.ConnectResponse()
        frame.CopyFrom(delivery)
        answered.clear()
        stream.inbox.put_nowait(frame)
        await answered.wait()

    try:
        return await per_op(one, count, count // 10)
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await client.close()


async def client_request(count: int) -> float:
    answer = message_to_pb(
        Message(
            from_agent="echo-0",
            to_agent="driver",
            message_type=MessageType.RESPONSE,
            content=ANSWER,
        )
    )

    def broker_read(stream: MemoryStream, frame: Any) -> None:
        for inner in _frames(frame):
            if inner.WhichOneof("frame") == "request":
                out = broker_pb2.ConnectResponse(seq=inner.seq)
                out.response.CopyFrom(answer)
                out.response.correlation_id = inner.request.message.message_id
                stream.inbox.put_nowait(out)

    client = connect("127.0.0.1:1", agent_id="driver")
    client._stub = MemoryStub(broker_read)  # type: ignore[assignment]

    async def one() -> None:
        await client.request("echo-0", PAYLOAD)

    try:
        return await per_op(one, count, count // 10)
    finally:
        await client.close()


async def raw_loop(count: int) -> float:
    done = asyncio.Event()
    stream = MemoryStream(lambda _stream, _frame: done.set())

    async def echo() -> None:
        while True:
            await stream.write(await stream.read())

    task = asyncio.create_task(echo())

    async def one() -> None:
        done.clear()
        stream.inbox.put_nowait(b"")
        await done.wait()

    try:
        return await per_op(one, count, count // 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


SHARE = {"broker_gather5": 4, "broker_batched": BATCH}
"""Paths whose operation is several of the others: run ``count // share`` times."""

PATHS: dict[str, Callable[[int], Awaitable[float]]] = {
    "broker_roundtrip": broker_roundtrip,
    "broker_gather5": broker_gather5,
    "broker_batched": broker_batched,
    "agent_message": agent_message,
    "client_request": client_request,
    "raw_loop": raw_loop,
}


async def measure(count: int, repetitions: int = 5) -> dict[str, float]:
    """Microseconds of Python per operation of each path, the least of ``repetitions``."""
    runs: dict[str, list[float]] = {name: [] for name in PATHS}
    for _ in range(repetitions):
        for name, path in PATHS.items():
            # (a gather to five is a few roundtrips' work: a quarter as many of them; a
            # batch is a hundred messages: a hundredth as many)
            runs[name].append(await path(max(count // SHARE.get(name, 1), 10)))
    return {f"{name}_us": round(min(values), 2) for name, values in runs.items()}


PROFILES = Path(__file__).resolve().parent / "results" / "profiles"


async def profile(name: str, count: int) -> Any:
    """One run of path ``name`` under pyinstrument, after one to warm it: the profiler that
    watched it (:func:`save_profile`)."""
    from pyinstrument import Profiler

    path = PATHS[name]
    count = max(count // SHARE.get(name, 1), 10)
    await path(count)
    profiler = Profiler(interval=0.0001, async_mode="enabled")
    profiler.start()
    await path(count)
    profiler.stop()
    return profiler


def save_profile(profiler: Any, name: str, folder: Path) -> tuple[str, Path]:
    """A path's profile: its call tree as text, and the page to browse it in
    (``hotpath.NAME.html`` in ``folder``), written."""
    folder.mkdir(parents=True, exist_ok=True)
    page = folder / f"hotpath.{name}.html"
    page.write_text(profiler.output_html())
    return profiler.output_text(unicode=True, color=False), page


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hotpath", description=__doc__)
    parser.add_argument("--count", type=int, default=20_000, help="operations per run")
    parser.add_argument(
        "--repetitions", type=int, default=5, help="runs of each path; the least is kept"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--profile",
        choices=list(PATHS),
        metavar="PATH",
        help="instead, profile one path with pyinstrument: its call tree printed, and a page "
        f"to browse it in written to --profile-dir ({', '.join(PATHS)})",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        default=PROFILES,
        metavar="DIR",
        help="where --profile writes hotpath.PATH.html (default: benchmarks/results/profiles)",
    )
    args = parser.parse_args(argv)
    if args.count < 1 or args.repetitions < 1:
        parser.error("--count and --repetitions must be at least 1")
    if args.profile:
        profiler = await profile(args.profile, args.count)
        tree, page = await asyncio.to_thread(save_profile, profiler, args.profile, args.profile_dir)
        print(tree)
        print(f"wrote {page}")
        return 0
    figures = await measure(args.count, args.repetitions)
    if args.json:
        print(json.dumps(figures))
    else:
        for name, value in figures.items():
            print(f"{name:24s} {value:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_loop(main(sys.argv[1:])))

"""Benchmark agents: `python -m benchmarks.agents --broker ADDR --prefix echo --count N` serves
N echo agents, each on its own gRPC server, in this one process. With `--consume-only` they
are plain consumers instead (subscribe, acknowledge, never answer): the receiving end of
one-way traffic, so that one-way figures carry no answers back."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from mesh import Agent, AgentContext, Message, connect, serve, serve_all
from mesh.cli import _until_signalled
from mesh.client import ClientSubscription
from mesh.loop import run as run_loop


class EchoAgent(Agent):
    """Answers every REQUEST, HANDOFF and BROADCAST at once with what it was sent and the
    wall-clock time its handler got it (``received_at``, for a broadcast's delivery latency);
    messages whose action is "sink" are only consumed."""

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, object] | None:
        if message.action == "sink":
            return None
        return {
            "received_at": time.time(),
            "echo": (message.content or {}).get("parameters"),
            "recommendation": "Buy AAPL",
            "confidence": 0.8,
            "reasoning": self.agent_id,
        }


async def consume(args: argparse.Namespace, types: list[str]) -> None:
    clients = []
    tasks = []

    async def drain(sub: ClientSubscription) -> None:
        async for received in sub:
            await received.ack()

    for i in range(args.start, args.start + args.count):
        agent_id = f"{args.prefix}-{i}"
        client = connect(args.broker, agent_id=agent_id)
        await client.register(agent_id, agent_types=types)
        sub = client.subscribe(agent_id, max_in_flight=args.max_in_flight)
        await sub.start()
        clients.append(client)
        tasks.append(asyncio.create_task(drain(sub)))
    print(f"agents ready: {len(clients)}", flush=True)
    await _until_signalled()
    for task in tasks:
        task.cancel()
    for client in clients:
        await client.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--prefix", default="echo")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--types", default="bench")
    parser.add_argument("--max-in-flight", type=int, default=128)
    parser.add_argument("--consume-only", action="store_true")
    args = parser.parse_args()
    types = args.types.split(",")
    if args.consume_only:
        await consume(args, types)
        return
    agents = [
        EchoAgent(f"{args.prefix}-{i}", agent_types=types)
        for i in range(args.start, args.start + args.count)
    ]
    if os.environ.get("BENCH_CLIENT_PER_AGENT"):  # the shape before agents shared a stream
        served = [await serve(a, args.broker, max_in_flight=args.max_in_flight) for a in agents]
        stop = [s.stop(1.0) for s in served]
    else:
        group = await serve_all(agents, args.broker, max_in_flight=args.max_in_flight)
        stop = [group.stop(1.0)]
    print(f"agents ready: {len(agents)}", flush=True)
    await _until_signalled()
    for stopping in stop:
        await stopping


if __name__ == "__main__":
    run_loop(main())

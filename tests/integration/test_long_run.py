"""A mesh that runs for long keeps what it holds, not what passed through it."""

from __future__ import annotations

import gc

from mesh import AgentContext, Message, agent
from mesh.testing import LocalMesh

ROUNDS = 4
SENDS = 1000
REQUESTS = 200


def messages_alive() -> int:
    gc.collect()
    return sum(isinstance(o, Message) for o in gc.get_objects())


async def test_messages_that_passed_through_are_not_kept() -> None:
    """Sends consumed through a subscription, requests answered by an agent and broadcasts,
    4,800 messages in all, through the broker, its servicer, the SDK and the agent runtime
    in this process: what stays alive afterwards is bounded (the broker's heaps rebuild once
    half stale), not one per message (acked messages used to stay until their TTL ended)."""

    @agent("EchoAgent", agent_types=("echo",))
    async def echo(message: Message, ctx: AgentContext) -> dict[str, object]:
        return {"echo": message.parameters}

    async with LocalMesh() as local:
        await local.add_agent(echo)
        async with local.client("Driver") as client:
            await client.register("Sink")
            await client.register("Driver")  # (where the agent's answers to broadcasts go)
            subscription = client.subscribe("Sink", max_in_flight=32)
            await subscription.start()
            before = messages_alive()
            for _ in range(ROUNDS):
                for i in range(SENDS):
                    await client.send("Sink", {"action": "work", "parameters": {"i": i}})
                taken = 0
                async for delivery in subscription:
                    await delivery.ack()
                    taken += 1
                    if taken == SENDS:
                        break
                for i in range(REQUESTS):
                    answer = await client.request(
                        "EchoAgent", {"action": "x", "parameters": {"i": i}}
                    )
                    assert answer.content["echo"] == {"i": i}
                await client.broadcast({"action": "hello"}, agent_types=["echo"])
                assert len(await client.receive("Driver")) <= 1
            await subscription.close()
            assert messages_alive() - before < 1500

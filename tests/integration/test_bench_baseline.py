"""The benchmark's physical-limit servers (raw grpc.aio, no mesh): the echo and the two-hop
relay give back what they were sent; the fan-out sends each frame to every upstream and
answers with each one's wall-clock time of receipt, in upstream order; the raw agent and driver
do a roundtrip through the real broker."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from benchmarks.baseline import (
    ContractClient,
    StreamClient,
    handler_for,
    serve_raw_agent,
    stamps,
    start,
)
from mesh.testing import LocalMesh
from mesh.v1 import broker_pb2, message_pb2


async def until_ready(ready: asyncio.Event, agents: list[asyncio.Task[None]]) -> None:
    """Waits (10 s at most) for the raw agents to say they are subscribed; one that ended
    before, failing, says why instead of a bare timeout."""
    waiting = asyncio.create_task(ready.wait())
    first = asyncio.FIRST_COMPLETED
    done, _ = await asyncio.wait([waiting, *agents], timeout=10, return_when=first)
    if waiting not in done:
        waiting.cancel()
        for agent in done:
            agent.result()  # (raises what stopped it)
        raise AssertionError(f"the raw agents were not subscribed within 10 s: {agents}")


async def test_the_relay_gives_back_what_the_echo_was_sent() -> None:
    echo, echo_address = await start(handler_for("echo", []))
    relay, relay_address = await start(handler_for("relay", [echo_address]))
    client = StreamClient(relay_address)
    try:
        assert [await client.roundtrip(f"frame {i}".encode()) for i in range(3)] == [
            b"frame 0",
            b"frame 1",
            b"frame 2",
        ]
    finally:
        await client.close()
        await relay.stop(0)
        await echo.stop(0)


async def test_the_fanout_answers_with_the_time_each_upstream_got_the_frame() -> None:
    stampers = [await start(handler_for("echo", [], stamp=True)) for _ in range(3)]
    servers: list[grpc.aio.Server] = [server for server, _ in stampers]
    fanout, address = await start(handler_for("fanout", [a for _, a in stampers]))
    servers.append(fanout)
    client = StreamClient(address)
    try:
        for _ in range(3):
            before = time.time()
            times = stamps(await client.roundtrip(b"payload"))
            after = time.time()
            assert len(times) == 3
            assert all(before <= t <= after for t in times)
    finally:
        await client.close()
        for server in servers:
            await server.stop(0)


async def test_the_contract_relay_answers_each_request_frame_as_a_broker_would() -> None:
    """The relay speaking the mesh's frames: a request frame goes to the echo as a delivery,
    and comes back as the response frame of the same seq, a RESPONSE correlated to it."""
    echo, echo_address = await start(handler_for("echo", [], contract=True))
    relay, relay_address = await start(handler_for("relay", [echo_address], contract=True))
    client = StreamClient(relay_address)
    try:
        for seq in (1, 2, 7):
            frame = broker_pb2.ConnectRequest(seq=seq)
            message = frame.request.message
            message.message_id, message.from_agent, message.to_agent = f"m{seq}", "driver", "echo"
            message.content.update({"action": "ping", "n": seq})
            answer = broker_pb2.ConnectResponse.FromString(
                await client.roundtrip(frame.SerializeToString())
            )
            assert answer.seq == seq
            assert answer.WhichOneof("frame") == "response"
            response = answer.response
            assert response.message_type == message_pb2.MESSAGE_TYPE_RESPONSE
            assert response.correlation_id == f"m{seq}"
            assert (response.from_agent, response.to_agent) == ("echo", "driver")
            assert dict(response.content) == {"action": "ping", "n": seq}
    finally:
        await client.close()
        await relay.stop(0)
        await echo.stop(0)


async def test_the_raw_agent_and_driver_do_a_roundtrip_through_the_real_broker(
    mesh: LocalMesh,
) -> None:
    """The ends of `roundtrip_raw_ends`: an agent and a driver in raw grpc.aio on the contract
    alone. Each request comes back as the RESPONSE correlated to it, and the answer settles the
    delivery (nothing is left for redelivery)."""
    ready = asyncio.Event()
    agent = asyncio.create_task(serve_raw_agent(mesh.address, "raw-0", ready.set))
    await until_ready(ready, [agent])
    driver = ContractClient(mesh.address)
    try:
        for n in range(3):
            request = message_pb2.Message(from_agent="raw-driver", to_agent="raw-0")
            request.content.update({"action": "ping", "n": n})
            response = await asyncio.wait_for(driver.request(request), 10)
            assert response.message_type == message_pb2.MESSAGE_TYPE_RESPONSE
            assert (response.from_agent, response.to_agent) == ("raw-0", "raw-driver")
            assert response.correlation_id  # the id the broker gave the request
            content = dict(response.content)
            assert content.pop("received_at") > 0  # when the agent read it
            assert content == {"action": "ping", "n": n}
        view = (await mesh.client().queue_stats("raw-0")).for_agent("raw-0")
        assert view is not None
        assert (view.depth, view.in_flight, view.dead_letters, view.subscribers) == (0, 0, 0, 1)
    finally:
        await driver.close()
        agent.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await agent


async def test_raw_agents_of_a_type_answer_a_raw_gather_with_the_time_they_had_it(
    mesh: LocalMesh,
) -> None:
    """The ends of `broadcast5_raw_ends`: a gather to the agents of a type reaches every raw
    agent of it, and each answers with the wall-clock time it read its copy."""
    ready = asyncio.Event()
    count = 0

    def one_ready() -> None:
        nonlocal count
        count += 1
        if count == 3:
            ready.set()

    agents = [
        asyncio.create_task(serve_raw_agent(mesh.address, f"rawb-{i}", one_ready, ("rawb",)))
        for i in range(3)
    ]
    await until_ready(ready, agents)
    driver = ContractClient(mesh.address)
    try:
        asked = message_pb2.Message(from_agent="raw-driver")
        asked.content.update({"query": "q"})
        before = time.time()
        answers = await asyncio.wait_for(driver.gather(asked, ["rawb"]), 10)
        after = time.time()
        assert sorted(a.from_agent for a in answers) == ["rawb-0", "rawb-1", "rawb-2"]
        for answer in answers:
            assert answer.message_type == message_pb2.MESSAGE_TYPE_RESPONSE
            assert before <= answer.content.fields["received_at"].number_value <= after
            assert answer.content.fields["query"].string_value == "q"
    finally:
        await driver.close()
        for agent in agents:
            agent.cancel()
        await asyncio.gather(*agents, return_exceptions=True)


async def test_a_raw_agent_reaches_a_broker_on_a_port_another_channel_backs_off_from() -> None:
    """The raw ends keep their connections to themselves, as the mesh's clients do: a raw
    agent made as a broker comes up on a port that another channel of the process still backs
    off from (its server gone; in a test process, the kernel gives its port to the next
    server) reaches that broker (it failed at once, "connection refused": in gRPC's
    process-wide pool the two channels shared one connection, and its backoff)."""
    from mesh.config import ServerConfig
    from mesh.server import serve_broker
    from tests.helpers.processes import free_port

    port = free_port()
    address = f"127.0.0.1:{port}"
    _, server = await serve_broker(server_config=ServerConfig(port=port))
    async with grpc.aio.insecure_channel(address) as older:
        await older.channel_ready()
        await server.stop(0)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await older.unary_unary("/mesh.v1.BrokerService/ListAgents")(b"", timeout=1)
        await asyncio.sleep(1.0)  # (its connection backs off meanwhile)
        _, server = await serve_broker(server_config=ServerConfig(port=port))
        ready = asyncio.Event()
        agent = asyncio.create_task(serve_raw_agent(address, "rawlate", ready.set, ("late",)))
        try:
            await until_ready(ready, [agent])
        finally:
            agent.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await agent
            await server.stop(0)

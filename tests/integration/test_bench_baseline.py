"""The benchmark's physical-limit servers (raw grpc.aio, no mesh): the echo and the two-hop
relay give back what they were sent; the fan-out sends each frame to every upstream and
answers with each one's wall-clock time of receipt, in upstream order."""

from __future__ import annotations

import time

import grpc

from benchmarks.baseline import StreamClient, handler_for, stamps, start
from mesh.v1 import broker_pb2, message_pb2


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

"""Numbers the contract does not define for message_type or priority (a client built from a
newer or a mistaken .proto), timestamps out of a Timestamp's range and negative timeouts are
refused with INVALID_ARGUMENT naming the field, on every path a message enters by; the other
messages of a batch go on. Unset values keep their defaults."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from grpc_status import rpc_status

from mesh import Agent, AgentClient, AgentContext, Message, MessageValidationError, on
from mesh.core.tools import Tool, ToolHost
from mesh.testing import LocalMesh
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2, tools_pb2, tools_pb2_grpc


def envelope(action: str, **fields: int) -> message_pb2.Message:
    pb = message_pb2.Message(from_agent="sender", to_agent="Sink", **fields)
    pb.content.update({"action": action})
    return pb


async def answered(call: Any, *frames: broker_pb2.ConnectRequest) -> dict[int, Any]:
    """Writes ``frames`` on a Connect session and reads until each has its answer, by seq."""
    for frame in frames:
        await call.write(frame)
    answers = {}
    while len(answers) < len(frames):
        frame = await asyncio.wait_for(call.read(), 10)
        for one in frame.batch.frames if frame.WhichOneof("frame") == "batch" else [frame]:
            answers[one.seq] = one
    return answers


def bad_request_fields(error: grpc.aio.AioRpcError) -> list[str]:
    from google.rpc import error_details_pb2

    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    fields = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return fields


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"priority": 7}, ["priority"]), ({"message_type": 42}, ["message_type"])],
)
async def test_send_message_refuses_an_undefined_number(
    mesh: LocalMesh, fields: dict[str, int], named: list[str]
) -> None:
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id="Sink"))
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SendMessage(broker_pb2.SendMessageRequest(message=envelope("x", **fields)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not defined (known:" in (info.value.details() or "")
        assert bad_request_fields(info.value) == named
        # Unset, they are REQUEST and MEDIUM.
        sent = await stub.SendMessage(broker_pb2.SendMessageRequest(message=envelope("ok")))
        assert sent.message.message_type == message_pb2.MESSAGE_TYPE_REQUEST
        assert sent.message.priority == message_pb2.PRIORITY_MEDIUM
        received = await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="Sink"))
        assert [m.content["action"] for m in received.messages] == ["ok"]


async def test_an_unset_type_to_broadcast_is_a_broadcast(mesh: LocalMesh) -> None:
    """RF-009 scenario 3 as a plain gRPC client writes it: to "broadcast", an alert with no
    action and no type; every other agent gets a BROADCAST copy."""
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        for name in ("Flight", "Hotel", "Orchestrator"):
            await stub.RegisterAgent(
                broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id=name))
            )
        alert = message_pb2.Message(from_agent="Orchestrator", to_agent="broadcast")
        alert.content.update({"alert": "System maintenance in 10 minutes"})
        sent = await stub.SendMessage(broker_pb2.SendMessageRequest(message=alert))
        assert sent.message.message_type == message_pb2.MESSAGE_TYPE_BROADCAST
        assert sorted(sent.recipients) == ["Flight", "Hotel"]
        for name in ("Flight", "Hotel"):
            got = await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id=name))
            [copy] = got.messages
            assert copy.message_type == message_pb2.MESSAGE_TYPE_BROADCAST
            assert copy.to_agent == name and copy.message_id == sent.message.message_id


async def test_a_batch_refuses_only_its_undefined_message(mesh: LocalMesh) -> None:
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id="Sink"))
        )
        batch = broker_pb2.SendMessagesRequest(
            messages=[
                envelope("first", priority=message_pb2.PRIORITY_HIGH),
                envelope("odd", priority=9),
                envelope("last"),
            ]
        )
        batch.messages[1].message_id = "odd-1"
        answer = await stub.SendMessages(batch)
        outcomes = [(r.message_id, r.error.code) for r in answer.results]
        assert outcomes[1] == ("odd-1", grpc.StatusCode.INVALID_ARGUMENT.value[0])
        assert outcomes[0][1] == outcomes[2][1] == 0
        assert [v.field for v in answer.results[1].error.field_violations] == ["priority"]
        received = await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="Sink"))
        assert [m.content["action"] for m in received.messages] == ["first", "last"]
        assert mesh.broker is not None
        assert mesh.broker.metrics.totals.validation_errors == 1  # counted with the others


async def test_a_connect_frame_with_an_undefined_number_is_answered_and_the_stream_goes_on(
    mesh: LocalMesh,
) -> None:
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id="Sink"))
        )
        call = stub.Connect()
        odd = broker_pb2.ConnectRequest(seq=1)
        odd.send.CopyFrom(envelope("odd", message_type=99))
        good = broker_pb2.ConnectRequest(seq=2)
        good.send.CopyFrom(envelope("good"))
        answers = await answered(call, odd, good)
        assert answers[1].WhichOneof("frame") == "error"
        assert answers[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert [v.field for v in answers[1].error.field_violations] == ["message_type"]
        assert answers[2].WhichOneof("frame") == "accepted"
        await call.done_writing()
        received = await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="Sink"))
        assert [m.content["action"] for m in received.messages] == ["good"]


async def test_a_gather_with_an_undefined_number_is_refused_on_both_paths(mesh: LocalMesh) -> None:
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id="Sink"))
        )
        request = broker_pb2.GatherRequest(message=envelope("poll", priority=7))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Gather(request):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_fields(info.value) == ["priority"]
        # On a session: that frame is answered with the error, the session goes on.
        call = stub.Connect()
        frame = broker_pb2.ConnectRequest(seq=5)
        frame.gather.CopyFrom(request)
        await call.write(frame)
        answer = await asyncio.wait_for(call.read(), 10)
        assert (answer.seq, answer.WhichOneof("frame")) == (5, "error")
        assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF


async def test_a_timestamp_out_of_its_range_is_refused_naming_it(mesh: LocalMesh) -> None:
    """Before year 1 or after 9999 (what google.protobuf.Timestamp allows): INVALID_ARGUMENT,
    not an internal error; the batch's other messages go on."""
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id="Sink"))
        )
        late = envelope("late")
        late.timestamp.seconds = 253_402_300_800  # 10000-01-01T00:00:00Z
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SendMessage(broker_pb2.SendMessageRequest(message=late))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "timestamp must be from 0001-01-01T00:00:00Z" in (info.value.details() or "")
        assert bad_request_fields(info.value) == ["timestamp"]
        early = envelope("early")
        early.timestamp.nanos = -1
        batch = await stub.SendMessages(
            broker_pb2.SendMessagesRequest(messages=[early, envelope("ok")])
        )
        assert [r.HasField("error") for r in batch.results] == [True, False]
        assert batch.results[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        received = await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="Sink"))
        assert [m.content["action"] for m in received.messages] == ["ok"]


async def test_nan_or_infinity_in_json_is_refused_so_json_readers_can_read_the_queue(
    mesh: LocalMesh,
) -> None:
    """A client not using the SDK can put NaN in a Struct; a reader of JSON (grpcurl, buf curl)
    then failed on the whole ReceiveMessages answer, every message it had taken off the queue
    with it. Refused at the door, naming where it is; the queue stays readable as JSON."""
    from google.protobuf import json_format

    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id="Sink"))
        )
        await stub.SendMessage(broker_pb2.SendMessageRequest(message=envelope("before")))
        bad = envelope("nan")
        bad.content.fields["scores"].list_value.values.add().number_value = float("nan")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SendMessage(broker_pb2.SendMessageRequest(message=bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "message.content.scores.0 is NaN or Infinity" in (info.value.details() or "")
        stats = await stub.GetQueueStats(broker_pb2.GetQueueStatsRequest())
        assert stats.totals.validation_errors == 1  # counted with the other refusals
        received = await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="Sink"))
    as_json = json.loads(json_format.MessageToJson(received))
    assert [m["content"]["action"] for m in as_json["messages"]] == ["before"]


async def test_a_negative_timeout_is_refused_on_every_path_that_takes_one() -> None:
    """A Duration of -1 s is the caller's mistake, not a deadline that passed: INVALID_ARGUMENT
    naming `timeout` from a gather (unary and on a session), a session's request and a tool
    call; nothing is queued, and the session goes on."""

    async def count(arguments: dict[str, object]) -> int:
        return len(arguments)

    tools = ToolHost([Tool("count", "counts its arguments", count)], {"Sink": ["count"]})
    async with (
        LocalMesh(tool_host=tools) as mesh,
        grpc.aio.insecure_channel(mesh.address) as channel,
    ):
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id="Sink"))
        )
        minus_one = duration_pb2.Duration(seconds=-1)
        gather = broker_pb2.GatherRequest(message=envelope("poll"), timeout=minus_one)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Gather(gather):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_fields(info.value) == ["timeout"]
        assert "timeout must not be negative" in (info.value.details() or "")

        call = stub.Connect()
        asked = broker_pb2.ConnectRequest(seq=1)
        asked.request.message.CopyFrom(envelope("ask"))
        asked.request.timeout.CopyFrom(minus_one)
        gathered = broker_pb2.ConnectRequest(seq=2, gather=gather)
        sent = broker_pb2.ConnectRequest(seq=3, send=envelope("kept"))
        answers = await answered(call, asked, gathered, sent)
        for seq in (1, 2):
            assert answers[seq].WhichOneof("frame") == "error"
            assert answers[seq].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert [v.field for v in answers[seq].error.field_violations] == ["timeout"]
        assert answers[3].WhichOneof("frame") == "accepted"
        await call.done_writing()

        tool = tools_pb2_grpc.ToolServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await tool.InvokeTool(
                tools_pb2.InvokeToolRequest(agent_id="Sink", tool="count", timeout=minus_one)
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_fields(info.value) == ["timeout"]
        done = await tool.InvokeTool(tools_pb2.InvokeToolRequest(agent_id="Sink", tool="count"))
        assert done.result.number_value == 0

        received = await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="Sink"))
        assert [m.content["action"] for m in received.messages] == ["kept"]


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf")])
async def test_the_sdk_refuses_a_timeout_that_is_no_time_before_sending(timeout: float) -> None:
    """A request, a gather, a tool call or a call on an agent's own server with a negative
    or non-finite timeout raises MessageValidationError naming it (NaN and infinity failed
    in the Duration's arithmetic); nothing is sent."""
    tools = ToolHost([Tool("count", "counts its arguments", _count)], {"asker": ["count"]})
    async with LocalMesh(tool_host=tools) as mesh:
        served = await mesh.add_agent(Quiet())
        async with mesh.client("asker") as client:
            calls = [
                lambda: client.request("Sink", {"action": "ask"}, timeout=timeout),
                lambda: anext(aiter(client.gather({"action": "poll"}, timeout=timeout))),
                lambda: client.call_tool("count", timeout=timeout),
            ]
            async with AgentClient(served.address) as direct:
                calls.append(lambda: direct.describe(timeout=timeout))
                for call in calls:
                    with pytest.raises(MessageValidationError, match="timeout must be a finite"):
                        await call()
            assert (await client.queue_stats()).totals["sent_count"] == 0
            assert await client.call_tool("count", {"a": 1}) == 1


async def _count(arguments: dict[str, object]) -> int:
    return len(arguments)


class Quiet(Agent):
    agent_id = "Sink"

    @on("ask")
    async def ask(self, message: Message, ctx: AgentContext) -> dict[str, str]:
        return {"answer": "yes"}

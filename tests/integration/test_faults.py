"""A fault of a server's own (a bug) as it serves a call: logged with its traceback, the caller
answered INTERNAL "internal error" (a Subscribe stream's delivery: UNAVAILABLE, "subscribe
again") and told nothing of the fault (gRPC itself would send the exception's text, as
UNKNOWN), what the call held given back. On a Connect session only the
frame that met the fault fails: the session, and every subscription and request it carries,
goes on. The faults are made by patching one function of the broker to raise."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest

from mesh import LocalMesh, MeshError, codec
from mesh.core.broker import Broker
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2

SECRET = "the fault's own text, /etc/agentmesh/credentials"


def fault(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(SECRET)


def faults_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The ERROR records with a traceback the mesh's loggers wrote."""
    return [
        r
        for r in caplog.records
        if r.name.startswith("mesh") and r.levelname == "ERROR" and r.exc_info is not None
    ]


async def test_a_fault_in_a_streaming_call_is_answered_without_its_text_and_loses_nothing(
    mesh: LocalMesh, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A streaming call that meets a fault is answered INTERNAL "internal error"; a Subscribe
    stream whose delivery meets one ends UNAVAILABLE instead, "subscribe again", as a
    session's subscription does. Neither says the fault's text, both log it with its
    traceback, and the message the subscription held is back in the queue."""
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        await stub.RegisterAgent(
            broker_pb2.RegisterAgentRequest(agent=message_pb2.AgentInfo(agent_id="Payment"))
        )
        sent = message_pb2.Message(from_agent="Flight", to_agent="Payment")
        sent.content.update({"action": "pay"})
        await stub.SendMessage(broker_pb2.SendMessageRequest(message=sent))
        with monkeypatch.context() as patched:
            patched.setattr(codec, "delivery_to_pb", fault)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Subscribe(broker_pb2.SubscribeRequest(agent_id="Payment")):
                    pass
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == (
            "the broker failed to deliver Payment's messages: subscribe again"
        )
        [logged] = faults_logged(caplog)
        assert logged.getMessage() == "the deliveries to Payment failed"
        assert SECRET in str(logged.exc_info[1] if logged.exc_info else "")
        # The message the subscription held is back in the queue.
        received = await stub.ReceiveMessages(broker_pb2.ReceiveMessagesRequest(agent_id="Payment"))
        assert [dict(m.content) for m in received.messages] == [{"action": "pay"}]
        caplog.clear()
        with monkeypatch.context() as patched:
            patched.setattr(Broker, "gather", fault)
            asked = message_pb2.Message(from_agent="Flight", to_agent="broadcast")
            asked.content.update({"action": "quote"})
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Gather(
                    broker_pb2.GatherRequest(message=asked, agent_ids=["Payment"])
                ):
                    pass
        assert refused.value.code() == grpc.StatusCode.INTERNAL
        assert refused.value.details() == "internal error"
        [logged] = faults_logged(caplog)
        assert logged.getMessage() == "/mesh.v1.BrokerService/Gather failed"
        assert SECRET in str(logged.exc_info[1] if logged.exc_info else "")


async def test_a_fault_serving_a_session_frame_fails_that_frame_alone(
    mesh: LocalMesh, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with mesh.client("Payment") as payment, mesh.client("Flight") as flight:
        await payment.register()
        session = await payment._open_session()
        async with payment.subscribe() as inbox:
            with monkeypatch.context() as patched:
                patched.setattr(Broker, "receive", fault)
                with pytest.raises(MeshError) as refused:
                    await payment.receive()
            assert (refused.value.code, refused.value.message) == ("INTERNAL", "internal error")
            [logged] = faults_logged(caplog)
            assert logged.getMessage() == "a session's receive frame failed"
            # The same session goes on: its subscription delivers, its calls are answered.
            assert await payment._open_session() is session and not session.closed
            await flight.send("Payment", {"action": "pay"})
            async for delivery in inbox:
                assert delivery.message.content == {"action": "pay"}
                await delivery.ack()
                break
            assert await payment.receive() == []

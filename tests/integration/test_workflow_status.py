"""RT-011's hand-off protocol keeps each workflow's status in the shared state: every hand-off
that names its workflow writes ``workflow/<workflow_id>`` (the agent that has it now, the step,
who handed it on), read by any client through the MemoryService; and entries written with a
ttl lapse."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from google.protobuf import json_format

from mesh import AgentContext, ChangeKind, LocalMesh, Message, MessageValidationError, agent
from mesh.config import BrokerConfig
from mesh.v1 import broker_pb2, broker_pb2_grpc, memory_pb2, memory_pb2_grpc, message_pb2


async def status_of(mesh: LocalMesh, workflow_id: str) -> memory_pb2.StateEntry | None:
    """The workflow's entry as a plain gRPC client reads it (None: NOT_FOUND)."""
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        try:
            found = await stub.GetState(memory_pb2.GetStateRequest(key=f"workflow/{workflow_id}"))
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND
            return None
        return found.entry


async def test_each_hand_off_moves_the_workflow_status_on() -> None:
    async with LocalMesh() as mesh, mesh.client("CustomerAgent") as customer:
        for agent_id in ("SellerAgent", "PaymentAgent", "NotificationAgent"):
            await customer.register(agent_id)
        await customer.handoff(
            "SellerAgent", "Approve refund for order 12345", workflow_id="wf-refund", step_number=1
        )
        first = await status_of(mesh, "wf-refund")
        assert first is not None and first.version == 1 and first.updated_by == "CustomerAgent"
        seller = mesh.client("SellerAgent")
        async with seller:
            sent = await seller.handoff(
                "PaymentAgent", "Refund 50 EUR", workflow_id="wf-refund", step_number=2
            )
        entry = await status_of(mesh, "wf-refund")
        assert entry is not None
        assert json_format.MessageToDict(entry.value) == {
            "workflow_id": "wf-refund",
            "status": "IN_PROGRESS",
            "current_agent": "PaymentAgent",
            "step": 2,
            "from_agent": "SellerAgent",
            "task_description": "Refund 50 EUR",
            "message_id": sent.message_id,
            "handed_off_at": sent.timestamp.isoformat(),
        }
        assert entry.version == 2 and entry.updated_by == "SellerAgent"  # one per hand-off
        lapses = entry.expires_at.ToDatetime(tzinfo=UTC) - datetime.now(UTC)
        assert timedelta(hours=23, minutes=59) < lapses <= timedelta(days=1)
        # A hand-off of an earlier step (one sent again late) leaves the status as it is.
        await customer.handoff(
            "SellerAgent", "Approve refund for order 12345", workflow_id="wf-refund", step_number=1
        )
        again = await status_of(mesh, "wf-refund")
        assert again is not None and again.version == 2
        assert json_format.MessageToDict(again.value)["current_agent"] == "PaymentAgent"
        # The SDK reads it as any entry; a hand-off without a workflow records nothing.
        via_sdk = await customer.get_state("workflow/wf-refund")
        assert via_sdk is not None and via_sdk.value["step"] == 2
        assert via_sdk.expires_at is not None
        await customer.handoff("SellerAgent", "No workflow named")
        assert await status_of(mesh, "") is None
        # Every hand-off was delivered, recorded or not.
        assert len(await customer.receive("SellerAgent")) == 3
        assert len(await customer.receive("PaymentAgent")) == 1


async def test_a_status_that_cannot_be_written_never_stops_the_hand_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="mesh.broker")
    async with LocalMesh() as mesh, mesh.client("CustomerAgent") as customer:
        await customer.register("SellerAgent")
        await customer.lock_state("workflow/wf-locked", lease=30)
        await customer.handoff("SellerAgent", "Approve", workflow_id="wf-locked", step_number=1)
        [delivered] = await customer.receive("SellerAgent")
        assert delivered.handoff is not None and delivered.handoff.workflow_id == "wf-locked"
        assert await status_of(mesh, "wf-locked") is None
        [warned] = [
            r
            for r in caplog.records
            if getattr(r, "event", {}).get("category") == "workflow_status"
        ]
        assert (
            "wf-locked" in warned.getMessage()
            and "locked by CustomerAgent" in warned.event["error"]
        )


async def test_the_status_lapses_after_its_ttl_or_is_not_kept_at_all() -> None:
    brief = BrokerConfig(workflow_status_ttl=0.3)
    async with LocalMesh(brief) as mesh, mesh.client("CustomerAgent") as customer:
        await customer.register("SellerAgent")
        await customer.handoff("SellerAgent", "Approve", workflow_id="wf-brief", step_number=1)
        assert await status_of(mesh, "wf-brief") is not None
        await asyncio.sleep(0.5)
        assert await status_of(mesh, "wf-brief") is None
    none = BrokerConfig(workflow_status_ttl=0)
    async with LocalMesh(none) as mesh, mesh.client("CustomerAgent") as customer:
        await customer.register("SellerAgent")
        await customer.handoff("SellerAgent", "Approve", workflow_id="wf-none", step_number=1)
        assert await status_of(mesh, "wf-none") is None
        assert len(await customer.receive("SellerAgent")) == 1


async def test_a_plain_client_writes_an_entry_that_lapses() -> None:
    async with LocalMesh() as mesh, grpc.aio.insecure_channel(mesh.address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        put = memory_pb2.PutStateRequest(key="lease/printer", agent_id="A")
        put.value.string_value = "busy"
        put.ttl.FromMilliseconds(300)
        written = (await stub.PutState(put)).entry
        assert written.HasField("expires_at")
        assert written.expires_at.ToDatetime() > written.updated_at.ToDatetime()
        read = (await stub.GetState(memory_pb2.GetStateRequest(key="lease/printer"))).entry
        assert read.expires_at == written.expires_at and read.value.string_value == "busy"
        await asyncio.sleep(0.5)
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.GetState(memory_pb2.GetStateRequest(key="lease/printer"))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        never = memory_pb2.PutStateRequest(key="lease/printer", agent_id="A")
        never.value.string_value = "free"
        assert not (await stub.PutState(never)).entry.HasField("expires_at")
        bad = memory_pb2.PutStateRequest(key="lease/printer", agent_id="A")
        bad.value.string_value = "x"
        bad.ttl.FromSeconds(0)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.PutState(bad)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ttl must be above 0" in (refused.value.details() or "")


async def test_the_last_agent_of_a_workflow_its_agents_run_ends_it() -> None:
    """A refund handed on from agent to agent, with no gateway: the last agent ends the
    workflow from its handler, and its status says COMPLETED, or FAILED at that step and why
    (RF-010 scenario 10), with the time it finished, keeping what the hand-offs wrote."""

    @agent("WfSeller")
    async def seller(message: Message, ctx: AgentContext) -> None:
        if message.handoff:
            await ctx.handoff("WfPayment", "Refund", context=message.handoff.context)

    @agent("WfPayment")
    async def payment(message: Message, ctx: AgentContext) -> None:
        if message.handoff and message.handoff.context["amount"] > 100:
            await ctx.end_workflow(error_reason="Payment failed")
        elif message.handoff:
            await ctx.end_workflow()

    async with LocalMesh() as mesh:
        await mesh.add_agent(seller)
        await mesh.add_agent(payment)
        customer = mesh.client("WfCustomer")
        changes = customer.watch_state("workflow/wf_end_")
        assert (await anext(changes)).kind is ChangeKind.SYNCED
        for workflow_id, amount in (("wf_end_ok", 50), ("wf_end_bad", 500)):
            await customer.handoff(
                "WfSeller", "Refund", context={"amount": amount}, workflow_id=workflow_id
            )
        ended = {}
        async with asyncio.timeout(10):
            async for change in changes:
                assert change.entry is not None
                if change.entry.value["status"] != "IN_PROGRESS":
                    ended[change.entry.key] = change.entry
                    if len(ended) == 2:
                        break
        await changes.aclose()
        ok, bad = ended["workflow/wf_end_ok"], ended["workflow/wf_end_bad"]
        assert ok.updated_by == "WfPayment" and ok.version == 3  # two hand-offs, the ending
        assert {k: ok.value[k] for k in ("status", "current_agent", "step", "from_agent")} == {
            "status": "COMPLETED",
            "current_agent": "WfPayment",
            "step": 2,
            "from_agent": "WfSeller",
        }
        finished = datetime.fromisoformat(str(ok.value["finished_at"]))
        assert abs(datetime.now(UTC) - finished) < timedelta(seconds=10)
        assert "failed_at_step" not in ok.value and ok.expires_at is not None  # (its ttl kept)
        assert {k: bad.value[k] for k in ("status", "failed_at_step", "error_reason")} == {
            "status": "FAILED",
            "failed_at_step": 2,
            "error_reason": "Payment failed",
        }
        # A workflow no hand-off named has no status to end; a mistake is refused before
        # anything is written.
        assert await customer.end_workflow("wf_never_handed_off") is None
        with pytest.raises(MessageValidationError, match="COMPLETED or FAILED"):
            await customer.end_workflow("wf_end_ok", "DONE")
        with pytest.raises(MessageValidationError, match="workflow_id is required"):
            await customer.end_workflow("")
        assert (await customer.get_state("workflow/wf_end_ok")) == ok
        # Ended again, COMPLETED over FAILED: the failure is no longer the workflow's.
        again = await customer.end_workflow("wf_end_bad")
        assert again is not None and again.value["status"] == "COMPLETED"
        assert "failed_at_step" not in again.value and "error_reason" not in again.value


async def test_a_hand_off_naming_a_workflow_its_status_cannot_be_kept_for_is_refused() -> None:
    """A workflow id whose status key would pass the shared state's 256 characters: the
    hand-off went on and its status was never recorded (a warning in the broker's log); now
    refused, on a session and on the Handoff RPC alike, naming the field, and nothing sent."""
    async with LocalMesh() as mesh, mesh.client("CustomerAgent") as customer:
        await customer.register("SellerAgent")
        too_long = "w" * 248
        with pytest.raises(MessageValidationError, match="at most 247 characters") as info:
            await customer.handoff("SellerAgent", "Approve refund", workflow_id=too_long)
        assert [v.field for v in info.value.field_violations] == ["metadata.workflow_id"]
        async with grpc.aio.insecure_channel(mesh.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            request = broker_pb2.HandoffRequest(
                from_agent="CustomerAgent",
                to_agent="SellerAgent",
                handoff=message_pb2.Handoff(task_description="Approve", workflow_id="wf\n1"),
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Handoff(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "workflow_id must be printable" in (refused.value.details() or "")
        seller = (await customer.queue_stats("SellerAgent")).for_agent("SellerAgent")
        assert seller is not None and seller.depth == 0
        await customer.handoff("SellerAgent", "Approve refund", workflow_id=too_long[:-1])
        assert await status_of(mesh, too_long[:-1]) is not None

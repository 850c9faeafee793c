"""A workflow's status in the shared state: moved on by each hand-off, its ending added by
whoever ran it (RF-010 scenario 10's status, failed_at_step and error_reason), never made for a
workflow whose hand-offs were not recorded."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gateway.dispatch import BrokerDispatcher
from gateway.patterns.group_chat import GroupChatSpec
from gateway.patterns.handoff import WorkflowSpec, WorkflowStep
from mesh.config import BrokerConfig
from mesh.core.broker import Broker
from mesh.core.errors import MessageValidationError
from mesh.core.model import AgentInfo, Message, MessageType
from mesh.core.state import SharedState
from mesh.core.validation import message_violations
from mesh.core.workflows import (
    MAX_WORKFLOW_ID,
    ended,
    key_of,
    record_ending,
    record_hand_off,
    workflow_id_problem,
)


def hand_off(to_agent: str, step: int, workflow_id: str = "wf_1", hop: int = 0) -> Message:
    return Message(
        from_agent="Seller",
        to_agent=to_agent,
        message_type=MessageType.HANDOFF,
        content={"action": "execute_handoff", "parameters": {"task_description": "Refund"}},
        metadata={
            "workflow_id": workflow_id,
            "handoff_step": step,
            **({"hop": hop} if hop else {}),
        },
    )


async def test_a_workflow_gone_back_to_an_earlier_step_moves_its_status_by_hop() -> None:
    """The gateway counts its hand-offs: a reviewer that sends the work back to step 1 makes
    the writer current again; a late hand-off, by that count, still does not."""
    state = SharedState()
    await record_hand_off(state, hand_off("Writer", 1, hop=1), ttl=3600)
    await record_hand_off(state, hand_off("Reviewer", 2, hop=2), ttl=3600)
    await record_hand_off(state, hand_off("Writer", 1, hop=3), ttl=3600)
    status = await state.get(key_of("wf_1"))
    assert (status.value["current_agent"], status.value["step"]) == ("Writer", 1)
    await record_hand_off(state, hand_off("Reviewer", 2, hop=2), ttl=3600)  # late
    assert (await state.get(key_of("wf_1"))).value["current_agent"] == "Writer"
    # Without a count (agents handing off by themselves), the step decides, as before.
    await record_hand_off(state, hand_off("Writer", 1, "wf_2"), ttl=3600)
    await record_hand_off(state, hand_off("Reviewer", 2, "wf_2"), ttl=3600)
    await record_hand_off(state, hand_off("Writer", 1, "wf_2"), ttl=3600)
    assert (await state.get(key_of("wf_2"))).value["current_agent"] == "Reviewer"


async def test_an_ending_is_added_to_the_status_the_hand_offs_left() -> None:
    state = SharedState()
    await record_hand_off(state, hand_off("Payment", 2), ttl=3600)
    await record_hand_off(state, hand_off("Notification", 3), ttl=3600)
    await record_hand_off(state, hand_off("Payment", 2), ttl=3600)  # late: left as it is
    at = datetime.now(UTC)
    entry = await record_ending(
        state, "wf_1", "FAILED", "gateway", at, failed_at_step=1, error_reason="Payment failed"
    )
    assert entry is not None and entry.version == 3 and entry.updated_by == "gateway"
    assert entry.value["current_agent"] == "Notification" and entry.value["step"] == 3
    assert (entry.value["status"], entry.value["failed_at_step"]) == ("FAILED", 1)
    assert entry.value["error_reason"] == "Payment failed"
    assert entry.value["finished_at"] == at.isoformat()
    assert entry.expires_at is not None  # the hour its hand-offs gave it, not for ever
    assert entry.expires_at - at <= timedelta(hours=1, seconds=1)
    # A workflow whose hand-offs were not recorded gets no status from its ending.
    assert await record_ending(state, "wf_unknown", "COMPLETED", "gateway", at) is None
    assert (await state.entries("workflow/")).entries[0].key == "workflow/wf_1"
    assert len((await state.entries("workflow/")).entries) == 1


def test_an_ending_is_completed_or_failed() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    done = ended({"step": 4, "status": "IN_PROGRESS"}, "COMPLETED", at)
    assert done == {"step": 4, "status": "COMPLETED", "finished_at": "2026-01-01T00:00:00+00:00"}
    with pytest.raises(ValueError, match="COMPLETED or FAILED"):
        ended({}, "IN_PROGRESS", at)


async def test_the_in_process_dispatcher_records_an_ending_in_its_brokers_state() -> None:
    broker = Broker(BrokerConfig())
    await broker.start()
    try:
        await broker.register(AgentInfo(agent_id="Payment"))
        await broker.send(hand_off("Payment", 1, "wf_local"))
        await BrokerDispatcher(broker).record_ending(
            "wf_local", "COMPLETED", failed_at_step=None, error_reason=""
        )
        entry = await broker.state.get("workflow/wf_local")
        assert entry.value["status"] == "COMPLETED" and entry.updated_by == "gateway"
    finally:
        await broker.stop()


def test_a_workflow_id_fits_the_key_of_its_status() -> None:
    """``workflow/<workflow_id>`` is a shared state key, 256 characters at most: a longer id
    (or one with a line break) is refused where it comes in, by the broker for a hand-off and
    by the gateway for a workflow or a group chat, instead of the hand-offs going on with
    their status never recorded."""
    config = BrokerConfig()
    fits = "w" * MAX_WORKFLOW_ID
    assert len(key_of(fits)) == 256 and workflow_id_problem(fits) is None
    for wrong in ("w" * (MAX_WORKFLOW_ID + 1), "wf\nrefund"):
        assert workflow_id_problem(wrong) is not None
        message = Message(
            from_agent="CustomerAgent",
            to_agent="SellerAgent",
            message_type=MessageType.HANDOFF,
            content={"action": "handoff", "parameters": {"task_description": "Approve"}},
            metadata={"workflow_id": wrong},
        )
        assert [v.field for v in message_violations(message, config)] == ["metadata.workflow_id"]
        with pytest.raises(MessageValidationError, match="workflow_id must be printable"):
            WorkflowSpec(
                steps=[WorkflowStep(agent_id="SellerAgent")], task="t", workflow_id=wrong
            ).validate()
        with pytest.raises(MessageValidationError, match="group_id must be printable"):
            GroupChatSpec(agent_ids=["A"], query="q", group_id=wrong).validate()
    WorkflowSpec(
        steps=[WorkflowStep(agent_id="SellerAgent")], task="t", workflow_id=fits
    ).validate()
    GroupChatSpec(agent_ids=["A"], query="q", group_id=fits).validate()

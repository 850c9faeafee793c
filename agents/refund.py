"""The refund workflow agents (RF-010 scenarios 6 to 10, 17), deciding from orders.json."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from agents._data import read
from mesh import Agent, AgentContext, Message
from mesh.core.model import Handoff


def order_id_of(message: Message) -> str:
    """The order in question: from the context (or accumulated context), else "#12345" text."""
    handoff = message.handoff
    context: dict[str, Any] = dict(handoff.context) if handoff else {}
    content = message.content or {}
    if isinstance(content.get("context"), dict):
        context.update(content["context"])
    accumulated = context.get("accumulated_context") or {}
    for source in (context, accumulated):
        if isinstance(source, dict) and source.get("order_id"):
            return str(source["order_id"])
    text = " ".join(
        str(x)
        for x in (
            handoff.task_description if handoff else "",
            context.get("task", ""),
            content.get("query", ""),
        )
    )
    match = re.search(r"#?(\d{4,})", text)
    return match.group(1) if match else ""


class RefundAgent(Agent):
    agent_types: tuple[str, ...] = ("refund",)

    def __init__(self, agent_id: str | None = None, *, data_dir: str | Path | None = None) -> None:
        super().__init__(agent_id)
        self.data_dir = data_dir

    async def order(self, message: Message) -> tuple[str, dict[str, Any] | None, dict[str, Any]]:
        data = await read("orders.json", self.data_dir)
        order_id = order_id_of(message)
        return order_id, data["orders"].get(order_id), data["policy"]


class CustomerAgent(RefundAgent):
    """Validates the customer's refund request against the order and the refund window."""

    agent_id = "CustomerAgent"
    capabilities = ("validate_refund",)

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        order_id, order, policy = await self.order(message)
        if order is None:
            return {"status": "FAILED", "error": f"order {order_id or '?'} not found"}
        eligible = order["days_since_purchase"] <= policy["refund_window_days"]
        result = {"order_id": order_id, "eligible": eligible}
        if eligible:
            return {
                "status": "APPROVED",
                "result": result,
                "next_task": f"Approve refund for order {order_id}",
            }
        return {
            "status": "REJECTED",
            "result": result,
            "next_agent": "NotificationAgent",
            "next_task": f"Tell the customer order {order_id} is outside the refund window",
        }


class SellerAgent(RefundAgent):
    """Reviews the refund: approves known defects under the auto-approve limit."""

    agent_id = "SellerAgent"
    capabilities = ("approve_refund",)

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        order_id, order, policy = await self.order(message)
        if order is None:
            return {"status": "FAILED", "error": f"order {order_id or '?'} not found"}
        approved = (
            order["reason"] in policy["approved_reasons"]
            and order["amount"] <= policy["seller_auto_approve_limit"]
        )
        result = {"approved": approved, "reason": order["reason"]}
        if approved:
            return {
                "status": "APPROVED",
                "result": result,
                "next_agent": "PaymentAgent",
                "next_task": f"Refund ${order['amount']:g} for order {order_id}",
            }
        return {
            "status": "REJECTED",
            "result": result,
            "next_agent": "NotificationAgent",
            "next_task": f"Send rejection email for order {order_id}",
        }


class PaymentAgent(RefundAgent):
    """Refunds the amount, respecting the hand-off's constraints; fails on a blocked card."""

    agent_id = "PaymentAgent"
    agent_types = ("refund", "payment")
    capabilities = ("process_refund",)

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        order_id, order, policy = await self.order(message)
        if order is None:
            return {"status": "FAILED", "error": f"order {order_id or '?'} not found"}
        if order["card_status"] != "active":
            return {"status": "FAILED", "error": "Payment failed"}
        constraints = message.handoff.constraints if message.handoff else {}
        method = str(constraints.get("refund_method") or order["payment_method"])
        days = policy["processing_days"].get(str(constraints.get("processing_time", "")), 5)
        return {
            "status": "SUCCESS",
            "result": {"refunded": order["amount"], "method": method, "processing_days": days},
        }


class NotificationAgent(RefundAgent):
    """Writes the customer's email: approval, rejection, or failure."""

    agent_id = "NotificationAgent"
    agent_types = ("refund", "notification")
    capabilities = ("send_email",)

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        order_id, order, _ = await self.order(message)
        handoff = message.handoff or Handoff(task_description="")
        context = handoff.context
        accumulated = context.get("accumulated_context") or {}
        to = order["customer"] if order else "unknown"
        # After a parallel step of checks, the previous result holds each check's verdict.
        checks = handoff.previous_result if isinstance(handoff.previous_result, dict) else {}
        refused_by = sorted(
            agent_id
            for agent_id, verdict in checks.items()
            if isinstance(verdict, dict) and verdict.get("recommendation") == "REJECTED"
        )
        if context.get("error"):
            failed = str(context.get("failed_agent", "")).removesuffix("Agent").lower() or "system"
            text = f"Refund failed - {failed} error"
        elif refused_by:
            text = f"Refund rejected: order {order_id} did not pass {', '.join(refused_by)}"
        elif accumulated.get("eligible") is False:
            text = f"Refund rejected: order {order_id} is outside the refund window"
        elif accumulated.get("approved") is False:
            text = f"Refund rejected: order {order_id} ({accumulated.get('reason')})"
        elif "refunded" in accumulated:
            text = (
                f"Refund approved: ${accumulated['refunded']:g} to "
                f"{accumulated.get('method', 'original payment')} for order {order_id}"
            )
        else:
            text = f"Refund update for order {order_id}"
        return {"status": "SENT", "result": {"email": text, "to": to}}


class ApprovalAgent(RefundAgent):
    """A member of the approval group chat (scenario 17), or a check of a workflow's
    parallel step: votes APPROVED or REJECTED."""

    agent_types = ("refund_approval",)

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        order_id, order, policy = await self.order(message)
        if order is None:
            return {
                "recommendation": "REJECTED",
                "confidence": 1.0,
                "reasoning": f"order {order_id or '?'} not found",
            }
        approve, confidence, reasoning = self.judge(order, policy)
        verdict = "APPROVED" if approve else "REJECTED"
        answer: dict[str, Any] = {
            "recommendation": verdict,
            "confidence": confidence,
            "reasoning": reasoning,
        }
        if message.handoff is not None:  # a check step of a workflow: the verdict is its status
            answer["status"] = verdict
        return answer

    def judge(self, order: dict[str, Any], policy: dict[str, Any]) -> tuple[bool, float, str]:
        raise NotImplementedError


class PolicyAgent(ApprovalAgent):
    """Checks the refund policy: reason and window."""

    agent_id = "PolicyAgent"

    def judge(self, order: dict[str, Any], policy: dict[str, Any]) -> tuple[bool, float, str]:
        ok = (
            order["reason"] in policy["approved_reasons"]
            and order["days_since_purchase"] <= policy["refund_window_days"]
        )
        return ok, 0.9, f"reason {order['reason']}, day {order['days_since_purchase']}"


class FraudCheckAgent(ApprovalAgent):
    """Checks the order's fraud score."""

    agent_id = "FraudCheckAgent"

    def judge(self, order: dict[str, Any], policy: dict[str, Any]) -> tuple[bool, float, str]:
        score = float(order["fraud_score"])
        ok = score < policy["fraud_score_limit"]
        return (
            ok,
            round(abs(score - policy["fraud_score_limit"]) + 0.5, 2),
            f"fraud score {score:g}",
        )


class FinanceAgent(ApprovalAgent):
    """Checks the amount against the auto-approve limit."""

    agent_id = "FinanceAgent"

    def judge(self, order: dict[str, Any], policy: dict[str, Any]) -> tuple[bool, float, str]:
        ok = order["amount"] <= policy["seller_auto_approve_limit"]
        return ok, 0.8, f"amount ${order['amount']:g}"


def refund_agents(data_dir: str | Path | None = None) -> list[Agent]:
    return [
        cls(data_dir=data_dir)
        for cls in (
            CustomerAgent,
            SellerAgent,
            PaymentAgent,
            NotificationAgent,
            PolicyAgent,
            FraudCheckAgent,
            FinanceAgent,
        )
    ]

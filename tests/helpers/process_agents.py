"""Agents that tests run in separate OS processes with `agentmesh agent module:attr`."""

from __future__ import annotations

import asyncio
import os

from mesh import Agent, AgentContext, Message, on


class Payment(Agent):
    """Answers process_payment requests with its own process id."""

    agent_id = "PaymentAgent"
    agent_types = ("payment",)

    @on("process_payment")
    async def pay(self, message: Message, ctx: AgentContext) -> dict[str, object]:
        return {"status": "PAID", "amount": message.parameters["amount"], "pid": os.getpid()}


class Seller(Agent):
    """Approves a handed-off refund and hands it on to the agent named in the context."""

    agent_id = "SellerAgent"

    async def handle(self, message: Message, ctx: AgentContext) -> None:
        handoff = message.handoff
        assert handoff is not None
        await ctx.handoff(
            str(handoff.context["report_to"]),
            "Refund approved: notify the customer",
            context=handoff.context,
            previous_result={
                "approved": True,
                "seller_pid": os.getpid(),
                "received": handoff.previous_result,
            },
        )


class Stuck(Agent):
    """Takes deliveries and never finishes them: its leases are held until it dies."""

    agent_id = "StuckAgent"

    async def handle(self, message: Message, ctx: AgentContext) -> None:
        await asyncio.Event().wait()


def payment_desk() -> list[Agent]:
    """Two payment agents served together by one process (one client, one stream)."""
    second = Payment()
    second.agent_id = "BackupPaymentAgent"
    return [Payment(), second]

"""The README's agent example does what the README says, run as written against a real broker."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from mesh import Agent, MessageType
from mesh.testing import LocalMesh

README = Path(__file__).resolve().parents[2] / "README.md"


def agent_example() -> dict[str, Any]:
    """The definitions of the README's agent example (the block that defines ``Payment``),
    executed: everything above its ``serve`` lines, which need a broker at a fixed port."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "class Payment(Agent)" in b]
    definitions, _, serving = block.partition("served = await serve(")
    assert "serve_all([Payment(), seller]" in serving
    namespace: dict[str, Any] = {}
    exec(compile(definitions, str(README), "exec"), namespace)
    return namespace


async def test_the_agent_example_pays_and_takes_the_sellers_handoff() -> None:
    example = agent_example()
    payment, seller = example["Payment"](), example["seller"]
    assert isinstance(payment, Agent) and isinstance(seller, Agent)
    async with LocalMesh() as mesh:
        served = await example["serve_all"]([payment, seller], mesh.address)
        try:
            async with mesh.client("FlightAgent") as client:
                await client.register()
                paid = await client.request(
                    "PaymentAgent",
                    {"action": "process_payment", "parameters": {"amount": 450}},
                    timeout=5,
                )
                assert paid.message_type is MessageType.RESPONSE
                assert paid.content["status"] == "PAID" and paid.content["amount"] == 450

                await client.handoff(
                    "SellerAgent",
                    "Approve refund for order 12345",
                    context={"order_id": "12345"},
                    workflow_id="wf_refund_123",
                    step_number=1,
                )
                # The seller hands on to PaymentAgent (step 2), whose handler takes it.
                for _ in range(200):
                    status = await client.get_state("workflow/wf_refund_123")
                    if status is not None and status.value["current_agent"] == "PaymentAgent":
                        break
                    await asyncio.sleep(0.025)
                assert status is not None
                assert status.value["step"] == 2
                assert status.value["from_agent"] == "SellerAgent"
                assert status.value["task_description"] == "Refund $50"
                # ... and answers it: the hand-off leaves the queue, not for the dead letters.
                for _ in range(200):
                    view = (await client.queue_stats("PaymentAgent")).for_agent("PaymentAgent")
                    if view is not None and view.depth == view.in_flight == 0:
                        break
                    await asyncio.sleep(0.025)
                assert view is not None and view.depth == view.in_flight == 0
                assert view.dead_letters == 0
                assert await client.dead_letters("PaymentAgent") == []
        finally:
            await served.stop()

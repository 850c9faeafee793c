"""Random hand-off workflows through the gateway, against real agents.

Hypothesis writes workflows of one to four steps over agents that each, in that run, finish
their step, pick the next agent or the end, report a failure, or raise; with or without a
failure agent. Whatever they do, the stream a client reads and the workflow's status in the
shared state (RT-011 hand-off protocol) must agree: one RESULT, last; the steps the stream
reports are the agents handed to, in order; a workflow fails exactly when an agent on its
path failed, raised or chose an agent that is not a step (or it looped past its hops), at
the step the stream names, and the status says FAILED there, with the same reason
(COMPLETED otherwise); the status's current agent is the last one handed to, the failure
agent when there is one (it is handed the error), however often the workflow went back to
an earlier step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gateway.client import GatewayClient
from gateway.server import serve_gateway
from mesh import AgentContext, LocalMesh, Message, agent, connect
from tests.helpers.programs import programs_settings

WORKERS = ("W0", "W1", "W2", "W3")
BEHAVIOURS = ("done", "done", "next:W0", "next:W2", "end", "fail", "raise")

workflows = st.fixed_dictionaries(
    {
        "steps": st.lists(st.sampled_from(WORKERS), min_size=1, max_size=4),
        "behaviour": st.fixed_dictionaries({w: st.sampled_from(BEHAVIOURS) for w in WORKERS}),
        "failure_agent": st.sampled_from(["", "Notifier"]),
    }
)


def worker(agent_id: str, behaviour: dict[str, str]) -> Any:
    @agent(agent_id)
    async def handle(message: Message, ctx: AgentContext) -> dict[str, Any]:
        what = behaviour[agent_id]
        if what == "raise":
            raise RuntimeError(f"{agent_id} broke")
        if what == "fail":
            return {"status": "FAILED", "error": f"{agent_id} could not"}
        answer: dict[str, Any] = {"status": "DONE", "result": {agent_id: True}}
        if what.startswith("next:"):
            answer["next_agent"] = what.removeprefix("next:")
        elif what == "end":
            answer["next_agent"] = "END"
        return answer

    return handle


async def run(workflow: dict[str, Any]) -> None:
    behaviour: dict[str, str] = workflow["behaviour"]
    told: list[Message] = []

    @agent("Notifier")
    async def notifier(message: Message, ctx: AgentContext) -> dict[str, Any]:
        told.append(message)
        return {"status": "DONE", "notified": True}

    async with LocalMesh() as local:
        for agent_id in WORKERS:
            await local.add_agent(worker(agent_id, behaviour))
        await local.add_agent(notifier)
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address, timeout=30) as client:
                events = await client.collect(
                    client.handoff_workflow(
                        steps=[{"agent_id": a} for a in workflow["steps"]],
                        task="do it",
                        failure_agent=workflow["failure_agent"],
                        max_hops=6,
                        step_timeout="5s",
                    )
                )
            async with connect(local.address, agent_id="Reader") as reader:
                result = events[-1]["data"]
                status = await reader.get_state(f"workflow/{result['workflow_id']}")
        finally:
            await gateway.stop(0.5)

    kinds = [e["kind"] for e in events]
    assert kinds.count("RESULT") == 1 and kinds[-1] == "RESULT", kinds
    handed = [e["data"] for e in events if e["kind"] == "HANDOFF"]
    steps = [h["to_agent"] for h in handed if not h.get("error_handoff")]
    answered = [e["agent_id"] for e in events if e["kind"] == "STEP_RESULT"]
    assert answered == steps[: len(answered)], (steps, answered)
    assert steps and steps[0] == workflow["steps"][0]

    def breaks(agent_id: str) -> bool:  # (routing to an agent that is not a step fails too)
        what = behaviour[agent_id]
        return what in ("fail", "raise") or (
            what.startswith("next:") and what.removeprefix("next:") not in workflow["steps"]
        )

    broke = [a for a in steps if breaks(a)]
    looped = result.get("hops", 0) >= 6 and not broke
    assert status is not None
    if broke or looped:
        assert result["status"] == "FAILED", result
        assert status.value["status"] == "FAILED"
        assert status.value["failed_at_step"] == result["failed_at_step"]
        assert status.value["error_reason"] == result["error_reason"]
        if broke:
            assert steps[-1] == broke[0] == result["agent_id"]
            # (the failing step's place in the workflow, from 0, as its STEP_RESULT tells it)
            last = [e["data"] for e in events if e["kind"] == "STEP_RESULT"][-1]
            assert result["failed_at_step"] == last["step_number"] - 1
        if workflow["failure_agent"]:
            assert handed[-1]["error_handoff"] is True
            assert handed[-1]["to_agent"] == "Notifier"
            assert len(told) == 1 and told[0].handoff is not None
            assert status.value["current_agent"] == "Notifier"
        else:
            assert not told
            assert status.value["current_agent"] == steps[-1]
    else:
        assert result["status"] == "COMPLETED", result
        assert status.value["status"] == "COMPLETED"
        assert not told
        # the last agent handed to, however the workflow went back and forth
        assert status.value["current_agent"] == steps[-1]


@programs_settings(25)
@given(workflow=workflows)
def test_a_workflow_stream_and_its_recorded_status_agree_whatever_the_agents_do(
    workflow: dict[str, Any],
) -> None:
    asyncio.run(run(workflow))

"""Random programs of client calls, made by the Node.js client and by the Python SDK.

Hypothesis writes programs of sends one at a time and many at once (the Node.js client
writes those of one moment as one batch frame on its session, the SDK likewise), batches,
receives, queue statistics and broadcasts; each client runs the program against a broker of
its own, and what each call answered (accepted or refused and why, what each agent
received, in which order, the queue counts, a broadcast's recipients) must be the same.
The Node.js side is one process (tests/helpers/node_programs.js) taking program after program.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh import LocalMesh, Message, connect
from mesh.client import NO_RETRY
from mesh.config import BrokerConfig
from mesh.core.errors import MultiAgentCommunicationError
from mesh.core.model import Priority
from tests.helpers.node import NODE_DIR
from tests.helpers.programs import programs_settings

pytestmark = pytest.mark.processes

AGENTS = {"a": "worker", "b": "worker", "c": "auditor"}
IDS = [f"m{i}" for i in range(6)]
LIMITS: dict[str, Any] = {"max_messages_per_agent": 4, "max_total_messages": 7}
RUNNER = NODE_DIR.parent.parent / "tests" / "helpers" / "node_programs.js"


@st.composite
def ones(draw: st.DrawFn) -> list[str]:
    """A message: its target, id and priority (the same id, the same priority: a retry)."""
    to = draw(st.sampled_from(["a", "a", "b", "c", "nobody"]))
    mid = draw(st.sampled_from(IDS))
    return [to, mid, list(Priority)[(ord(to[0]) + IDS.index(mid)) % 3].value]


operations = st.one_of(
    st.tuples(st.just("send"), ones()),
    st.tuples(st.just("send"), ones()),
    st.tuples(st.just("parallel"), st.lists(ones(), min_size=2, max_size=6)),
    st.tuples(st.just("parallel"), st.lists(ones(), min_size=2, max_size=6)),
    st.tuples(st.just("batch"), st.lists(ones(), min_size=1, max_size=6)),
    st.tuples(st.just("receive"), st.sampled_from(list(AGENTS)), st.integers(0, 3)),
    st.tuples(st.just("stats")),
    st.tuples(st.just("broadcast"), st.sampled_from([[], ["worker"], ["auditor"]])),
).map(list)
programs = st.lists(operations, min_size=5, max_size=25)


def message(one: list[str], number: int) -> Message:
    to, mid, priority = one
    return Message(
        message_id=mid,
        from_agent="sender",
        to_agent=to,
        content={"action": "work", "parameters": {"n": number}},
        priority=Priority(priority),
    )


def outcome(result: Any) -> list[str]:
    if isinstance(result, MultiAgentCommunicationError):
        return ["refused", result.reason]
    return ["accepted", result.message_id]


async def run(program: list[list[Any]], address: str) -> list[Any]:
    """The program through the Python SDK, in the shapes node_programs.js writes."""
    seen: list[Any] = []
    async with connect(address, agent_id="sender", retry=NO_RETRY) as client:
        for agent_id, agent_type in AGENTS.items():
            await client.register(agent_id, agent_types=[agent_type])
        await client.register("sender", agent_types=["sender"])
        for number, (kind, *args) in enumerate(program):
            if kind == "send":
                try:
                    seen.append(outcome(await client.send_message(message(args[0], number))))
                except MultiAgentCommunicationError as error:
                    seen.append(outcome(error))
            elif kind == "parallel":
                results = await client.send_parallel(
                    [message(one, number) for one in args[0]], return_exceptions=True
                )
                seen.append([outcome(r) for r in results])
            elif kind == "batch":
                results = await client.send_batch([message(one, number) for one in args[0]])
                seen.append([outcome(r) for r in results])
            elif kind == "receive":
                seen.append(
                    [
                        [
                            m.message_id if m.message_id in IDS else m.message_type.value,
                            m.from_agent,
                            m.priority.value,
                            dict(m.content),
                        ]
                        for m in await client.receive(args[0], args[1])
                    ]
                )
            elif kind == "stats":
                report = await client.queue_stats()
                seen.append(
                    sorted(
                        [q.agent_id, q.high, q.medium, q.low, q.in_flight, q.dead_letters]
                        for q in report.agents
                        if q.depth or q.in_flight or q.dead_letters
                    )
                )
            else:
                try:
                    result = await client.broadcast(
                        {"action": "notice", "parameters": {"n": number}}, agent_types=args[0]
                    )
                except MultiAgentCommunicationError as error:  # no agent could take it
                    seen.append(outcome(error))
                    continue
                seen.append([sorted(result.recipients), sorted(f[0] for f in result.failures)])
    return json.loads(json.dumps(seen))


class NodeRunner:
    """One Node.js process running programs, one a line."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.process = self.loop.run_until_complete(
            asyncio.create_subprocess_exec(
                "node",
                str(RUNNER),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env={**os.environ},
            )
        )

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    async def program(self, program: list[list[Any]], address: str) -> list[Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        line = json.dumps({"address": address, "program": program, "ids": IDS})
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()
        async with asyncio.timeout(60):
            answer = await self.process.stdout.readline()
        assert answer, "the Node.js program runner ended"
        return json.loads(answer)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.run(self.process.wait())
        self.loop.close()


@pytest.fixture(scope="module")
def node() -> Iterator[NodeRunner]:
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("clients/node dependencies are missing: run `make setup`")
    runner = NodeRunner()
    try:
        yield runner
    finally:
        runner.close()


async def side_by_side(program: list[list[Any]], node: NodeRunner) -> None:
    meshes = [await LocalMesh(BrokerConfig(**LIMITS)).start() for _ in range(2)]
    try:
        expected = await run(program, meshes[0].address)
        got = await node.program(program, meshes[1].address)
    finally:
        for mesh in meshes:
            await mesh.stop()
    for number, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"step {number} {program[number]} of {program}: {have} != {want}"


@programs_settings(40)
@given(program=programs)
def test_the_nodejs_client_is_answered_as_the_python_sdk_is(
    program: list[list[Any]], node: NodeRunner
) -> None:
    node.run(side_by_side(program, node))

"""Random agent answers through the gateway's patterns, against real agents.

Agents are other processes, often in other languages: whatever they answer is theirs to
choose. Hypothesis has each agent of a run answer with some JSON (an object near the shape
the pattern reads, with values of any type, or any other value), or raise. Whatever they
answer, a group chat, a collaborative filtering run and a consensus round end in one of two
defined ways: one RESULT, last, that counts exactly the answers the pattern can use and
names every other agent as missing; or, for a consensus round without a proposal or a
decision, ABORTED with the reason. Never INTERNAL, and the gateway goes on serving.

A research run's researchers likewise answer anything (findings of any shape, escalations
with unknown actions, ...): the coordinator keeps what it can read, notes the rest, and the
sample synthesis and report agents take what it passes on; the run completes, its report
written, citing only findings the researchers gave.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from agents.research import RESEARCH_POLICY, research_tools
from agents.research.agents import ReportAgent, SynthesisAgent
from agents.research.analysis import claim_key, is_finding, one_line, source_of
from agents.research.corpus import DocumentFolder
from gateway.client import GatewayClient
from gateway.patterns.group_chat import STRATEGIES
from gateway.server import serve_gateway
from mesh import AgentContext, LocalMesh, Message, agent
from mesh.core.errors import MeshError
from mesh.core.tools import ToolHost
from tests.helpers.programs import programs_settings

T = TypeVar("T")
GROUP = ("G0", "G1", "G2")
ROLES = ("proposer", "reviewer_1", "reviewer_2", "reviewer_3", "facilitator")
WORDS = ["A", "B", "approve", "reject", "modify", "ACCEPT", "REJECT", "p1", "", " "]

scalars = (
    st.none()
    | st.booleans()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0, 0.5, 0.9, 1, 1.5, -1])
    | st.text(max_size=4)
    | st.sampled_from(WORDS)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["A", "B", "x"]), inner, max_size=3)
    ),
    max_leaves=6,
)
shares = st.sampled_from([0, 0.5, 0.7, 0.9, 1, None, 1.5, -0.1, "0.5", True])
KEYS = ("recommendation", "result", "confidence", "scores", "proposal_id", "vote", "decision")
shaped = st.one_of(
    st.fixed_dictionaries(
        {"recommendation": st.sampled_from(["A", "B"]) | values, "confidence": shares}
    ),
    st.fixed_dictionaries(
        {"scores": st.dictionaries(st.sampled_from(["A", "B", "C"]), shares, max_size=3)},
        optional={"recommendation": st.sampled_from(["A", "Z", ""]), "confidence": shares},
    ),
    st.fixed_dictionaries({"proposal_id": st.sampled_from(["p1", ""]) | values}),
    st.fixed_dictionaries(
        {"vote": st.sampled_from(["approve", "REJECT", "modify", "maybe"]) | values},
        optional={"confidence": shares},
    ),
    st.fixed_dictionaries({"decision": st.sampled_from(["ACCEPT", ""]) | values}),
    st.dictionaries(st.sampled_from(KEYS), values, max_size=3),
)
answers = st.one_of(
    shaped.map(lambda content: ("answer", content)),
    shaped.map(lambda content: ("answer", content)),
    values.map(lambda value: ("answer", value)),
    st.just(("raise", None)),
)
runs = st.one_of(
    st.fixed_dictionaries(
        {
            "rpc": st.just("RunGroupChat"),
            "strategy": st.sampled_from(STRATEGIES),
        }
    ),
    st.fixed_dictionaries(
        {
            "rpc": st.just("RunCollaborativeFiltering"),
            "method": st.sampled_from(["weighted", "confidence"]),
        }
    ),
    st.fixed_dictionaries({"rpc": st.just("RunConsensus")}),
)


def content_of(value: Any) -> dict[str, Any]:
    """What the SDK sends for a handler's return value."""
    return dict(value) if isinstance(value, dict) else {} if value is None else {"result": value}


def is_share(value: Any, absent_ok: bool = True) -> bool:
    if value is None:
        return absent_ok
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1


def is_pick(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def counts(rpc: str, method: str, content: dict[str, Any]) -> bool:
    """Whether the pattern can use this answer: the rule each pattern documents."""
    if rpc == "RunGroupChat":
        pick = content.get("recommendation", content.get("result"))
        return is_pick(pick) and is_share(content.get("confidence"))
    if rpc == "RunCollaborativeFiltering":
        scores = content.get("scores")
        scores = scores if isinstance(scores, dict) else {}
        if not all(is_share(v) for v in scores.values()):  # (null: no score, 0)
            return False
        given = content.get("recommendation")
        if given not in (None, "") and not is_pick(given):
            return False
        if not is_share(content.get("confidence")):
            return False
        return bool(scores) if method == "weighted" else bool(given or scores)
    # a reviewer's vote
    vote = content.get("vote", "")
    return str(vote).lower() in ("approve", "reject", "modify") and is_share(
        content.get("confidence")
    )


class World:
    """One mesh and one gateway for every program: the agents read their parts from
    ``behaviour``, set before each run; ``sample`` agents are the real ones."""

    def __init__(
        self, agent_ids: tuple[str, ...], sample: tuple[Any, ...] = (), tools: Any = None
    ) -> None:
        self.agent_ids, self.sample, self.tools = agent_ids, sample, tools
        self.behaviour: dict[str, tuple[str, Any]] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start())

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def _agent(self, agent_id: str) -> Any:
        @agent(agent_id)
        async def handle(message: Message, ctx: AgentContext) -> Any:
            kind, value = self.behaviour[agent_id]
            if kind == "raise":
                raise RuntimeError(f"{agent_id} broke")
            return value

        return handle

    async def _start(self) -> None:
        self.mesh = LocalMesh(tool_host=self.tools)
        await self.mesh.start()
        for agent_id in self.agent_ids:
            await self.mesh.add_agent(self._agent(agent_id))
        for sample in self.sample:
            await self.mesh.add_agent(sample)
        self.gateway = await serve_gateway(self.mesh.address)
        self.client = GatewayClient(self.gateway.address, timeout=30)

    async def _stop(self) -> None:
        await self.client.__aexit__()
        await self.gateway.stop(0.5)
        await self.mesh.stop()

    def stop(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def collect(self, rpc: str, request: dict[str, Any]) -> list[dict[str, Any]]:
        return await self.client.collect(self.client.run(rpc, request))


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    running = World((*GROUP, *ROLES))
    try:
        yield running
    finally:
        running.stop()


def request_for(run: dict[str, Any]) -> dict[str, Any]:
    if run["rpc"] == "RunGroupChat":
        return {
            "agent_ids": list(GROUP),
            "query": "Which one?",
            "strategy": run["strategy"],
            "agent_timeout": "5s",
            "hierarchy": {"G0": 0, "G1": 1},
            "expertise": {"G1": 0.9},
        }
    if run["rpc"] == "RunCollaborativeFiltering":
        return {
            "agent_ids": list(GROUP),
            "query": "Which hotel?",
            "method": run["method"],
            "weights": {"G0": 0.5, "G1": 0.3, "G2": 0.2},
            "agent_timeout": "5s",
        }
    return {
        "problem": "Migrate?",
        "reviewer_ids": ["reviewer_1", "reviewer_2", "reviewer_3"],
        "wait_for_all_votes": True,
        "agent_timeout": "5s",
    }


@programs_settings(60)
@given(run=runs, parts=st.fixed_dictionaries({a: answers for a in (*GROUP, *ROLES)}))
def test_whatever_the_agents_answer_a_pattern_ends_defined_and_counts_what_it_can_use(
    world: World, run: dict[str, Any], parts: dict[str, tuple[str, Any]]
) -> None:
    world.behaviour = parts
    rpc, method = run["rpc"], run.get("method", "")

    def usable(agent_id: str) -> bool:
        kind, value = parts[agent_id]
        return kind == "answer" and counts(rpc, method, content_of(value))

    try:
        events = world.call(world.collect(rpc, request_for(run)))
    except MeshError as error:
        assert rpc == "RunConsensus", error
        assert error.code == "ABORTED", error
        proposer = parts["proposer"]
        proposed = proposer[0] == "answer" and is_pick(content_of(proposer[1]).get("proposal_id"))
        if not proposed:
            assert error.reason == "PROPOSAL_FAILED", error
        else:
            assert error.reason == "DECISION_FAILED", error
            facilitator = parts["facilitator"]
            assert not (
                facilitator[0] == "answer" and is_pick(content_of(facilitator[1]).get("decision"))
            ), error
        return
    kinds = [e["kind"] for e in events]
    assert kinds.count("RESULT") == 1 and kinds[-1] == "RESULT", kinds
    result = events[-1]["data"]
    if rpc == "RunGroupChat":
        agents, answered = GROUP, set(result["answered"])
    elif rpc == "RunCollaborativeFiltering":
        agents, answered = GROUP, {o["agent_id"] for o in result["opinions"]}
    else:
        assert is_pick(content_of(parts["proposer"][1]).get("proposal_id"))
        agents = ("reviewer_1", "reviewer_2", "reviewer_3")
        answered = {v["reviewer_id"] for v in result["votes"]}
    assert answered == {a for a in agents if usable(a)}, (answered, result["missing_reasons"])
    assert set(result["missing"]) == set(agents) - answered
    expected = "COMPLETED" if answered == set(agents) else "PARTIAL" if answered else "FAILED"
    assert result["status"] == expected
    if rpc == "RunCollaborativeFiltering" and answered:
        decision = result["decision"]
        assert result["recommendation"] in decision["breakdown"]
        assert isinstance(result["score"], int | float) and math.isfinite(result["score"])
    if rpc == "RunGroupChat" and answered:
        picks = {c["recommendation"] for c in result["contributions"]}
        assert all(is_pick(p) for p in picks)


RESEARCHERS = ("web-search-agent", "document-analysis-agent")
TOPICS = ["recycling_rate", "collection_target", "economic_viability"]
findings = st.fixed_dictionaries(
    {
        "claim": st.sampled_from(["Rate is 5%", "Rate is 50%", ""]) | values,
        "topic": st.sampled_from(TOPICS) | values,
        "value": st.sampled_from(["5", "50"]) | values,
        "source_url": st.sampled_from(["https://a.example", "https://b.example"]) | values,
    },
    optional={
        "kind": st.sampled_from(["factual", "temporal", "interpretive"]) | values,
        "tier": st.sampled_from(["official", "article", "blog"]) | values,
        "confidence": st.sampled_from(["high", "low"]) | values,
        "date": st.sampled_from(["2024-01-01", "2025-06-01"]) | values,
    },
)
researcher_answers = st.one_of(
    st.fixed_dictionaries(
        {"findings": st.lists(findings, min_size=1, max_size=4)},
        optional={"partial": st.booleans() | values, "errors": values},
    ),
    st.fixed_dictionaries(
        {"findings": st.lists(findings | values, max_size=3) | values},
        optional={
            "partial": values,
            "escalation": st.fixed_dictionaries(
                {},
                optional={
                    "failure_type": st.sampled_from(["access_denied", "timeout_complete"]) | values,
                    "suggested_action": st.sampled_from(
                        ["retry_with_other_agent", "skip", "report_gap", "panic"]
                    )
                    | values,
                    "attempted_query": values,
                },
            )
            | values,
        },
    ),
    values,
).map(lambda content: ("answer", content)) | st.just(("raise", None))


@pytest.fixture(scope="module")
def research_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    output = tmp_path_factory.mktemp("reports")
    tools = ToolHost(research_tools(docs=DocumentFolder(), output=output), RESEARCH_POLICY)
    running = World(RESEARCHERS, (SynthesisAgent(), ReportAgent()), tools)
    running.output = output  # type: ignore[attr-defined]
    try:
        yield running
    finally:
        running.stop()


@programs_settings(40)
@given(
    parts=st.fixed_dictionaries({a: researcher_answers for a in RESEARCHERS}),
    iterations=st.integers(1, 3),
)
@example(  # (claims that hold line breaks: once found by the program, now always tried)
    parts={
        "web-search-agent": ("raise", None),
        "document-analysis-agent": (
            "answer",
            {
                "findings": [
                    {"claim": claim, "topic": "recycling_rate", "source_url": "https://a.example"}
                    for claim in ("Rate is 5%", "0\r", "Rate\n# Injected\r\n- item")
                ]
            },
        ),
    },
    iterations=1,
)
def test_whatever_the_researchers_answer_the_research_completes_with_what_it_could_read(
    research_world: World, parts: dict[str, tuple[str, Any]], iterations: int
) -> None:
    research_world.behaviour = parts
    request = {
        "query": "latest: compare the recycling rate, the collection target and the viability",
        "documents": True,
        "max_iterations": iterations,
        "subagent_timeout": "5s",
        "report_name": "programs",
    }
    events = research_world.call(research_world.collect("RunResearch", request))
    kinds = [e["kind"] for e in events]
    assert kinds.count("RESULT") == 1 and kinds[-1] == "RESULT", kinds
    result = events[-1]["data"]
    given = [
        f
        for kind, content in parts.values()
        if kind == "answer"
        and isinstance(content, dict)
        and isinstance(content.get("findings"), list)
        for f in content["findings"]
        if is_finding(f)
    ]
    # (by claim: a source_url of 0.0 comes back as 0, a Struct's whole number)
    assert all(is_finding(f) for f in result["findings"])
    assert {claim_key(f) for f in result["findings"]} <= {claim_key(f) for f in given}
    for agent_id, (kind, _) in parts.items():
        if kind == "raise":
            assert agent_id in result["partial_agents"]
    report = result["report"]
    cited = {(c["source"], c["claim"]) for c in report["citations"]}
    assert cited == {(source_of(f), f["claim"]) for f in result["findings"]}
    assert [Path(f).name for f in report["files"]] == ["programs.md", "programs.json"]
    with (research_world.output / "programs.md").open(encoding="utf-8", newline="") as file:  # type: ignore[attr-defined]
        lines = file.read().split("\n")
    # Each finding a list item on a line of its own, whatever line breaks its claim held.
    for f in result["findings"]:
        assert any(line.startswith(f"- {one_line(f['claim'])} [ref-") for line in lines), f

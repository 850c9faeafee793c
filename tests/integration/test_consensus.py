"""Consensus building through the gateway's gRPC API, with agents and the shared memory pool
on the mesh."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from agents.consensus import FacilitatorAgent, ProposerAgent, ReviewerAgent
from agents.reasoning import ChatCompletionsReasoner, RuleReasoner
from gateway.client import GatewayClient
from gateway.embedded import EmbeddedMesh
from gateway.server import serve_gateway
from mesh import AgentContext, LocalMesh, Message, agent, connect
from mesh.core.errors import MeshError


def fixed(vote: str, delay: float = 0.0) -> RuleReasoner:
    async def rule(task: str, inputs: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(delay)
        return {"vote": vote, "feedback": f"fixed {vote}", "confidence": 0.9}

    return RuleReasoner(rule)


async def run(
    ballot: list[str], delays: list[float] | None = None, **request: Any
) -> list[dict[str, Any]]:
    delays = delays or [0.0] * len(ballot)
    reviewers = [
        ReviewerAgent(f"voter_{i}", reasoner=fixed(vote, delay))
        for i, (vote, delay) in enumerate(zip(ballot, delays, strict=True))
    ]
    return await run_with(reviewers, **request)


async def run_with(
    reviewers: list[Any], problem: str = "Should we migrate to microservices?", **request: Any
) -> list[dict[str, Any]]:
    """A round of the sample proposer and facilitator with ``reviewers`` (asked in their
    order), through the gateway: its events."""
    async with LocalMesh() as local:
        await local.add_agent(ProposerAgent())
        await local.add_agent(FacilitatorAgent())
        for reviewer in reviewers:
            await local.add_agent(reviewer)
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                return await client.collect(
                    client.consensus(
                        problem=problem,
                        reviewer_ids=[r.agent_id for r in reviewers],
                        **request,
                    )
                )
        finally:
            await gateway.stop(0.5)


def decision_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    [decision] = [e for e in events if e["kind"] == "DECISION"]
    return decision["data"]


@pytest.mark.parametrize(
    ("ballot", "level", "decision"),
    [
        (["approve", "approve", "approve"], "100.0%", "ACCEPT"),
        (["approve", "approve", "reject"], "66.7%", "ACCEPT"),
        (["approve", "approve", "modify"], "83.3%", "ACCEPT"),
        (["approve", "reject", "reject"], "33.3%", "REJECT"),
        (["reject", "reject", "reject"], "0.0%", "REJECT"),
        (["approve", "reject", "modify"], "50.0%", "REQUEST_REVISION"),
        (["reject", "reject", "modify"], "16.7%", "REJECT"),
    ],
)
async def test_decision_matrix_rows_through_grpc(
    ballot: list[str], level: str, decision: str
) -> None:
    events = await run(ballot, wait_for_all_votes=True)
    result = decision_of(events)
    assert (result["consensus_level"], result["decision"]) == (level, decision)
    assert len([e for e in events if e["kind"] == "VOTE"]) == 3


async def test_thresholds_through_grpc() -> None:
    ballot = ["approve", "approve", "reject"]
    assert decision_of(await run(ballot, threshold=0.51))["decision"] == "ACCEPT"
    assert (
        decision_of(await run(ballot, threshold=0.75, wait_for_all_votes=True))["decision"]
        == "REQUEST_REVISION"
    )
    assert decision_of(await run(["approve"] * 3, threshold=1.0))["decision"] == "ACCEPT"


async def test_quorum_through_grpc() -> None:
    events = await run(["approve", "approve", "approve"], quorum=3, agent_timeout="5s")
    assert decision_of(events)["decision"] == "ACCEPT"
    # A reviewer who never answers leaves the round below its quorum.
    events = await run(
        ["approve", "approve", "approve"], delays=[0, 0, 30], quorum=3, agent_timeout="0.5s"
    )
    result = decision_of(events)
    assert result["decision"] == "NO_QUORUM"
    assert result["rationale"].startswith("No quorum: 2 of 3 required votes")
    assert events[-1]["data"]["missing"] == ["voter_2"]
    assert events[-1]["data"]["status"] == "PARTIAL"


async def test_a_round_nobody_votes_in_fails() -> None:
    async with LocalMesh() as local:
        await local.add_agent(ProposerAgent())
        await local.add_agent(FacilitatorAgent())
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                events = await client.collect(
                    client.consensus(problem="Migrate?", reviewer_ids=["Ghost1", "Ghost2"])
                )
        finally:
            await gateway.stop(0.5)
    missing = [e["summary"] for e in events if e["kind"] == "AGENT_MISSING"]
    assert missing == [
        "Ghost1 did not vote: agent Ghost1 is not registered",
        "Ghost2 did not vote: agent Ghost2 is not registered",
    ]
    assert decision_of(events)["decision"] == "NO_QUORUM"
    assert events[-1]["data"]["status"] == "FAILED"


async def test_weighted_reviewers_through_grpc() -> None:
    ballot = ["approve", "reject", "modify"]
    events = await run(ballot, reviewer_weights={"voter_0": 3.0}, wait_for_all_votes=True)
    result = decision_of(events)
    assert (result["decision"], result["consensus_level"]) == ("ACCEPT", "70.0%")


async def test_early_termination_once_the_outcome_cannot_change() -> None:
    events = await run(["approve", "approve", "reject"], delays=[0, 0, 3])
    result = events[-1]["data"]
    assert result["decision"]["decision"] == "ACCEPT"
    assert result["skipped"] == ["voter_2"]
    assert "decided after 2 of 3 votes" in result["decision"]["early_termination"]
    # voter_0 and voter_1 answer at once, in either order; voter_2's vote never came.
    assert sorted(e["agent_id"] for e in events if e["kind"] == "VOTE") == ["voter_0", "voter_1"]


async def test_consensus_with_the_sample_agents_and_the_memory_pool(embedded: EmbeddedMesh) -> None:
    async with GatewayClient(embedded.gateway.address) as client:
        events = await client.collect(
            client.consensus(problem="Should we migrate to microservices?", wait_for_all_votes=True)
        )
        with pytest.raises(MeshError, match=r"threshold must be above 0\.5") as info:
            await client.collect(client.consensus(problem="x", threshold=0.3))
        assert info.value.code == "INVALID_ARGUMENT"
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "PROPOSAL" and kinds[-2:] == ["DECISION", "RESULT"]
    result = events[-1]["data"]
    assert result["decision"]["decision"] == "ACCEPT"
    assert result["decision"]["consensus_level"] == "83.3%"
    assert result["decision"]["rationale"] == (
        "Consensus reached with 83.3% approval (2 approve, 1 modify, 0 reject)"
    )
    assert {v["reviewer_id"]: v["vote"] for v in result["votes"]} == {
        "reviewer_1": "approve",
        "reviewer_2": "modify",
        "reviewer_3": "approve",
    }
    stats = result["stats"]
    assert stats["segment_distribution"] == {"proposals": 1, "votes": 3, "decisions": 1}
    assert stats["tag_distribution"]["vote"] == 3
    assert stats["agents_involved"] == 5
    # What a run writes to the pool leaves it after a day by default (insight_ttl), so that
    # rounds run for months do not fill it.
    proposal_id = events[0]["data"]["proposal_id"]
    async with connect(embedded.broker.address, agent_id="auditor") as reader:
        written = await reader.read_insights(tags=[proposal_id])
        assert sorted(i.segment for i in written) == ["decisions", "proposals"] + ["votes"] * 3
        for insight in written:
            assert insight.ttl == 86_400
            assert insight.created_at is not None
            assert insight.expires_at == insight.created_at + timedelta(days=1)
        async with GatewayClient(embedded.gateway.address) as client:
            events = await client.collect(
                client.consensus(problem="Should we migrate?", insight_ttl="0.5s")
            )
        brief = events[0]["data"]["proposal_id"]
        assert {i.ttl for i in await reader.read_insights(tags=[brief])} == {0.5}
        async with asyncio.timeout(10):
            while await reader.read_insights(tags=[brief]):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert len(await reader.read_insights(tags=[proposal_id])) == 5


class ChatServer(BaseHTTPRequestHandler):
    """A local server speaking the OpenAI chat-completions API."""

    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ChatServer.seen.append(
            {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
        )
        answer = {"vote": "reject", "feedback": "model says no", "confidence": 0.6}
        payload = json.dumps(
            {"choices": [{"message": {"role": "assistant", "content": json.dumps(answer)}}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def chat_server() -> AsyncIterator[str]:
    server = HTTPServer(("127.0.0.1", 0), ChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()


async def test_a_reviewer_backed_by_a_chat_completions_model(chat_server: str) -> None:
    ChatServer.seen.clear()
    reasoner = ChatCompletionsReasoner(chat_server, "test-model", "secret-key")
    events = await run_with([ReviewerAgent("model_reviewer", reasoner=reasoner)])
    [vote] = [e["data"] for e in events if e["kind"] == "VOTE"]
    assert vote == {
        "reviewer_id": "model_reviewer",
        "vote": "reject",
        "feedback": "model says no",
        "confidence": 0.6,
    }
    assert decision_of(events)["decision"] == "REJECT"
    [call] = ChatServer.seen
    assert call["path"] == "/v1/chat/completions"
    assert call["body"]["model"] == "test-model"
    assert call["auth"] == "Bearer secret-key"
    assert "microservices" in call["body"]["messages"][1]["content"]


@pytest.mark.parametrize(
    ("who", "answer", "said", "reason"),
    [
        (
            "proposer",
            {"proposal": "Migrate"},
            "answered without a proposal_id",
            "PROPOSAL_FAILED",
        ),
        ("proposer", RuntimeError("model offline"), "failed: model offline", "PROPOSAL_FAILED"),
        (
            "facilitator",
            {"rationale": "?"},
            "answered without a decision",
            "DECISION_FAILED",
        ),
        ("facilitator", RuntimeError("model offline"), "failed: model offline", "DECISION_FAILED"),
    ],
    ids=["proposal without id", "proposer raises", "no decision", "facilitator raises"],
)
async def test_a_proposer_or_facilitator_that_fails_aborts_the_round(
    who: str, answer: object, said: str, reason: str
) -> None:
    """A facilitator that raised or answered without a decision was reported as the round's
    decision ({"error": ...}, status COMPLETED). Without a proposal or a decision there is no
    round: the stream ends ABORTED, naming the agent and what it did."""

    @agent(who)
    async def broken(message: Message, ctx: AgentContext) -> object:
        if isinstance(answer, Exception):
            raise answer
        return answer

    async with LocalMesh() as local:
        await local.add_agent(broken)
        if who == "facilitator":
            await local.add_agent(ProposerAgent())
        await local.add_agent(ReviewerAgent("voter_0", reasoner=fixed("approve")))
        gateway = await serve_gateway(local.address)
        try:
            async with GatewayClient(gateway.address) as client:
                events: list[dict[str, Any]] = []
                with pytest.raises(MeshError) as info:
                    async for event in client.consensus(
                        problem="Migrate?", reviewer_ids=["voter_0"]
                    ):
                        events.append(event)
        finally:
            await gateway.stop(0.5)
    assert (info.value.code, info.value.reason) == ("ABORTED", reason)
    assert info.value.message == f"the {who} {who} {said}"
    assert not [e for e in events if e["kind"] in ("DECISION", "RESULT")]
    if who == "facilitator":  # (the votes were asked for and reported before it failed)
        assert [e["agent_id"] for e in events if e["kind"] == "VOTE"] == ["voter_0"]


async def test_a_vote_in_the_pool_that_cannot_count_is_left_out_not_fatal() -> None:
    """The facilitator reads the votes from the shared memory pool, which any agent may write.
    A vote there that is no vote (here: "maybe") failed the facilitator, and so the round;
    now it is left out, named, and the others decide."""

    @agent("rogue")
    async def rogue(message: Message, ctx: AgentContext) -> dict[str, Any]:
        proposal_id = str(message.content["proposal_id"])
        await ctx.client.write_insight(
            {"reviewer_id": "rogue", "vote": "maybe"},
            tags=["vote", "rogue", proposal_id],
            segment="votes",
            agent_id="rogue",
        )
        return {"vote": "approve", "confidence": 0.9}

    voters = [ReviewerAgent(f"voter_{i}", reasoner=fixed("approve")) for i in range(2)]
    events = await run_with([*voters, rogue], problem="Migrate?", wait_for_all_votes=True)
    result = decision_of(events)
    assert result["decision"] == "ACCEPT"
    assert result["unreadable_votes"] == ["rogue"]
    assert result["votes_counted"] == 2
    assert events[-1]["data"]["status"] == "COMPLETED"

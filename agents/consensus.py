"""The consensus-building agents: proposer, reviewers and facilitator, coordinating through the
mesh's shared memory pool (segments proposals, votes, decisions)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from agents._data import read
from agents.reasoning import ReasoningAgent
from gateway.patterns._common import as_float
from gateway.patterns.consensus import decide, vote_from
from mesh import Agent, AgentContext, Message, on
from mesh.core.errors import MessageValidationError


class ProposerAgent(ReasoningAgent):
    """Creates a proposal for a problem and writes it to the shared memory pool."""

    agent_id = "proposer"
    agent_types = ("consensus", "proposer")
    capabilities = ("propose",)

    async def _rules(self, task: str, inputs: dict[str, Any]) -> dict[str, Any]:
        problem = str(inputs["problem"]).lower()
        catalog = (await read("consensus.json", self.data_dir))["proposals"]
        chosen = next(p for p in catalog if not p["match"] or any(m in problem for m in p["match"]))
        return {
            "proposal": chosen["proposal"],
            "reasoning": chosen["reasoning"],
            "traits": chosen["traits"],
        }

    @on("propose")
    async def propose(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        problem = str((message.content or {}).get("problem") or "")
        if not problem:
            raise ValueError("a proposal needs a problem")
        made = await self.reasoner.complete(
            "propose", {"problem": problem}, '{"proposal": str, "reasoning": str, "traits": [str]}'
        )
        proposal_id = f"proposal_{uuid.uuid4().hex[:8]}"
        content = {
            "proposal": made["proposal"],
            "reasoning": made.get("reasoning", ""),
            "problem": problem,
            "traits": made.get("traits", []),
        }
        await ctx.client.write_insight(
            content,
            tags=["proposal", "pending", proposal_id],
            importance=0.9,
            segment="proposals",
            metadata={"proposal_id": proposal_id, "problem": problem},
            agent_id=self.agent_id,
            ttl=insight_ttl(message),
        )
        return {"proposal_id": proposal_id, **content}


def insight_ttl(message: Message) -> float:
    """How long the pool is to keep what this agent writes for the run (0: until deleted)."""
    return as_float((message.content or {}).get("insight_ttl"), 0.0)


class ReviewerAgent(ReasoningAgent):
    """Reads a proposal from the pool, votes approve / reject / modify from its focus, and
    writes the vote to the pool."""

    agent_types = ("consensus", "reviewer")
    capabilities = ("review",)

    async def _rules(self, task: str, inputs: dict[str, Any]) -> dict[str, Any]:
        profile = (await read("consensus.json", self.data_dir))["reviewers"][self.agent_id]
        traits = set(inputs["proposal"].get("traits", []))
        for vote in ("reject", "modify", "approve"):
            hits = sorted(traits.intersection(profile[vote]))
            if hits:
                return {
                    "vote": vote,
                    "confidence": profile["confidence"],
                    "feedback": f"{profile['focus']} review: {vote} because of {', '.join(hits)}",
                }
        return {
            "vote": "modify",
            "confidence": 0.5,
            "feedback": f"{profile['focus']} review: nothing in it addresses my concerns",
        }

    @on("review")
    async def review(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        proposal_id = str((message.content or {}).get("proposal_id") or "")
        found = await ctx.client.read_insights(tags=["proposal", proposal_id], limit=1)
        if not found:
            raise LookupError(f"proposal {proposal_id} is not in the shared memory pool")
        proposal = found[0].content
        assert isinstance(proposal, dict)
        answer = await self.reasoner.complete(
            "review",
            {"proposal": proposal, "reviewer": self.agent_id},
            '{"vote": "approve"|"reject"|"modify", "feedback": str, "confidence": number}',
        )
        vote = vote_from(self.agent_id, answer)
        await ctx.client.write_insight(
            vote.to_dict(),
            tags=["vote", self.agent_id, proposal_id],
            importance=0.8,
            segment="votes",
            metadata={"proposal_id": proposal_id, "reviewer_id": self.agent_id},
            agent_id=self.agent_id,
            ttl=insight_ttl(message),
        )
        return vote.to_dict()


class FacilitatorAgent(Agent):
    """Reads the votes from the pool, applies the decision matrix, writes the decision."""

    agent_id = "facilitator"
    agent_types = ("consensus", "facilitator")
    capabilities = ("facilitate",)

    @on("facilitate")
    async def facilitate(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        content = message.content or {}
        proposal_id = str(content.get("proposal_id") or "")
        counted = set(content.get("reviewers") or [])
        insights = await ctx.client.read_insights(
            tags=["vote", proposal_id], segment="votes", limit=1000
        )
        latest: dict[str, Any] = {}
        for insight in reversed(insights):  # oldest first, so a later vote wins
            if isinstance(insight.content, dict):
                latest[str(insight.content.get("reviewer_id"))] = insight.content
        votes, unreadable = [], []
        for reviewer, said in sorted(latest.items()):
            if counted and reviewer not in counted:
                continue
            try:  # (the pool is anyone's to write: a vote that cannot count is left out)
                votes.append(vote_from(reviewer, said))
            except MessageValidationError:
                unreadable.append(reviewer)
        decision = decide(
            votes,
            threshold=float(content.get("threshold") or 0.67),
            quorum=int(content.get("quorum") or 0),
            weights=dict(content.get("weights") or {}),
        )
        await ctx.client.write_insight(
            decision,
            tags=["decision", "final", proposal_id],
            importance=1.0,
            segment="decisions",
            metadata={"proposal_id": proposal_id},
            agent_id=self.agent_id,
            ttl=insight_ttl(message),
        )
        stats = await ctx.client.memory_stats()
        return {
            **decision,
            **({"unreadable_votes": unreadable} if unreadable else {}),
            "proposal_id": proposal_id,
            "memory_stats": {
                "total_insights": stats.total_insights,
                "agents_involved": stats.agents_involved,
                "tag_distribution": stats.tag_distribution,
                "segment_distribution": stats.segment_distribution,
            },
        }


def consensus_agents(data_dir: str | Path | None = None, reviewers: int = 5) -> list[Agent]:
    return [
        ProposerAgent(data_dir=data_dir),
        *(ReviewerAgent(f"reviewer_{i}", data_dir=data_dir) for i in range(1, reviewers + 1)),
        FacilitatorAgent(),
    ]

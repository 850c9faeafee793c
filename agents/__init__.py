"""Sample agents, each served on its own gRPC server; their answers come from data/*.json."""

from __future__ import annotations

from pathlib import Path

from agents.consensus import consensus_agents
from agents.refund import refund_agents
from agents.stocks import stock_experts
from agents.travel import flight_agents, hotel_agents
from mesh import Agent


def sample_agents(data_dir: str | Path | None = None) -> list[Agent]:
    """Every sample agent: stock experts, refund workflow, hotel and flight specialists,
    consensus proposer, reviewers and facilitator."""
    return [
        *stock_experts(data_dir),
        *refund_agents(data_dir),
        *hotel_agents(data_dir),
        *flight_agents(data_dir),
        *consensus_agents(data_dir),
    ]


__all__ = [
    "consensus_agents",
    "flight_agents",
    "hotel_agents",
    "refund_agents",
    "sample_agents",
    "stock_experts",
]

"""The hub-and-spoke research system: subagents, their tools and the analysis they share."""

from agents.research.agents import research_agents
from agents.research.corpus import RESEARCH_POLICY, research_tool_host, research_tools, tool_host

__all__ = [
    "RESEARCH_POLICY",
    "research_agents",
    "research_tool_host",
    "research_tools",
    "tool_host",
]

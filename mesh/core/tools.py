"""Tools run by the mesh on behalf of agents, each agent limited to its allow-list.

A tool is a coroutine function of JSON arguments returning JSON. The host tells a timeout
(DEADLINE_EXCEEDED: worth retrying) from a business error (FAILED_PRECONDITION: not worth it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from mesh.core.errors import MeshError
from mesh.core.model import JSON

logger = logging.getLogger("mesh.tools")
ToolFn = Callable[[dict[str, JSON]], Awaitable[JSON]]


class ToolPermissionError(MeshError):
    """The agent may not use this tool."""

    code = "PERMISSION_DENIED"
    reason = "TOOL_NOT_ALLOWED"


class UnknownToolError(MeshError):
    code = "NOT_FOUND"
    reason = "UNKNOWN_TOOL"


class ToolTimeoutError(MeshError):
    """The tool did not finish in time; a retry may succeed."""

    code = "DEADLINE_EXCEEDED"
    reason = "TOOL_TIMEOUT"


class ToolFailedError(MeshError):
    """The tool failed for a reason a retry will not fix (a missing file, bad arguments)."""

    code = "FAILED_PRECONDITION"
    reason = "TOOL_FAILED"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    run: ToolFn


class ToolHost:
    """Runs tools for agents; ``policy`` maps an agent id to the tool names it may use."""

    def __init__(self, tools: Sequence[Tool], policy: Mapping[str, Sequence[str]]) -> None:
        self.tools = {t.name: t for t in tools}
        self.policy = {agent: frozenset(names) for agent, names in policy.items()}

    def allowed(self, agent_id: str) -> list[Tool]:
        names = self.policy.get(agent_id, frozenset())
        return [t for name, t in sorted(self.tools.items()) if name in names]

    async def invoke(
        self, agent_id: str, name: str, arguments: dict[str, JSON], timeout: float = 10.0
    ) -> JSON:
        if name not in self.tools:
            raise UnknownToolError(f"no tool named {name!r}")
        if name not in self.policy.get(agent_id, frozenset()):
            logger.warning(
                "refused %s to %s",
                name,
                agent_id,
                extra={"event": {"category": "tool_denied", "agent_id": agent_id, "tool": name}},
            )
            raise ToolPermissionError(f"{agent_id} may not use {name}")
        try:
            async with asyncio.timeout(timeout):
                return await self.tools[name].run(arguments)
        except TimeoutError:
            raise ToolTimeoutError(f"{name} did not finish within {timeout:g} s") from None
        except MeshError:
            raise
        except (OSError, ValueError, KeyError, LookupError) as exc:
            raise ToolFailedError(f"{name} failed: {exc}") from None

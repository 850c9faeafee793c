"""The agent registry: who is on the mesh, of which types, at which address."""

from __future__ import annotations

from collections.abc import Iterable

from mesh.core.errors import (
    AgentNotFoundError,
    FieldViolation,
    LimitExceededError,
    MessageValidationError,
)
from mesh.core.model import BROADCAST_TARGET, AgentInfo, utc_now

MAX_TYPES = 32
MAX_CAPABILITIES = 128


class AgentRegistry:
    """Registered agents by id; bounded by ``max_agents``."""

    def __init__(self, max_agents: int = 10_000, max_id_length: int = 256) -> None:
        self._agents: dict[str, AgentInfo] = {}
        self.max_agents = max_agents
        self.max_id_length = max_id_length

    def register(self, info: AgentInfo) -> AgentInfo:
        violations = []
        if not info.agent_id:
            violations.append(FieldViolation("agent.agent_id", "agent_id is required"))
        elif info.agent_id == BROADCAST_TARGET:
            violations.append(FieldViolation("agent.agent_id", f'"{BROADCAST_TARGET}" is reserved'))
        elif len(info.agent_id) > self.max_id_length or not info.agent_id.isprintable():
            violations.append(
                FieldViolation(
                    "agent.agent_id",
                    f"agent_id must be printable and at most {self.max_id_length} characters",
                )
            )
        if any(not t for t in info.agent_types):
            violations.append(FieldViolation("agent.agent_types", "agent types must not be empty"))
        for name, values, most in (
            ("agent_types", info.agent_types, MAX_TYPES),
            ("capabilities", info.capabilities, MAX_CAPABILITIES),
        ):
            if len(values) > most:
                violations.append(FieldViolation(f"agent.{name}", f"at most {most} {name}"))
            if any(len(v) > self.max_id_length for v in values):
                violations.append(
                    FieldViolation(
                        f"agent.{name}", f"{name} must be at most {self.max_id_length} characters"
                    )
                )
        if len(info.address) > self.max_id_length:
            violations.append(
                FieldViolation(
                    "agent.address", f"address must be at most {self.max_id_length} characters"
                )
            )
        if violations:
            raise MessageValidationError.from_violations(violations)
        if info.agent_id not in self._agents and len(self._agents) >= self.max_agents:
            raise LimitExceededError(f"the registry holds its limit of {self.max_agents} agents")
        previous = self._agents.get(info.agent_id)
        registered = AgentInfo(
            agent_id=info.agent_id,
            agent_types=tuple(dict.fromkeys(info.agent_types)),
            address=info.address,
            capabilities=tuple(dict.fromkeys(info.capabilities)),
            registered_at=previous.registered_at if previous else utc_now(),
        )
        self._agents[info.agent_id] = registered
        return registered

    def deregister(self, agent_id: str) -> AgentInfo:
        info = self._agents.pop(agent_id, None)
        if info is None:
            raise AgentNotFoundError(f"agent {agent_id} is not registered")
        return info

    def get(self, agent_id: str) -> AgentInfo | None:
        return self._agents.get(agent_id)

    def require(self, agent_id: str) -> AgentInfo:
        info = self._agents.get(agent_id)
        if info is None:
            raise AgentNotFoundError(f"agent {agent_id} is not registered")
        return info

    def __contains__(self, agent_id: object) -> bool:
        return agent_id in self._agents

    def __len__(self) -> int:
        return len(self._agents)

    def ids(self) -> list[str]:
        """The registered agents' ids, in registration order."""
        return list(self._agents)

    def agents(self, agent_type: str = "") -> list[AgentInfo]:
        agents = sorted(self._agents.values(), key=lambda a: a.agent_id)
        if agent_type:
            agents = [a for a in agents if agent_type in a.agent_types]
        return agents

    def of_types(self, agent_types: Iterable[str]) -> list[AgentInfo]:
        wanted = set(agent_types)
        return [a for a in self.agents() if wanted.intersection(a.agent_types)]

"""The agent registry: who is on the mesh, of which types, at which address."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from datetime import datetime

from mesh.core.errors import (
    AgentNotFoundError,
    FieldViolation,
    LimitExceededError,
    MessageValidationError,
)
from mesh.core.model import BROADCAST_TARGET, AgentInfo, DeliveryMode, utc_now

MAX_TYPES = 32
MAX_CAPABILITIES = 128
MAX_REQUIRED_FIELDS = 32
MAX_INSTANCES = 64
"""Instances kept per agent: past it, the one registered longest ago is forgotten."""


_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")
_URLS = ("http://", "https://", "grpc://", "grpcs://")
"""What tools such as buf curl are given, and gRPC cannot dial (it reads them as host names)."""


def address_problem(address: str) -> str | None:
    """What is wrong with a server's address for gRPC to dial it as meant, or None: it is
    empty, a URL (``http://host:port``), or a host:port whose port is past 65535 (gRPC would
    wrap it round to another)."""
    if not address.strip():
        return "an address is required: host:port (or any gRPC target)"
    if address.lower().startswith(_URLS):
        scheme, _, rest = address.partition("://")
        return (
            f"{address} is a URL, not a gRPC target: give host:port ({rest.rstrip('/')}; "
            f"TLS is set apart, not by {scheme}://)"
        )
    if not address.startswith(_SCHEMES) and "://" not in address:
        port = address.rpartition(":")[2]
        if port.isascii() and port.isdigit() and not 0 < int(port) < 65536:
            return f"{address}: a port is from 1 to 65535"
    return None


class AgentRegistry:
    """Registered agents by id; bounded by ``max_agents``."""

    def __init__(
        self, max_agents: int = 10_000, max_id_length: int = 256, max_in_flight: int = 10_000
    ) -> None:
        self._agents: dict[str, AgentInfo] = {}
        self.max_agents = max_agents
        self.max_id_length = max_id_length
        self.max_in_flight = max_in_flight

    def register(self, info: AgentInfo, *, restore: bool = False) -> AgentInfo:
        """Registers an instance of an agent: the agent's types, capabilities and address
        become the ones given, and its address joins the agent's instances (one leaving takes
        the agent off only with the last: :meth:`leave`). ``restore``: the registration as a
        store kept it, its instances as they are."""
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
        if any(not f for f in info.required_fields):
            violations.append(
                FieldViolation("agent.required_fields", "required fields must not be empty")
            )
        for name, values, most in (
            ("agent_types", info.agent_types, MAX_TYPES),
            ("capabilities", info.capabilities, MAX_CAPABILITIES),
            ("required_fields", info.required_fields, MAX_REQUIRED_FIELDS),
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
        if info.address and (problem := address_problem(info.address)):
            violations.append(FieldViolation("agent.address", problem))
        if info.delivery_mode is DeliveryMode.PUSH and not info.address:
            violations.append(
                FieldViolation(
                    "agent.address",
                    "push delivery needs the address of the agent's server (host:port)",
                )
            )
        if not 0 <= info.max_in_flight <= self.max_in_flight:
            violations.append(
                FieldViolation(
                    "agent.max_in_flight", f"max_in_flight must be within 0..{self.max_in_flight}"
                )
            )
        if violations:
            raise MessageValidationError.from_violations(violations)
        if info.agent_id not in self._agents and len(self._agents) >= self.max_agents:
            raise LimitExceededError(f"the registry holds its limit of {self.max_agents} agents")
        previous = self._agents.get(info.agent_id)
        if restore:
            # (A registration kept before instances were counted: its address alone.)
            instances = info.instances or ((info.address,) if info.address else ())
            since = info.registered_at
            subscribed = info.subscribed
            lost_at = info.lost_at
            pushed = dict(info.pushed)
        else:
            earlier = previous.instances if previous else ()
            instances = tuple(a for a in earlier if a != info.address)
            if info.address:
                instances = (*instances, info.address)
            since = previous.registered_at if previous else None
            subscribed = previous.subscribed if previous else {}
            lost_at = previous.lost_at if previous else None
            # Each instance keeps the delivery it registered with: one registering to pull
            # (an old process of a rolling update) does not stop the pushes to the others.
            pushed = dict(previous.pushed) if previous else {}
            pushed.pop(info.address, None)
            if info.delivery_mode is DeliveryMode.PUSH:
                pushed[info.address] = info.max_in_flight
        instances = instances[-MAX_INSTANCES:]
        registered = AgentInfo(
            agent_id=info.agent_id,
            agent_types=tuple(dict.fromkeys(info.agent_types)),
            address=info.address,
            capabilities=tuple(dict.fromkeys(info.capabilities)),
            registered_at=since or utc_now(),
            instances=instances,
            subscribed={a: s for a, s in subscribed.items() if a in instances},
            lost_at=None if instances else lost_at,
            delivery_mode=info.delivery_mode,
            max_in_flight=info.max_in_flight,
            pushed={a: n for a, n in pushed.items() if a in instances},
            required_fields=tuple(dict.fromkeys(info.required_fields)),
        )
        self._agents[info.agent_id] = registered
        return registered

    def deregister(self, agent_id: str) -> AgentInfo:
        """Takes the agent off, every instance of it."""
        named(agent_id)
        info = self._agents.pop(agent_id, None)
        if info is None:
            raise AgentNotFoundError(f"agent {agent_id} is not registered")
        return info

    def discard(self, agent_id: str) -> None:
        """Forgets the agent if it is registered (it left through another replica)."""
        self._agents.pop(agent_id, None)

    def leave(self, agent_id: str, address: str) -> AgentInfo | None:
        """One instance of the agent, at ``address``, leaves. The agent stays while other
        instances serve it (its address the latest of theirs) and is returned; with the last
        one (or with none known but this) it is taken off, and None is returned."""
        info = self.require(agent_id)
        others = tuple(a for a in info.instances if a != address)
        if not others:
            del self._agents[agent_id]
            return None
        return self._without(info, address)

    def hold(self, agent_id: str, address: str, subscription_id: str) -> AgentInfo:
        """A subscription of the instance at ``address`` opened: while it lasts the instance
        serves the agent (it is put back among the agent's instances, the latest, if a lost
        subscription had taken it off) and the subscription holds it (:meth:`lose`)."""
        info = self.require(agent_id)
        if len(address) > self.max_id_length:
            raise MessageValidationError.for_field(
                "instance", f"instance must be at most {self.max_id_length} characters"
            )
        if address in info.instances:
            held = info
        else:
            instances = (*info.instances, address)[-MAX_INSTANCES:]
            held = dataclasses.replace(info, address=address, instances=instances)
        subscribed = {a: s for a, s in info.subscribed.items() if a in held.instances}
        subscribed[address] = subscription_id
        pushed = {a: n for a, n in info.pushed.items() if a in held.instances}
        held = dataclasses.replace(held, subscribed=subscribed, lost_at=None, pushed=pushed)
        self._agents[agent_id] = held
        return held

    def lose(self, agent_id: str, address: str, subscription_id: str) -> AgentInfo | None:
        """The subscription that held the instance at ``address`` ended while the instance was
        still registered (its process died, its connection was lost): the instance is taken
        off, unless another subscription holds it since (the process subscribed again,
        here or through another replica). The agent stays registered, with no instance when
        that was the last, so that its queue keeps what is sent to it until one comes back.
        Returns the agent as changed, or None when nothing changed."""
        info = self._agents.get(agent_id)
        if info is None or info.subscribed.get(address) != subscription_id:
            return None
        return self._without(info, address, lost=True)

    def lose_unreachable(self, agent_id: str, address: str, since: datetime) -> AgentInfo | None:
        """The instance at ``address``, taking its messages by push, has not answered since
        ``since``: it is taken off as :meth:`lose` takes off one whose subscription ended (a
        last one lost then). Returns the agent as changed, or None when nothing changed."""
        info = self._agents.get(agent_id)
        if info is None or address not in info.instances:
            return None
        return self._without(info, address, lost=True, lost_at=since)

    def _without(
        self, info: AgentInfo, address: str, *, lost: bool = False, lost_at: datetime | None = None
    ) -> AgentInfo:
        others = tuple(a for a in info.instances if a != address)
        remaining = dataclasses.replace(
            info,
            address=others[-1] if others else "",
            instances=others,
            subscribed={a: s for a, s in info.subscribed.items() if a != address},
            lost_at=(lost_at or utc_now()) if lost and not others else info.lost_at,
            pushed={a: n for a, n in info.pushed.items() if a != address},
        )
        self._agents[info.agent_id] = remaining
        return remaining

    def get(self, agent_id: str) -> AgentInfo | None:
        return self._agents.get(agent_id)

    def require(self, agent_id: str) -> AgentInfo:
        named(agent_id)
        info = self._agents.get(agent_id)
        if info is None:
            raise AgentNotFoundError(f"agent {agent_id} is not registered")
        return info

    def __contains__(self, agent_id: object) -> bool:
        return agent_id in self._agents

    def __len__(self) -> int:
        return len(self._agents)

    def __iter__(self) -> Iterator[AgentInfo]:
        """The registered agents, in registration order (unsorted: :meth:`agents` sorts)."""
        return iter(list(self._agents.values()))

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


def named(agent_id: str) -> None:
    """A call about an agent names it: none is INVALID_ARGUMENT, not an agent "" not found
    (nor a call that quietly does nothing)."""
    if not agent_id:
        raise MessageValidationError.for_field("agent_id", "agent_id is required")

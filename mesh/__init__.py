"""agentmesh: a gRPC agent mesh.

The pieces most programs need::

    from mesh import connect, Agent, agent, serve, Message, Priority

Each is imported when first asked for (PEP 562), so that importing the pure core
(``mesh.core``) or the gateway's patterns does not load gRPC and the SDK with them.
"""

import importlib as _importlib
import os as _os
import sys as _sys
import types as _types
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

# gRPC's core writes some INFO lines of its own to stderr ("Got goaway" when a peer closes a
# connection): not JSON, they break the mesh's JSON-lines log for whatever reads it. Errors
# only, unless the environment says otherwise; it must be set before grpc is first imported.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

if _TYPE_CHECKING:
    from mesh.agent import (
        Agent,
        AgentContext,
        AgentServer,
        ServedAgents,
        agent,
        on,
        run_agents,
        serve,
        serve_all,
    )
    from mesh.client import AgentClient, MeshClient, Received, RetryPolicy, connect
    from mesh.config import BrokerConfig, SecurityConfig, ServerConfig
    from mesh.core import (
        BROADCAST_TARGET,
        AgentCard,
        AgentError,
        AgentInfo,
        AgentNotFoundError,
        Broker,
        BrokerUnavailableError,
        ChangeKind,
        ConflictResolutionError,
        DeadLetter,
        Delivery,
        DeliveryMode,
        Handoff,
        HandoffError,
        LimitExceededError,
        LockNotHeldError,
        MeshError,
        Message,
        MessageIdTakenError,
        MessageQueueFullError,
        MessageTooLargeError,
        MessageType,
        MessageValidationError,
        MultiAgentCommunicationError,
        NotFoundError,
        PermissionDeniedError,
        Priority,
        QueuedMessage,
        QueuedState,
        RequestTimeoutError,
        RetryLater,
        RoutingError,
        SessionClosedError,
        StateChange,
        StateConflictError,
        StateEntry,
        StateLock,
        StatePage,
        Tool,
        UnauthenticatedError,
        UnhandledActionError,
        negotiation,
    )
    from mesh.server import serve_broker
    from mesh.testing import LocalMesh


_HOMES = ("mesh.core", "mesh.config", "mesh.client", "mesh.agent", "mesh.server", "mesh.testing")
"""Where the names of ``__all__`` live, in the order they are looked for: the pure core's
first, whose names load no gRPC."""


def __getattr__(name: str) -> _Any:
    if name in __all__:
        for home in _HOMES:
            module = _importlib.import_module(home)
            if name in vars(module):
                value = vars(module)[name]
                globals()[name] = value  # (found once: the next lookup finds it here)
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(_types.ModuleType):
    """The package, whose names win over its submodules of the same name: ``mesh.agent`` is
    the decorator, not the module ``mesh.agent``, whichever import loads that module (the
    import system binds a submodule onto its package as it loads it)."""

    def __setattr__(self, name: str, value: object) -> None:
        if (
            name in __all__
            and isinstance(value, _types.ModuleType)
            and value.__name__ == f"{__name__}.{name}"
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


__all__ = [
    "BROADCAST_TARGET",
    "Agent",
    "AgentCard",
    "AgentClient",
    "AgentContext",
    "AgentError",
    "AgentInfo",
    "AgentNotFoundError",
    "AgentServer",
    "Broker",
    "BrokerConfig",
    "BrokerUnavailableError",
    "ChangeKind",
    "ConflictResolutionError",
    "DeadLetter",
    "Delivery",
    "DeliveryMode",
    "Handoff",
    "HandoffError",
    "LimitExceededError",
    "LocalMesh",
    "LockNotHeldError",
    "MeshClient",
    "MeshError",
    "Message",
    "MessageIdTakenError",
    "MessageQueueFullError",
    "MessageTooLargeError",
    "MessageType",
    "MessageValidationError",
    "MultiAgentCommunicationError",
    "NotFoundError",
    "PermissionDeniedError",
    "Priority",
    "QueuedMessage",
    "QueuedState",
    "Received",
    "RequestTimeoutError",
    "RetryLater",
    "RetryPolicy",
    "RoutingError",
    "SecurityConfig",
    "ServedAgents",
    "ServerConfig",
    "SessionClosedError",
    "StateChange",
    "StateConflictError",
    "StateEntry",
    "StateLock",
    "StatePage",
    "Tool",
    "UnauthenticatedError",
    "UnhandledActionError",
    "agent",
    "connect",
    "negotiation",
    "on",
    "run_agents",
    "serve",
    "serve_all",
    "serve_broker",
]

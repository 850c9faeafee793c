"""agentmesh: a gRPC agent mesh.

The pieces most programs need::

    from mesh import connect, Agent, agent, serve, Message, Priority
"""

import os as _os

# gRPC's core writes some INFO lines of its own to stderr ("Got goaway" when a peer closes a
# connection): not JSON, they break the mesh's JSON-lines log for whatever reads it. Errors
# only, unless the environment says otherwise; it must be set before grpc is first imported.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from mesh.agent import Agent, AgentContext, AgentServer, ServedAgents, agent, on, serve, serve_all
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
    RequestTimeoutError,
    RoutingError,
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
    "Received",
    "RequestTimeoutError",
    "RetryPolicy",
    "RoutingError",
    "SecurityConfig",
    "ServedAgents",
    "ServerConfig",
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
    "serve",
    "serve_all",
    "serve_broker",
]

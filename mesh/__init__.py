"""agentmesh: a gRPC agent mesh.

The pieces most programs need::

    from mesh import connect, Agent, agent, serve, Message, Priority
"""

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
    ConflictResolutionError,
    DeadLetter,
    Delivery,
    Handoff,
    HandoffError,
    MeshError,
    Message,
    MessageQueueFullError,
    MessageTooLargeError,
    MessageType,
    MessageValidationError,
    MultiAgentCommunicationError,
    PermissionDeniedError,
    Priority,
    RequestTimeoutError,
    RoutingError,
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
    "ConflictResolutionError",
    "DeadLetter",
    "Delivery",
    "Handoff",
    "HandoffError",
    "LocalMesh",
    "MeshClient",
    "MeshError",
    "Message",
    "MessageQueueFullError",
    "MessageTooLargeError",
    "MessageType",
    "MessageValidationError",
    "MultiAgentCommunicationError",
    "PermissionDeniedError",
    "Priority",
    "Received",
    "RequestTimeoutError",
    "RetryPolicy",
    "RoutingError",
    "SecurityConfig",
    "ServedAgents",
    "ServerConfig",
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

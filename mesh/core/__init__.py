"""The pure core of the mesh: message model, validation, queues, registry and broker logic.

Nothing here imports gRPC; the transport in :mod:`mesh.server` and :mod:`mesh.client`
translates to and from it.
"""

from mesh.core.broker import BroadcastOutcome, Broker, SendOutcome, Subscription
from mesh.core.errors import (
    AgentError,
    AgentNotFoundError,
    BrokerUnavailableError,
    ConflictResolutionError,
    FieldViolation,
    HandoffError,
    LimitExceededError,
    MeshError,
    MessageQueueFullError,
    MessageTooLargeError,
    MessageValidationError,
    MultiAgentCommunicationError,
    PermissionDeniedError,
    RequestTimeoutError,
    RoutingError,
    SessionClosedError,
    UnauthenticatedError,
    UnhandledActionError,
)
from mesh.core.model import (
    BROADCAST_TARGET,
    AgentCard,
    AgentInfo,
    DeadLetter,
    Delivery,
    Handoff,
    Message,
    MessageType,
    Priority,
    Tool,
)
from mesh.core.queue import InMemoryQueueStore, QueueStore

__all__ = [
    "BROADCAST_TARGET",
    "AgentCard",
    "AgentError",
    "AgentInfo",
    "AgentNotFoundError",
    "BroadcastOutcome",
    "Broker",
    "BrokerUnavailableError",
    "ConflictResolutionError",
    "DeadLetter",
    "Delivery",
    "FieldViolation",
    "Handoff",
    "HandoffError",
    "InMemoryQueueStore",
    "LimitExceededError",
    "MeshError",
    "Message",
    "MessageQueueFullError",
    "MessageTooLargeError",
    "MessageType",
    "MessageValidationError",
    "MultiAgentCommunicationError",
    "PermissionDeniedError",
    "Priority",
    "QueueStore",
    "RequestTimeoutError",
    "RoutingError",
    "SendOutcome",
    "SessionClosedError",
    "Subscription",
    "Tool",
    "UnauthenticatedError",
    "UnhandledActionError",
]

"""The exception tree of the mesh (RT-011 "Excepciones").

Every error carries the name of the gRPC status code it maps to, a machine-readable
``reason`` and, where it applies, field violations and a retry delay. The core raises these;
the transport turns them into a rich gRPC status in one place, and the SDK turns the status
back into the same class by its reason, so callers never see a raw gRPC error.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

from mesh.config import MAX_TTL

_SHOWN = reprlib.Repr()  # (Python 3.11 takes no limits as arguments)
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 3, 5, 5
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 80, 80, 40


def shown(value: Any) -> str:
    """``value`` as an error message quotes what an agent or a caller sent: its repr, cut
    short (an answer of a megabyte must not come back in every event that names it)."""
    return _SHOWN.repr(value)


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One invalid field of a message: its path and what is wrong with it."""

    field: str
    description: str


class MultiAgentCommunicationError(Exception):
    """Base exception for multi-agent communication errors."""

    code: str = "INTERNAL"
    reason: str = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        field_violations: tuple[FieldViolation, ...] = (),
        retry_after: float | None = None,
        reason: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field_violations = field_violations
        self.retry_after = retry_after
        if reason is not None:
            self.reason = reason
        if code is not None:
            self.code = code


MeshError = MultiAgentCommunicationError


class MessageValidationError(MultiAgentCommunicationError):
    """Message does not conform to the format standard."""

    code = "INVALID_ARGUMENT"
    reason = "VALIDATION_FAILED"

    @classmethod
    def for_field(cls, field: str, description: str) -> MessageValidationError:
        """One invalid field, described: the message is the description."""
        return cls(description, field_violations=(FieldViolation(field, description),))

    @classmethod
    def from_violations(cls, violations: list[FieldViolation]) -> MessageValidationError:
        text = "; ".join(v.description for v in violations)
        return cls(text, field_violations=tuple(violations))


class MessageTooLargeError(MessageValidationError):
    """A message, or a part of it, is larger than the configured limit."""

    reason = "MESSAGE_TOO_LARGE"


class RoutingError(MultiAgentCommunicationError):
    """Cannot route a message or task to an appropriate agent."""

    code = "FAILED_PRECONDITION"
    reason = "ROUTING_FAILED"


class AgentNotFoundError(RoutingError):
    """The target agent is not registered."""

    code = "NOT_FOUND"
    reason = "AGENT_NOT_FOUND"


DEREGISTERED = "AGENT_DEREGISTERED"
"""The reason of the AgentNotFoundError that ends an agent's subscriptions when it is
deregistered: not a broker that forgot it (which an SDK agent answers by registering again),
but someone who took it off the mesh on purpose."""


def deregistered(agent_id: str) -> AgentNotFoundError:
    return AgentNotFoundError(
        f"agent {agent_id} was deregistered: its subscription ended", reason=DEREGISTERED
    )


class HandoffError(MultiAgentCommunicationError):
    """Hand-off between agents failed."""

    code = "INVALID_ARGUMENT"
    reason = "HANDOFF_FAILED"


class ConflictResolutionError(MultiAgentCommunicationError):
    """Cannot resolve a conflict between agents."""

    code = "ABORTED"
    reason = "CONFLICT_UNRESOLVED"


class MessageQueueFullError(MultiAgentCommunicationError):
    """A message queue is full; retry after ``retry_after`` seconds."""

    code = "RESOURCE_EXHAUSTED"
    reason = "QUEUE_FULL"


class RequestTimeoutError(MultiAgentCommunicationError):
    """No response arrived before the deadline."""

    code = "DEADLINE_EXCEEDED"
    reason = "DEADLINE_EXCEEDED"


class BrokerUnavailableError(MultiAgentCommunicationError):
    """The broker (or an agent server) could not be reached."""

    code = "UNAVAILABLE"
    reason = "UNAVAILABLE"


class AgentError(MultiAgentCommunicationError):
    """The agent handled the request and answered with an ERROR message."""

    code = "ABORTED"
    reason = "AGENT_ERROR"


class UnhandledActionError(MultiAgentCommunicationError, LookupError):
    """An agent has no handler for a message's action: trying again would fail the same way
    (a REQUEST is answered with an ERROR of this reason; any other message is
    dead-lettered at once, or, a broadcast, left aside)."""

    code = "UNIMPLEMENTED"
    reason = "UNHANDLED_ACTION"


class RetryLater(MultiAgentCommunicationError):
    """Raised by a handler for a message it cannot handle yet (a rate limit met, a resource
    not ready, an order not paid yet): the message goes back to the broker and comes again
    ``after`` seconds from now (a nack's ``redeliver_after``, up to a day), to whichever
    instance of the agent is free then; meanwhile its place in flight takes the agent's other
    messages. Whatever its type: a requester waits on (within its own timeout), and nothing is
    answered now. The delivery counts as an attempt: after the broker's last the message goes
    to the dead-letter queue. Called directly, by the broker's push or by a caller of the
    agent's own server, the agent answers ``UNAVAILABLE`` with a RetryInfo of ``after``."""

    code = "UNAVAILABLE"
    reason = "RETRY_LATER"

    def __init__(self, after: float, why: str = "") -> None:
        if (
            isinstance(after, bool)
            or not isinstance(after, int | float)
            or not 0 < after <= MAX_TTL  # (NaN too; a broker's longest wait by default)
        ):
            raise ValueError(
                f"RetryLater takes the seconds to wait, more than 0 and at most {MAX_TTL},"
                f" not {shown(after)}"
            )
        super().__init__(why or f"retry in {after:g} s", retry_after=float(after))


class SessionClosedError(MultiAgentCommunicationError):
    """The session or subscription was closed."""

    code = "CANCELLED"
    reason = "SESSION_CLOSED"


class MessageIdTakenError(MultiAgentCommunicationError):
    """Another sender's message with the same id is in the agent's queue: the id is no retry
    of this sender's (which would be accepted once), and taking it would lose one of the two."""

    code = "ALREADY_EXISTS"
    reason = "MESSAGE_ID_TAKEN"


def message_id_taken(agent_id: str, message_id: str, holder: str) -> MessageIdTakenError:
    return MessageIdTakenError(
        f"{agent_id}'s queue holds a message {message_id!r} from {holder}: a message id must"
        " be unique (leave it empty, and one is assigned, or make it a UUID)"
    )


class LimitExceededError(MultiAgentCommunicationError):
    """A bounded resource (pending requests, subscriptions) is at its limit."""

    code = "RESOURCE_EXHAUSTED"
    reason = "LIMIT_EXCEEDED"


TOO_MANY_RUNS = "TOO_MANY_RUNS"
"""The reason of the LimitExceededError (RESOURCE_EXHAUSTED, with a RetryInfo) that refuses a
pattern run while the gateway already runs its limit: refused before anything of it ran, so
that a client may always try it again."""


class UnauthenticatedError(MultiAgentCommunicationError):
    """No credential, or one the mesh does not know."""

    code = "UNAUTHENTICATED"
    reason = "UNAUTHENTICATED"


class PermissionDeniedError(MultiAgentCommunicationError):
    """A known caller asked for something its identity does not allow (e.g. to send as
    another agent)."""

    code = "PERMISSION_DENIED"
    reason = "PERMISSION_DENIED"


class NotFoundError(MultiAgentCommunicationError):
    """What was named does not exist (a shared state entry, a pattern run)."""

    code = "NOT_FOUND"
    reason = "NOT_FOUND"


class StateConflictError(MultiAgentCommunicationError):
    """A shared-state write lost a race: the entry is locked by another agent
    (reason STATE_LOCKED), or is not at the version expected (VERSION_CONFLICT); or a lock
    was not granted in time (LOCK_TIMEOUT)."""

    code = "ABORTED"
    reason = "STATE_CONFLICT"


class LockNotHeldError(MultiAgentCommunicationError):
    """A lock token that holds no lock on the entry now (released, expired, never given)."""

    code = "FAILED_PRECONDITION"
    reason = "LOCK_NOT_HELD"


_BY_REASON: dict[str, type[MultiAgentCommunicationError]] = {
    cls.reason: cls
    for cls in (
        MessageValidationError,
        MessageTooLargeError,
        RoutingError,
        AgentNotFoundError,
        HandoffError,
        ConflictResolutionError,
        MessageQueueFullError,
        RequestTimeoutError,
        BrokerUnavailableError,
        AgentError,
        UnhandledActionError,
        SessionClosedError,
        LimitExceededError,
        UnauthenticatedError,
        PermissionDeniedError,
        NotFoundError,
        StateConflictError,
        LockNotHeldError,
        MessageIdTakenError,
    )
}
# Reasons that say more than their class's own.
_BY_REASON.update(
    NO_INSTANCE=RoutingError,
    AGENT_DEREGISTERED=AgentNotFoundError,
    STATE_NOT_FOUND=NotFoundError,
    RUN_NOT_FOUND=NotFoundError,
    STATE_LOCKED=StateConflictError,
    VERSION_CONFLICT=StateConflictError,
    LOCK_TIMEOUT=StateConflictError,
    TOO_MANY_RUNS=LimitExceededError,
)

_BY_CODE: dict[str, type[MultiAgentCommunicationError]] = {
    "INVALID_ARGUMENT": MessageValidationError,
    "NOT_FOUND": AgentNotFoundError,
    "RESOURCE_EXHAUSTED": MessageQueueFullError,
    "DEADLINE_EXCEEDED": RequestTimeoutError,
    "UNAVAILABLE": BrokerUnavailableError,
    "CANCELLED": SessionClosedError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "ALREADY_EXISTS": MessageIdTakenError,
}


def error_class_for(reason: str, code: str) -> type[MultiAgentCommunicationError]:
    """The exception class for a reason, falling back to the status code, then the base."""
    return _BY_REASON.get(reason) or _BY_CODE.get(code) or MultiAgentCommunicationError

"""Validation of messages against the RT-011 format standard."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from mesh.config import BrokerConfig
from mesh.core.errors import FieldViolation, MessageTooLargeError, MessageValidationError
from mesh.core.model import (
    BROADCAST_TARGET,
    EncodedContent,
    Handoff,
    Message,
    MessageType,
    due_in,
    is_number,
    utc_now,
)
from mesh.core.workflows import workflow_id_problem

_OBJECT_OR_NOTHING = frozenset({"object", "null", None})
"""What content.parameters and content.context may be: an object, null, or absent."""


def _object_or_nothing(value: object) -> bool:
    return value is None or type(value) is dict or isinstance(value, Mapping)


def message_violations(message: Message, config: BrokerConfig) -> list[FieldViolation]:
    """Every way in which a message breaks the format standard; empty when it is valid.
    (On the path of every message the broker takes in: plain locals, no helper calls.)"""
    found: list[FieldViolation] = []
    from_agent, to_agent = message.from_agent, message.to_agent
    if not from_agent:
        found.append(FieldViolation("from_agent", "from_agent is required"))
    if not to_agent:
        found.append(FieldViolation("to_agent", "to_agent is required"))
    limit = config.max_id_length
    if (
        len(message.message_id) > limit
        or len(from_agent) > limit
        or len(to_agent) > limit
        or len(message.correlation_id) > limit
        or len(message.reply_to) > limit
    ):
        for name in ("message_id", "from_agent", "to_agent", "correlation_id", "reply_to"):
            if len(getattr(message, name)) > limit:
                found.append(FieldViolation(name, f"{name} must be at most {limit} characters"))

    content = message.content
    if content is None:
        found.append(FieldViolation("content", "content is required"))
    else:
        action = content.get("action")
        if action is None or action == "":
            if message.message_type is not MessageType.BROADCAST:
                found.append(FieldViolation("content.action", "content.action is required"))
        elif not isinstance(action, str):
            found.append(FieldViolation("content.action", "content.action must be a string"))
        if content.__class__ is not dict and isinstance(content, EncodedContent):
            kind = content.value_kind
            bad_parameters = kind("parameters") not in _OBJECT_OR_NOTHING
            bad_context = kind("context") not in _OBJECT_OR_NOTHING
        else:
            bad_parameters = not _object_or_nothing(content.get("parameters"))
            bad_context = not _object_or_nothing(content.get("context"))
        if bad_parameters:
            found.append(
                FieldViolation("content.parameters", "content.parameters must be an object")
            )
        if bad_context:
            found.append(FieldViolation("content.context", "content.context must be an object"))
        if message.message_type is MessageType.HANDOFF:
            found.extend(_handoff_shape_violations(message))
            found.extend(
                handoff_violations(
                    Handoff.from_message(message),
                    "content.parameters.",
                    config.max_context_bytes,
                    "metadata.workflow_id",
                )
            )

    ttl = message.ttl
    if ttl < 0:
        found.append(FieldViolation("ttl", "ttl must not be negative"))
    elif ttl > config.max_ttl:
        found.append(FieldViolation("ttl", f"ttl must be at most {config.max_ttl} seconds"))
    if message.deliver_at is not None:
        found.extend(_schedule_violations(message, message.deliver_at, config))

    headers = message.headers
    if len(headers) > config.max_headers:
        found.append(FieldViolation("headers", f"at most {config.max_headers} headers are allowed"))
    elif headers and sum(len(k) + len(v) for k, v in headers.items()) > config.max_header_bytes:
        found.append(
            FieldViolation("headers", f"headers must be at most {config.max_header_bytes} bytes")
        )
    return found


_WORK_TYPES = (MessageType.REQUEST, MessageType.HANDOFF)
"""What an agent's ``required_fields`` hold to: the messages that give it work (an alert or a
group's query goes to every agent alike, and an answer or ack is the sender's to shape)."""


def missing_fields(message: Message, required: tuple[str, ...]) -> list[FieldViolation]:
    """The content keys of ``required`` (the receiving agent's ``required_fields``) that a
    REQUEST or HANDOFF lacks or holds null at, one violation each."""
    content = message.content
    if content is None or message.message_type not in _WORK_TYPES:
        return []  # (no content: refused already, as content is required)
    if content.__class__ is not dict and isinstance(content, EncodedContent):
        kind = content.value_kind  # (read in place: nothing decoded)
        lacking = [key for key in required if kind(key) in (None, "null")]
    else:
        lacking = [key for key in required if content.get(key) is None]
    return [
        FieldViolation(f"content.{key}", f"content.{key} is required by {message.to_agent}")
        for key in lacking
    ]


_UNSCHEDULED = (MessageType.RESPONSE, MessageType.ERROR, MessageType.ACK)
"""What goes to its requester (or sender) at once: never scheduled."""


def _schedule_violations(
    message: Message, deliver_at: datetime, config: BrokerConfig
) -> list[FieldViolation]:
    """A scheduled message's ``deliver_at``, when ahead (one already past means at once,
    as a copy of a message that was scheduled carries it): not on an answer or an ack, at
    most ``max_ttl`` ahead, and before a ttl the message gives ends (counted as the broker
    counts it: from its timestamp, or from now for a timestamp ahead of this clock)."""
    wait = due_in(deliver_at)
    if wait <= 0:
        return []
    kind = message.message_type
    if kind in _UNSCHEDULED:
        return [
            FieldViolation("deliver_at", f"deliver_at is not for a {kind.value}: it goes at once")
        ]
    if wait > config.max_ttl:
        return [
            FieldViolation(
                "deliver_at", f"deliver_at must be at most {config.max_ttl} seconds ahead"
            )
        ]
    ttl = message.ttl
    if ttl > 0:
        age = (utc_now() - message.timestamp).total_seconds()
        left = ttl - age if age > 0 else float(ttl)
        if wait >= left:
            return [
                FieldViolation(
                    "deliver_at",
                    f"deliver_at must come before the message's ttl of {ttl} s ends"
                    f" ({max(left, 0.0):.1f} s from now, counted from its timestamp)",
                )
            ]
    return []


def _handoff_shape_violations(message: Message) -> list[FieldViolation]:
    """What a hand-off's parts must be before they are read: read as they were, a context
    that is no object was taken as none, a step "2" as step 0, and a workflow id {"a": 1}
    as the text "{'a': 1}"."""
    found = []
    parameters = message.parameters
    task = parameters.get("task_description")
    if task is not None and not isinstance(task, str):
        found.append(
            FieldViolation(
                "content.parameters.task_description",
                "content.parameters.task_description must be a string",
            )
        )
    for name in ("context", "constraints"):
        if not _object_or_nothing(parameters.get(name)):
            field = f"content.parameters.{name}"
            found.append(FieldViolation(field, f"{field} must be an object"))
    workflow_id = message.metadata.get("workflow_id")
    if workflow_id is not None and not isinstance(workflow_id, str):
        found.append(
            FieldViolation("metadata.workflow_id", "metadata.workflow_id must be a string")
        )
    for name in ("step_number", "handoff_step"):
        step = message.metadata.get(name)
        if step is not None and (
            not is_number(step) or (isinstance(step, float) and not step.is_integer())
        ):  # (is_integer: NaN and the infinities are not either)
            found.append(
                FieldViolation(f"metadata.{name}", f"metadata.{name} must be a whole number")
            )
    return found


def handoff_violations(
    handoff: Handoff,
    prefix: str = "handoff.",
    max_context_bytes: int = 0,
    workflow_field: str = "handoff.workflow_id",
) -> list[FieldViolation]:
    found = []
    if handoff.workflow_id and (problem := workflow_id_problem(handoff.workflow_id)):
        found.append(FieldViolation(workflow_field, problem))
    if max_context_bytes and handoff.context_size_kb * 1024 > max_context_bytes:
        found.append(
            FieldViolation(
                prefix + "context",
                f"the hand-off context is {handoff.context_size_kb:g} KB; "
                f"the limit is {max_context_bytes / 1024:g} KB",
            )
        )
    if not handoff.task_description:
        found.append(
            FieldViolation(prefix + "task_description", "task_description is required for handoff")
        )
    if handoff.step_number < 0:
        found.append(FieldViolation(prefix + "step_number", "step_number must not be negative"))
    return found


def validate_message(message: Message, config: BrokerConfig, size_bytes: int = 0) -> None:
    """Raises MessageValidationError (or MessageTooLargeError) when the message is invalid."""
    if size_bytes > config.max_message_bytes:
        raise MessageTooLargeError(
            f"message is {size_bytes} bytes; the limit is {config.max_message_bytes} bytes",
            field_violations=(
                FieldViolation(
                    "message", f"message must be at most {config.max_message_bytes} bytes"
                ),
            ),
        )
    found = message_violations(message, config)
    if found:
        raise MessageValidationError.from_violations(found)


def is_broadcast_target(to_agent: str) -> bool:
    return to_agent == BROADCAST_TARGET

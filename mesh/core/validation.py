"""Validation of messages against the RT-011 format standard."""

from __future__ import annotations

from mesh.config import BrokerConfig
from mesh.core.errors import FieldViolation, MessageTooLargeError, MessageValidationError
from mesh.core.model import BROADCAST_TARGET, EncodedContent, Handoff, Message, MessageType


def message_violations(message: Message, config: BrokerConfig) -> list[FieldViolation]:
    """Every way in which a message breaks the format standard; empty when it is valid."""
    found: list[FieldViolation] = []

    def violation(field: str, description: str) -> None:
        found.append(FieldViolation(field, description))

    if not message.from_agent:
        violation("from_agent", "from_agent is required")
    if not message.to_agent:
        violation("to_agent", "to_agent is required")
    limit = config.max_id_length
    if (
        len(message.message_id) > limit
        or len(message.from_agent) > limit
        or len(message.to_agent) > limit
        or len(message.correlation_id) > limit
        or len(message.reply_to) > limit
    ):
        for name in ("message_id", "from_agent", "to_agent", "correlation_id", "reply_to"):
            if len(getattr(message, name)) > limit:
                violation(name, f"{name} must be at most {limit} characters")

    content = message.content
    if content is None:
        violation("content", "content is required")
    else:
        action = content.get("action")
        if action is None or action == "":
            if message.message_type is not MessageType.BROADCAST:
                violation("content.action", "content.action is required")
        elif not isinstance(action, str):
            violation("content.action", "content.action must be a string")
        for key in ("parameters", "context"):
            if isinstance(content, EncodedContent):
                wrong = key in content and not content.is_object(key) and content[key] is not None
            else:
                value = content.get(key)
                wrong = value is not None and not isinstance(value, dict)
            if wrong:
                violation(f"content.{key}", f"content.{key} must be an object")
        if message.message_type is MessageType.HANDOFF:
            found.extend(
                handoff_violations(
                    Handoff.from_message(message),
                    "content.parameters.",
                    config.max_context_bytes,
                )
            )

    if message.ttl < 0:
        violation("ttl", "ttl must not be negative")
    elif message.ttl > config.max_ttl:
        violation("ttl", f"ttl must be at most {config.max_ttl} seconds")

    headers = message.headers
    if len(headers) > config.max_headers:
        violation("headers", f"at most {config.max_headers} headers are allowed")
    elif headers and sum(len(k) + len(v) for k, v in headers.items()) > config.max_header_bytes:
        violation("headers", f"headers must be at most {config.max_header_bytes} bytes")
    return found


def handoff_violations(
    handoff: Handoff, prefix: str = "handoff.", max_context_bytes: int = 0
) -> list[FieldViolation]:
    found = []
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

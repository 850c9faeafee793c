"""MeshError <-> gRPC status, with google.rpc details (ErrorInfo, BadRequest, RetryInfo)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from mesh.codec import STATUS_CODES, seconds_to_duration
from mesh.core.errors import BrokerUnavailableError, FieldViolation, MeshError, error_class_for

ERROR_DOMAIN = "agentmesh.dev"
logger = logging.getLogger("mesh.status")

_CODES_BY_NAME = {code.name: code for code in grpc.StatusCode}


def status_code(name: str) -> grpc.StatusCode:
    return _CODES_BY_NAME.get(name, grpc.StatusCode.UNKNOWN)


def to_rpc_status(error: MeshError) -> status_pb2.Status:
    """The rich status for an error: code, message and typed details."""
    details: list[any_pb2.Any] = []
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN)
    details.append(_pack(info))
    if error.field_violations:
        bad = error_details_pb2.BadRequest()
        for v in error.field_violations:
            bad.field_violations.add(field=v.field, description=v.description)
        details.append(_pack(bad))
    if error.retry_after is not None:
        retry = error_details_pb2.RetryInfo()
        seconds_to_duration(error.retry_after, retry.retry_delay)
        details.append(_pack(retry))
    return status_pb2.Status(
        code=STATUS_CODES.get(error.code, code_pb2.INTERNAL), message=error.message, details=details
    )


def _pack(detail: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(detail)  # type: ignore[arg-type]
    return packed


async def abort(context: grpc.aio.ServicerContext, error: MeshError) -> NoReturn:  # type: ignore[type-arg]
    await context.abort_with_status(rpc_status.to_status(to_rpc_status(error)))
    raise AssertionError("unreachable")  # abort_with_status always raises


CORE_INTERNAL = "Internal error from Core"
"""The details of the status grpc.aio gives a call itself when an operation of it fails."""


def _is_core_internal(error: grpc.RpcError) -> bool:
    return bool(error.code() is grpc.StatusCode.INTERNAL and error.details() == CORE_INTERNAL)


def _status_now(call: Any) -> grpc.aio.AioRpcError | None:
    """The status of a grpc.aio call that has one, read at once (its accessors are coroutines
    that return without waiting once it is set); None when it has none, or it is OK."""
    readers: tuple[Callable[[], Awaitable[Any]], ...] = (
        call.code,
        call.details,
        call.initial_metadata,
        call.trailing_metadata,
        call.debug_error_string,
    )
    values: list[Any] = []
    for read in readers:
        step: Any = read()
        try:
            step.send(None)
        except StopIteration as done:
            values.append(done.value)
            continue
        except (Exception, asyncio.CancelledError):
            return None
        step.close()  # (it would wait: the status is not there)
        return None
    code, details, initial, trailing, debug = values
    if code is grpc.StatusCode.OK:
        return None
    return grpc.aio.AioRpcError(code, initial, trailing, details, debug)


class PeerStatus:
    """The status a streaming grpc.aio call ended with, as its peer sent it.

    When a write fails because the call has just ended, grpc.aio replaces the status the peer
    sent with INTERNAL "Internal error from Core" (grpc/grpc#36066): a broker's refusal of a
    session as it opens (UNAUTHENTICATED, say) would read as a broken stream. This keeps the
    status as it is first set (from the call's done-callback) and :meth:`of` gives it in place
    of grpc's own."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.first: grpc.aio.AioRpcError | None = None
        call.add_done_callback(self._set)

    def _set(self, call: Any) -> None:
        if self.first is None:
            self.first = _status_now(call)

    def of(self, error: grpc.RpcError) -> grpc.RpcError:
        """``error``, or the peer's status when ``error`` is grpc's stand-in for it."""
        if not _is_core_internal(error):
            return error
        for status in (self.first, _status_now(self.call)):  # (as first set; as it is now)
            if status is not None and not _is_core_internal(status):
                return status
        return error


def has_rich_status(error: grpc.RpcError) -> bool:
    """Whether a failed call carries a ``google.rpc.Status`` (as every error the mesh's
    servers send does), rather than a bare status of gRPC's own."""
    try:
        return rpc_status.from_call(error) is not None
    except Exception:
        return False


def from_rpc_error(error: grpc.RpcError) -> MeshError:
    """The mesh error a failed call stands for, read from its rich status when present."""
    code: grpc.StatusCode = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    reason = ""
    violations: list[FieldViolation] = []
    retry_after: float | None = None
    try:
        status = rpc_status.from_call(error)
    except Exception:  # a malformed status detail must not hide the error itself
        status = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                violations.extend(
                    FieldViolation(v.field, v.description) for v in bad.field_violations
                )
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_after = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
    if code is grpc.StatusCode.UNIMPLEMENTED and status is None:
        # gRPC's own "Method not found!": the address is of a server without that service.
        message = (
            f"{message or code.name}: the server at this address does not serve this call;"
            " is it the right address? (the broker, the gateway and each agent serve"
            " different services)"
        )
    cls = error_class_for(reason, code.name)
    return cls(
        message or code.name,
        field_violations=tuple(violations),
        retry_after=retry_after,
        reason=reason or None,
        code=code.name,
    )


def stream_error(error: grpc.RpcError) -> MeshError:
    """What a failed stream stands for: :func:`from_rpc_error`, except that INTERNAL or
    UNKNOWN without the server's own status (the mesh's errors all carry one) is the stream
    broken under it, as gRPC reports some connections lost mid-stream ("Stream removed"):
    like UNAVAILABLE, worth a new stream."""
    failure = from_rpc_error(error)
    if failure.code in ("INTERNAL", "UNKNOWN") and not has_rich_status(error):
        return BrokerUnavailableError(f"the stream broke: {failure.message}")
    return failure

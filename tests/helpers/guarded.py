"""What a caller sees of an agent's own server that holds its callers to a credentials file,
whichever SDK serves it (Python, Node.js, Go)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct, Value

from mesh.v1 import agent_pb2, agent_pb2_grpc, message_pb2
from tests.helpers.health import SERVING, health_of

PAYMENT_TOKEN = "payment-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef01"


def write_credentials(path: Path, *, payment: bool = True) -> None:
    """Principals payment (acting as PaymentAgent, unless ``payment`` is False: taken out)
    and admin, each by its token's digest, as `agentmesh credentials` writes them."""
    from mesh.core.auth import principal_entry

    principals = [principal_entry("admin", [], admin=True, token=ADMIN_TOKEN)]
    if payment:
        principals.append(
            principal_entry("payment", ["PaymentAgent"], admin=False, token=PAYMENT_TOKEN)
        )
    path.write_text(json.dumps({"principals": principals}))


def handle(from_agent: str, agent_id: str) -> agent_pb2.HandleMessageRequest:
    """A direct call's request: an echo REQUEST from ``from_agent`` to ``agent_id``."""
    return agent_pb2.HandleMessageRequest(
        message=message_pb2.Message(
            from_agent=from_agent,
            to_agent=agent_id,
            message_type=message_pb2.MESSAGE_TYPE_REQUEST,
            content=Struct(fields={"action": Value(string_value="echo")}),
        )
    )


async def outcome(call: Any) -> tuple[grpc.StatusCode, str]:
    """The status a call ended with, and its details (OK and "" when it was answered)."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def mutual_tls_env(issued: dict[str, Path]) -> dict[str, str]:
    """The variables that have an agent (of any SDK) serve mutual TLS with ``issued``'s
    server certificate and CA, and check the broker's with that CA."""
    return {
        "AGENTMESH_TLS_CA": str(issued["ca"]),
        "AGENTMESH_TLS_CERT": str(issued["server"]),
        "AGENTMESH_TLS_KEY": str(issued["server_key"]),
    }


async def check_direct_calls_are_held_to_credentials(
    address: str,
    agent_id: str,
    credentials: Path,
    warned: Callable[[], Awaitable[str]],
) -> None:
    """Direct calls to the agent ``agent_id`` serving at ``address`` with ``credentials``
    (written by :func:`write_credentials`): refused without a valid token, and when sent as an
    agent the caller may not act as; answered otherwise; health open. The file renewed
    without payment refuses its token from then on; renewed into junk, what was read before
    stays (``warned`` returns the line the agent said of it)."""

    def bearer(token: str) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {token}"),)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        as_payment, as_admin = bearer(PAYMENT_TOKEN), bearer(ADMIN_TOKEN)
        assert await outcome(stub.HandleMessage(handle("PaymentAgent", agent_id))) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "credentials required: a bearer token in the authorization metadata",
        )
        assert await outcome(
            stub.HandleMessage(handle("PaymentAgent", agent_id), metadata=bearer("x" * 20))
        ) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "the token is not valid",
        )
        assert await outcome(
            stub.HandleMessage(handle("HotelAgent", agent_id), metadata=as_payment)
        ) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "payment may not send as HotelAgent",
        )
        answer = await stub.HandleMessage(handle("PaymentAgent", agent_id), metadata=as_payment)
        assert answer.response.to_agent == "PaymentAgent"
        answer = await stub.HandleMessage(handle("Anyone", agent_id), metadata=as_admin)
        assert answer.response.to_agent == "Anyone"
        told = agent_pb2.NotifyDeregisteredRequest(agent_id=agent_id)
        assert await outcome(stub.NotifyDeregistered(told, metadata=as_payment)) == (
            grpc.StatusCode.PERMISSION_DENIED,
            f"payment may not deregister as {agent_id}",
        )
        assert await health_of(address, "mesh.v1.AgentService") == SERVING  # (no credential)

        await asyncio.to_thread(credentials.write_text, "{not json")
        said = ""
        for _ in range(50):  # (calls go on meanwhile: a server may look as a call comes)
            answer = await stub.HandleMessage(handle("PaymentAgent", agent_id), metadata=as_payment)
            assert answer.response.to_agent == "PaymentAgent"
            try:
                said = await asyncio.wait_for(warned(), 0.2)
                break
            except TimeoutError:
                continue
        assert "changed into what cannot be used, so what was read before stays in use" in said
        answer = await stub.HandleMessage(handle("PaymentAgent", agent_id), metadata=as_payment)
        assert answer.response.to_agent == "PaymentAgent"

        await asyncio.to_thread(write_credentials, credentials, payment=False)
        for _ in range(50):  # (read again within a second or so)
            code, _ = await outcome(
                stub.HandleMessage(handle("PaymentAgent", agent_id), metadata=as_payment)
            )
            if code == grpc.StatusCode.UNAUTHENTICATED:
                break
            await asyncio.sleep(0.1)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        answer = await stub.HandleMessage(handle("Anyone", agent_id), metadata=as_admin)
        assert answer.response.to_agent == "Anyone"


async def check_direct_calls_are_held_to_certificates(
    address: str, agent_id: str, certs: dict[str, Path]
) -> None:
    """Direct calls to the agent ``agent_id`` serving mutual TLS at ``address``, its CA the
    one of ``certs`` (written with a client certificate named PaymentAgent): the certificate
    names who calls, acting as the agent of its name alone; a token no credentials file names
    is refused; no certificate, no connection."""
    roots, chain, key = (certs[n].read_bytes() for n in ("ca", "PaymentAgent", "PaymentAgent_key"))

    mutual = grpc.ssl_channel_credentials(roots, key, chain)
    async with grpc.aio.secure_channel(address, mutual) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        answer = await stub.HandleMessage(handle("PaymentAgent", agent_id))
        assert answer.response.to_agent == "PaymentAgent"
        assert await outcome(stub.HandleMessage(handle("HotelAgent", agent_id))) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "PaymentAgent may not send as HotelAgent",
        )
        told = agent_pb2.NotifyDeregisteredRequest(agent_id=agent_id)
        assert await outcome(stub.NotifyDeregistered(told)) == (
            grpc.StatusCode.PERMISSION_DENIED,
            f"PaymentAgent may not deregister as {agent_id}",
        )
        stranger = (("authorization", "Bearer " + "x" * 20),)
        assert await outcome(
            stub.HandleMessage(handle("PaymentAgent", agent_id), metadata=stranger)
        ) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "the token is not valid",
        )
    anonymous = grpc.ssl_channel_credentials(roots)
    async with grpc.aio.secure_channel(address, anonymous) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        code, _ = await outcome(stub.HandleMessage(handle("PaymentAgent", agent_id), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE

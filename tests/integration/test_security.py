"""TLS, mutual TLS, credentials and per-agent identity, against real servers.

Each refusal is checked for its status: UNAUTHENTICATED without a (valid) credential,
PERMISSION_DENIED for a known caller acting as another agent, UNAVAILABLE when the TLS
handshake fails. Health and reflection stay open, as balancers and tools expect.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.client import GatewayClient
from gateway.server import serve_gateway
from mesh import (
    AgentContext,
    LocalMesh,
    Message,
    MessageType,
    PermissionDeniedError,
    SecurityConfig,
    UnauthenticatedError,
    agent,
)
from mesh.certs import write_dev_certificates
from mesh.client import NO_RETRY, _Session
from mesh.core.errors import BrokerUnavailableError, MeshError
from mesh.v1 import broker_pb2, broker_pb2_grpc, message_pb2
from tests.helpers.secrets import SecretVolume

PAYMENT_TOKEN = "payment-token-0123456789"
GATEWAY_TOKEN = "gateway-token-0123456789"
HOTEL_TOKEN = "hotel-token-0123456789ab"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_dev_certificates(
        tmp_path_factory.mktemp("certs"), clients=["PaymentAgent", "gateway"]
    )


@pytest.fixture
def credentials(tmp_path: Path) -> Path:
    path = tmp_path / "credentials.json"
    path.write_text(
        json.dumps(
            {
                "principals": [
                    {"name": "payment", "token": PAYMENT_TOKEN, "agents": ["PaymentAgent"]},
                    {"name": "hotel", "token": HOTEL_TOKEN, "agents": ["HotelAgent"]},
                    {"name": "gateway", "token": GATEWAY_TOKEN, "admin": True},
                ]
            }
        )
    )
    return path


@pytest.fixture
async def token_mesh(credentials: Path) -> AsyncIterator[LocalMesh]:
    async with LocalMesh(security=SecurityConfig(credentials_file=str(credentials))) as mesh:
        yield mesh


def as_(mesh: LocalMesh, agent_id: str, token: str = "", **security: str):  # type: ignore[no-untyped-def]
    return mesh.client(agent_id, retry=NO_RETRY, security=SecurityConfig(token=token, **security))


async def health(address: str, channel: grpc.aio.Channel | None = None) -> int:
    channel = channel or grpc.aio.insecure_channel(address)
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return int(reply.status)


# -- credentials ------------------------------------------------------------------------------


async def test_calls_without_a_valid_credential_are_unauthenticated(
    token_mesh: LocalMesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    nobody = as_(token_mesh, "PaymentAgent")
    with pytest.raises(UnauthenticatedError, match="credentials required"):
        await nobody.register("PaymentAgent")
    with pytest.raises(UnauthenticatedError):
        await nobody.list_agents()
    with pytest.raises(UnauthenticatedError):
        await nobody.send("PaymentAgent", {"action": "pay"})
    wrong = as_(token_mesh, "PaymentAgent", token="not-the-token-at-all-123")
    with pytest.raises(UnauthenticatedError, match="token is not valid"):
        await wrong.register("PaymentAgent")
    with pytest.raises(UnauthenticatedError):
        await wrong.send("PaymentAgent", {"action": "pay"})
    # Health stays open for balancers and probes.
    assert await health(token_mesh.address) == health_pb2.HealthCheckResponse.SERVING
    # Refusals are logged, credentials never.
    logged = "\n".join(r.getMessage() + json.dumps(getattr(r, "event", {})) for r in caplog.records)
    assert "refused" in logged
    assert "not-the-token-at-all-123" not in logged and PAYMENT_TOKEN not in logged


async def test_tokens_are_rotated_and_revoked_without_a_restart(
    credentials: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The credentials file and an agent's token file are read again when they change. A
    token rotated (the new one added beside the old, the agent's token file renewed, the old
    one taken out) keeps its agent going: its session ends UNAVAILABLE as the old token goes,
    and its SDK connects again with the new one. A token revoked (leaked) is refused from
    the next call on, and its session ends; connecting again, UNAUTHENTICATED. A principal
    added is known at once. A credentials file renewed into junk leaves the last one in use."""
    import mesh.security

    monkeypatch.setattr(mesh.security, "RENEWAL_LOOK_SECONDS", 0.05)
    caplog.set_level(logging.INFO, logger="mesh.security")

    def principals() -> list[dict[str, object]]:
        return list(json.loads(credentials.read_text())["principals"])

    def rewrite(path: Path, text: str) -> None:
        path.write_text(text)
        time.sleep(0.2)  # (looked at again, at most every 0.05 s, by the broker and client)

    token_file = tmp_path / "payment.token"
    token_file.write_text(PAYMENT_TOKEN + "\n")
    rotated, flight_token = "payment-token-rotated-0123", "flight-token-0123456789ab"
    async with LocalMesh(security=SecurityConfig(credentials_file=str(credentials))) as local:
        # (the file's token is sent, in place of the one AGENTMESH_TOKEN would give)
        settings = SecurityConfig(token="not-this-token-0123456789", token_file=str(token_file))
        payment = local.client("PaymentAgent", security=settings)
        hotel = as_(local, "HotelAgent", token=HOTEL_TOKEN)
        await payment.register("PaymentAgent")
        await hotel.register("HotelAgent")
        paying = payment.subscribe("PaymentAgent")
        staying = hotel.subscribe("HotelAgent")
        await paying.start()
        await staying.start()

        both = [*principals(), {"name": "payment", "token": rotated, "agents": ["PaymentAgent"]}]
        await asyncio.to_thread(rewrite, credentials, json.dumps({"principals": both}))
        await asyncio.to_thread(rewrite, token_file, rotated)
        after = [p for p in both if p.get("token") not in (PAYMENT_TOKEN, HOTEL_TOKEN)]
        after.append({"name": "flight", "token": flight_token, "agents": ["FlightAgent"]})
        await asyncio.to_thread(rewrite, credentials, json.dumps({"principals": after}))

        with pytest.raises(UnauthenticatedError, match="the token is not valid"):
            async with asyncio.timeout(10):
                async for _ in staying:
                    pass
        with pytest.raises(UnauthenticatedError, match="the token is not valid"):
            await hotel.list_agents()
        flight = as_(local, "FlightAgent", token=flight_token)
        await flight.send("PaymentAgent", {"action": "pay", "amount": 450})
        async with asyncio.timeout(10):
            delivery = await anext(aiter(paying))
        assert delivery.message.content["amount"] == 450
        await delivery.ack()
        assert "PaymentAgent" in [a.agent_id for a in await payment.list_agents()]

        await asyncio.to_thread(rewrite, credentials, '{"principals": [')  # (cut short)
        await flight.send("PaymentAgent", {"action": "pay", "amount": 460})
        said = [r.getMessage() for r in caplog.records if r.name == "mesh.security"]
        for expected in (
            f"the token file {token_file} was renewed: new calls send its token",
            f"the credentials file {credentials} was read again: it counts from now on (streams "
            "ended, their credential changed: 2)",
            f"the credentials file {credentials} changed into what cannot be used, so what was "
            f"read before stays in use: cannot read the credentials file {credentials}",
        ):
            assert any(expected in line for line in said), (expected, said)
        await paying.close()
        for client in (payment, hotel, flight):
            await client.close()


async def test_a_session_refused_while_it_writes_reports_the_brokers_status(
    token_mesh: LocalMesh,
) -> None:
    """The broker refuses a session without a valid credential as it opens, while the client
    may still be writing its first frames. grpc.aio then reports INTERNAL "Internal error from
    Core" in place of the status the broker sent (grpc/grpc#36066); the SDK's session reports
    the broker's, UNAUTHENTICATED, not a broken stream (which it would try again)."""
    failures: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(token_mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        for _ in range(100):
            session = _Session(stub)
            with contextlib.suppress(MeshError):
                for seq in range(1, 6):  # (as frames follow one another on a busy session)
                    await session.write(broker_pb2.ConnectRequest(seq=seq))
            await asyncio.wait([session._reader], timeout=10)
            assert session.failure is not None
            failures[f"{session.failure.code}: {session.failure.message}"] += 1
    assert failures == {
        "UNAUTHENTICATED: credentials required: a bearer token in the authorization metadata": 100
    }


async def test_a_refused_client_leaves_no_task_or_stream_behind(token_mesh: LocalMesh) -> None:
    """A client with a token the broker refuses gets UNAUTHENTICATED and, once closed, leaves
    nothing running: no pending task, no unretrieved error for asyncio to complain of."""
    complaints: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: complaints.append(context["message"]))
    try:
        for _ in range(20):
            wrong = as_(token_mesh, "PaymentAgent", token="not-the-token-at-all-123")
            with pytest.raises(UnauthenticatedError, match="token is not valid"):
                await wrong.send("PaymentAgent", {"action": "pay"})
            await wrong.close()
        await asyncio.sleep(0.1)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert complaints == []


async def test_an_agent_acts_only_as_itself(token_mesh: LocalMesh) -> None:
    admin = as_(token_mesh, "gateway", GATEWAY_TOKEN)
    payment = as_(token_mesh, "PaymentAgent", PAYMENT_TOKEN)
    hotel = as_(token_mesh, "HotelAgent", HOTEL_TOKEN)
    await payment.register("PaymentAgent")
    await hotel.register("HotelAgent")
    with pytest.raises(PermissionDeniedError, match="payment may not register as HotelAgent"):
        await payment.register("HotelAgent")

    # Sending as itself works, on the session and by unary call.
    await payment.send("HotelAgent", {"action": "book"})
    await payment.send_batch([payment.build("HotelAgent", {"action": "book"})])
    # A spoofed sender is refused, whichever way it travels.
    spoofed = payment.build("HotelAgent", {"action": "book"}, from_agent="HotelAgent")
    with pytest.raises(PermissionDeniedError, match="may not send as HotelAgent"):
        await payment.send_message(spoofed)
    with pytest.raises(PermissionDeniedError):  # the whole batch: none of it is accepted
        await payment.send_batch([payment.build("HotelAgent", {"action": "book"}), spoofed])
    with pytest.raises(PermissionDeniedError):
        await payment.broadcast({"action": "hello"}, from_agent="HotelAgent")

    # An agent receives only from its own queue.
    with pytest.raises(PermissionDeniedError, match="may not receive as HotelAgent"):
        await payment.receive("HotelAgent")
    sub = payment.subscribe("HotelAgent", reconnect=False)
    with pytest.raises(PermissionDeniedError):
        await sub.start()
    with pytest.raises(PermissionDeniedError):
        await payment.dead_letters("HotelAgent")
    with pytest.raises(PermissionDeniedError, match="may not requeue the dead letters as Hotel"):
        await payment.requeue_dead_letters("HotelAgent")
    assert (await payment.requeue_dead_letters("PaymentAgent")).requeued == 0
    with pytest.raises(PermissionDeniedError, match="may not read the queue as HotelAgent"):
        await payment.list_messages("HotelAgent")
    assert [w.message.from_agent for w in await admin.list_messages("HotelAgent")] == [
        "PaymentAgent"
    ] * 2
    # A sender takes back only what it sent, as itself.
    held = [w.message.message_id for w in await admin.list_messages("HotelAgent")]
    with pytest.raises(PermissionDeniedError, match="may not cancel messages as PaymentAgent"):
        await hotel.cancel_messages("HotelAgent", held, from_agent="PaymentAgent")
    assert await hotel.cancel_messages("HotelAgent", held) == []  # (not hotel's to take)
    received = await hotel.receive("HotelAgent")
    # Nothing spoofed got in: two sends and one batch from PaymentAgent itself.
    assert [m.from_agent for m in received] == ["PaymentAgent", "PaymentAgent"]

    # An agent keeps its own leases, no one else's, by unary call or on a session.
    as_payment = (("authorization", f"Bearer {PAYMENT_TOKEN}"),)
    async with grpc.aio.insecure_channel(token_mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        for agent_id, code in (("HotelAgent", 7), ("PaymentAgent", 0)):
            extend = broker_pb2.ExtendLeaseRequest(agent_id=agent_id, message_ids=["m"])
            try:
                assert (await stub.ExtendLease(extend, metadata=as_payment)).extended == 0
                assert code == 0
            except grpc.aio.AioRpcError as error:
                assert error.code().value[0] == code
            session = stub.Connect(metadata=as_payment)
            await session.write(broker_pb2.ConnectRequest(seq=5, extend_lease=extend))
            await session.write(broker_pb2.ConnectRequest(seq=6, receive={"agent_id": agent_id}))
            answer = await asyncio.wait_for(session.read(), 5)  # the error, or the receive's
            assert answer.seq == (5 if code else 6)
            assert answer.error.code == code
            session.cancel()

    # The admin (the gateway) may act as anyone.
    await admin.send("HotelAgent", {"action": "book"}, from_agent="PaymentAgent")
    assert len(await admin.receive("HotelAgent")) == 1

    # An agent deletes its own insights from the shared memory pool, no one else's.
    await hotel.write_insight("booked", tags=["stay"], agent_id="HotelAgent")
    await payment.write_insight("paid", tags=["stay"], agent_id="PaymentAgent")
    with pytest.raises(PermissionDeniedError, match="may not delete insights as HotelAgent"):
        await payment.delete_insights(tags=["stay"], agent_id="HotelAgent")
    with pytest.raises(PermissionDeniedError, match=r"may not delete insights as \(no agent\)"):
        await payment.delete_insights(tags=["stay"])
    assert await payment.delete_insights(tags=["stay"], agent_id="PaymentAgent") == 1
    assert [i.content for i in await hotel.read_insights(tags=["stay"])] == ["booked"]


async def test_agents_serve_and_answer_with_their_own_credentials(token_mesh: LocalMesh) -> None:
    @agent("PaymentAgent")
    async def payment(message: Message, ctx: AgentContext) -> dict:
        return {"status": "PAID"}

    await token_mesh.add_agent(payment, security=SecurityConfig(token=PAYMENT_TOKEN))
    admin = as_(token_mesh, "gateway", GATEWAY_TOKEN)
    answer = await admin.request("PaymentAgent", {"action": "pay"}, timeout=5)
    assert answer.content == {"action": "pay", "status": "PAID"}
    hotel = as_(token_mesh, "HotelAgent", HOTEL_TOKEN)
    await hotel.register("HotelAgent")
    answer = await hotel.request("PaymentAgent", {"action": "pay"}, timeout=5)
    assert answer.content == {"action": "pay", "status": "PAID"}


async def test_an_agents_own_server_with_credentials_holds_direct_callers_to_their_agents(
    token_mesh: LocalMesh, credentials: Path
) -> None:
    """An agent whose server reads the credentials file (as in the secured overlay) takes a
    direct call only with a credential, and only sent as an agent the caller may act as (an
    admin may act as any: the broker pushing, the gateway); only an admin or the agent's own
    principal may tell it that it was deregistered."""
    from google.protobuf.struct_pb2 import Struct, Value

    from mesh.v1 import agent_pb2, agent_pb2_grpc

    @agent("PaymentAgent")
    async def payment(message: Message, ctx: AgentContext) -> dict:
        return {"status": "PAID", "from": message.from_agent}

    served = await token_mesh.add_agent(
        payment,
        security=SecurityConfig(token=PAYMENT_TOKEN, credentials_file=str(credentials)),
    )

    def handle(from_agent: str) -> agent_pb2.HandleMessageRequest:
        return agent_pb2.HandleMessageRequest(
            message=message_pb2.Message(
                from_agent=from_agent,
                to_agent="PaymentAgent",
                content=Struct(fields={"action": Value(string_value="pay")}),
            )
        )

    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)

        async def code_of(call: Any) -> grpc.StatusCode:
            try:
                await call
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

        def bearer(token: str) -> tuple[tuple[str, str]]:
            return (("authorization", f"Bearer {token}"),)

        assert await code_of(stub.HandleMessage(handle("HotelAgent"))) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        as_hotel = bearer(HOTEL_TOKEN)
        with pytest.raises(grpc.aio.AioRpcError) as spoofed:
            await stub.HandleMessage(handle("PaymentAgent"), metadata=as_hotel)
        assert spoofed.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert spoofed.value.details() == "hotel may not send as PaymentAgent"
        answer = await stub.HandleMessage(handle("HotelAgent"), metadata=as_hotel)
        assert answer.response.content["from"] == "HotelAgent"
        answer = await stub.HandleMessage(handle("Anyone"), metadata=bearer(GATEWAY_TOKEN))
        assert answer.response.content["from"] == "Anyone"

        told = agent_pb2.NotifyDeregisteredRequest(agent_id="PaymentAgent")
        assert await code_of(stub.NotifyDeregistered(told, metadata=as_hotel)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        # (health stays open: the probes need no credential)
        assert await health(served.address) == health_pb2.HealthCheckResponse.SERVING


async def test_a_python_agents_own_server_holds_its_callers_as_the_other_sdks_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same direct calls, the same refusals, the same renewed file, as the Node.js and
    Go agents' servers are held to (tests/helpers/guarded.py)."""
    import mesh.security
    from tests.helpers.guarded import check_direct_calls_are_held_to_credentials, write_credentials

    monkeypatch.setattr(mesh.security, "RENEWAL_LOOK_SECONDS", 0.2)
    credentials = tmp_path / "credentials.json"
    write_credentials(credentials)
    said: asyncio.Queue[str] = asyncio.Queue()

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.put_nowait(record.getMessage())

    @agent("PyGuarded")
    async def guarded(message: Message, ctx: AgentContext) -> dict:
        return {"echo": message.content}

    handler = Said(level=logging.WARNING)
    logging.getLogger("mesh.security").addHandler(handler)
    try:
        async with LocalMesh() as local:
            served = await local.add_agent(
                guarded, security=SecurityConfig(credentials_file=str(credentials))
            )

            async def warned() -> str:  # (each refusal is said too, before)
                while "changed into" not in (line := await said.get()):
                    pass
                return line

            await check_direct_calls_are_held_to_credentials(
                served.address, "PyGuarded", credentials, warned
            )
    finally:
        logging.getLogger("mesh.security").removeHandler(handler)


async def test_a_python_agents_mutual_tls_server_holds_callers_to_their_certificates(
    tmp_path: Path,
) -> None:
    """An agent's server with mutual TLS: a caller's certificate names who it is, as the
    broker's does, held to the same test as the Node.js and Go agents' servers."""
    from tests.helpers.guarded import check_direct_calls_are_held_to_certificates

    issued = write_dev_certificates(tmp_path / "certs", clients=["PaymentAgent"])
    tls = {"tls_cert": str(issued["server"]), "tls_key": str(issued["server_key"])}

    @agent("PyMutual")
    async def mutual(message: Message, ctx: AgentContext) -> dict:
        return {"echo": message.content}

    async with LocalMesh(security=SecurityConfig(**tls)) as local:
        served = await local.add_agent(
            mutual, security=SecurityConfig(**tls, tls_ca=str(issued["ca"]))
        )
        await check_direct_calls_are_held_to_certificates(served.address, "PyMutual", issued)


async def test_a_broker_pushes_to_a_mutual_tls_agent_whose_credentials_name_it_an_admin(
    tmp_path: Path,
) -> None:
    """Under mutual TLS a certificate acts as the agent its name is; the broker, pushing the
    messages of every sender, is one the agent's credentials file names an admin (a principal
    with no token, known by its certificate). Without that entry the push is refused."""
    issued = write_dev_certificates(tmp_path / "certs", clients=["broker", "PyPushed", "Caller"])
    tls = {
        "tls_cert": str(issued["server"]),
        "tls_key": str(issued["server_key"]),
        "tls_ca": str(issued["ca"]),
    }

    def as_client(name: str) -> SecurityConfig:
        return SecurityConfig(
            **tls, tls_client_cert=str(issued[name]), tls_client_key=str(issued[f"{name}_key"])
        )

    credentials = tmp_path / "agent-credentials.json"

    @agent("PyPushed")
    async def pushed(message: Message, ctx: AgentContext) -> dict:
        return {"status": "DONE"}

    for names_the_broker in (True, False):
        principals = [{"name": "broker", "admin": True}] if names_the_broker else []
        credentials.write_text(json.dumps({"principals": principals}))
        async with LocalMesh(security=as_client("broker")) as mesh:
            await mesh.add_agent(
                pushed,
                security=as_client("PyPushed").evolve(credentials_file=str(credentials)),
                delivery_mode="push",
            )
            c = mesh.client("Caller", retry=NO_RETRY, security=as_client("Caller"))
            async with c:
                if names_the_broker:
                    answer = await c.request("PyPushed", {"action": "go"}, timeout=10)
                    assert answer.content == {"action": "go", "status": "DONE"}
                else:
                    with pytest.raises(MeshError, match="broker may not send as Caller"):
                        await c.request("PyPushed", {"action": "go"}, timeout=3)


def refused(registry: CollectorRegistry, name: str) -> dict[str, float]:
    """The calls a server counted as refused for their credential, by status code."""
    return {
        sample.labels["code"]: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        if family.name == name
        for sample in family.samples
        if sample.name == name + "_total"
    }


async def test_gateway_calls_need_a_credential(token_mesh: LocalMesh, credentials: Path) -> None:
    security = SecurityConfig(credentials_file=str(credentials), token=GATEWAY_TOKEN)
    gateway = await serve_gateway(token_mesh.address, security=security)
    try:
        async with GatewayClient(gateway.address, security=SecurityConfig()) as anonymous:
            with pytest.raises(UnauthenticatedError):
                await anonymous.pattern_stats()
        async with GatewayClient(
            gateway.address, security=SecurityConfig(token=HOTEL_TOKEN)
        ) as known:
            assert isinstance(await known.pattern_stats(), dict)
        name = "agentmesh_gateway_calls_refused"
        assert refused(gateway.metrics.registry, name) == {"UNAUTHENTICATED": 1.0}
    finally:
        await gateway.stop(0.5)


async def test_calls_and_frames_refused_for_their_credential_are_counted(
    token_mesh: LocalMesh,
) -> None:
    """What the AgentmeshCallsRefused alert reads: a call without a credential, one with a
    token that is not valid (a revoked one still in use), one acting as another agent, and a
    session's frame acting as another agent."""
    assert token_mesh.broker is not None
    registry = token_mesh.broker.metrics.registry
    with pytest.raises(UnauthenticatedError):
        await as_(token_mesh, "PaymentAgent").list_agents()
    with pytest.raises(UnauthenticatedError):
        await as_(token_mesh, "PaymentAgent", token="revoked-token-0123456789").list_agents()
    payment = as_(token_mesh, "PaymentAgent", token=PAYMENT_TOKEN)
    with pytest.raises(PermissionDeniedError):
        await payment.register("HotelAgent")
    await payment.register("PaymentAgent")
    with pytest.raises(PermissionDeniedError):  # (a send travels on the session, as a frame)
        await payment.send("PaymentAgent", {"action": "pay"}, from_agent="HotelAgent")
    await payment.send("PaymentAgent", {"action": "pay"})
    assert refused(registry, "agentmesh_calls_refused") == {
        "UNAUTHENTICATED": 2.0,
        "PERMISSION_DENIED": 2.0,
    }
    await payment.close()


# -- TLS ----------------------------------------------------------------------------------------


async def test_tls_server_is_reached_only_over_verified_tls(
    certs: dict[str, Path], tmp_path: Path
) -> None:
    server = SecurityConfig(tls_cert=str(certs["server"]), tls_key=str(certs["server_key"]))
    async with LocalMesh(security=server) as mesh:
        good = as_(mesh, "PaymentAgent", tls_ca=str(certs["ca"]))
        await good.register("PaymentAgent")
        assert [a.agent_id for a in await good.list_agents()] == ["PaymentAgent"]

        plaintext = as_(mesh, "PaymentAgent")
        with pytest.raises(BrokerUnavailableError):
            await plaintext.list_agents()

        other = write_dev_certificates(tmp_path / "other")
        untrusting = as_(mesh, "PaymentAgent", tls_ca=str(other["ca"]))
        with pytest.raises(BrokerUnavailableError):
            await untrusting.list_agents()


async def test_mutual_tls_identifies_agents_by_their_certificate(certs: dict[str, Path]) -> None:
    server = SecurityConfig(
        tls_cert=str(certs["server"]), tls_key=str(certs["server_key"]), tls_ca=str(certs["ca"])
    )
    async with LocalMesh(security=server) as mesh:
        payment = as_(
            mesh,
            "PaymentAgent",
            tls_ca=str(certs["ca"]),
            tls_client_cert=str(certs["PaymentAgent"]),
            tls_client_key=str(certs["PaymentAgent_key"]),
        )
        await payment.register("PaymentAgent")
        await payment.send("PaymentAgent", {"action": "note"})
        assert len(await payment.receive("PaymentAgent")) == 1
        with pytest.raises(PermissionDeniedError, match="PaymentAgent may not register as Hotel"):
            await payment.register("HotelAgent")
        with pytest.raises(PermissionDeniedError, match="may not send as HotelAgent"):
            await payment.send("PaymentAgent", {"action": "x"}, from_agent="HotelAgent")

        # No client certificate: the handshake itself fails.
        anonymous = as_(mesh, "PaymentAgent", tls_ca=str(certs["ca"]))
        with pytest.raises(BrokerUnavailableError):
            await anonymous.list_agents()


async def test_a_gateway_with_a_ca_for_its_broker_asks_its_own_callers_for_no_certificate(
    certs: dict[str, Path],
) -> None:
    """The gateway is a server and a client of the broker: its CA checks the broker's
    certificate. With tls_client_auth "none" its own callers need no certificate of their own
    (only the CA, to check the gateway's); with the default, "require", they do."""
    server = SecurityConfig(tls_cert=str(certs["server"]), tls_key=str(certs["server_key"]))
    caller = SecurityConfig(tls_ca=str(certs["ca"]))
    async with LocalMesh(security=server) as mesh:
        for auth, reached in (("none", True), ("require", False)):
            gateway = await serve_gateway(
                mesh.address, security=server.evolve(tls_ca=caller.tls_ca, tls_client_auth=auth)
            )
            try:
                client = GatewayClient(gateway.address, security=caller, retry=NO_RETRY)
                async with client:
                    if reached:
                        assert "GROUP_CHAT" in await client.pattern_stats()
                    else:
                        with pytest.raises(MeshError) as refused:
                            await client.pattern_stats()
                        assert refused.value.code == "UNAVAILABLE"
            finally:
                await gateway.stop()


async def test_a_renewed_server_certificate_serves_new_connections_without_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The certificate is renewed in place (here by another CA's, so that which one a
    connection got shows): connections made after it get it, the one open before keeps
    working, and files renewed into junk leave the last good certificate in use. The server's
    metrics say when the certificate it serves expires, the renewed one's from then on."""
    from mesh.watched import valid_until

    first = write_dev_certificates(tmp_path / "first", days=30)
    second = write_dev_certificates(tmp_path / "second", days=90)
    volume = SecretVolume(
        tmp_path / "tls", {"tls.crt": first["server"], "tls.key": first["server_key"]}
    )
    server = SecurityConfig(tls_cert=volume["tls.crt"], tls_key=volume["tls.key"])
    async with LocalMesh(security=server) as mesh:
        # What the AgentmeshCertificateExpiresSoon alert reads: when the served one expires.
        def expiry() -> float | None:
            return mesh.broker.metrics.registry.get_sample_value(
                "agentmesh_tls_certificate_expiry_timestamp_seconds",
                {"server": "mesh.v1.BrokerService"},
            )

        def until(certs: dict[str, Path]) -> float:
            return valid_until(certs["server"].read_bytes()).timestamp()

        assert expiry() == until(first)
        before = as_(mesh, "PaymentAgent", tls_ca=str(first["ca"]))
        await before.register("PaymentAgent")

        volume.renew({"tls.crt": second["server"], "tls.key": second["server_key"]})
        after = as_(mesh, "PaymentAgent", tls_ca=str(second["ca"]))
        assert [a.agent_id for a in await after.list_agents()] == ["PaymentAgent"]
        assert expiry() == until(second)
        with pytest.raises(BrokerUnavailableError):
            await as_(mesh, "PaymentAgent", tls_ca=str(first["ca"])).list_agents()
        await before.send("PaymentAgent", {"action": "note"})  # (its connection stays)
        assert len(await after.receive("PaymentAgent")) == 1

        caplog.set_level(logging.INFO, logger="mesh.security")
        volume.write({"tls.crt": b"half written", "tls.key": second["server_key"].read_bytes()})
        again = as_(mesh, "PaymentAgent", tls_ca=str(second["ca"]))
        assert [a.agent_id for a in await again.list_agents()] == ["PaymentAgent"]
        said = [r.getMessage() for r in caplog.records if r.name == "mesh.security"]
        assert any(
            "the server's TLS files changed into what cannot be used, so what was read before "
            f"stays in use: --tls-cert {volume['tls.crt']} and --tls-key {volume['tls.key']} "
            "are not a PEM certificate and its private key: the certificate is not PEM" in line
            for line in said
        ), said
        for client in (before, after, again):
            await client.close()


async def test_a_renewed_ca_bundle_admits_the_new_cas_clients_without_a_restart(
    tmp_path: Path,
) -> None:
    """Mutual TLS across a CA rotation: the server's CA file renewed into a bundle of the old
    CA and the new one admits the clients of both from the next connection on; renewed into
    the new CA alone, the old CA's clients are refused."""
    old, new = (
        write_dev_certificates(tmp_path / name, clients=["PaymentAgent"]) for name in ("old", "new")
    )
    volume = SecretVolume(
        tmp_path / "tls",
        {"tls.crt": old["server"], "tls.key": old["server_key"], "ca.crt": old["ca"]},
    )
    server = SecurityConfig(
        tls_cert=volume["tls.crt"], tls_key=volume["tls.key"], tls_ca=volume["ca.crt"]
    )

    def client_of(issued: dict[str, Path]) -> Any:
        return as_(
            local,
            "PaymentAgent",
            tls_ca=str(old["ca"]),  # (the server's certificate stays the old CA's)
            tls_client_cert=str(issued["PaymentAgent"]),
            tls_client_key=str(issued["PaymentAgent_key"]),
        )

    async with LocalMesh(security=server) as local:
        with pytest.raises(BrokerUnavailableError):
            await client_of(new).list_agents()
        bundle = old["ca"].read_bytes() + new["ca"].read_bytes()
        server_files = {
            "tls.crt": old["server"].read_bytes(),
            "tls.key": old["server_key"].read_bytes(),
        }
        volume.write({**server_files, "ca.crt": bundle})
        for issued in (old, new):
            client = client_of(issued)
            await client.register("PaymentAgent")
            await client.close()
        volume.write({**server_files, "ca.crt": new["ca"].read_bytes()})
        with pytest.raises(BrokerUnavailableError):
            await client_of(old).list_agents()
        assert await client_of(new).list_agents()


async def test_a_client_keeps_a_few_channels_from_before_renewals_and_closes_the_older(
    certs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each renewal of a client's TLS files opens a new channel for the calls after it; the
    RENEWED_KEPT channels before it stay open (their calls go on), and an older one is
    closed: a client renewed every day does not pile up connections."""
    import mesh.security
    from mesh.security import RENEWED_KEPT, open_channel

    monkeypatch.setattr(mesh.security, "RENEWAL_LOOK_SECONDS", 0.0)
    other = write_dev_certificates(tmp_path / "other")
    ca = tmp_path / "ca.pem"
    ca.write_bytes(certs["ca"].read_bytes())
    server = SecurityConfig(tls_cert=str(certs["server"]), tls_key=str(certs["server_key"]))
    async with LocalMesh(security=server) as mesh:
        channel = open_channel(mesh.address, SecurityConfig(tls_ca=str(ca)))
        async with channel:
            check = health_pb2_grpc.HealthStub(channel).Check  # (made once, as clients do)
            serving = health_pb2.HealthCheckResponse.SERVING
            assert (await check(health_pb2.HealthCheckRequest(), timeout=5)).status == serving
            used = [channel.current()]  # type: ignore[attr-defined]
            for n in range(RENEWED_KEPT + 3):
                # (a bundle with another CA beside, then without: changed each time)
                extra = other["ca"].read_bytes() if n % 2 == 0 else b""
                ca.write_bytes(certs["ca"].read_bytes() + extra)
                reply = await check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == serving
                used.append(channel.current())  # type: ignore[attr-defined]
            assert len(set(map(id, used))) == RENEWED_KEPT + 4  # a channel per renewal
            await asyncio.sleep(0.1)  # (the older ones close in a task of their own)
            shutdown = grpc.ChannelConnectivity.SHUTDOWN
            states = [c.get_state() for c in used]
            assert states[:3] == [shutdown] * 3, states
            assert shutdown not in states[3:], states


async def test_a_renewed_client_certificate_is_presented_on_the_calls_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's client certificate renewed in place is what its next calls present: here
    renewed into another name's, so that the broker's answers show which one it saw. The
    stream it opened before goes on as it was. (gRPC fixes a channel's credentials when it
    is made: without renewal, an agent presents the certificate it started with until it
    restarts, and once that expired, it could not connect again.)"""
    import mesh.security

    monkeypatch.setattr(mesh.security, "RENEWAL_LOOK_SECONDS", 0.0)
    issued = write_dev_certificates(tmp_path / "ca", clients=["FlightAgent", "PaymentAgent"])
    volume = SecretVolume(
        tmp_path / "tls",
        {
            "ca.crt": issued["ca"],
            "tls.crt": issued["PaymentAgent"],
            "tls.key": issued["PaymentAgent_key"],
        },
    )
    server = SecurityConfig(
        tls_cert=str(issued["server"]), tls_key=str(issued["server_key"]), tls_ca=str(issued["ca"])
    )
    async with LocalMesh(security=server) as local:
        payment = as_(
            local,
            "PaymentAgent",
            tls_ca=volume["ca.crt"],
            tls_client_cert=volume["tls.crt"],
            tls_client_key=volume["tls.key"],
        )
        await payment.register("PaymentAgent")
        subscription = payment.subscribe("PaymentAgent")
        await subscription.start()

        volume.renew(
            {
                "ca.crt": issued["ca"],
                "tls.crt": issued["FlightAgent"],
                "tls.key": issued["FlightAgent_key"],
            }
        )
        with pytest.raises(PermissionDeniedError, match="FlightAgent may not register as"):
            await payment.register("PaymentAgent")
        await payment.register("FlightAgent")

        flight = as_(
            local,
            "FlightAgent",
            tls_ca=str(issued["ca"]),
            tls_client_cert=str(issued["FlightAgent"]),
            tls_client_key=str(issued["FlightAgent_key"]),
        )
        await flight.send("PaymentAgent", {"action": "pay", "amount": 450})
        async with asyncio.timeout(10):
            delivery = await anext(aiter(subscription))
        assert delivery.message.from_agent == "FlightAgent"
        assert delivery.message.content["amount"] == 450
        await delivery.ack()
        await subscription.close()
        for client in (payment, flight):
            await client.close()


def test_security_settings_are_checked_and_describe_themselves() -> None:
    assert "insecure" in SecurityConfig().describe()
    assert (
        SecurityConfig(tls_cert="c", tls_key="k", tls_ca="ca").describe().startswith("mutual TLS")
    )
    asks_none = SecurityConfig(tls_cert="c", tls_key="k", tls_ca="ca", tls_client_auth="none")
    assert asks_none.describe() == "TLS"
    with pytest.raises(ValueError, match="tls_client_auth must be require or none, not 'maybe'"):
        SecurityConfig(tls_client_auth="maybe")
    with pytest.raises(ValueError, match="go together"):
        SecurityConfig(tls_cert="c")
    assert "secret-secret-secret" not in repr(SecurityConfig(token="secret-secret-secret"))


@pytest.mark.parametrize("rpc", ["Connect", "SendMessage"])
async def test_an_unreadable_answer_spoofing_another_agent_tells_its_requester_nothing(
    token_mesh: LocalMesh, rpc: str
) -> None:
    """A frame or a call the broker cannot read, that would answer a request as an agent
    the caller may not act as: refused, and the request goes on waiting for its own agent's
    answer (an unreadable answer tells its requester why only when its sender may send as
    its agent)."""
    admin = as_(token_mesh, "gateway", GATEWAY_TOKEN)
    hotel = as_(token_mesh, "HotelAgent", HOTEL_TOKEN)
    await hotel.register("HotelAgent")
    asking = asyncio.create_task(admin.request("HotelAgent", {"action": "book"}, timeout=30))
    taken: list[Message] = []
    while not taken:
        taken = await hotel.receive("HotelAgent")
    spoofed = broker_pb2.ConnectRequest(seq=2)
    spoofed.send.from_agent, spoofed.send.to_agent = "HotelAgent", "gateway"
    spoofed.send.message_type = message_pb2.MESSAGE_TYPE_RESPONSE
    spoofed.send.correlation_id = taken[0].message_id
    spoofed.send.content.update({"action": "answer", "price": math.nan})
    as_payment = (("authorization", f"Bearer {PAYMENT_TOKEN}"),)
    async with grpc.aio.insecure_channel(token_mesh.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        if rpc == "Connect":
            session = stub.Connect(metadata=as_payment)
            await session.write(spoofed)
            refused = await asyncio.wait_for(session.read(), 5)
            assert (refused.seq, refused.error.code) == (
                2,
                grpc.StatusCode.INVALID_ARGUMENT.value[0],
            )
            session.cancel()
        else:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.SendMessage(
                    broker_pb2.SendMessageRequest(message=spoofed.send), metadata=as_payment
                )
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await asyncio.sleep(0.2)
    assert not asking.done()
    await hotel.send(
        "gateway",
        {"action": "booked"},
        message_type=MessageType.RESPONSE,
        correlation_id=taken[0].message_id,
    )
    assert (await asyncio.wait_for(asking, 5)).content["action"] == "booked"


async def test_the_dashboard_reads_the_health_of_agents_serving_over_mutual_tls(
    certs: dict[str, Path], credentials: Path
) -> None:
    """Agents serve with the mesh's TLS (a server that has a CA asks its callers for their
    certificates): the dashboard asks for their health with the same settings as the rest
    of the gateway (before: a plaintext channel, and every agent showed UNREACHABLE)."""
    from gateway.dashboard.server import Dashboard

    tls = {"tls_cert": str(certs["server"]), "tls_key": str(certs["server_key"])}
    tls["tls_ca"] = str(certs["ca"])
    async with LocalMesh(security=SecurityConfig(**tls, credentials_file=str(credentials))) as mesh:

        @agent("PaymentAgent")
        async def payment(message: Message, ctx: AgentContext) -> dict:
            return {"status": "PAID"}

        await mesh.add_agent(
            payment,
            security=SecurityConfig(
                **tls,
                tls_client_cert=str(certs["PaymentAgent"]),
                tls_client_key=str(certs["PaymentAgent_key"]),
            ),
        )
        as_gateway = SecurityConfig(
            **tls,
            tls_client_cert=str(certs["gateway"]),
            tls_client_key=str(certs["gateway_key"]),
            token=GATEWAY_TOKEN,
        )
        gateway = await serve_gateway(mesh.address, security=as_gateway)
        try:
            board = Dashboard(gateway.client, gateway, security=as_gateway)
            sample = await board.sample()
            assert [(a["agent_id"], a["health"]) for a in sample["agents"]] == [
                ("PaymentAgent", "SERVING")
            ]
            await board.stop()
        finally:
            await gateway.stop(0.5)

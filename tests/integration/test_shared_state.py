"""RT-011 shared-state coordination through the broker's MemoryService: agents on their own
clients read, lock and write versioned entries; the gRPC statuses a plain client sees."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from mesh import (
    BrokerUnavailableError,
    ChangeKind,
    LocalMesh,
    LockNotHeldError,
    MessageValidationError,
    PermissionDeniedError,
    SecurityConfig,
    StateConflictError,
    connect,
)
from mesh.client import NO_RETRY
from mesh.core.errors import LimitExceededError
from mesh.v1 import memory_pb2, memory_pb2_grpc
from tests.helpers.processes import BROKER_READY, start, stop
from tests.helpers.stores import BROKER_STORES, store_url


@pytest.fixture
async def mesh() -> AsyncIterator[LocalMesh]:
    async with LocalMesh() as local:
        yield local


async def test_writers_that_lock_never_lose_an_update(mesh: LocalMesh) -> None:
    """Five agents, each on its own connection, add 1 to a counter 20 times with read, then
    write under the lock: 100 increments, 100 versions, none lost."""
    writers = [mesh.client(f"Writer{i}") for i in range(5)]
    await writers[0].put_state("counter", {"n": 0})

    async def add_ones(client: object) -> None:
        for _ in range(20):
            async with client.locked("counter") as lock:  # type: ignore[attr-defined]
                entry = await client.get_state("counter")  # type: ignore[attr-defined]
                await client.put_state("counter", {"n": entry.value["n"] + 1}, lock=lock)  # type: ignore[attr-defined]

    await asyncio.gather(*(add_ones(w) for w in writers))
    final = await writers[0].get_state("counter")
    assert final is not None
    assert final.value == {"n": 100} and final.version == 101


async def test_compare_and_set_writers_retry_and_never_lose_an_update(mesh: LocalMesh) -> None:
    writers = [mesh.client(f"Writer{i}") for i in range(4)]

    async def add_ones(client: object) -> None:
        for _ in range(10):
            while True:
                entry = await client.get_state("tally")  # type: ignore[attr-defined]
                n, version = (entry.value, entry.version) if entry else (0, 0)
                try:
                    await client.put_state("tally", n + 1, expected_version=version)  # type: ignore[attr-defined]
                    break
                except StateConflictError as lost:
                    assert lost.reason == "VERSION_CONFLICT"  # another came first: again

    await asyncio.gather(*(add_ones(w) for w in writers))
    final = await writers[0].get_state("tally")
    assert final is not None and final.value == 40 and final.version == 40


async def test_a_plain_grpc_client_sees_the_statuses(mesh: LocalMesh) -> None:
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)

        async def code_of(call: object) -> grpc.StatusCode:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call  # type: ignore[misc]
            return failed.value.code()

        assert (
            await code_of(stub.GetState(memory_pb2.GetStateRequest(key="missing")))
            == grpc.StatusCode.NOT_FOUND
        )
        put = memory_pb2.PutStateRequest(key="plan", agent_id="A")
        put.value.string_value = "draft"
        written = await stub.PutState(put)
        assert written.entry.version == 1 and written.entry.updated_by == "A"
        lock = await stub.LockState(memory_pb2.LockStateRequest(key="plan", agent_id="A"))
        assert lock.lock_token and lock.HasField("expires_at")
        other = memory_pb2.PutStateRequest(key="plan", agent_id="B")
        other.value.string_value = "mine"
        assert await code_of(stub.PutState(other)) == grpc.StatusCode.ABORTED
        waited = memory_pb2.LockStateRequest(key="plan", agent_id="B")
        waited.wait.FromMilliseconds(100)
        assert await code_of(stub.LockState(waited)) == grpc.StatusCode.ABORTED
        too_long = memory_pb2.LockStateRequest(key="plan", agent_id="B")
        too_long.wait.FromSeconds(5)  # more than RT-011's 1 s
        assert await code_of(stub.LockState(too_long)) == grpc.StatusCode.INVALID_ARGUMENT
        stale = memory_pb2.PutStateRequest(key="plan", agent_id="A", expected_version=7)
        stale.value.string_value = "x"
        stale.lock_token = lock.lock_token
        assert await code_of(stub.PutState(stale)) == grpc.StatusCode.ABORTED
        bad_token = memory_pb2.UnlockStateRequest(key="plan", lock_token="nope")
        assert await code_of(stub.UnlockState(bad_token)) == grpc.StatusCode.FAILED_PRECONDITION
        await stub.UnlockState(
            memory_pb2.UnlockStateRequest(key="plan", lock_token=lock.lock_token)
        )
        assert (await stub.PutState(other)).entry.version == 2
        gone = await stub.DeleteState(memory_pb2.DeleteStateRequest(key="plan", agent_id="B"))
        assert gone.entry.value.string_value == "mine"


async def test_the_sdk_raises_typed_errors_and_releases_its_lock(mesh: LocalMesh) -> None:
    a, b = mesh.client("A", retry=NO_RETRY), mesh.client("B", retry=NO_RETRY)
    assert await a.get_state("nothing") is None
    async with a.locked("doc", lease=5) as lock:
        with pytest.raises(StateConflictError) as locked:
            await b.put_state("doc", "b")
        assert locked.value.reason == "STATE_LOCKED"
        with pytest.raises(StateConflictError) as waited:
            await b.lock_state("doc", wait=0.1)
        assert waited.value.reason == "LOCK_TIMEOUT"
        await a.put_state("doc", "a", lock=lock)
    with pytest.raises(LockNotHeldError):
        await a.put_state("doc", "again", lock=lock)  # released on leaving the block
    assert (await b.put_state("doc", "b")).version == 2


async def test_an_agent_writes_and_locks_only_as_itself(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials.json"
    token = "planner-token-0123456789"
    credentials.write_text(
        json.dumps({"principals": [{"name": "p", "token": token, "agents": ["Planner"]}]})
    )
    async with LocalMesh(security=SecurityConfig(credentials_file=str(credentials))) as local:
        planner = local.client("Planner", retry=NO_RETRY, security=SecurityConfig(token=token))
        await planner.put_state("budget", 100)
        with pytest.raises(PermissionDeniedError):
            await planner.put_state("budget", 0, agent_id="Buyer")
        with pytest.raises(PermissionDeniedError):
            await planner.lock_state("budget", agent_id="Buyer")
        entry = await planner.get_state("budget")
        assert entry is not None and entry.value == 100


async def test_a_plain_grpc_client_lists_the_state_page_by_page(mesh: LocalMesh) -> None:
    """ListState as any gRPC client calls it: entries by key prefix in key order, a page at a
    time until next_page_token comes back empty; a bad page_token or page_size is
    INVALID_ARGUMENT, naming the field."""
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        for n in range(250):
            put = memory_pb2.PutStateRequest(key=f"orders/{n:03d}", agent_id="Seller")
            put.value.number_value = n
            await stub.PutState(put)
        other = memory_pb2.PutStateRequest(key="payments/001", agent_id="Payment")
        other.value.string_value = "paid"
        await stub.PutState(other)

        pages, token = [], ""
        while True:
            page = await stub.ListState(
                memory_pb2.ListStateRequest(prefix="orders/", page_token=token)
            )
            pages.append(page.entries)
            if not (token := page.next_page_token):
                break
        assert [len(p) for p in pages] == [100, 100, 50]  # page_size unset: 100
        listed = [e for p in pages for e in p]
        assert [e.key for e in listed] == [f"orders/{n:03d}" for n in range(250)]
        assert [e.value.number_value for e in listed] == list(range(250))
        assert all(e.version == 1 and e.updated_by == "Seller" for e in listed)

        everything = await stub.ListState(memory_pb2.ListStateRequest(page_size=1000))
        assert len(everything.entries) == 251 and everything.entries[-1].key == "payments/001"
        assert everything.next_page_token == ""

        for bad, field in (
            (memory_pb2.ListStateRequest(page_token="not a token"), "page_token"),
            (memory_pb2.ListStateRequest(page_size=-5), "page_size"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListState(bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in (refused.value.details() or "")
        first = await stub.ListState(memory_pb2.ListStateRequest(prefix="orders/", page_size=5))
        with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
            await stub.ListState(
                memory_pb2.ListStateRequest(prefix="payments/", page_token=first.next_page_token)
            )
        assert elsewhere.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "continues the listing of prefix 'orders/'" in (elsewhere.value.details() or "")


async def test_a_plain_grpc_client_watches_the_state_change_by_change(mesh: LocalMesh) -> None:
    """WatchState as any gRPC client calls it: the entries there are, SYNCED, then each
    write, deletion and lapse under the prefix as it is made, until the client cancels."""
    writer = mesh.client("Seller")
    await writer.put_state("orders/002", {"status": "paid"})
    await writer.put_state("orders/001", {"status": "new"})
    await writer.put_state("payments/001", "elsewhere")
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        call = stub.WatchState(memory_pb2.WatchStateRequest(prefix="orders/", send_initial=True))
        seen: list[tuple[str, str, object, int]] = []

        async def take(n: int) -> None:
            for _ in range(n):
                change = await asyncio.wait_for(call.read(), 5)
                kind = memory_pb2.StateChangeKind.Name(change.kind).removeprefix(
                    "STATE_CHANGE_KIND_"
                )
                value = json.loads(json_format.MessageToJson(change.entry.value) or "null")
                seen.append((kind, change.entry.key, value, change.entry.version))

        await take(3)
        assert seen == [
            ("CURRENT", "orders/001", {"status": "new"}, 1),
            ("CURRENT", "orders/002", {"status": "paid"}, 1),
            ("SYNCED", "", None, 0),
        ]
        seen.clear()
        await writer.put_state("orders/001", {"status": "paid"})
        await writer.put_state("payments/002", "not watched")
        await writer.delete_state("orders/002")
        await writer.put_state("orders/003", {"status": "held"}, ttl=0.2)
        await take(4)
        assert seen == [
            ("PUT", "orders/001", {"status": "paid"}, 2),
            ("DELETE", "orders/002", {"status": "paid"}, 1),
            ("PUT", "orders/003", {"status": "held"}, 1),
            ("LAPSE", "orders/003", {"status": "held"}, 1),
        ]
        call.cancel()

        too_long = stub.WatchState(memory_pb2.WatchStateRequest(prefix="p" * 300))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await too_long.read()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prefix" in (refused.value.details() or "")


async def test_the_sdk_watches_workflows_move_from_agent_to_agent(mesh: LocalMesh) -> None:
    """A dashboard's view: each hand-off of a workflow, as its status changes."""
    watcher = mesh.client("Dashboard")
    actor = mesh.client("CustomerAgent")
    for agent_id in ("SellerAgent", "PaymentAgent"):
        await actor.register(agent_id)
    changes = watcher.watch_state("workflow/")
    assert (await anext(changes)).kind is ChangeKind.SYNCED
    await actor.handoff("SellerAgent", "Approve refund", workflow_id="wf_w1", step_number=1)
    await actor.handoff("PaymentAgent", "Process refund", workflow_id="wf_w1", step_number=2)
    steps = []
    for _ in range(2):
        change = await asyncio.wait_for(anext(changes), 5)
        assert change.kind is ChangeKind.PUT and change.entry is not None
        steps.append((change.entry.key, change.entry.value["current_agent"], change.entry.version))
    assert steps == [("workflow/wf_w1", "SellerAgent", 1), ("workflow/wf_w1", "PaymentAgent", 2)]
    await changes.aclose()


async def test_the_watches_open_are_on_the_metrics_page() -> None:
    """agentmesh_state_watches: the watches open now (a bounded resource: 1000 at most),
    beside agentmesh_state_watches_ended_total (by reason; see the unit tests)."""
    from tests.integration.test_rf009_scenarios import scrape

    async with LocalMesh(metrics_port=0) as local:
        assert local.server is not None
        port = local.server.metrics_port
        watcher = local.client("Watcher")
        watches = [watcher.watch_state("metered/"), watcher.watch_state("")]
        for changes in watches:
            assert (await anext(changes)).kind is ChangeKind.SYNCED
        samples = await scrape(port)
        assert samples["agentmesh_state_watches"] == 2
        assert not [k for k in samples if k.startswith("agentmesh_state_watches_ended")]
        for changes in watches:
            await changes.aclose()
        async with asyncio.timeout(5):  # the broker sees the calls end
            while (await scrape(port))["agentmesh_state_watches"] != 0:  # noqa: ASYNC110
                await asyncio.sleep(0.05)


async def test_a_resumed_watch_that_fell_behind_catches_up_by_itself(mesh: LocalMesh) -> None:
    """A watcher that reads nothing while 3,000 writes of 8 kB are made (more than gRPC holds
    for it in flight) falls 1000 changes behind, and the broker ends its watch; with
    ``resume`` the SDK watches again by itself:
    the watcher reads every change the broker held for it, then the latest version of each
    entry (and nothing of one that came and went meanwhile), then SYNCED, with no error."""
    watcher, writer = mesh.client("Watcher"), mesh.client("Writer")
    changes = watcher.watch_state("k/", resume=True)
    assert (await anext(changes)).kind is ChangeKind.SYNCED
    for n in range(3000):
        await writer.put_state(f"k/{n % 10}", {"n": n, "pad": "x" * 8000})
    await writer.put_state("k/gone", "soon")
    await writer.delete_state("k/gone")
    versions: dict[str, list[int]] = {}
    async with asyncio.timeout(30):
        async for change in changes:
            if change.kind is ChangeKind.SYNCED:
                break
            assert change.kind is ChangeKind.PUT and change.entry is not None, change
            versions.setdefault(change.entry.key, []).append(change.entry.version)
    assert sorted(versions) == [f"k/{n}" for n in range(10)]  # (k/gone: never told)
    for told in versions.values():
        assert told == sorted(set(told)) and told[-1] == 300  # rising, and the latest
    held = sum(len(told) for told in versions.values()) - 10  # (less the catch-up's)
    assert 1000 <= held < 3000, held  # the broker's backlog and what was in flight
    assert mesh.broker is not None and mesh.broker.state.watchers.ended == {"WATCH_BEHIND": 1}
    await writer.put_state("k/0", "after")
    later = await asyncio.wait_for(anext(changes), 5)
    assert later.entry is not None and (later.entry.key, later.entry.version) == ("k/0", 301)
    await changes.aclose()


async def test_a_resumed_watch_that_was_never_in_place_fails_at_once() -> None:
    """``resume`` goes on with a watch that was in place: one that could not begin (a broker
    that is not there, a prefix refused) raises at once, as any watch."""
    async with LocalMesh() as local:
        client = local.client("Watcher")
        with pytest.raises(MessageValidationError, match="prefix"):
            await anext(client.watch_state("k" * 300, resume=True))
        address = local.address
    async with connect(address, agent_id="Watcher", reconnect_timeout=30) as gone:
        with pytest.raises(BrokerUnavailableError):
            await asyncio.wait_for(anext(gone.watch_state("k/", resume=True)), 10)


@pytest.mark.parametrize("store", BROKER_STORES)
async def test_a_full_state_makes_room_for_new_workflows_on_every_store(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """``--max-state-entries 3``: each hand-off of a workflow records its status, kept a day.
    A state full of them takes out the oldest status for the next workflow's (told to a
    watcher as its lapse) and for an agent's own entry, where every write of a new entry was
    refused once as many workflows had run; entries without a ttl are never taken out, and
    with nothing else left a write is refused RESOURCE_EXHAUSTED."""
    url = store_url(store, request, tmp_path)
    process = await start(
        "broker", "--port", "0", "--store", url, "--max-state-entries", "3", ready=BROKER_READY
    )
    try:
        async with (
            connect(process.address, agent_id="CustomerAgent", retry=NO_RETRY) as actor,
            connect(process.address, agent_id="Dashboard", retry=NO_RETRY) as watcher,
        ):
            await actor.register("SellerAgent")
            changes = watcher.watch_state("workflow/")
            assert (await anext(changes)).kind is ChangeKind.SYNCED
            for n in range(1, 5):
                await actor.handoff("SellerAgent", "Review", workflow_id=f"wf_{n}", step_number=1)
            seen = []
            for _ in range(5):
                change = await asyncio.wait_for(anext(changes), 5)
                assert change.entry is not None
                seen.append((change.kind, change.entry.key))
            assert seen == [
                (ChangeKind.PUT, "workflow/wf_1"),
                (ChangeKind.PUT, "workflow/wf_2"),
                (ChangeKind.PUT, "workflow/wf_3"),
                (ChangeKind.LAPSE, "workflow/wf_1"),
                (ChangeKind.PUT, "workflow/wf_4"),
            ]
            await actor.put_state("plan", "v1")  # wf_2's place
            await actor.put_state("budget", 100)  # wf_3's
            await actor.handoff("SellerAgent", "Review", workflow_id="wf_5", step_number=1)
            keys = [e.key async for e in actor.state_entries()]
            assert keys == ["budget", "plan", "workflow/wf_5"]
            await actor.put_state("notes", "n")  # wf_5's
            # Nothing with a ttl left: a hand-off is still taken (its status not recorded),
            # a new entry is refused.
            await actor.handoff("SellerAgent", "Review", workflow_id="wf_6", step_number=1)
            with pytest.raises(LimitExceededError, match="limit of 3 entries") as info:
                await actor.put_state("extra", "x")
            assert info.value.code == "RESOURCE_EXHAUSTED"
            keys = [e.key async for e in actor.state_entries()]
            assert keys == ["budget", "notes", "plan"]
            await changes.aclose()
    finally:
        await stop(process)

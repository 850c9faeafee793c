"""The shared state's rules without a server: versions, compare-and-set, locks with their
1 s wait, leases and the limit of 5 writers at once (RT-011 shared_state)."""

from __future__ import annotations

import asyncio

import pytest

from mesh.core.errors import (
    BrokerUnavailableError,
    LimitExceededError,
    LockNotHeldError,
    MessageValidationError,
    NotFoundError,
    StateConflictError,
)
from mesh.core.state import (
    WATCH_BACKLOG,
    ChangeKind,
    SharedState,
    StateChange,
    StateMirror,
    StateWatch,
)


async def test_every_write_makes_a_new_version_and_the_last_write_wins() -> None:
    state = SharedState()
    with pytest.raises(NotFoundError):
        await state.get("budget")
    first = await state.put("budget", {"left": 100}, "Planner")
    second = await state.put("budget", {"left": 80}, "Buyer")
    assert (first.version, second.version) == (1, 2)
    current = await state.get("budget")
    assert current.value == {"left": 80} and current.updated_by == "Buyer"
    gone = await state.delete("budget", "Planner")
    assert gone.version == 2
    with pytest.raises(NotFoundError):
        await state.get("budget")
    assert (await state.put("budget", 1, "Planner")).version == 1  # a new entry starts again


async def test_a_write_that_names_a_version_is_refused_when_another_came_first() -> None:
    state = SharedState()
    await state.put("plan", "a", "A", expected_version=0)  # only if there is none yet
    with pytest.raises(StateConflictError) as lost:
        await state.put("plan", "b", "B", expected_version=0)
    assert lost.value.reason == "VERSION_CONFLICT" and lost.value.code == "ABORTED"
    assert (await state.put("plan", "b", "B", expected_version=1)).version == 2
    with pytest.raises(StateConflictError):
        await state.delete("plan", "A", expected_version=1)
    assert (await state.get("plan")).value == "b"


async def test_a_locked_entry_is_written_only_with_its_lock() -> None:
    state = SharedState()
    await state.put("budget", 100, "Planner")
    lock = await state.lock("budget", "Buyer")
    with pytest.raises(StateConflictError) as refused:
        await state.put("budget", 0, "Planner")
    assert refused.value.reason == "STATE_LOCKED" and "Buyer" in refused.value.message
    with pytest.raises(StateConflictError):
        await state.delete("budget", "Planner")
    assert (await state.put("budget", 70, "Buyer", lock_token=lock.token)).version == 2
    with pytest.raises(LockNotHeldError):
        await state.put("budget", 60, "Buyer", lock_token="not-the-token")
    await state.unlock("budget", lock.token)
    with pytest.raises(LockNotHeldError):  # released: the token holds nothing any more
        await state.put("budget", 60, "Buyer", lock_token=lock.token)
    with pytest.raises(LockNotHeldError):
        await state.unlock("budget", lock.token)
    assert (await state.put("budget", 50, "Planner")).version == 3


async def test_a_second_writer_waits_for_the_lock_at_most_its_wait() -> None:
    state = SharedState()
    held = await state.lock("budget", "A")

    async def release_soon() -> None:
        await asyncio.sleep(0.1)
        await state.unlock("budget", held.token)

    releasing = asyncio.create_task(release_soon())
    got = await state.lock("budget", "B", wait=1.0)  # waits for A's release
    await releasing
    assert got.holder == "B" and got.token != held.token
    with pytest.raises(StateConflictError) as late:
        await state.lock("budget", "C", wait=0.1)
    assert late.value.reason == "LOCK_TIMEOUT" and "held by B" in late.value.message
    with pytest.raises(StateConflictError):
        await state.lock("budget", "C", wait=0)  # 0: one try, no wait


async def test_a_lock_lapses_when_its_lease_runs_out_and_its_holder_may_renew_it() -> None:
    state = SharedState()
    short = await state.lock("budget", "A", lease=0.1)
    again = await state.lock("budget", "A", lease=0.1)
    assert again.token == short.token and again.expires_at >= short.expires_at
    taken = await state.lock("budget", "B", wait=1.0)  # A's lease runs out meanwhile
    assert taken.holder == "B"
    with pytest.raises(LockNotHeldError):
        await state.put("budget", 1, "A", lock_token=short.token)


async def test_at_most_five_agents_hold_locks_at_once() -> None:
    state = SharedState()
    locks = [await state.lock(f"key-{i}", f"Writer{i}") for i in range(5)]
    # A writer already holding a lock may take another: it is still one writer.
    await state.lock("key-extra", "Writer0")
    with pytest.raises(StateConflictError) as full:
        await state.lock("key-5", "Writer5", wait=0.1)
    assert full.value.reason == "LOCK_TIMEOUT" and "5 agents hold locks" in full.value.message

    async def finish_one() -> None:
        await asyncio.sleep(0.1)
        await state.unlock("key-1", locks[1].token)

    finishing = asyncio.create_task(finish_one())
    assert (await state.lock("key-5", "Writer5", wait=1.0)).holder == "Writer5"
    await finishing
    assert sorted({lock.holder for lock in state.locks()}) == [
        "Writer0",
        "Writer2",
        "Writer3",
        "Writer4",
        "Writer5",
    ]


async def test_bad_requests_and_limits_are_refused() -> None:
    state = SharedState(capacity=2, max_value_bytes=100)
    for call in (
        lambda: state.put("", 1, "A"),
        lambda: state.put("k", None, "A"),
        lambda: state.put("k", 1, ""),
        lambda: state.put("k", "x" * 200, "A"),
        lambda: state.put("k" * 300, 1, "A"),
        lambda: state.put("k", 1, "A", expected_version=-1),
    ):
        with pytest.raises(MessageValidationError):
            await call()
    for wait, lease in ((1.5, None), (-1, None), (None, 0), (None, 61)):
        with pytest.raises(MessageValidationError):
            await state.lock("k", "A", wait=wait, lease=lease)
    await state.put("a", 1, "A")
    await state.put("b", 1, "A")
    with pytest.raises(LimitExceededError):
        await state.put("c", 1, "A")
    assert (await state.put("a", 2, "A")).version == 2  # a new version of a held entry still fits


async def test_waiting_writers_get_the_lock_in_their_order_of_arrival() -> None:
    state = SharedState()
    first = await state.lock("budget", "A")
    order: list[str] = []

    async def take(agent_id: str) -> None:
        lock = await state.lock("budget", agent_id, wait=1.0)
        order.append(agent_id)
        await asyncio.sleep(0.01)
        await state.unlock("budget", lock.token)

    waiting = [asyncio.create_task(take(a)) for a in ("B", "C", "D")]
    await asyncio.sleep(0.05)  # B, C and D wait, in that order
    await state.unlock("budget", first.token)
    # E asks at once, while the lock is free and B has not run yet: still behind them.
    await take("E")
    await asyncio.gather(*waiting)
    assert order == ["B", "C", "D", "E"]


async def test_an_entry_with_a_ttl_lapses_and_frees_its_place() -> None:
    state = SharedState(capacity=2)
    brief = await state.put("brief", {"hold": True}, "A", ttl=0.05)
    assert brief.expires_at is not None and brief.expires_at > brief.updated_at
    kept = await state.put("kept", 1, "A")
    assert kept.expires_at is None
    assert (await state.get("brief")).value == {"hold": True}
    await asyncio.sleep(0.08)
    with pytest.raises(NotFoundError):
        await state.get("brief")
    assert len((await state.entries()).entries) == 1
    assert (await state.put("third", 1, "A")).version == 1  # its place is free again
    # A lapsed entry is absent to a compare-and-set too: written anew, from version 1.
    await state.delete("third", "A")
    again = await state.put("brief", 2, "A", expected_version=0)
    assert again.version == 1 and again.expires_at is None


async def test_a_full_state_makes_room_by_the_unlocked_entry_nearest_its_lapse() -> None:
    """Full, the state takes out for a new entry the one with a ttl nearest its end that
    nobody holds a lock on, told to watchers as its lapse (a workflow's status of a day ago
    goes before a new one, or an agent's own entry, is refused); with none, a write is
    refused until an entry leaves. A new version of an entry there still fits."""
    state = SharedState(capacity=3)
    watch = await state.watch("workflow/")
    assert await next_change(watch) == ("synced", None, None)
    await state.put("workflow/wf_1", {"step": 4}, "A", ttl=3600)
    await state.put("workflow/wf_2", {"step": 1}, "A", ttl=7200)
    await state.put("budget", 100, "A")
    lock = await state.lock("workflow/wf_1", "A")
    await state.put("plan", "v1", "B")  # wf_1 is locked: wf_2 goes
    assert [await next_change(watch) for _ in range(3)] == [
        ("put", "workflow/wf_1", {"step": 4}),
        ("put", "workflow/wf_2", {"step": 1}),
        ("lapse", "workflow/wf_2", {"step": 1}),
    ]
    with pytest.raises(LimitExceededError, match="limit of 3 entries") as info:
        await state.put("notes", "n", "B", ttl=60)
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert (await state.put("budget", 90, "A")).version == 2
    await state.unlock("workflow/wf_1", lock.token)
    await state.put("notes", "n", "B")  # wf_1 goes now
    assert await next_change(watch) == ("lapse", "workflow/wf_1", {"step": 4})
    assert [e.key for e in (await state.entries()).entries] == ["budget", "notes", "plan"]


async def test_each_write_sets_an_entrys_lifetime_anew() -> None:
    state = SharedState()
    await state.put("k", 1, "A", ttl=0.05)
    renewed = await state.put("k", 2, "A", ttl=10)  # renewed before it lapsed
    await asyncio.sleep(0.08)
    assert (await state.get("k")).version == 2 == renewed.version
    await state.put("k", 3, "A")  # written without a ttl: kept until deleted
    assert (await state.get("k")).expires_at is None
    await state.put("short", 1, "A", ttl=0.05)
    await state.put("short", 2, "A", ttl=0.05)  # the first lapse is stale: the second counts
    await asyncio.sleep(0.08)
    with pytest.raises(NotFoundError):
        await state.get("short")
    for ttl in (0, -1, float("nan"), float("inf"), 366 * 86400):
        with pytest.raises(MessageValidationError, match="ttl"):
            await state.put("k", 1, "A", ttl=ttl)


async def test_entries_are_listed_by_prefix_in_key_order_a_page_at_a_time() -> None:
    state = SharedState()
    for key in ("workflow/wf_3", "budget/q3", "workflow/wf_1", "workflow/wf_10", "workflow/wf_2"):
        await state.put(key, {"key": key}, "A")
    page = await state.entries("workflow/", page_size=2)
    assert [e.key for e in page.entries] == ["workflow/wf_1", "workflow/wf_10"]
    assert page.entries[0].value == {"key": "workflow/wf_1"} and page.entries[0].version == 1
    # Written meanwhile: a key after the page's end is in the next page, one before is not.
    await state.put("workflow/wf_0", 0, "A")
    await state.put("workflow/wf_25", 25, "A")
    second = await state.entries("workflow/", page_size=2, page_token=page.next_page_token)
    assert [e.key for e in second.entries] == ["workflow/wf_2", "workflow/wf_25"]
    last = await state.entries("workflow/", page_size=2, page_token=second.next_page_token)
    assert [e.key for e in last.entries] == ["workflow/wf_3"] and last.next_page_token == ""
    everything = await state.entries()
    assert [e.key for e in everything.entries][:2] == ["budget/q3", "workflow/wf_0"]
    assert len(everything.entries) == 7 and everything.next_page_token == ""
    assert (await state.entries("none/")).entries == ()


async def test_a_page_holds_at_most_a_thousand_entries_and_a_mebibyte_of_values() -> None:
    state = SharedState(capacity=3000)
    for i in range(1500):
        await state.put(f"k{i:04d}", i, "A")
    first = await state.entries(page_size=5000)  # more than the most: the most
    assert len(first.entries) == 1000
    rest = await state.entries(page_token=first.next_page_token)
    assert len(rest.entries) == 100  # unset: 100
    assert rest.entries[0].key == "k1000"
    large = "x" * 60_000  # 60 KB of JSON each: 17 fill a page's mebibyte, the 18th starts a next
    for i in range(40):
        await state.put(f"large/{i:02d}", large, "A")
    pages, token = [], ""
    while True:
        page = await state.entries("large/", page_size=1000, page_token=token)
        pages.append([e.key for e in page.entries])
        if not (token := page.next_page_token):
            break
    assert [len(p) for p in pages] == [17, 17, 6]
    assert [k for p in pages for k in p] == [f"large/{i:02d}" for i in range(40)]


async def test_a_listing_leaves_out_lapsed_entries_and_refuses_what_it_did_not_give() -> None:
    state = SharedState()
    await state.put("s/brief", 1, "A", ttl=0.05)
    await state.put("s/kept", 2, "A")
    assert [e.key for e in (await state.entries("s/")).entries] == ["s/brief", "s/kept"]
    await asyncio.sleep(0.08)
    assert [e.key for e in (await state.entries("s/")).entries] == ["s/kept"]
    await state.put("t/other", 3, "A")
    other = await state.entries("", page_size=1)
    assert other.next_page_token
    with pytest.raises(MessageValidationError, match="page_token continues the listing of"):
        await state.entries("s/", page_token=other.next_page_token)
    for token in ("nope", "bm9wZQ==", "WzEsMl0="):  # not base64 JSON; "nope"; [1,2]
        with pytest.raises(MessageValidationError, match="page_token"):
            await state.entries("s/", page_token=token)
    with pytest.raises(MessageValidationError, match="page_size"):
        await state.entries("s/", page_size=-1)
    with pytest.raises(MessageValidationError, match="prefix"):
        await state.entries("p" * 257)


async def next_change(watch: StateWatch) -> tuple[str, str | None, object]:
    change = await asyncio.wait_for(anext(watch), 2)
    entry = change.entry
    return change.kind.value, entry and entry.key, entry and entry.value


async def test_a_watch_sees_every_change_under_its_prefix_in_order() -> None:
    state = SharedState()
    await state.put("workflow/wf_2", {"step": 1}, "A")
    await state.put("workflow/wf_1", {"step": 3}, "A")
    await state.put("budget", 100, "A")
    watch = await state.watch("workflow/", send_initial=True)
    plain = await state.watch("workflow/")  # without the entries there already
    assert [await next_change(watch) for _ in range(3)] == [
        ("current", "workflow/wf_1", {"step": 3}),
        ("current", "workflow/wf_2", {"step": 1}),
        ("synced", None, None),
    ]
    assert await next_change(plain) == ("synced", None, None)
    await state.put("workflow/wf_2", {"step": 2}, "B")
    await state.put("budget", 90, "B")  # not under the prefix
    await state.delete("workflow/wf_1", "B")
    await state.put("workflow/wf_3", "brief", "B", ttl=0.05)
    expected = [
        ("put", "workflow/wf_2", {"step": 2}),
        ("delete", "workflow/wf_1", {"step": 3}),
        ("put", "workflow/wf_3", "brief"),
        ("lapse", "workflow/wf_3", "brief"),  # told when it lapses, with nobody reading it
    ]
    assert [await next_change(watch) for _ in range(4)] == expected
    assert [await next_change(plain) for _ in range(4)] == expected
    watch.close()
    await state.put("workflow/wf_4", 1, "B")
    assert [c async for c in watch] == []  # closed: it ends
    assert (await next_change(plain))[:2] == ("put", "workflow/wf_4")
    assert len(state.watchers) == 1


async def test_a_watch_that_falls_behind_is_ended_after_what_it_holds() -> None:
    state = SharedState()
    watch = await state.watch("k/")
    for n in range(WATCH_BACKLOG + 5):  # nobody takes them
        await state.put(f"k/{n}", n, "A")
    taken = []
    with pytest.raises(LimitExceededError, match="fell 1000 changes behind") as ended:
        async for change in watch:
            taken.append(change)
    assert ended.value.reason == "WATCH_BEHIND"
    assert state.watchers.ended == {"WATCH_BEHIND": 1}  # (counted once, for the metrics)
    assert taken[0].kind is ChangeKind.SYNCED and len(taken) == WATCH_BACKLOG
    assert taken[-1].entry is not None and taken[-1].entry.key == f"k/{WATCH_BACKLOG - 2}"
    # The writers were never held back, and a new watch starts afresh.
    assert len((await state.entries("k/", page_size=1000)).entries) == 1000
    again = await state.watch("k/", send_initial=True)
    initial = [await anext(again) for _ in range(WATCH_BACKLOG + 5)]  # (not held to the most)
    assert {c.kind for c in initial} == {ChangeKind.CURRENT}
    assert (await anext(again)).kind is ChangeKind.SYNCED
    with pytest.raises(MessageValidationError, match="prefix"):
        await state.watch("p" * 257)


async def test_at_most_so_many_watches_are_open_at_once() -> None:
    state = SharedState(max_watches=2)
    first, second = await state.watch("a/"), await state.watch("b/")
    with pytest.raises(LimitExceededError, match="2 watches") as refused:
        await state.watch("c/")
    assert refused.value.reason == "TOO_MANY_WATCHES"
    first.close()  # its place is free again
    third = await state.watch("c/")
    await state.close()  # the broker stops: every watch ends, and no new one begins
    for watch in (second, third):
        assert (await anext(watch)).kind is ChangeKind.SYNCED
        with pytest.raises(BrokerUnavailableError, match="shutting down"):
            await anext(watch)
    assert state.watchers.ended == {"SHUTTING_DOWN": 2}
    with pytest.raises(BrokerUnavailableError, match="shutting down") as refused:
        await state.watch("d/")
    assert refused.value.reason == "SHUTTING_DOWN"


async def test_a_mirror_tells_what_changed_while_no_watch_was_in_place() -> None:
    """What a resumed watch tells after its gap: the latest version of each entry written
    meanwhile, each entry gone meanwhile, and nothing of what did not change."""
    state = SharedState()
    mirror = StateMirror()
    for key in ("p/1", "p/2", "p/3", "p/4"):
        mirror.note(StateChange(ChangeKind.CURRENT, await state.put(key, {"n": 1}, "A")))
    gone = await state.delete("p/4", "A")
    mirror.note(StateChange(ChangeKind.DELETE, gone))
    assert sorted(mirror.entries) == ["p/1", "p/2", "p/3"]
    # The gap: p/2 written twice, p/3 deleted, p/0 and p/4 (again) new.
    await state.put("p/2", {"n": 2}, "B")
    latest = await state.put("p/2", {"n": 3}, "B")
    last_seen = mirror.entries["p/3"]
    await state.delete("p/3", "B")
    new0 = await state.put("p/0", "new", "B")
    new4 = await state.put("p/4", "again", "B")
    now = (await state.entries("p/")).entries
    missed = mirror.catch_up(now)
    assert [(c.kind, c.entry) for c in missed] == [
        (ChangeKind.PUT, new0),
        (ChangeKind.PUT, latest),
        (ChangeKind.PUT, new4),
        (ChangeKind.DELETE, last_seen),
    ]
    assert mirror.catch_up(now) == []  # caught up: nothing more
    # A broker that lost its memory writes versions from 1 again: a rewrite at the same
    # version is still a change.
    rewritten = [await SharedState().put("p/0", "other", "C")]
    assert rewritten[0].version == new0.version
    assert [(c.kind, c.entry.key) for c in mirror.catch_up(rewritten) if c.entry] == [
        (ChangeKind.PUT, "p/0"),
        *((ChangeKind.DELETE, key) for key in ("p/1", "p/2", "p/4")),
    ]
    mirror.note(StateChange(ChangeKind.LAPSE, rewritten[0]))
    mirror.note(StateChange(ChangeKind.SYNCED))
    assert mirror.entries == {}

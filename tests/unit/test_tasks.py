"""Background tasks around a shared store: stopping those whose cancellation can be swallowed
(asyncio.wait_for on Python 3.11 returns the inner result when it completes in the same loop
iteration as the cancel; redis-py sends commands through it), waking subscriptions when a
replica follows the others again after losing them, a subscription that leaves the store
alone while its queue is empty, and the check of a subscription's places in flight."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from mesh.config import BrokerConfig
from mesh.core.broker import Broker
from mesh.core.model import AgentInfo, Message
from mesh.core.queue import InMemoryQueueStore
from mesh.core.tasks import cancel_and_wait
from tests.helpers.stores import CountingStore


async def test_a_loop_whose_cancellation_a_wait_for_swallowed_is_still_stopped() -> None:
    loop = asyncio.get_running_loop()
    rounds: list[asyncio.Future[None]] = []

    async def poll_forever() -> None:
        while True:  # the shape of a sweeper: one call after another
            rounds.append(loop.create_future())
            await asyncio.wait_for(rounds[-1], 3600)

    task = asyncio.create_task(poll_forever())
    await asyncio.sleep(0)
    # The call completes in the very iteration the task is cancelled.
    rounds[-1].set_result(None)
    await cancel_and_wait(task)
    assert task.cancelled()


async def test_a_task_that_swallows_a_cancellation_once_is_cancelled_again() -> None:
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert swallowed.is_set()
    assert task.cancelled()


async def test_the_outcome_of_a_task_that_already_ended_is_retrieved_not_raised() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    await asyncio.wait({task})
    await cancel_and_wait(task)  # no ValueError here
    await cancel_and_wait(None)
    assert isinstance(task.exception(), ValueError)


async def test_a_task_that_will_not_stop_is_left_with_a_warning_after_the_patience(
    caplog: pytest.LogCaptureFixture,
) -> None:
    released = asyncio.Event()

    async def ignores_cancellation() -> None:
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await released.wait()

    stuck = asyncio.create_task(ignores_cancellation(), name="stuck")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="mesh.core.tasks"):
        await cancel_and_wait(stuck, every=0.01, patience=0.1)
    assert not stuck.done()
    assert "task stuck did not stop when cancelled" in caplog.text
    released.set()
    await stuck


async def test_a_caller_cancelled_while_it_waits_is_cancelled() -> None:
    released = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await released.wait()

    task = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    waiting = asyncio.create_task(cancel_and_wait(task, patience=3600))
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.wait({waiting})
    assert waiting.cancelled()
    released.set()
    await asyncio.wait({task})
    assert task.cancelled()


class SwallowingStore(InMemoryQueueStore):
    """A store whose sweep, like a redis-py call on Python 3.11, can return normally from a
    cancellation."""

    def __init__(self) -> None:
        super().__init__()
        self.sweeping = asyncio.Event()

    async def sweep(self) -> None:
        self.sweeping.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)


async def test_a_broker_stops_even_when_its_store_swallows_the_sweepers_cancellation() -> None:
    store = SwallowingStore()
    broker = Broker(BrokerConfig(sweep_interval=0.01), store=store)
    await broker.start()
    await store.sweeping.wait()
    await broker.stop()  # before, this waited forever
    assert broker._sweeper is None


async def test_a_sweeper_whose_store_swallowed_its_cancellation_ends_on_that_one_cancel() -> None:
    """A loop closing (asyncio.run, a test runner) cancels what is left once, then waits for
    it: a broker never stopped, its store swallowing that cancel, still lets the loop close."""
    store = SwallowingStore()
    broker = Broker(BrokerConfig(sweep_interval=0.01), store=store)
    await broker.start()
    try:
        await store.sweeping.wait()
        sweeper = broker._sweeper
        assert sweeper is not None
        sweeper.cancel()
        await asyncio.wait({sweeper}, timeout=5)
        assert sweeper.cancelled()
    finally:
        await broker.stop()


async def test_following_the_other_replicas_again_wakes_every_subscription() -> None:
    """A wake-up lost while a replica's connection to the others was down: the message was
    queued (by another replica) without this one hearing of it. Following again wakes every
    subscription, which then finds it."""
    store = InMemoryQueueStore()
    async with Broker(BrokerConfig(), store=store) as broker:
        await broker.register(AgentInfo(agent_id="Listener"))
        sub = await broker.subscribe("Listener")
        waiting = asyncio.create_task(sub.next())
        await asyncio.sleep(0)
        queued = Message(from_agent="Elsewhere", to_agent="Listener", content={"action": "x"})
        await store.put(queued, 60)  # as another replica does: into the store, no wake here
        await asyncio.sleep(0.05)
        assert not waiting.done()
        broker.on_followed_again()
        delivery = await asyncio.wait_for(waiting, 5)
        assert delivery.message.message_id == queued.message_id
        await sub.close()


class TornStore(InMemoryQueueStore):
    """A store whose client fails a lease in a way it does not name, as redis-py's cluster
    client can while a node restarts (its connection's writer torn down under the call)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def lease_many(self, *args: Any, **options: Any) -> Any:
        if self.failures:
            self.failures -= 1
            raise AttributeError("'NoneType' object has no attribute 'writelines'")
        return await super().lease_many(*args, **options)


async def test_a_lease_failing_unforeseen_leaves_the_subscription_delivering(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Raised out of the subscription, the failure ended the task that writes its deliveries
    and the subscriber waited for ever; now it is said once, and the lease is tried again."""
    store = TornStore(failures=3)
    async with Broker(BrokerConfig(), store=store) as broker:
        await broker.register(AgentInfo(agent_id="Listener"))
        sub = await broker.subscribe("Listener")
        sent = await broker.send(note("first"))
        delivery = await asyncio.wait_for(sub.next(), 5)
        assert delivery.message.message_id == sent.message.message_id
        assert store.failures == 0
        await sub.close()
    said = [r for r in caplog.records if r.getMessage().startswith("leasing for subscription")]
    assert len(said) == 1  # (the next two within the ten seconds held back)
    assert said[0].exc_info is not None and said[0].exc_info[0] is AttributeError


def note(text: str) -> Message:
    return Message(from_agent="Sender", to_agent="Listener", content={"action": text})


async def test_a_subscription_that_took_every_ready_message_leases_again_only_when_woken() -> None:
    """A subscriber that emptied its queue waits to be woken (a send, a redelivery, another
    replica's message, a release) rather than asking the store once more for nothing; one
    whose lease was filled to what it asked for asks again at once."""
    store = CountingStore()
    async with Broker(BrokerConfig(), store=store) as broker:
        await broker.register(AgentInfo(agent_id="Listener"))
        sub = await broker.subscribe("Listener", max_in_flight=10)
        await broker.send(note("first"))
        [first] = await sub.next_batch(5)
        waiting = asyncio.create_task(sub.next_batch(5))
        await asyncio.sleep(0.05)
        await broker.ack("Listener", [first.message.message_id])  # a place back: no matter
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert store.leases == 1  # the queue was left empty: no second look
        await broker.send(note("second"))
        [second] = await asyncio.wait_for(waiting, 5)
        assert [first.message.action, second.message.action] == ["first", "second"]
        assert store.leases == 2

        for text in ("a", "b", "c"):
            await broker.send(note(text))
        full = await sub.next_batch(2)  # all it asked for: there may be more
        rest = await asyncio.wait_for(sub.next_batch(2), 5)
        assert [d.message.action for d in full + rest] == ["a", "b", "c"]
        assert store.leases == 4

        # Out of credit with messages waiting, a settled delivery is what wakes it.
        tight = await broker.subscribe("Listener", max_in_flight=1)
        for text in ("d", "e"):
            await broker.send(note(text))
        await sub.close()  # (what it did not settle goes back in its place: second, a, b, c)
        taken = await asyncio.wait_for(tight.next(), 5)
        assert taken.message.action == "second"
        later = asyncio.create_task(tight.next())
        await asyncio.sleep(0.05)
        assert not later.done()  # its one place is taken
        await broker.ack("Listener", [taken.message.message_id])
        assert (await asyncio.wait_for(later, 5)).message.action == "a"
        await tight.close()


class GatedLeases(CountingStore):
    """Counts its leases; each waits for ``gate`` once it is closed (a slow store)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.leasing = asyncio.Event()

    async def lease_many(self, *args: Any, **kwargs: Any) -> Any:
        self.leasing.set()
        await self.gate.wait()
        return await super().lease_many(*args, **kwargs)


async def test_a_place_given_back_while_a_lease_is_out_costs_no_lease_more() -> None:
    """A delivery settled while the subscription's lease is on its way: that lease counts the
    place as it is when it runs, so when it comes back empty the subscription waits for a
    message instead of asking the store once more for nothing."""
    store = GatedLeases()
    async with Broker(BrokerConfig(), store=store) as broker:
        await broker.register(AgentInfo(agent_id="Listener"))
        sub = await broker.subscribe("Listener", max_in_flight=10)
        await broker.send(note("first"))
        [first] = await sub.next_batch(5)
        assert store.leases == 1
        await broker.send(note("second"))  # (a wake-up: the next lease goes out at once)
        [second] = await sub.next_batch(5)
        assert store.leases == 2
        store.gate.clear()
        store.leasing.clear()
        await broker.send(note("third"))
        waiting = asyncio.create_task(sub.next_batch(5))
        await asyncio.wait_for(store.leasing.wait(), 5)
        await broker.ack("Listener", [first.message.message_id])  # while the lease is out
        store.gate.set()
        [third] = await asyncio.wait_for(waiting, 5)
        waiting = asyncio.create_task(sub.next_batch(5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert store.leases == 3  # the lease took every ready message: no look more
        await broker.send(note("fourth"))
        [fourth] = await asyncio.wait_for(waiting, 5)
        assert [d.message.action for d in (first, second, third, fourth)] == [
            "first",
            "second",
            "third",
            "fourth",
        ]
        assert store.leases == 4
        await broker.ack("Listener", [d.message.message_id for d in (second, third, fourth)])
        await sub.close()


class SlowCheckStore(InMemoryQueueStore):
    """A store whose answer to still_leased comes when the test says, and names nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def still_leased(self, *args: Any) -> set[str]:
        await self.answer.wait()
        return set()


async def test_a_credit_check_that_spans_a_lease_leaves_the_places_as_they_are() -> None:
    """The check of a subscription's places against the store reads the store, then frees
    what it found ended; a lease taken in between (perhaps of one of those very messages,
    handed back and leased again) makes the answer stale: nothing is freed this time."""
    store = SlowCheckStore()
    async with Broker(BrokerConfig(), store=store) as broker:
        await broker.register(AgentInfo(agent_id="Listener"))
        sub = await broker.subscribe("Listener", max_in_flight=5)
        await broker.send(note("first"))
        first = await sub.next()
        check = asyncio.create_task(broker._check_credit())
        await asyncio.sleep(0)
        await broker.send(note("second"))
        second = await sub.next()  # leased while the check waits for the store
        store.answer.set()
        await check
        assert sub.in_flight == {first.message.message_id, second.message.message_id}

        store.answer.clear()
        check = asyncio.create_task(broker._check_credit())
        await asyncio.sleep(0)
        store.answer.set()  # nothing leased meanwhile: the store's word stands
        await check
        assert sub.in_flight == set()
        await sub.close()


class EmptiedStore(InMemoryQueueStore):
    """A store that keeps registrations as a shared one does, and whose putting one back
    waits for the test; a cancellation meanwhile is lost, as in a redis-py call on 3.11."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[str, AgentInfo] = {}
        self.gate, self.entered = asyncio.Event(), asyncio.Event()
        self.restoring = self.most_at_once = 0

    async def save_agent(self, info: AgentInfo) -> None:
        self.kept[info.agent_id] = info

    async def saved_agents(self) -> list[AgentInfo]:
        return list(self.kept.values())

    async def saved_agent(self, agent_id: str) -> AgentInfo | None:
        return self.kept.get(agent_id)

    async def restore_agent(self, info: AgentInfo) -> bool:
        self.restoring += 1
        self.most_at_once = max(self.most_at_once, self.restoring)
        self.entered.set()
        try:
            while not self.gate.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await self.gate.wait()
            return self.kept.setdefault(info.agent_id, info) is info
        finally:
            self.restoring -= 1


async def test_a_second_call_to_read_the_registry_again_waits_for_the_reading_under_way(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The store came back empty, and while the broker puts its registrations back there it
    loses the other replicas and follows them again: the registry is read once more, after
    the reading under way. Before, that one was cancelled for a new one; the cancellation
    lost in the store's call, the two ran side by side, each putting back and reading as if
    alone (seen on Redis Cluster: the test waiting for each broker's "put back" found two
    from one broker and none yet from the other)."""
    caplog.set_level(logging.INFO, logger="mesh")
    store = EmptiedStore()
    async with Broker(BrokerConfig(), store=store) as broker:
        for agent_id in ("a1", "a2", "a3"):
            await broker.register(AgentInfo(agent_id=agent_id))
        store.kept.clear()  # (lost with the store)
        broker.on_store_emptied()
        await asyncio.wait_for(store.entered.wait(), 5)
        broker.on_followed_again()
        await asyncio.sleep(0.05)
        store.gate.set()
        reading = broker._catching_up
        assert reading is not None
        await asyncio.wait_for(asyncio.shield(reading), 5)
        assert store.most_at_once == 1
        assert sorted(store.kept) == ["a1", "a2", "a3"]
        assert sorted(a.agent_id for a in broker.list_agents()) == ["a1", "a2", "a3"]
    put_back = [r.getMessage() for r in caplog.records if "put back in the store" in r.getMessage()]
    assert len(put_back) == 1 and put_back[0].startswith("registrations put back in the store: 3")

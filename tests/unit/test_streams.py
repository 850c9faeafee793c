"""FrameWriter: one write at a time; frames that queue up meanwhile go out together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from mesh.streams import FrameWriter

Make = Callable[..., FrameWriter[Any]]


class Stream:
    """A stream whose writes finish when the test says so and, like grpc.aio's, takes one
    write at a time (another one meanwhile is refused)."""

    def __init__(self) -> None:
        self.written: list[object] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: BaseException | None = None
        self.writing = False
        self.hold_after: int | None = None
        """Close the gate again once this many frames are written."""

    async def write(self, frame: object) -> None:
        if self.writing:
            raise RuntimeError("too many operations: a write is in flight")
        self.writing = True
        try:
            await self.gate.wait()
        finally:
            self.writing = False
        if self.fail is not None:
            raise self.fail
        self.written.append(frame)
        if self.hold_after is not None and len(self.written) >= self.hold_after:
            self.gate.clear()


def batch(frames: list[str]) -> tuple[str, ...]:
    return tuple(frames)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
async def make() -> AsyncIterator[Make]:
    """Writers closed at the end of the test, as a stream's owner closes its writer."""
    made: list[FrameWriter[Any]] = []

    def make(*args: Any, **kwargs: Any) -> FrameWriter[Any]:
        made.append(FrameWriter(*args, **kwargs))
        return made[-1]

    yield make
    for writer in made:
        writer.close()


async def in_flight(make: Make, frame: str) -> tuple[Stream, FrameWriter[Any], asyncio.Task[None]]:
    """A writer over a stream that holds its first write, ``frame``, in flight."""
    stream = Stream()
    writer = make(stream.write, batch)
    stream.gate.clear()
    first = asyncio.create_task(writer.write(frame))
    await settle()
    return stream, writer, first


async def test_a_lone_frame_is_written_at_once(make: Make) -> None:
    stream = Stream()
    writer = make(stream.write, batch)
    await writer.write("a")
    assert stream.written == ["a"]


async def test_frames_given_at_the_same_moment_go_out_as_one_write(make: Make) -> None:
    stream = Stream()
    writer = make(stream.write, batch)
    await asyncio.gather(*(writer.write(f) for f in "abc"))
    await writer.write("d")
    assert stream.written == [("a", "b", "c"), "d"]


async def test_a_frame_whose_caller_gave_up_before_its_write_is_not_written(
    make: Make,
) -> None:
    stream, writer, first = await in_flight(make, "a")
    given_up = asyncio.create_task(writer.write("b"))
    kept = asyncio.create_task(writer.write("c"))
    await settle()
    given_up.cancel()
    await settle()
    stream.gate.set()
    await asyncio.gather(first, kept)
    assert given_up.cancelled()
    assert stream.written == ["a", "c"]


async def test_frames_given_during_a_write_go_out_together_in_order(make: Make) -> None:
    stream, writer, first = await in_flight(make, "a")
    rest = [asyncio.create_task(writer.write(f)) for f in "bcd"]
    await settle()
    assert not any(t.done() for t in [first, *rest])
    stream.gate.set()
    await asyncio.gather(first, *rest)
    assert stream.written == ["a", ("b", "c", "d")]


async def test_without_a_batch_shape_frames_are_written_one_by_one(make: Make) -> None:
    stream = Stream()
    writer = make(stream.write)
    stream.gate.clear()
    tasks = [asyncio.create_task(writer.write(f)) for f in "abc"]
    await settle()
    stream.gate.set()
    await asyncio.gather(*tasks)
    assert stream.written == ["a", "b", "c"]


async def test_batches_hold_at_most_most_frames(make: Make) -> None:
    stream = Stream()
    writer = make(stream.write, batch, most=2)
    stream.gate.clear()
    tasks = [asyncio.create_task(writer.write(f)) for f in "abcde"]
    await settle()
    stream.gate.set()
    await asyncio.gather(*tasks)
    assert stream.written == [("a", "b"), ("c", "d"), "e"]


async def test_batches_hold_at_most_most_bytes_and_a_larger_frame_goes_alone(
    make: Make,
) -> None:
    stream = Stream()
    writer = make(stream.write, batch, size=len, most_bytes=8)
    stream.gate.clear()
    frames = ["aaaa", "bbbb", "cccc", "d" * 20, "ee", "ff"]
    tasks = [asyncio.create_task(writer.write(f)) for f in frames]
    await settle()
    stream.gate.set()
    await asyncio.gather(*tasks)
    assert stream.written == [("aaaa", "bbbb"), "cccc", "d" * 20, ("ee", "ff")]


async def test_a_failed_write_fails_the_frames_waiting_behind_it(make: Make) -> None:
    stream = Stream()
    writer = make(stream.write, batch)
    stream.gate.clear()
    tasks = [asyncio.create_task(writer.write(f)) for f in "abc"]
    await settle()
    stream.fail = ConnectionResetError("the stream broke")
    stream.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, ConnectionResetError) for r in results)
    stream.fail = None
    await writer.write("d")  # usable again
    assert stream.written == ["d"]


async def test_when_the_writing_task_is_cancelled_the_others_are_still_written(make: Make) -> None:
    stream, writer, first = await in_flight(make, "a")
    rest = [asyncio.create_task(writer.write(f)) for f in "bc"]
    await settle()
    first.cancel()
    await settle()
    stream.gate.set()
    await asyncio.gather(*rest)
    with pytest.raises(asyncio.CancelledError):
        await first
    # A write once started cannot be taken back (grpc.aio's go on without their caller):
    # the next one waits for it to end instead of being refused beside it.
    assert stream.written == ["a", ("b", "c")]


async def test_a_cancelled_write_is_not_overlapped_by_the_next_frame(make: Make) -> None:
    """An unsubscribe stops the task writing a subscription's deliveries in the middle of
    its write; the `accepted` that follows must wait for that write to end."""
    stream = Stream()
    writer = make(stream.write, batch)
    stream.gate.clear()
    pump = asyncio.create_task(writer.write("deliveries"))
    await settle()
    pump.cancel()
    await settle()
    answer = asyncio.create_task(writer.write("accepted"))
    await settle()
    assert not answer.done()  # waits for the write in flight
    stream.gate.set()
    await answer
    assert stream.written == ["deliveries", "accepted"]
    await writer.flush()
    assert not writer.busy


async def test_finish_runs_after_every_frame_given_before_it(make: Make) -> None:
    stream = Stream()
    writer = make(stream.write, batch)
    stream.gate.clear()
    tasks = [asyncio.create_task(writer.write(f)) for f in "ab"]
    await settle()

    async def done() -> None:
        stream.written.append("done")

    finishing = asyncio.create_task(writer.finish(done))
    await settle()
    assert not finishing.done()
    stream.gate.set()
    await asyncio.gather(*tasks, finishing)
    assert stream.written == [("a", "b"), "done"]


async def test_posted_frames_are_written_in_order_without_waiting_a_write_each(make: Make) -> None:
    stream = Stream()
    writer = make(stream.write, batch)
    stream.gate.clear()
    posted = [writer.post(f) for f in "abc"]  # returns at once, nothing written yet
    assert stream.written == [] and not any(f.done() for f in posted)
    await settle()
    later = [writer.post(f) for f in "de"]
    last = asyncio.create_task(writer.write("f"))
    stream.gate.set()
    await asyncio.gather(*posted, *later, last)
    assert stream.written == [("a", "b", "c"), ("d", "e", "f")]


async def test_a_failed_post_fails_its_future_and_leaves_the_writer_usable(make: Make) -> None:
    stream = Stream()
    writer = make(stream.write, batch)
    stream.fail = ConnectionResetError("the stream broke")
    future = writer.post("a")
    with pytest.raises(ConnectionResetError):
        await future
    stream.fail = None
    await writer.write("b")
    assert stream.written == ["b"]


async def test_frames_in_a_write_in_flight_count_as_written_when_their_caller_gives_up(
    make: Make,
) -> None:
    """A caller whose frame is in the write in flight is cancelled: the write goes on, the
    frame is not written again by the next write, and the others of that write learn it
    went through."""
    stream = Stream()
    writer = make(stream.write, batch)
    stream.gate.clear()
    stream.hold_after = 1  # "a" goes through, then the batch of the others waits
    first = asyncio.create_task(writer.write("a"))
    await settle()
    others = [asyncio.create_task(writer.write(f)) for f in "bc"]
    await settle()
    stream.gate.set()  # "a" is written; the writer goes on to write ("b", "c")
    await settle()
    assert stream.written == ["a"] and stream.writing
    others[0].cancel()
    await settle()
    late = asyncio.create_task(writer.write("d"))
    await settle()
    assert not late.done()  # waits for the write in flight
    stream.hold_after = None
    stream.gate.set()
    await asyncio.gather(first, others[1], late)
    assert others[0].cancelled()
    assert stream.written == ["a", ("b", "c"), "d"]


async def test_a_closed_writer_fails_what_waits_and_what_comes(
    make: Make,
) -> None:
    _, writer, first = await in_flight(make, "a")
    waiting = asyncio.create_task(writer.write("b"))
    await settle()
    writer.close(ConnectionAbortedError("the session ended"))
    with pytest.raises(ConnectionAbortedError):
        await waiting
    with pytest.raises(ConnectionAbortedError):
        await writer.write("c")
    with pytest.raises(ConnectionAbortedError):
        await writer.post("d")
    with pytest.raises(ConnectionAbortedError):  # in flight: it fails as the stream did
        await first
    assert not writer.busy
    await writer.flush()  # returns: nothing more will be written


async def test_the_writer_task_waits_while_idle_and_wakes_for_the_next_frame(
    make: Make,
) -> None:
    stream = Stream()
    writer = make(stream.write, batch)
    await writer.write("a")
    await settle()
    assert not writer.busy
    tasks = {t for t in asyncio.all_tasks() if t.get_name() == "frame-writer"}
    assert len(tasks) == 1  # one task per stream, kept for the next frame
    await writer.write("b")
    assert {t for t in asyncio.all_tasks() if t.get_name() == "frame-writer"} == tasks
    writer.close()
    await settle()
    assert all(t.done() for t in tasks)
    assert stream.written == ["a", "b"]


async def test_the_reader_writes_a_lone_frame_itself_and_what_comes_meanwhile_follows(
    make: Make,
) -> None:
    stream = Stream()
    writer = make(stream.write, batch)
    stream.gate.clear()
    own = asyncio.create_task(writer.write_now("accepted"))
    await settle()
    assert writer.busy and stream.writing
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "frame-writer"]
    later = [asyncio.create_task(writer.write(f)) for f in "ab"]
    await settle()
    assert not any(t.done() for t in later)  # not written beside the one in flight
    stream.gate.set()
    await asyncio.gather(own, *later)
    assert stream.written == ["accepted", ("a", "b")]
    await writer.flush()
    assert not writer.busy
    busy_then = asyncio.create_task(writer.write("c"))
    await asyncio.sleep(0)
    await writer.write_now("d")  # the stream is busy: it waits its turn like any frame
    await busy_then
    assert stream.written[2:] in (["c", "d"], [("c", "d")])


async def test_a_reader_cancelled_in_its_own_write_closes_the_writer(make: Make) -> None:
    """The reader is cancelled only as the stream ends; its write goes on in grpc.aio, and
    nothing may be written beside it: what waits fails, and so does what comes after."""
    stream = Stream()
    writer = make(stream.write, batch)
    stream.gate.clear()
    own = asyncio.create_task(writer.write_now("accepted"))
    await settle()
    waiting = asyncio.create_task(writer.write("delivery"))
    await settle()
    own.cancel()
    with pytest.raises(asyncio.CancelledError):
        await own
    with pytest.raises(asyncio.InvalidStateError):
        await waiting
    with pytest.raises(asyncio.InvalidStateError):
        await writer.write("more")
    assert not writer.busy


async def test_a_half_close_under_way_when_the_stream_ends_is_done(make: Make) -> None:
    """The client half-closes; the broker ends the stream before the half-close completes,
    and the session closes its writer: the half-close is over, not cancelled."""
    stream = Stream()
    writer = make(stream.write, batch)
    started = asyncio.Event()

    async def done() -> None:
        started.set()
        await asyncio.Event().wait()  # completes only with the stream

    finishing = asyncio.create_task(writer.finish(done))
    await started.wait()
    writer.close(ConnectionAbortedError("the broker ended the session"))
    await finishing  # returns, does not raise CancelledError into the closer

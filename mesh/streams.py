"""Writing frames to a gRPC stream from many tasks: one write at a time, the rest together.

grpc.aio takes one write at a time on a stream, and each write costs about as much whatever
its size (in CPU on both ends: the write, the read, the poller thread's wake-ups).
:class:`FrameWriter` gives every stream one task of its own that does all its writes: tasks
hand their frames over and wait (or not) for them to be written. The writer wakes after the
tasks ready at that moment have run, so that the frames they give go in the same write, and
frames given while a write is in flight go in the next one. Several frames go as one batch
frame when the peer takes batches (without a batch shape, they are written one by one).
Under load the cost per frame falls with the number of frames per write: at 64 requests in
flight, a mesh roundtrip costs the three processes about half the CPU it did with a write
per frame; a lone frame costs one hand-over (a future and a wake-up of the writer).

A write carries at most ``most`` frames (32): a burst larger than that goes as several
writes, so the receiving side starts on the first while the next is written and the
processes of a mesh keep working side by side instead of in turn. A batch frame also holds
at most ``most_bytes`` (the mesh's sessions: mesh.serving.ANSWER_BYTES): frames of messages
near the 1 MiB limit go a few to a write, never as one frame over what the other end takes
(over it, the whole stream fails).

The task reading a stream may write a lone frame itself when the stream is idle
(:meth:`FrameWriter.write_now`: no hand-over, so the answer to a send goes out before the
delivery it set off): that task is cancelled only as the stream ends.

Why a task of the writer's own: a write once started is not taken back. grpc.aio goes on
with it when the task awaiting it is cancelled (a subscription ended mid-delivery, a request
given up) and refuses another write meanwhile (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, which ends
the stream's handler without a status). Callers are cancelled while they wait for their
frame, never in the middle of a write: a frame whose caller gave up before its write began is
not written; one already being written counts as written (it is, or the stream failed).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Frame = TypeVar("Frame")

BATCH_HEADER = "agentmesh-batch"
"""Request header of a Connect session whose client takes `batch` frames (value "1")."""


class _Finish:
    """A queued half-close: run once every frame given before it is written."""

    __slots__ = ("done",)

    def __init__(self, done: Callable[[], Awaitable[object]]) -> None:
        self.done = done


class FrameWriter(Generic[Frame]):
    """Serialises writes to one stream, combining the frames that queue up meanwhile.

    The writer's task starts with the first frame and lives until :meth:`close`, which the
    stream's owner calls when the stream ends."""

    def __init__(
        self,
        write: Callable[[Frame], Awaitable[object]],
        combine: Callable[[list[Frame]], Frame] | None = None,
        *,
        most: int = 32,
        size: Callable[[Frame], int] | None = None,
        most_bytes: int = 0,
    ) -> None:
        self._write = write
        self.combine = combine
        """Makes one batch frame of several; None writes them one by one."""
        self.most = most
        """Frames per write at most."""
        self.size = size
        """A frame's size in bytes (a protobuf message's ByteSize)."""
        self.most_bytes = most_bytes
        """Bytes of the frames combined in one write at most, with ``size`` (a lone frame
        goes whatever its size); 0: not bounded."""
        self._queue: collections.deque[tuple[Frame | _Finish, asyncio.Future[None]]] = (
            collections.deque()
        )
        self._idle = asyncio.Event()
        self._idle.set()
        self._wake: asyncio.Future[None] | None = None
        """What the writer's task awaits while there is nothing to write."""
        self._task: asyncio.Task[None] | None = None
        self._closed: BaseException | None = None

    async def write(self, frame: Frame) -> None:
        """Returns once the frame is written (alone or in a batch); raises what the write
        raised. Cancelled before its write began, the frame is not written."""
        await self._give(frame)

    async def write_now(self, frame: Frame) -> None:
        """Writes the frame from the calling task when the stream is idle (no hand-over, no
        wait for company), else as :meth:`write` does. Only for a task whose cancellation
        ends the stream (the task reading it): a write in flight when the caller is cancelled
        goes on without it, and the stream must then take no other write — the writer is
        closed."""
        if not self._idle.is_set() or self._closed is not None:
            await self._give(frame)
            return
        self._idle.clear()
        try:
            await self._write(frame)
        except asyncio.CancelledError:
            self.close()
            raise
        except BaseException as error:
            self._fail_queued(error)
            self._resume()
            raise
        self._resume()

    def _resume(self) -> None:
        """After a write of the caller's own: the frames given meanwhile go to the writer's
        task, or the stream is idle again."""
        if self._closed is not None:
            return
        if self._queue:
            self._kick()
        else:
            self._idle.set()

    def _kick(self) -> None:
        """Sets the writer's task to the frames queued: wakes it, or starts it."""
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)
        elif self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="frame-writer")

    def post(self, frame: Frame) -> asyncio.Future[None]:
        """Queues a frame and returns at once; it is written in order with the others. The
        future tells how the write went; nobody has to look (a failed stream fails the next
        write too)."""
        future = self._give(frame)
        future.add_done_callback(_seen)
        return future

    async def finish(self, done: Callable[[], Awaitable[object]]) -> None:
        """Runs ``done`` (a half-close) once every frame given so far is written; frames
        given after it are written after it (and fail as the stream does)."""
        await self._give(_Finish(done))

    @property
    def busy(self) -> bool:
        """A write is in flight or frames wait for one."""
        return not self._idle.is_set()

    @property
    def backlog(self) -> int:
        """Frames given and not yet being written."""
        return len(self._queue)

    async def flush(self) -> None:
        """Returns once every frame given so far is written (or failed)."""
        while not self._idle.is_set():
            await self._idle.wait()

    def close(self, error: BaseException | None = None) -> None:
        """Stops the writer's task (a write in flight goes on without it): frames still
        waiting, and any given later, fail with ``error`` (by default InvalidStateError, as
        grpc.aio's writes on a finished call)."""
        if self._closed is None:
            self._closed = error or asyncio.InvalidStateError("the stream is closed")
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._wake = None
        self._fail_queued(self._closed)
        self._idle.set()

    def _give(self, item: Frame | _Finish) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._closed is not None:
            future.set_exception(self._closed)
            return future
        self._queue.append((item, future))
        if self._idle.is_set():  # (while busy, the write in flight is followed by these)
            self._idle.clear()
            self._kick()
        return future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        while True:
            if not queue:
                self._idle.set()
                self._wake = wake = loop.create_future()
                await wake
                continue
            if queue[0][0].__class__ is _Finish:
                item, future = queue.popleft()
                if not future.cancelled():
                    await self._finish(item, future)  # type: ignore[arg-type]
                continue
            carried = self._take()
            if not carried:
                continue
            try:
                if len(carried) == 1:
                    await self._write(carried[0][0])
                else:
                    assert self.combine is not None
                    await self._write(self.combine([frame for frame, _ in carried]))
            except asyncio.CancelledError:
                # close(): the write in flight goes on; whether it gets through is not known
                # here, and the stream is over: its frames fail as the stream did.
                for _, future in carried:
                    if not future.done():
                        if self._closed is None:
                            future.cancel()
                        else:
                            future.set_exception(self._closed)
                raise
            except BaseException as error:  # the stream failed: what waits fails the same way
                for _, future in carried:
                    if not future.done():
                        future.set_exception(error)
                self._fail_queued(error)
                continue
            for _, future in carried:
                if not future.done():
                    future.set_result(None)

    def _take(self) -> list[tuple[Frame, asyncio.Future[None]]]:
        """The frames of the next write: up to ``most`` (one without a batch shape) and
        ``most_bytes``, up to the next half-close; frames whose caller gave up meanwhile are
        dropped."""
        queue = self._queue
        size_of = self.size
        if self.combine is None:
            most, budget = 1, 0
        elif size_of is None or not self.most_bytes or len(queue) == 1:  # (a lone frame goes)
            most, budget = self.most, 0
        else:
            most, budget = self.most, self.most_bytes
        carried: list[tuple[Frame, asyncio.Future[None]]] = []
        while queue and len(carried) < most and queue[0][0].__class__ is not _Finish:
            frame, future = queue[0]
            if future.cancelled():
                queue.popleft()
                continue
            if budget and size_of is not None:
                size = size_of(frame)  # type: ignore[arg-type]
                if carried and size > budget:
                    break  # the next write's first
                budget = max(1, budget - size)
            queue.popleft()
            carried.append((frame, future))  # type: ignore[arg-type]
        return carried

    async def _finish(self, item: _Finish, future: asyncio.Future[None]) -> None:
        try:
            await item.done()
        except asyncio.CancelledError:
            # close() during the half-close: the stream ended, which is what it was for.
            if not future.done():
                if self._closed is None:
                    future.cancel()
                else:
                    future.set_result(None)
            raise
        except BaseException as error:
            if not future.done():
                future.set_exception(error)
            return
        if not future.done():
            future.set_result(None)

    def _fail_queued(self, error: BaseException) -> None:
        queue = self._queue
        while queue:
            _, future = queue.popleft()
            if not future.done():
                future.set_exception(error)


def _seen(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failed write is not "never retrieved"

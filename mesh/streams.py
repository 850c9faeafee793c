"""Writing frames to a gRPC stream from many tasks: one write at a time, the rest together.

grpc.aio takes one write at a time on a stream, and each write costs about as much whatever
its size (in CPU on both ends: the write, the read, the poller thread's wake-ups).
:class:`FrameWriter` writes a frame when the stream is idle after yielding once to the event
loop, so that the frames other tasks give at the same moment go in the same write (unless
the caller knows the frame is alone: a session with one call outstanding); frames that
arrive while a write is in flight wait, and the next write carries them. Several frames
go as one batch frame when the peer takes batches (without a batch shape, frames are written
at once, one by one). A frame that may have company pays one loop iteration, a frame known
to be alone none; under load the cost per frame falls with the number of frames per write:
at 64 requests in flight, a mesh roundtrip costs the three processes about half the CPU it
did with a write per frame.

A write carries at most ``most`` frames (32): a burst larger than that goes as several
writes, so the receiving side starts on the first while the next is written and the
processes of a mesh keep working side by side instead of in turn.

A write once started is not taken back: grpc.aio goes on with it when the task awaiting it
is cancelled (a subscription ended mid-delivery, a request given up) and refuses another
write meanwhile, so each write runs as a task of its own and the next waits for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Frame = TypeVar("Frame")

BATCH_HEADER = "agentmesh-batch"
"""Request header of a Connect session whose client takes `batch` frames (value "1")."""


class FrameWriter(Generic[Frame]):
    """Serialises writes to one stream, combining the frames that queue up meanwhile."""

    def __init__(
        self,
        write: Callable[[Frame], Awaitable[object]],
        combine: Callable[[list[Frame]], Frame] | None = None,
        *,
        most: int = 32,
    ) -> None:
        self._write = write
        self.combine = combine
        """Makes one batch frame of several; None writes them one by one."""
        self.most = most
        """Frames per write at most."""
        self._busy = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._waiting: list[tuple[Frame, asyncio.Future[None]]] = []
        self._handover: asyncio.Task[None] | None = None
        self._op: asyncio.Future[object] | None = None
        """The write last started (it may outlive a cancelled caller)."""

    async def write(self, frame: Frame, *, alone: bool = False) -> None:
        """Returns once the frame is written (alone or in a batch); raises what the write
        raised. ``alone``: the caller knows of nothing else to be written on this stream at
        this moment (one call outstanding), so the frame goes without waiting for company."""
        if self._busy:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append((frame, future))
            await future
            return
        self._set_busy(True)
        if self.combine is not None and not alone:
            # Let the other tasks that run at this moment give their frames, so that they go
            # in this same write (the answers to one batch of deliveries, the requests of
            # callers woken together by one batch of answers).
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                self._hand_over()
                raise
            if self._waiting:
                future = asyncio.get_running_loop().create_future()
                self._waiting.insert(0, (frame, future))
                await self._drain()
                await future
                return
        try:
            await self._send(frame)
        except asyncio.CancelledError:
            self._hand_over()
            raise
        except BaseException as error:
            self._set_busy(False)
            self._fail_waiting(error)
            raise
        await self._drain()

    def post(self, frame: Frame) -> asyncio.Future[None]:
        """Queues a frame and returns at once; it is written in order with the others (in the
        write in flight's wake, or by a task of the writer's own when the stream is idle). For
        a task with many frames to give one after another (a gather's answers as they come),
        which would otherwise wait for a write per frame. The future tells how the write went;
        a failed stream also fails the next write, so nobody has to look."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        future.add_done_callback(_seen)
        self._waiting.append((frame, future))
        if not self._busy:
            self._set_busy(True)
            self._handover = loop.create_task(self._drain_soon())
        return future

    @property
    def busy(self) -> bool:
        """A write is in flight (or about to be)."""
        return self._busy

    @property
    def backlog(self) -> int:
        """Frames given and not yet being written."""
        return len(self._waiting)

    async def flush(self) -> None:
        """Returns once every frame given so far is written (or failed)."""
        while self._busy:
            await self._idle.wait()

    async def _drain_soon(self) -> None:
        await asyncio.sleep(0)  # the frames posted at this moment go together
        await self._drain()

    async def finish(self, done: Callable[[], Awaitable[object]]) -> None:
        """Runs ``done`` (a half-close) once every frame given so far is written."""
        await self.flush()
        self._set_busy(True)
        try:
            await done()
        finally:
            await self._drain()  # frames given meanwhile: written, or failed as the stream

    def _set_busy(self, busy: bool) -> None:
        self._busy = busy
        if busy:
            self._idle.clear()
        else:
            self._idle.set()

    async def _drain(self) -> None:
        """Writes what queued up while this task wrote, until nothing waits."""
        try:
            while self._waiting:
                waiting = self._waiting[: self.most]
                del self._waiting[: self.most]
                carried = waiting
                try:
                    if self.combine is not None and len(waiting) > 1:
                        await self._send(self.combine([frame for frame, _ in waiting]))
                        for _, future in waiting:
                            if not future.done():
                                future.set_result(None)
                        waiting = []
                    else:
                        while waiting:
                            carried = waiting[:1]
                            await self._send(waiting[0][0])
                            _, future = waiting.pop(0)
                            if not future.done():
                                future.set_result(None)
                except asyncio.CancelledError:
                    # The write in flight goes on: its frames are settled by how it ends
                    # (never written twice); those not yet given to a write wait their turn.
                    self._waiting[:0] = waiting[len(carried) :]
                    self._hand_over(carried)
                    raise
                except BaseException as error:
                    for _, future in waiting:
                        if not future.done():
                            future.set_exception(error)
                    raise
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the stream failed: what waits fails the same way
            self._set_busy(False)
            self._fail_waiting(error)
            return
        self._set_busy(False)

    async def _send(self, frame: Frame) -> None:
        """One write, as a task of its own: grpc.aio goes on with a write whose caller was
        cancelled (it cannot take it back) and refuses another meanwhile, so the writer keeps
        hold of it to wait for its end before the next one (:meth:`_hand_over`)."""
        self._op = asyncio.ensure_future(self._write(frame))
        await asyncio.shield(self._op)

    def _hand_over(self, carried: list[tuple[Frame, asyncio.Future[None]]] | None = None) -> None:
        """The writing task was cancelled: a task of our own waits for the write it had
        started, if any (settling the frames that write ``carried`` for others by its
        outcome), then writes what still waits (or marks the stream idle)."""
        loop = asyncio.get_running_loop()
        self._handover = loop.create_task(self._after_cancel(self._op, carried or []))

    async def _after_cancel(
        self,
        op: asyncio.Future[object] | None,
        carried: list[tuple[Frame, asyncio.Future[None]]],
    ) -> None:
        if op is not None:
            await asyncio.wait({op})
            # (retrieved here: a failed stream fails the next write too)
            error = asyncio.CancelledError() if op.cancelled() else op.exception()
            for _, future in carried:
                if future.done():
                    pass
                elif error is None:
                    future.set_result(None)
                elif isinstance(error, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(error)
        await self._drain()

    def _fail_waiting(self, error: BaseException) -> None:
        waiting, self._waiting = self._waiting, []
        for _, future in waiting:
            if not future.done():
                future.set_exception(error)


def _seen(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failed write is not "never retrieved"

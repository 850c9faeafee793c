"""Writing frames to a gRPC stream from many tasks: one write at a time, the rest together.

grpc.aio takes one write at a time on a stream, and each write costs about as much whatever
its size. :class:`FrameWriter` writes a frame at once when the stream is idle; frames that
arrive while a write is in flight wait, and the next write carries all of them, as one batch
frame when the peer takes batches. So a lone frame pays no extra hop, and under load the cost
per frame falls with the number of frames per write.
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
        most: int = 256,
    ) -> None:
        self._write = write
        self.combine = combine
        """Makes one batch frame of several; None writes them one by one."""
        self.most = most
        """Frames per batch at most."""
        self._busy = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._waiting: list[tuple[Frame, asyncio.Future[None]]] = []
        self._handover: asyncio.Task[None] | None = None

    async def write(self, frame: Frame) -> None:
        """Returns once the frame is written (alone or in a batch); raises what the write
        raised."""
        if self._busy:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append((frame, future))
            await future
            return
        self._set_busy(True)
        try:
            await self._write(frame)
        except asyncio.CancelledError:
            self._hand_over()
            raise
        except BaseException as error:
            self._set_busy(False)
            self._fail_waiting(error)
            raise
        await self._drain()

    async def finish(self, done: Callable[[], Awaitable[object]]) -> None:
        """Runs ``done`` (a half-close) once every frame given so far is written."""
        while self._busy:
            await self._idle.wait()
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
                try:
                    if self.combine is not None and len(waiting) > 1:
                        await self._write(self.combine([frame for frame, _ in waiting]))
                        for _, future in waiting:
                            if not future.done():
                                future.set_result(None)
                        waiting = []
                    else:
                        while waiting:
                            await self._write(waiting[0][0])
                            _, future = waiting.pop(0)
                            if not future.done():
                                future.set_result(None)
                except asyncio.CancelledError:
                    self._waiting[:0] = waiting  # not known to be written: the next writer's
                    self._hand_over()
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

    def _hand_over(self) -> None:
        """The writing task was cancelled: a task of our own writes what still waits."""
        if self._waiting:
            self._handover = asyncio.get_running_loop().create_task(self._drain())
        else:
            self._set_busy(False)

    def _fail_waiting(self, error: BaseException) -> None:
        waiting, self._waiting = self._waiting, []
        for _, future in waiting:
            if not future.done():
                future.set_exception(error)

"""Which event loop the mesh's processes run on: uvloop when it is installed (a faster loop
that grpc.aio runs on unchanged), else asyncio's own. AGENTMESH_EVENT_LOOP=asyncio forces
the standard loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from mesh.core.tasks import cancel_and_wait

T = TypeVar("T")


LOOPS = ("uvloop", "asyncio")


def loop_name() -> str:
    """The loop AGENTMESH_EVENT_LOOP names (ValueError for one it does not), else uvloop when
    it is installed."""
    wanted = os.environ.get("AGENTMESH_EVENT_LOOP", "")
    if wanted and wanted not in LOOPS:
        raise ValueError(f"AGENTMESH_EVENT_LOOP must be uvloop or asyncio, got {wanted!r}")
    if wanted == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs a process's main coroutine on the chosen loop. Once it is over, the process is
    on its way out: a SIGTERM then (a supervisor saying it again while the process finishes
    exiting) is ignored, where the default the loop leaves behind would turn a clean exit into
    death by that signal."""
    try:
        if loop_name() == "uvloop":
            import uvloop

            return uvloop.run(main)
        return asyncio.run(main)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def stop_on_signals() -> asyncio.Event:
    """Set by SIGINT (Ctrl-C) or SIGTERM from now on. Taken as a process starts, so that a
    signal while it starts stops it gracefully once started, instead of killing it half-way."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def started_before(starting: asyncio.Task[Any], stop: asyncio.Event) -> bool:
    """Whether ``starting`` (a server's start) ended, or was cancelled because ``stop`` came
    first: a signal while it waits for what it needs (its broker, its queue store) stops it
    at once; what it had started stops too, and what was delivered meanwhile goes back."""
    signalled = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        await cancel_and_wait(signalled)
        return True
    await cancel_and_wait(starting)
    return False


class AsyncOnly:
    """For a class used with ``async with``: a plain ``with`` says so, instead of Python's
    bare "does not support the context manager protocol"."""

    def __enter__(self) -> None:
        name = type(self).__name__
        raise TypeError(
            f"{name} is asynchronous: use 'async with', in an async def run by asyncio.run()"
        )

    def __exit__(self, *exc: object) -> None:
        """Never reached: :meth:`__enter__` refuses."""

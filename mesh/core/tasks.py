"""Stopping a background task for certain.

On Python 3.11 a cancellation can be lost: ``asyncio.wait_for`` returns the inner result when
the inner future completes in the same loop iteration as the cancel (CPython gh-86296, fixed
in 3.12), and libraries built on it (redis-py sends a command through it) then return
normally from a cancelled call. A loop such as a sweeper goes round again, and whoever awaits
it after ``cancel()`` waits forever. :func:`cancel_and_wait` cancels again until the task ends;
:func:`stop_if_cancelled`, called at the top of such a loop, ends it on the first cancel
(``asyncio.run`` and test runners cancel what is left once, and then wait for it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)


async def cancel_and_wait(
    task: asyncio.Task[Any] | None, *, every: float = 0.05, patience: float = 5.0
) -> None:
    """Cancels ``task`` and waits for it to end, cancelling it again every ``every`` seconds
    while a cancellation was swallowed; gives up (with a warning) after ``patience`` seconds.
    The task's own outcome (its result, CancelledError or an exception) is retrieved, not
    raised. A cancellation of the caller propagates."""
    if task is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every)
        if loop.time() >= deadline and not task.done():
            logger.warning("task %s did not stop when cancelled; left running", task.get_name())
            return
    if not task.cancelled() and task.exception() is not None:
        logger.debug("task %s ended with %r", task.get_name(), task.exception())


def stop_if_cancelled() -> None:
    """Raises CancelledError when the running task was cancelled and the cancellation was
    swallowed on the way (the task still counts it as requested, see above)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError

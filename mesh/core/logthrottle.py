"""One log line per key per interval under a flood, counting the lines held back between."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any


class LogThrottle:
    """Says whether a warning about ``key`` (an agent, say) is written now: the first of an
    interval is, with how many were held back since the last one written; the rest of the
    interval are not. Holds at most ``max_keys`` keys (it forgets them all past that)."""

    def __init__(
        self,
        interval: float = 1.0,
        *,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self._clock = clock
        self._last: dict[str, tuple[float, int]] = {}

    def admit(self, key: str) -> int | None:
        """None: hold this one back. Otherwise write it, saying the number held back before."""
        now = self._clock()
        last, held = self._last.get(key, (-float("inf"), 0))
        if now - last < self.interval:
            self._last[key] = (last, held + 1)
            return None
        if key not in self._last and len(self._last) >= self.max_keys:
            self._last.clear()
        self._last[key] = (now, 0)
        return held

    def warning(
        self, logger: logging.Logger, key: str, message: str, *args: Any, event: dict[str, Any]
    ) -> None:
        """Logs ``message % args`` as a warning with its structured ``event``, if
        :meth:`admit` lets it through: saying how many were held back since the last one
        (in the line, and as the event's ``suppressed``)."""
        held = self.admit(key)
        if held is None:
            return
        more = f" ({held} more since the last warning)" if held else ""
        logger.warning(message + "%s", *args, more, extra={"event": {**event, "suppressed": held}})

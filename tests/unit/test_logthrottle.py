"""LogThrottle: one warning per key per interval, saying how many it held back."""

from __future__ import annotations

import logging

import pytest

from mesh.core.logthrottle import LogThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_of_an_interval_is_written_with_the_count_held_back() -> None:
    clock = Clock()
    throttle = LogThrottle(1.0, clock=clock)
    assert throttle.admit("Ghost") == 0
    clock.now += 0.2
    assert [throttle.admit("Ghost") for _ in range(3)] == [None, None, None]
    assert throttle.admit("Other") == 0  # each key on its own
    clock.now += 0.81  # a second after the last one written
    assert throttle.admit("Ghost") == 3
    assert throttle.admit("Ghost") is None
    clock.now += 5.0
    assert throttle.admit("Ghost") == 1


def test_it_keeps_at_most_max_keys() -> None:
    clock = Clock()
    throttle = LogThrottle(1.0, max_keys=2, clock=clock)
    assert [throttle.admit(k) for k in ("a", "b")] == [0, 0]
    assert throttle.admit("a") is None
    assert throttle.admit("c") == 0  # a third key: the others are forgotten
    assert len(throttle._last) == 1
    assert throttle.admit("a") == 0


def test_a_throttled_warning_says_how_many_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    throttle = LogThrottle(1.0, clock=clock)
    log = logging.getLogger("test.throttle")
    caplog.set_level(logging.WARNING, logger="test.throttle")
    for _ in range(3):
        throttle.warning(log, "Ghost", "refused for %s", "Ghost", event={"category": "x"})
    clock.now += 1.0
    throttle.warning(log, "Ghost", "refused for %s", "Ghost", event={"category": "x"})
    said = [(r.getMessage(), r.event) for r in caplog.records]  # type: ignore[attr-defined]
    assert said == [
        ("refused for Ghost", {"category": "x", "suppressed": 0}),
        ("refused for Ghost (2 more since the last warning)", {"category": "x", "suppressed": 2}),
    ]

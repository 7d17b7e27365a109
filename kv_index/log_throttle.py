"""Rate limit for warnings that a misbehaving peer could otherwise repeat every batch."""

from __future__ import annotations

import time
from collections.abc import Callable


class LogThrottle:
    """Allows one log line per interval and counts the ones it held back."""

    __slots__ = ("_clock", "_held", "_next", "interval_s")

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")
        self._held = 0

    def allow(self) -> int | None:
        """None while the line must be held back; else how many were held since the last."""
        now = self._clock()
        if now < self._next:
            self._held += 1
            return None
        self._next = now + self.interval_s
        held, self._held = self._held, 0
        return held

"""How often each prompt prefix was reused lately.

A request reuses a prefix when the pod it is sent to already holds it (a KV-cache hit, or
a prompt sent there and not yet answered). Counted per chunk key of the prompt (chained:
equal key at depth n = equal first n chunks) over a sliding window, so the count of a key
is the requests of the last window that found those chunks held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

# Events (one per key of a routed request) kept at most; the oldest go first beyond it.
# At 1,000 requests/s of 100 held chunks each, a window of a second holds 100,000.
MAX_EVENTS = 1_000_000


class RecentReuse:
    """Per chunk key, the requests that reused it in the last `window_s` seconds."""

    def __init__(self, window_s: float, max_events: int = MAX_EVENTS) -> None:
        self.window_s = window_s
        self.max_events = max_events
        # One event per key of a routed request, oldest first: its time and its key (two
        # deques, so that an event allocates no tuple).
        self._times: deque[float] = deque()
        self._keys: deque[int] = deque()
        self._counts: dict[int, int] = {}

    def __len__(self) -> int:
        """Distinct keys reused in the window."""
        return len(self._counts)

    def add(self, keys: Sequence[int], now: float) -> None:
        """One request reused the prefix of chained `keys` (all of them, every depth)."""
        self._expire(now)
        counts = self._counts
        self._times.extend([now] * len(keys))
        self._keys.extend(keys)
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        while len(self._times) > self.max_events:
            self._drop_oldest()

    def count(self, key: int, now: float) -> int:
        """Requests of the last window that reused the prefix ending at chunk `key`."""
        self._expire(now)
        return self._counts.get(key, 0)

    def _expire(self, now: float) -> None:
        times = self._times
        horizon = now - self.window_s
        while times and times[0] <= horizon:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        self._times.popleft()
        key = self._keys.popleft()
        left = self._counts[key] - 1
        if left:
            self._counts[key] = left
        else:
            del self._counts[key]

"""Recent prefix reuse: per chunk key, the requests of the last window that reused it."""

from __future__ import annotations

from smart_epp.scorers.prefix_reuse import RecentReuse


def test_a_key_counts_the_requests_that_reused_it_within_the_window():
    reuse = RecentReuse(window_s=1.0)
    reuse.add([1, 2, 3], now=10.0)  # held three chunks
    reuse.add([1, 2], now=10.5)  # held two of them
    assert (reuse.count(1, 10.6), reuse.count(2, 10.6), reuse.count(3, 10.6)) == (2, 2, 1)
    assert reuse.count(4, 10.6) == 0
    # The first request leaves the window a second after it came.
    assert (reuse.count(1, 11.0), reuse.count(3, 11.0)) == (1, 0)
    assert len(reuse) == 2
    assert reuse.count(1, 11.5) == 0 and len(reuse) == 0


def test_memory_is_bounded_by_dropping_the_oldest_events():
    reuse = RecentReuse(window_s=60.0, max_events=5)
    reuse.add([1, 2, 3], now=0.0)
    reuse.add([1, 4, 5], now=1.0)  # 6 events: the oldest (key 1 at t=0) goes
    assert reuse.count(1, 1.0) == 1
    assert (reuse.count(2, 1.0), reuse.count(4, 1.0)) == (1, 1)

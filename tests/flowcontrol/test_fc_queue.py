"""The flow-control queue alone: strict priority, fairness, bounds and TTL."""

from __future__ import annotations

import pytest

from smart_epp.epp.flowcontrol.queue import BandLimits, FlowQueue, QueuedItem, QueueFull


def item(name: str, priority: int = 0, flow: str = "f", size: int = 10, at: float = 0.0,
         ttl: float | None = None) -> QueuedItem:  # fmt: skip
    return QueuedItem(name, priority, flow, size, at, at + ttl if ttl is not None else None)


def drain(queue: FlowQueue) -> list[str]:
    out = []
    while (popped := queue.pop()) is not None:
        out.append(popped.payload)
    return out


def test_strict_priority_between_bands() -> None:
    queue = FlowQueue()
    for name, priority in [("low1", -1), ("mid1", 0), ("high1", 2), ("low2", -1), ("high2", 2)]:
        queue.push(item(name, priority))
    assert drain(queue) == ["high1", "high2", "mid1", "low1", "low2"]
    assert len(queue) == 0 and queue.bytes == 0


def test_round_robin_across_flows_fcfs_within_a_flow() -> None:
    queue = FlowQueue()
    for name in ["a1", "a2", "a3", "a4"]:
        queue.push(item(name, flow="tenant-a"))
    for name in ["b1", "b2"]:
        queue.push(item(name, flow="tenant-b"))
    queue.push(item("c1", flow="tenant-c"))
    # A heavy tenant does not starve the others: one request per flow per turn.
    assert drain(queue) == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]


def test_global_strict_fairness_is_arrival_order() -> None:
    queue = FlowQueue(default_band=BandLimits(fairness="global-strict"))
    for name, flow in [("a1", "a"), ("a2", "a"), ("b1", "b"), ("a3", "a")]:
        queue.push(item(name, flow=flow))
    assert drain(queue) == ["a1", "a2", "b1", "a3"]


def test_band_bounds_in_requests_and_bytes() -> None:
    queue = FlowQueue({0: BandLimits(max_requests=2, max_bytes=1000)})
    queue.push(item("r1"))
    queue.push(item("r2"))
    with pytest.raises(QueueFull, match="holds 2 requests"):
        queue.push(item("r3"))
    # Another band has its own room.
    queue.push(item("other", priority=1))
    by_bytes = FlowQueue({0: BandLimits(max_requests=100, max_bytes=25)})
    by_bytes.push(item("big", size=20))
    with pytest.raises(QueueFull, match="holds 25 bytes"):
        by_bytes.push(item("more", size=10))
    by_bytes.push(item("fits", size=5))
    assert by_bytes.bytes == 25


def test_global_bounds_across_bands() -> None:
    queue = FlowQueue(max_requests=2)
    queue.push(item("a", priority=0))
    queue.push(item("b", priority=1))
    with pytest.raises(QueueFull, match="the queue holds 2 requests"):
        queue.push(item("c", priority=2))


def test_negative_bands_use_their_own_default_template() -> None:
    queue = FlowQueue(default_negative_band=BandLimits(max_requests=1))
    queue.push(item("s1", priority=-1))
    with pytest.raises(QueueFull):
        queue.push(item("s2", priority=-1))
    queue.push(item("n1", priority=0))
    queue.push(item("n2", priority=0))


def test_ttl_expiry_takes_out_only_overdue_items() -> None:
    queue = FlowQueue()
    queue.push(item("short", at=0.0, ttl=1.0))
    queue.push(item("long", at=0.0, ttl=5.0))
    queue.push(item("forever", at=0.0, ttl=None))
    assert queue.next_deadline() == 1.0
    assert queue.expire(0.99) == []
    assert [i.payload for i in queue.expire(1.0)] == ["short"]
    assert queue.next_deadline() == 5.0
    assert [i.payload for i in queue.expire(10.0)] == ["long"]
    assert drain(queue) == ["forever"]


def test_removed_item_leaves_at_once_and_never_expires_later() -> None:
    queue = FlowQueue()
    gone = item("gone", ttl=1.0)
    queue.push(gone)
    queue.push(item("stays", ttl=2.0))
    assert queue.remove(gone) is True
    assert queue.remove(gone) is False
    assert len(queue) == 1 and queue.bytes == 10
    assert queue.next_deadline() == 2.0
    assert [i.payload for i in queue.expire(5.0)] == ["stays"]
    assert queue.band_usage() == {0: (0, 0)}

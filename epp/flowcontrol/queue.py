"""The flow-control queue: pure data structure, no clock of its own, no I/O.

Requests wait in priority bands (strict priority: a higher band always dispatches
first). Within a band, each fairness flow (`x-gateway-inference-fairness-id`) has its
own FCFS queue and the band serves its flows round-robin (or, with the
`global-strict-fairness-policy`, oldest head first). Each band is bounded in requests
and bytes, and so is the queue as a whole. Each item carries its own deadline;
`expire(now)` takes out every item past it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

Fairness = Literal["round-robin", "global-strict"]


@dataclass(frozen=True, slots=True)
class BandLimits:
    max_requests: int = 5000  # llm-d's per-band defaults
    max_bytes: int = 1_000_000_000
    fairness: Fairness = "round-robin"


@dataclass(slots=True, eq=False)
class QueuedItem:
    payload: Any  # the caller's object (the request flow's FlowRequest)
    priority: int
    flow_id: str
    size: int  # bytes counted against the limits
    enqueued_at: float
    deadline: float | None  # None: waits until dispatched or removed
    seq: int = 0
    queued: bool = True  # false once popped, removed or expired


@dataclass(slots=True)
class _Band:
    limits: BandLimits
    flows: OrderedDict[str, dict[int, QueuedItem]] = field(default_factory=OrderedDict)
    requests: int = 0
    bytes: int = 0


class QueueFull(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class FlowQueue:
    def __init__(
        self,
        band_limits: dict[int, BandLimits] | None = None,
        default_band: BandLimits | None = None,
        default_negative_band: BandLimits | None = None,
        max_requests: int = 0,  # 0: no limit across bands
        max_bytes: int = 0,
    ) -> None:
        self._limits = dict(band_limits or {})
        self._default = default_band or BandLimits()
        self._default_negative = default_negative_band or self._default
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._bands: dict[int, _Band] = {}
        self._order: list[int] = []  # band priorities, highest first
        self._deadlines: list[tuple[float, int, QueuedItem]] = []
        self._seq = 0
        self.requests = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self.requests

    def limits(self, priority: int) -> BandLimits:
        found = self._limits.get(priority)
        if found is not None:
            return found
        return self._default_negative if priority < 0 else self._default

    def _band(self, priority: int) -> _Band:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band(self.limits(priority))
            self._order = sorted(self._bands, reverse=True)
        return band

    def push(self, item: QueuedItem) -> None:
        """Queues `item`; raises QueueFull (with the limit that was hit) when it does not fit."""
        band = self._band(item.priority)
        limits = band.limits
        if band.requests + 1 > limits.max_requests:
            raise QueueFull(f"priority band {item.priority} holds {limits.max_requests} requests")
        if band.bytes + item.size > limits.max_bytes:
            raise QueueFull(f"priority band {item.priority} holds {limits.max_bytes} bytes")
        if self.max_requests and self.requests + 1 > self.max_requests:
            raise QueueFull(f"the queue holds {self.max_requests} requests")
        if self.max_bytes and self.bytes + item.size > self.max_bytes:
            raise QueueFull(f"the queue holds {self.max_bytes} bytes")
        self._seq += 1
        item.seq = self._seq
        item.queued = True
        flow = band.flows.get(item.flow_id)
        if flow is None:
            flow = band.flows[item.flow_id] = {}
        flow[item.seq] = item
        band.requests += 1
        band.bytes += item.size
        self.requests += 1
        self.bytes += item.size
        if item.deadline is not None:
            heapq.heappush(self._deadlines, (item.deadline, item.seq, item))

    def _take(self, band: _Band, item: QueuedItem) -> None:
        flow = band.flows[item.flow_id]
        del flow[item.seq]
        if not flow:
            del band.flows[item.flow_id]
        item.queued = False
        band.requests -= 1
        band.bytes -= item.size
        self.requests -= 1
        self.bytes -= item.size

    def peek(self) -> QueuedItem | None:
        """The item `pop` would return, left in place."""
        for priority in self._order:
            band = self._bands[priority]
            if band.requests:
                return self._head(band)
        return None

    @staticmethod
    def _head(band: _Band) -> QueuedItem:
        if band.limits.fairness == "global-strict":
            return min((next(iter(f.values())) for f in band.flows.values()), key=_seq_of)
        return next(iter(next(iter(band.flows.values())).values()))

    def pop(self) -> QueuedItem | None:
        """The next item to dispatch: highest band first, then the band's fairness order."""
        for priority in self._order:
            band = self._bands[priority]
            if not band.requests:
                continue
            item = self._head(band)
            flow_id = item.flow_id
            self._take(band, item)
            if flow_id in band.flows:  # round-robin: the flow goes to the back
                band.flows.move_to_end(flow_id)
            return item
        return None

    def remove(self, item: QueuedItem) -> bool:
        """Takes `item` out (its client left); False when it was no longer queued."""
        if not item.queued:
            return False
        self._take(self._bands[item.priority], item)
        return True

    def next_deadline(self) -> float | None:
        heap = self._deadlines
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def expire(self, now: float) -> list[QueuedItem]:
        """Takes out and returns every queued item whose deadline has passed."""
        heap = self._deadlines
        expired: list[QueuedItem] = []
        while heap and (heap[0][0] <= now or not heap[0][2].queued):
            _, _, item = heapq.heappop(heap)
            if item.queued:
                self._take(self._bands[item.priority], item)
                expired.append(item)
        return expired

    def band_usage(self) -> dict[int, tuple[int, int]]:
        """(requests, bytes) queued per band priority, for every band seen so far."""
        return {p: (b.requests, b.bytes) for p, b in self._bands.items()}


def _seq_of(item: QueuedItem) -> int:
    return item.seq

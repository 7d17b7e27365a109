"""What pickers share, and the store interface behind which it is kept.

Several pickers (worker processes of one `epp serve`, or replicas behind one Envoy)
decide for the same pool. Each keeps the whole KV index in its own memory (every picker
subscribes to every pod), so what they must share is only what one picker decided and
the others cannot learn from the pods before their next decision:

- its requests in flight per pod (and their prompt tokens), as absolute totals per
  picker, so a picker that dies leaves nothing behind once its entry expires;
- its routed prefixes: the block keys of a prompt it sent to a pod, held there
  speculatively until the pod's KV events confirm them, with an expiry;
- the answers its learning plugins learned from (measured TTFT and what was ahead), so
  that every picker learns the pods' costs from all of the pool's answers;
- the /metrics scrapes it took: each pod is scraped by one picker of the pool (chosen
  by rendezvous hashing over the live pickers) and the others apply its scrape, so that
  N pickers cost the pods and themselves one scrape per interval, not N.

One exchange per sync writes what this picker changed and reads what the others hold,
in one round trip (`PoolStateStore.exchange`). An exchange that changed what the others'
decisions read (loads, routed prefixes) also sends them a change notice
(`PoolStateStore.watch`), so they read it at once instead of at their next heartbeat.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ...framework.plugins import LearnedSample
from ...framework.types import PodMetrics

# The per-picker entry (its loads and its membership) outlives its last exchange by this
# much: a picker that stops syncing is forgotten after it.
DEFAULT_PICKER_TTL_S = 3.0
# Routed-prefix entries kept in the store (the oldest dropped beyond), and read per sync.
DEFAULT_MAX_ROUTED_ENTRIES = 20_000
DEFAULT_MAX_READ = 2_000
# Learning records kept in the store for pickers that start late (the oldest dropped
# beyond): about the last minute of a busy pool's answers, or 20 s of it with the default
# policy's `sharedQueue` on (three records per request: routed, answered, learned from).
DEFAULT_MAX_LEARNED = 5_000
# A pod's shared scrape not rewritten for this long is dropped from the store: the pod
# left the pool (or no picker is left to scrape it).
SCRAPE_FORGET_S = 60.0


@dataclass(frozen=True, slots=True)
class PodLoad:
    """One picker's requests in flight on one pod (or the sum over pickers)."""

    requests: int = 0
    prompt_tokens: int = 0
    prefilling: int = 0  # of those, sent and not yet answered with a first byte
    prefilling_tokens: int = 0
    # Predicted prefill seconds routed to the pod so far: a counter, whose rate the
    # others read as this picker's share of the pool's prefill utilisation.
    routed_prefill_s: float = 0.0

    def encode(self) -> str:
        return (
            f"{self.requests} {self.prompt_tokens} {self.prefilling} "
            f"{self.prefilling_tokens} {self.routed_prefill_s:.6f}"
        )

    @classmethod
    def decode(cls, text: str | bytes) -> PodLoad:
        if isinstance(text, bytes):
            text = text.decode()
        fields = text.split()
        requests, prompt_tokens, prefilling, prefilling_tokens = (int(v) for v in fields[:4])
        # A picker of an earlier release writes four fields: no routed prefill.
        routed_prefill_s = float(fields[4]) if len(fields) > 4 else 0.0
        return cls(requests, prompt_tokens, prefilling, prefilling_tokens, routed_prefill_s)

    def __add__(self, other: PodLoad) -> PodLoad:
        return PodLoad(
            self.requests + other.requests,
            self.prompt_tokens + other.prompt_tokens,
            self.prefilling + other.prefilling,
            self.prefilling_tokens + other.prefilling_tokens,
            self.routed_prefill_s + other.routed_prefill_s,
        )

    @property
    def empty(self) -> bool:
        return not (self.requests or self.prompt_tokens or self.prefilling or self.routed_prefill_s)


@dataclass(frozen=True, slots=True)
class RoutedEntry:
    """A prompt's block keys sent to `pod`, counted as held there for `ttl_s` more."""

    pod: str
    keys: tuple[int, ...]
    ttl_s: float

    def packed_keys(self) -> bytes:
        return struct.pack(f"<{len(self.keys)}Q", *self.keys)

    @staticmethod
    def unpack_keys(data: bytes) -> tuple[int, ...]:
        return struct.unpack(f"<{len(data) // 8}Q", data)


@dataclass(frozen=True, slots=True)
class SharedScrape:
    """One picker's latest /metrics scrape of one pod: what the page said (`payload`, see
    `encode_scrape`) or how many scrapes of it in a row had failed."""

    pod: str
    picker: str
    seq: int  # the scraping picker's count of its scrapes of this pod: new ones only
    age_s: float  # how long before the exchange it was taken
    payload: str


def encode_scrape(metrics: PodMetrics | None, failures: int = 0) -> str:
    """A scrape's result as the pickers share it; `None` for a failed scrape."""
    if metrics is None:
        return json.dumps({"failed": failures})
    return json.dumps(
        {
            "m": [
                metrics.waiting,
                metrics.running,
                metrics.kv_usage,
                sorted(metrics.running_adapters),
                sorted(metrics.waiting_adapters),
                metrics.max_loras,
                metrics.block_size,
                metrics.num_gpu_blocks,
                metrics.prefix_cache_queries,
                metrics.prefix_cache_hits,
                metrics.process_start_time,
            ]
        }
    )


def decode_scrape(payload: str | bytes) -> PodMetrics | int:
    """The metrics of a shared scrape, or the failure count of a failed one; ValueError
    for anything else (a peer of another release, a corrupted entry)."""
    try:
        doc = json.loads(payload)
        if "failed" in doc:
            failures = int(doc["failed"])
            if failures < 0:
                raise ValueError("negative failure count")
            return failures
        (waiting, running, kv_usage, running_adapters, waiting_adapters, max_loras,
         block_size, num_gpu_blocks, queries, hits, start) = doc["m"]  # fmt: skip
        metrics = PodMetrics(
            waiting=int(waiting),
            running=int(running),
            kv_usage=float(kv_usage),
            running_adapters=frozenset(str(a) for a in running_adapters),
            waiting_adapters=frozenset(str(a) for a in waiting_adapters),
            max_loras=int(max_loras),
            block_size=None if block_size is None else int(block_size),
            num_gpu_blocks=None if num_gpu_blocks is None else int(num_gpu_blocks),
            prefix_cache_queries=float(queries),
            prefix_cache_hits=float(hits),
            process_start_time=None if start is None else float(start),
        )
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"malformed shared scrape: {exc}") from exc
    numbers = (metrics.kv_usage, metrics.prefix_cache_queries, metrics.prefix_cache_hits)
    if min(metrics.waiting, metrics.running, metrics.max_loras) < 0 or not all(
        math.isfinite(v) and v >= 0 for v in numbers
    ):
        raise ValueError("malformed shared scrape: a count is negative or not finite")
    return metrics


@dataclass(slots=True)
class PickerUpdate:
    """What one picker writes in one exchange."""

    picker: str
    # Pods whose load changed since the last exchange; an empty load removes the pod.
    loads: Mapping[str, PodLoad]
    routed: Sequence[RoutedEntry] = ()
    learned: Sequence[LearnedSample] = ()
    # This picker's newest scrape of each pod it scraped since the last exchange
    # (`picker` is this picker).
    scrapes: Sequence[SharedScrape] = ()
    # The store may have lost this picker's entry (first exchange, or after an outage):
    # `loads` is then the whole table and replaces what the store holds.
    replace: bool = False
    # Send the other pickers a change notice: this update changes what their next
    # decision should read (loads, routed prefixes).
    notify: bool = False


@dataclass(slots=True)
class PeerView:
    """What the other live pickers hold, as of one exchange."""

    loads: dict[str, PodLoad] = field(default_factory=dict)  # per pod, summed over peers
    # Each peer's own routed-prefill counter per pod, (peer, pod) -> seconds: a rate read
    # from the sum would jump by a peer's whole count when that peer (re)joins the sum.
    routed_prefill_s: dict[tuple[str, str], float] = field(default_factory=dict)
    routed: list[RoutedEntry] = field(default_factory=list)  # new since the last exchange
    learned: list[LearnedSample] = field(default_factory=list)  # the others', new since
    malformed_learned: int = 0  # batches that did not decode, dropped
    # The others' scrapes written since the last exchange (and possibly a few seen then:
    # a reader keeps the newest (picker, seq) per pod).
    scrapes: list[SharedScrape] = field(default_factory=list)
    peers: int = 0
    peer_ids: tuple[str, ...] = ()  # the other live pickers
    # The store was emptied or replaced since the last exchange: whatever this picker
    # wrote before must be written again.
    store_reset: bool = False


def encode_learned(samples: Sequence[LearnedSample]) -> str:
    rows: list[list[object]] = []
    for s in samples:
        row: list[object] = [s.plugin, s.pod, list(s.values)]
        if s.ref:
            row.append(s.ref)
        rows.append(row)
    return json.dumps(rows)


def decode_learned(blob: str | bytes) -> list[LearnedSample]:
    """A batch written by `encode_learned`; ValueError for anything else (a peer of
    another release, a corrupted entry)."""
    try:
        rows = json.loads(blob)
        samples = [
            LearnedSample(
                str(plugin), str(pod), tuple(float(v) for v in values), str(ref[0]) if ref else ""
            )
            for plugin, pod, values, *ref in rows
        ]
        if any(len(row) > 4 for row in rows):
            raise ValueError("a row has more than four fields")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed learned-sample batch: {exc}") from exc
    if not all(math.isfinite(v) for s in samples for v in s.values):
        raise ValueError("malformed learned-sample batch: a value is not finite")
    return samples


class PoolStateStore(Protocol):
    """Where pickers meet. Atomic per exchange, bounded, and expiring."""

    async def exchange(self, update: PickerUpdate) -> PeerView: ...

    async def watch(
        self, picker: str, notice: Callable[[], None], subscribed: Callable[[], None]
    ) -> None:
        """Calls `subscribed` once subscribed, then `notice` each time another picker's
        exchange sends a change notice. Runs until cancelled; raises when the connection
        to the store is lost."""
        ...

    async def close(self) -> None: ...


class LocalPoolStore:
    """The store in this process: for pickers that share one event loop (tests, the
    replay), and the reference the Redis store behaves like."""

    def __init__(
        self,
        *,
        picker_ttl_s: float = DEFAULT_PICKER_TTL_S,
        max_entries: int = DEFAULT_MAX_ROUTED_ENTRIES,
        max_read: int = DEFAULT_MAX_READ,
        max_learned: int = DEFAULT_MAX_LEARNED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.picker_ttl_s = picker_ttl_s
        self._clock = clock  # the replay's virtual clock, or the host's
        self.max_read = max_read
        self._loads: dict[str, dict[str, PodLoad]] = {}
        self._expires: dict[str, float] = {}
        # (sequence, picker, entry, expires at)
        self._routed: deque[tuple[int, str, RoutedEntry, float]] = deque(maxlen=max_entries)
        self._seq = 0
        self._cursors: dict[str, int] = {}
        # (sequence, picker, sample)
        self._learned: deque[tuple[int, str, LearnedSample]] = deque(maxlen=max_learned)
        self._learned_cursors: dict[str, int] = {}
        # pod -> (sequence written, taken at (monotonic), scrape)
        self._scrapes: dict[str, tuple[int, float, SharedScrape]] = {}
        self._scrape_cursors: dict[str, int] = {}
        self._watchers: dict[str, list[Callable[[], None]]] = {}

    async def watch(
        self, picker: str, notice: Callable[[], None], subscribed: Callable[[], None]
    ) -> None:
        watchers = self._watchers.setdefault(picker, [])
        watchers.append(notice)
        subscribed()
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            watchers.remove(notice)

    async def exchange(self, update: PickerUpdate) -> PeerView:
        now = self._clock()
        me = update.picker
        loads = self._loads.setdefault(me, {})
        if update.replace:
            loads.clear()
        for pod, load in update.loads.items():
            if load.empty:
                loads.pop(pod, None)
            else:
                loads[pod] = load
        self._expires[me] = now + self.picker_ttl_s
        for picker in [p for p, until in self._expires.items() if until <= now]:
            del self._expires[picker]
            self._loads.pop(picker, None)
            self._cursors.pop(picker, None)
            self._learned_cursors.pop(picker, None)
            self._scrape_cursors.pop(picker, None)
        for entry in update.routed:
            self._seq += 1
            self._routed.append((self._seq, me, entry, now + entry.ttl_s))
        for scrape in update.scrapes:
            self._seq += 1
            self._scrapes[scrape.pod] = (self._seq, now - scrape.age_s, scrape)
        forgotten = [
            p for p, (_, taken, _) in self._scrapes.items() if now - taken > SCRAPE_FORGET_S
        ]
        for pod in forgotten:
            del self._scrapes[pod]
        others = tuple(sorted(p for p in self._expires if p != me))
        view = PeerView(peers=len(others), peer_ids=others)
        cursor = self._scrape_cursors.get(me, 0)
        for seq, taken, scrape in self._scrapes.values():
            if seq > cursor and scrape.picker != me:
                view.scrapes.append(
                    SharedScrape(scrape.pod, scrape.picker, scrape.seq, now - taken, scrape.payload)
                )
        self._scrape_cursors[me] = self._seq
        for picker, held in self._loads.items():
            if picker == me:
                continue
            for pod, load in held.items():
                view.loads[pod] = view.loads.get(pod, PodLoad()) + load
                view.routed_prefill_s[picker, pod] = load.routed_prefill_s
        cursor = self._cursors.get(me, 0)
        for seq, picker, entry, until in self._routed:
            if seq <= cursor:
                continue
            if len(view.routed) >= self.max_read:
                break
            cursor = seq
            if picker != me and until > now:
                view.routed.append(RoutedEntry(entry.pod, entry.keys, until - now))
        self._cursors[me] = cursor
        for sample in update.learned:
            self._seq += 1
            self._learned.append((self._seq, me, sample))
        cursor = self._learned_cursors.get(me, 0)
        for seq, picker, sample in self._learned:
            if seq <= cursor:
                continue
            if len(view.learned) >= self.max_read:
                break
            cursor = seq
            if picker != me:
                view.learned.append(sample)
        self._learned_cursors[me] = cursor
        if update.notify:
            loop = asyncio.get_running_loop()
            for picker, watchers in self._watchers.items():
                if picker != me:
                    # After this exchange returns, as a notice over a socket would come.
                    for notice in watchers:
                        loop.call_soon(notice)
        return view

    async def close(self) -> None:
        return None


__all__ = [
    "DEFAULT_MAX_LEARNED",
    "DEFAULT_MAX_READ",
    "DEFAULT_MAX_ROUTED_ENTRIES",
    "DEFAULT_PICKER_TTL_S",
    "LocalPoolStore",
    "PeerView",
    "PickerUpdate",
    "PodLoad",
    "PoolStateStore",
    "RoutedEntry",
    "SharedScrape",
    "decode_learned",
    "decode_scrape",
    "encode_learned",
    "encode_scrape",
]

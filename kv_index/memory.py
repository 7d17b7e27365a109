"""The in-memory block index: key -> which pods hold the block, on which tier.

Layout, chosen for memory and lookup speed in pure Python:
- each pod gets a small slot number; a block's holders are ONE int per key with two bits
  per slot (bit 2s = GPU, bit 2s+1 = CPU), so a block held by many pods costs one dict
  entry, and identical holder sets share one int object (interned);
- the dict's insertion order is the recency order: storing or confirming a block moves
  it to the end, and eviction drops from the front in chunks (a chunk per call keeps the
  scan over the dict's deleted slots amortised O(1) per insert);
- speculative entries (the gateway routed a request there; no event yet) live in a
  separate small map with an expiry from the injected clock, so the replay simulator can
  run this index in virtual time.

Every method has a synchronous form (`*_sync`) and the async `BlockIndex` form.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import groupby, repeat
from operator import or_

from ..framework.types import Medium, PrefixHit
from .ingest import medium_of

DEFAULT_CAPACITY = 4_000_000  # distinct blocks
DEFAULT_SPECULATIVE_TTL_S = 2.0
_MASK_INTERN_LIMIT = 65_536


def _medium_offset(medium: str | None) -> int:
    return 0 if medium_of(medium) == "GPU" else 1


class MemoryBlockIndex:
    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
        evict_chunk: int | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._clock = clock
        # Evicting a chunk at a time amortises the scan over deleted dict slots.
        self._evict_chunk = evict_chunk or max(1, min(capacity // 16, 65_536))
        self._table: dict[int, int] = {}
        self._masks: dict[int, int] = {}
        self._slot_of: dict[str, int] = {}
        self._pod_of: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._all_pods_mask = 0  # the GPU bit of every slot in use
        self._entries = 0  # (block, pod) pairs held, speculative ones excluded
        self._gpu_held: dict[int, int] = {}  # slot -> blocks it holds on its GPU tier
        self._spec: dict[int, dict[int, float]] = {}  # key -> slot -> expiry
        # key -> GPU bits of the slots holding it speculatively (kept equal to _spec's
        # slots), so a lookup merges speculative holders with C-level maps, not a loop.
        self._spec_mask: dict[int, int] = {}
        self._spec_heap: list[tuple[float, int, tuple[int, ...]]] = []
        # slot -> {key: expiry} of blocks a request was routed to the slot for, in the
        # current and the previous generation (each one speculative TTL long).
        self._routed_current: dict[int, dict[int, float]] = {}
        self._routed_previous: dict[int, dict[int, float]] = {}
        self._routed_rotate_at = 0.0
        self.evicted_blocks = 0

    # ---- bookkeeping -----------------------------------------------------------------

    @property
    def entries(self) -> int:
        """(block, pod) pairs currently held (speculative entries not counted)."""
        return self._entries

    @property
    def blocks(self) -> int:
        return len(self._table)

    def pods(self) -> list[str]:
        return list(self._slot_of)

    def held_blocks_sync(self, pod: str) -> int:
        """Blocks `pod` holds on its GPU tier (confirmed by its events; speculative ones
        not counted): how full its prefix cache is, in the index's view."""
        slot = self._slot_of.get(pod)
        return 0 if slot is None else self._gpu_held.get(slot, 0)

    def _slot(self, pod: str) -> int:
        slot = self._slot_of.get(pod)
        if slot is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot = self._next_slot
                self._next_slot += 1
            self._slot_of[pod] = slot
            self._pod_of[slot] = pod
            self._all_pods_mask |= 1 << (2 * slot)
        return slot

    def _interned(self) -> dict[int, int]:
        # Identical holder sets share one int object; the table of shared ints is
        # bounded, and dropping it only loses sharing, never correctness.
        if len(self._masks) >= _MASK_INTERN_LIMIT:
            self._masks.clear()
        return self._masks

    # ---- writes ----------------------------------------------------------------------

    def add_sync(self, pod: str, keys: Iterable[int], medium: Medium | str = "GPU") -> None:
        # One call per stored batch, so per-call overhead counts for one-block batches.
        slot = self._slot_of.get(pod)
        if slot is None:
            slot = self._slot(pod)
        gpu = medium == "GPU" or _medium_offset(medium) == 0
        bit = 1 << (2 * slot + (0 if gpu else 1))
        pair = 3 << (2 * slot)
        table = self._table
        share = self._interned().setdefault
        spec = self._spec
        if type(keys) is not list and not isinstance(keys, list | tuple):
            keys = list(keys)
        if table.keys().isdisjoint(keys):
            # The usual case, newly stored blocks: one C-level update.
            before = len(table)
            table.update(zip(keys, repeat(share(bit, bit))))
            added = newly_held = len(table) - before
        else:
            added = newly_held = 0
            for key in keys:
                old = table.pop(key, 0)  # re-inserting moves the block to the recent end
                if not old & pair:
                    added += 1
                if not old & bit:
                    newly_held += 1
                new = old | bit
                table[key] = share(new, new)
        self._entries += added
        if gpu and newly_held:
            self._gpu_held[slot] = self._gpu_held.get(slot, 0) + newly_held
        if spec:
            self._drop_speculative(slot, keys)  # an event confirmed them
        if len(table) > self.capacity:
            self._evict(len(table) - self.capacity + self._evict_chunk)

    def remove_sync(self, pod: str, keys: Iterable[int], medium: Medium | str = "GPU") -> None:
        slot = self._slot_of.get(pod)
        if slot is None:
            return
        bit = 1 << (2 * slot + (0 if medium == "GPU" else _medium_offset(medium)))
        pair = 3 << (2 * slot)
        table = self._table
        table_get = table.get
        share = self._interned().setdefault
        if not isinstance(keys, list | tuple):
            keys = list(keys)
        dropped = released = 0
        for key in keys:
            old = table_get(key)
            if old is not None and old & bit:
                released += 1
                new = old & ~bit
                if not new & pair:
                    dropped += 1
                if new:
                    table[key] = share(new, new)  # keeps its recency position
                else:
                    del table[key]
        self._entries -= dropped
        if released and bit == 1 << (2 * slot):
            self._gpu_held[slot] -= released
            if slot in self._routed_current or slot in self._routed_previous:
                self._routed_while_held(slot, keys)

    def clear_pod_sync(self, pod: str) -> None:
        """Forgets everything about `pod` and frees its slot."""
        slot = self._slot_of.pop(pod, None)
        if slot is None:
            return
        del self._pod_of[slot]
        self._gpu_held.pop(slot, None)
        self._routed_current.pop(slot, None)
        self._routed_previous.pop(slot, None)
        self._all_pods_mask &= ~(1 << (2 * slot))
        pair = 3 << (2 * slot)
        keep = ~pair
        table = self._table
        emptied: list[int] = []
        changed: list[tuple[int, int]] = []
        for key, value in table.items():
            if value & pair:
                new = value & keep
                if new:
                    changed.append((key, new))
                else:
                    emptied.append(key)
        share = self._interned().setdefault
        for key, new in changed:
            table[key] = share(new, new)
        for key in emptied:
            del table[key]
        self._entries -= len(changed) + len(emptied)
        for key in [k for k, slots in self._spec.items() if slot in slots]:
            self._forget_speculative(key, slot)
        heapq.heappush(self._free_slots, slot)

    def add_speculative_sync(
        self, pod: str, keys: Sequence[int], ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    ) -> None:
        now = self._clock()
        self._expire(now)
        slot = self._slot(pod)
        pair = 3 << (2 * slot)
        expiry = now + ttl_s
        table = self._table
        spec = self._spec
        spec_get = spec.get
        mask = self._spec_mask
        gpu_bit = 1 << (2 * slot)
        fresh: list[int] = []
        append = fresh.append
        # Holder masks fetched in C; most keys of a routed prompt are not yet on the pod.
        for key, held in zip(keys, map(table.get, keys, repeat(0)), strict=True):
            if held & pair:
                # Confirmed already: the pod is about to reuse it, so it counts as used.
                table[key] = table.pop(key)
                continue
            slots = spec_get(key)
            if slots is None:
                spec[key] = {slot: expiry}
                mask[key] = gpu_bit
            elif slots.get(slot, 0.0) < expiry:  # a shorter life never cuts a longer one
                slots[slot] = expiry
                mask[key] |= gpu_bit
            else:
                continue
            append(key)
        if fresh:
            heapq.heappush(self._spec_heap, (expiry, slot, tuple(fresh)))
        # A waiting request pins no blocks in vLLM: should the pod evict the held ones
        # before the request runs, it computes them again, so they stay held there (see
        # remove_sync). Recorded in C for every key; two generations bound it.
        if now >= self._routed_rotate_at:
            self._routed_previous = self._routed_current
            self._routed_current = {}
            # Entries that last longer (a prompt predicted to wait) keep the default's
            # generations: the record grows with routed keys per generation, and a busy
            # pool routes many.
            self._routed_rotate_at = now + min(ttl_s, DEFAULT_SPECULATIVE_TTL_S)
        routed = self._routed_current.get(slot)
        if routed is None:
            routed = self._routed_current[slot] = {}
        routed.update(zip(keys, repeat(expiry)))

    def _routed_while_held(self, slot: int, keys: Sequence[int]) -> None:
        """Keys of `slot` just removed that a request was routed there for within its
        speculative TTL: one that has not run yet computes them again, so they count as
        held (speculatively) until that routing's expiry."""
        now = self._clock()
        current = self._routed_current.get(slot, {})
        previous = self._routed_previous.get(slot, {})
        spec = self._spec
        mask = self._spec_mask
        gpu_bit = 1 << (2 * slot)
        by_expiry: dict[float, list[int]] = {}
        # Most evicted blocks were not routed lately: the intersections are found in C.
        for key in (current.keys() & keys) | (previous.keys() & keys):
            expiry = current.get(key) or previous[key]
            if expiry <= now:
                continue
            slots = spec.get(key)
            if slots is None:
                spec[key] = {slot: expiry}
                mask[key] = gpu_bit
            elif slots.get(slot, 0.0) < expiry:
                slots[slot] = expiry
                mask[key] |= gpu_bit
            else:
                continue
            by_expiry.setdefault(expiry, []).append(key)
        for expiry, fresh in by_expiry.items():
            heapq.heappush(self._spec_heap, (expiry, slot, tuple(fresh)))

    def _drop_speculative(self, slot: int, keys: Iterable[int]) -> None:
        # Only keys with a speculative entry matter; the intersection is found in C.
        for key in self._spec.keys() & keys:
            self._forget_speculative(key, slot)

    def _forget_speculative(self, key: int, slot: int) -> None:
        slots = self._spec[key]
        if slots.pop(slot, None) is None:
            return
        if slots:
            self._spec_mask[key] &= ~(1 << (2 * slot))
        else:
            del self._spec[key]
            del self._spec_mask[key]

    def _expire(self, now: float) -> None:
        heap = self._spec_heap
        spec = self._spec
        spec_get = spec.get
        later = now + 1
        while heap and heap[0][0] <= now:
            _, slot, keys = heapq.heappop(heap)
            for key in keys:
                slots = spec_get(key)
                # A later speculative add may have extended this entry.
                if slots is not None and slots.get(slot, later) <= now:
                    self._forget_speculative(key, slot)

    def _evict(self, count: int) -> None:
        table = self._table
        victims = []
        for key in table:
            victims.append(key)
            if len(victims) >= count:
                break
        held = self._gpu_held
        for key in victims:
            value = table.pop(key)
            self._entries -= _pairs_held(value)
            gpu_bits = value & _even_bits(value.bit_length())
            while gpu_bits:
                lowest = gpu_bits & -gpu_bits
                slot = (lowest.bit_length() - 1) >> 1
                held[slot] -= 1
                gpu_bits ^= lowest
        self.evicted_blocks += len(victims)

    # ---- reads -----------------------------------------------------------------------

    def held_by_pod(self, chunk: int = 65_536) -> Iterator[dict[tuple[str, Medium], list[int]]]:
        """Every confirmed (block, pod, tier) entry, grouped by (pod, tier), `chunk` blocks
        at a time (a snapshot taken up front, so the caller may yield between chunks)."""
        items = list(self._table.items())
        pod_of = dict(self._pod_of)
        for start in range(0, len(items), chunk):
            grouped: dict[tuple[str, Medium], list[int]] = {}
            for key, mask in items[start : start + chunk]:
                while mask:
                    low = mask & -mask
                    bit = low.bit_length() - 1
                    mask ^= low
                    pod = pod_of.get(bit >> 1)
                    if pod is not None:
                        medium: Medium = "CPU" if bit & 1 else "GPU"
                        grouped.setdefault((pod, medium), []).append(key)
            yield grouped

    def holders_sync(self, key: int) -> dict[str, Medium]:
        """Which pods hold one block (confirmed entries only), for tests and debugging."""
        value = self._table.get(key, 0)
        out: dict[str, Medium] = {}
        for slot, pod in self._pod_of.items():
            bits = (value >> (2 * slot)) & 3
            if bits:
                out[pod] = "GPU" if bits & 1 else "CPU"
        return out

    def lookup_sync(
        self, keys: Sequence[int], pods: Collection[str] | None = None
    ) -> dict[str, PrefixHit]:
        """Longest run of consecutive blocks from the first key, per pod (absent = 0).

        The tier is the slowest one along the run: a block held on GPU counts as GPU
        even when a CPU copy exists too.
        """
        if pods is None:
            alive = self._all_pods_mask
        else:
            alive = 0
            slot_of = self._slot_of
            for pod in pods:
                slot = slot_of.get(pod)
                if slot is not None:
                    alive |= 1 << (2 * slot)
        if not alive or not keys:
            return {}
        table_get = self._table.get
        first = table_get(keys[0], 0)
        if not (first | (first >> 1)) & alive and not self._spec:
            return {}  # the common miss, without fetching the rest
        # Holder masks of every block, fetched in C; runs of blocks with the same
        # holders (the usual case along a shared prefix) are then handled as one step.
        values = list(map(table_get, keys, repeat(0)))
        if self._spec:
            values = self._merge_speculative(keys, values)
        counts: dict[int, int] = {}
        cpu_only = 0
        index = 0
        for value, run in groupby(values):
            present = (value | (value >> 1)) & alive
            if present != alive:
                # Pods dropping out at the first block matched nothing: not enumerated,
                # so a lookup does not cost O(pods in the pool).
                dropped = alive & ~present if index else 0
                while dropped:
                    low = dropped & -dropped
                    counts[(low.bit_length() - 1) >> 1] = index
                    dropped ^= low
                alive = present
                if not alive:
                    break
            cpu_only |= (value >> 1) & ~value & alive
            index += len(list(run))
        while alive:
            low = alive & -alive
            counts[(low.bit_length() - 1) >> 1] = index
            alive ^= low
        pod_of = self._pod_of
        return {
            pod_of[slot]: PrefixHit(blocks=n, medium="CPU" if cpu_only >> (2 * slot) & 1 else "GPU")
            for slot, n in counts.items()
            if n
        }

    def _merge_speculative(self, keys: Sequence[int], values: list[int]) -> list[int]:
        self._expire(self._clock())  # what is left in the mask has not expired
        mask = self._spec_mask
        if mask.keys().isdisjoint(keys):
            return values
        return list(map(or_, values, map(mask.get, keys, repeat(0))))

    # ---- BlockIndex (async) ------------------------------------------------------------

    async def add(self, pod: str, keys: Sequence[int], medium: Medium = "GPU") -> None:
        self.add_sync(pod, keys, medium)

    async def remove(self, pod: str, keys: Sequence[int], medium: Medium = "GPU") -> None:
        self.remove_sync(pod, keys, medium)

    async def clear_pod(self, pod: str) -> None:
        self.clear_pod_sync(pod)

    async def add_speculative(
        self, pod: str, keys: Sequence[int], ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    ) -> None:
        self.add_speculative_sync(pod, keys, ttl_s)

    async def lookup(
        self, keys: Sequence[int], pods: Collection[str] | None = None
    ) -> dict[str, PrefixHit]:
        return self.lookup_sync(keys, pods)


def _pairs_held(value: int) -> int:
    """How many pods a holder mask names (a pod with both tiers counts once)."""
    return ((value | (value >> 1)) & _even_bits(value.bit_length())).bit_count()


_EVEN_CACHE: dict[int, int] = {}


def _even_bits(width: int) -> int:
    mask = _EVEN_CACHE.get(width)
    if mask is None:
        mask = int("01" * ((width + 1) // 2 + 1), 2)
        _EVEN_CACHE[width] = mask
    return mask

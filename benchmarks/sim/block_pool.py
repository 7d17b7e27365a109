"""vLLM's paged KV block pool with prefix caching, as pure data structures.

Blocks are numbered ``0..num_blocks-1``; block 0 is the reserved null block, as in vLLM, so
``num_blocks - 1`` blocks are usable. Free blocks, cached or not, wait in an LRU queue:
allocation takes from the head (evicting the block's cached hash, if any) and freeing appends
to the tail, so the least recently released cached blocks are evicted first. Blocks in use
(``ref_cnt > 0``) are pinned. The same digest may be cached in several physical blocks (an
identical request computed twice), as in vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .events import BlockRemoved


class BlockPool:
    __slots__ = ("_cached", "_digest", "_free", "_ref", "num_blocks")

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (one is the reserved null block)")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._digest: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[bytes, dict[int, None]] = {}

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(v) for v in self._cached.values())

    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_usable

    def lookup(self, digest: bytes) -> int | None:
        blocks = self._cached.get(digest)
        return next(iter(blocks)) if blocks else None

    def longest_cached_prefix(self, digests: Sequence[bytes]) -> list[int]:
        """Block ids holding the longest cached run of ``digests`` from the first."""
        hit: list[int] = []
        for d in digests:
            block = self.lookup(d)
            if block is None:
                break
            hit.append(block)
        return hit

    def evictable_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them shrinks it)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """Pins cached blocks that a request reuses."""
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int, removed: list[BlockRemoved]) -> list[int] | None:
        """Takes ``n`` blocks from the LRU head, evicting their hashes into ``removed``."""
        free = self._free
        if n > len(free):
            return None
        ref, digest, cached = self._ref, self._digest, self._cached
        popitem = free.popitem
        from_bytes = int.from_bytes
        out: list[int] = []
        append = out.append
        for _ in range(n):
            b = popitem(False)[0]
            d = digest[b]
            if d is not None:
                holders = cached.get(d)
                if holders is not None:
                    holders.pop(b, None)
                    if not holders:
                        del cached[d]
                digest[b] = None
                # published_id, inlined: evictions run by the million in a replay.
                removed.append(BlockRemoved([from_bytes(d[-8:], "big")]))
            ref[b] = 1
            append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Releases a request's blocks, tail first so its last blocks are evicted first."""
        ref, free = self._ref, self._free
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def cache(self, block: int, digest: bytes) -> None:
        """Records that ``block`` now holds the full block ``digest``."""
        self._digest[block] = digest
        self._cached.setdefault(digest, {})[block] = None

    def cache_many(self, blocks: Sequence[int], digests: Sequence[bytes]) -> None:
        """``cache`` for each (block, digest) pair."""
        digest_of, cached = self._digest, self._cached
        holders_of = cached.get
        for block, d in zip(blocks, digests, strict=True):
            digest_of[block] = d
            holders = holders_of(d)
            if holders is None:
                cached[d] = {block: None}
            else:
                holders[block] = None

    def is_cached(self, block: int) -> bool:
        return self._digest[block] is not None

    def reset_cache(self) -> bool:
        """Drops every cached hash; refused (False) while any block is in use, like vLLM."""
        if len(self._free) != self.num_usable:
            return False
        self._cached.clear()
        self._digest = [None] * self.num_blocks
        return True

"""What a router remembers of the prompt prefixes it sent to each pod.

Routers without KV events (the Inference Extension's approximate prefix scorer, SGLang's
cache-aware router, AIBrix) guess each pod's prefix cache from their own routing: the
prompt is cut into fixed chunks with chained hashes (equal key at depth n = equal first n
chunks), which gives a radix tree's longest-prefix answers at chunk granularity. One
chained-key helper and one table serve all of them; each policy keeps its own upstream
rule for what a chunk is (characters, tokens, bytes per token).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash


def chained_keys(data: bytes, chunk_bytes: int, namespace: str = "") -> list[int]:
    """Chained 64-bit keys of the full `chunk_bytes`-sized pieces of `data`, the chain
    seeded with `namespace` (a model name, so equal prompts of two models never match)."""
    parent = xxhash.xxh64_intdigest(namespace.encode())
    keys = []
    for start in range(0, len(data) - chunk_bytes + 1, chunk_bytes):
        parent = xxhash.xxh64_intdigest(data[start : start + chunk_bytes], parent)
        keys.append(parent)
    return keys


def unit_chunk_keys(units: Sequence[int], chunk: int, namespace: str = "") -> list[int]:
    """`chained_keys` over a sequence of ints (token ids, or characters' code points)."""
    if len(units) < chunk:
        return []
    return chained_keys(array("q", units).tobytes(), 8 * chunk, namespace)


class RoutedPrefixTable:
    """Per pod, the chunk keys routed there, least recently routed evicted past a cap."""

    def __init__(self, max_chunks_per_pod: int) -> None:
        self._max = max_chunks_per_pod
        self._pods_by_key: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def match(self, keys: Sequence[int], pods: Sequence[str]) -> dict[str, int]:
        """Leading chunks of `keys` each pod holds (0 for pods holding none)."""
        matched = dict.fromkeys(pods, 0)
        alive = set(pods)
        for depth, key in enumerate(keys):
            holders = self._pods_by_key.get(key)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for pod in alive:
                matched[pod] = depth + 1
        return matched

    def insert(self, pod: str, keys: Sequence[int], capacity: int | None = None) -> None:
        """Records `keys` as routed to `pod`; `capacity` overrides the cap for this pod."""
        lru = self._lru.setdefault(pod, OrderedDict())
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                self._pods_by_key.setdefault(key, set()).add(pod)
        cap = self._max if capacity is None else capacity
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            holders = self._pods_by_key.get(old)
            if holders is not None:
                holders.discard(pod)
                if not holders:
                    del self._pods_by_key[old]

    def remove_pod(self, pod: str) -> None:
        for key in self._lru.pop(pod, ()):
            holders = self._pods_by_key.get(key)
            if holders is not None:
                holders.discard(pod)
                if not holders:
                    del self._pods_by_key[key]

    def size(self, pod: str) -> int:
        lru = self._lru.get(pod)
        return len(lru) if lru else 0

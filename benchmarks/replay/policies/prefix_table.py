"""A router-side guess of each pod's prefix cache, built from where requests were sent.

SGLang's cache-aware router keeps an approximate radix tree per worker and AIBrix a table
of prefix-block hashes; both learn only from their own routing. Here the prompt is cut
into fixed chunks with chained hashes, which gives the same longest-prefix answers as a
radix tree at chunk granularity, with per-pod LRU eviction at a size cap.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash

from ....framework.types import LLMRequest


def prompt_units(request: LLMRequest) -> Sequence[int]:
    """The prompt as a sequence of ints: token ids when known, else characters."""
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    return [ord(c) for c in request.text_for_hashing()]


CHARACTERS_PER_TOKEN = 4  # the usual estimate for English BPE vocabularies


def prompt_characters(request: LLMRequest) -> bytes:
    """The prompt as characters (UTF-32, 4 bytes each), for routers that tokenize by
    character. Replayed token ids stand for text: each counts as 4 characters (its id's 4
    bytes), so character blocks keep their size in tokens."""
    if request.prompt_token_ids is not None:
        ids = np.asarray(request.prompt_token_ids, dtype="<u4")
        return ids.view(np.uint8).astype("<u4").tobytes()
    return request.text_for_hashing().encode("utf-32-le")


def character_chunk_keys(chars: bytes, chunk_chars: int, namespace: str = "") -> list[int]:
    """Chained 64-bit keys of the full `chunk_chars`-character pieces of `chars`."""
    step = 4 * chunk_chars
    parent = xxhash.xxh64_intdigest(namespace.encode())
    keys = []
    for start in range(0, len(chars) - step + 1, step):
        parent = xxhash.xxh64_intdigest(chars[start : start + step], parent)
        keys.append(parent)
    return keys


def chunk_keys(units: Sequence[int], chunk: int, namespace: str = "") -> list[int]:
    """Chained 64-bit keys of the full `chunk`-sized pieces of `units`."""
    data = array("q", units)
    parent = xxhash.xxh64_intdigest(namespace.encode())
    keys = []
    for start in range(0, len(data) - chunk + 1, chunk):
        parent = xxhash.xxh64_intdigest(data[start : start + chunk].tobytes(), parent)
        keys.append(parent)
    return keys


class RoutedPrefixTable:
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

    def insert(self, pod: str, keys: Sequence[int]) -> None:
        lru = self._lru.setdefault(pod, OrderedDict())
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                self._pods_by_key.setdefault(key, set()).add(pod)
        while len(lru) > self._max:
            old, _ = lru.popitem(last=False)
            holders = self._pods_by_key.get(old)
            if holders is not None:
                holders.discard(pod)
                if not holders:
                    del self._pods_by_key[old]

    def size(self, pod: str) -> int:
        lru = self._lru.get(pod)
        return len(lru) if lru else 0

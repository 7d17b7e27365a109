"""smart-epp's own block keys: a chained 64-bit hash over token ids.

Keys never depend on the pods' hash algorithm or PYTHONHASHSEED, so the write side (a
pod's BlockStored token ids) and the read side (a prompt's token ids) agree by
construction. Each key is xxh3_64 of the block's token ids (as little-endian uint32)
seeded with the previous block's key; the first block is seeded with a root that
encodes model, LoRA adapter, cache_salt and block size, so two scopes never share keys.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest

# Token ids fit in 32 bits for every tokenizer vLLM serves; array('I') packs them in C.
_TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"


@dataclass(frozen=True, slots=True)
class KeyScope:
    """What, besides the tokens, decides whether two blocks hold the same KV values."""

    model: str = ""
    adapter: str | None = None
    cache_salt: str | None = None


@lru_cache(maxsize=4096)
def root_key(scope: KeyScope, block_size: int) -> int:
    """The seed of the first block's key for this scope and block size."""
    text = "\x1f".join(
        (
            "smart-epp-kv-v1",
            scope.model,
            "" if scope.adapter is None else "a:" + scope.adapter,
            "" if scope.cache_salt is None else "s:" + scope.cache_salt,
            str(block_size),
        )
    )
    return _xxh3(text.encode())


def token_bytes(token_ids: Sequence[int]) -> bytes:
    return array(_TOKEN_TYPECODE, token_ids).tobytes()


def extend_keys(parent_key: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of the full blocks of `token_ids`, chained after the block keyed `parent_key`.

    A trailing partial block gets no key (vLLM never caches or publishes one).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = token_bytes(token_ids)
    step = block_size * 4
    keys: list[int] = []
    append = keys.append
    key = parent_key
    for start in range(0, (len(token_ids) // block_size) * step, step):
        key = _xxh3(data[start : start + step], key)
        append(key)
    return keys


def block_keys(token_ids: Sequence[int], block_size: int, scope: KeyScope) -> list[int]:
    """One key per FULL block of a token sequence that starts at token 0."""
    return extend_keys(root_key(scope, block_size), token_ids, block_size)

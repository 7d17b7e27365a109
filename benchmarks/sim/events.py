"""KV-cache events as plain data, with vLLM 0.32's field names in vLLM's field order.

The engine produces these; ``kv_events`` encodes them to msgpack. Field order matters: vLLM
encodes each event as a msgpack map whose keys follow the struct's declaration order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]  # uint64 ids: low 64 bits of each block digest
    parent_block_hash: int | None
    token_ids: list[int]  # exactly len(block_hashes) * block_size tokens
    block_size: int
    lora_id: int | None = None
    medium: str = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # one entry per block: None or the untagged keys
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"
    session_id: str | None = None  # omitted from the wire when unset


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = "GPU"
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

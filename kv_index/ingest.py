"""Turns one pod's decoded event batches into index operations (pure, no I/O).

Per pod it keeps what the events teach: the block size, and for each data-parallel rank
and tier the map from vLLM's block hash to smart-epp's key, which is how a BlockRemoved
(which carries only vLLM hashes) finds the key to drop and how a BlockStored's parent
hash becomes the seed of its chain.

Each GPU `BlockStored` also reaches `progress` (kv_index/progress.py): how far the pod has
got through the prefill of the prompts the gateway sent it.

Key scope: `model` is the base model the pod serves (given when the pod is registered),
`adapter` is the event's `lora_name`, and `cache_salt` is read from the first block's
published extra keys (vLLM puts the salt there, untagged, next to the adapter name).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import Literal

from ..framework.types import Medium
from .events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from .keys import KeyScope, extend_keys, root_key
from .progress import PrefillProgress


@dataclass(frozen=True, slots=True)
class IndexOp:
    kind: Literal["add", "remove", "clear"]
    keys: list[int] = field(default_factory=list)
    medium: Medium = "GPU"


@dataclass(slots=True)
class ApplyResult:
    ops: list[IndexOp] = field(default_factory=list)
    stored_blocks: int = 0
    removed_blocks: int = 0
    orphan_blocks: int = 0  # stored after a parent we never saw: no key can be computed
    unknown_removals: int = 0  # removal of a hash we never saw stored
    malformed_events: int = 0
    evicted_hashes: int = 0  # oldest hash -> key entries dropped to stay within the bound


def medium_of(raw: str | None) -> Medium:
    # vLLM names its tiers GPU/CPU (and reports "GPU" on its CPU build); any other
    # offload tier is at least as slow as CPU.
    return "GPU" if raw is None or raw == "GPU" or raw.upper() == "GPU" else "CPU"


def cache_salt_of(event: BlockStored) -> str | None:
    """The cache_salt vLLM folded into the first block's extra keys, if any."""
    if event.parent_block_hash is not None or not event.extra_keys:
        return None
    first = event.extra_keys[0]
    if not isinstance(first, list):
        return None
    salts = [k for k in first if isinstance(k, str) and k != event.lora_name]
    return salts[-1] if salts else None


@dataclass(slots=True)
class PodIngest:
    model: str
    block_size: int | None = None
    # (data-parallel rank, tier) -> vLLM block hash -> smart-epp key
    maps: dict[tuple[int, Medium], dict[BlockHash, int]] = field(default_factory=dict)
    batches: int = 0
    # (adapter, cache_salt, block size) -> root key; saves rebuilding a scope per event
    roots: dict[tuple[str | None, str | None, int], int] = field(default_factory=dict)

    def root(self, adapter: str | None, salt: str | None, block_size: int) -> int:
        key = (adapter, salt, block_size)
        seed = self.roots.get(key)
        if seed is None:
            seed = self.roots[key] = root_key(KeyScope(self.model, adapter, salt), block_size)
        return seed

    def hashes_known(self) -> int:
        return sum(len(m) for m in self.maps.values())


class IngestState:
    """What the index learned from each pod's events; pods are "ip:port" addresses.

    `max_hashes_per_tier` bounds each pod's hash -> key map per (rank, tier), normally at
    the index capacity: a pod cannot hold more blocks than the index keeps, so entries
    beyond it are ones whose removal was lost. The oldest stored go first, in chunks.
    """

    def __init__(
        self, max_hashes_per_tier: int | None = None, progress: PrefillProgress | None = None
    ) -> None:
        if max_hashes_per_tier is not None and max_hashes_per_tier <= 0:
            raise ValueError("max_hashes_per_tier must be positive")
        self._pods: dict[str, PodIngest] = {}
        self.max_hashes_per_tier = max_hashes_per_tier
        self.progress = progress if progress is not None else PrefillProgress()

    def register_pod(self, pod: str, model: str) -> PodIngest:
        state = self._pods.get(pod)
        if state is None:
            state = self._pods[pod] = PodIngest(model=model)
        elif state.model != model:
            state.model = model
            state.roots.clear()
        return state

    def forget_pod(self, pod: str) -> None:
        self._pods.pop(pod, None)
        self.progress.reset_pod(pod)

    def reset_pod(self, pod: str) -> None:
        """The pod restarted or cleared its cache: nothing it published is valid."""
        state = self._pods.get(pod)
        if state is not None:
            state.maps.clear()
        self.progress.reset_pod(pod)

    def pods(self) -> list[str]:
        return list(self._pods)

    def pod(self, pod: str) -> PodIngest | None:
        return self._pods.get(pod)

    def block_size(self, pod: str) -> int | None:
        """The block size the pod's events use (None until its first BlockStored)."""
        state = self._pods.get(pod)
        return None if state is None else state.block_size

    def model(self, pod: str) -> str | None:
        state = self._pods.get(pod)
        return None if state is None else state.model

    def apply(self, pod: str, batch: EventBatch, model: str = "") -> ApplyResult:
        state = self._pods.get(pod) or self.register_pod(pod, model)
        state.batches += 1
        rank = batch.data_parallel_rank or 0
        result = ApplyResult()
        ops = result.ops
        maps = state.maps
        # Consecutive removals from one tier become one op: vLLM publishes every evicted
        # block as its own event, so a busy pod's batch holds hundreds of them.
        in_run = False
        run_medium: Medium = "GPU"
        run_map: dict[BlockHash, int] | None = None
        run_keys: list[int] | None = None
        removed = unknown = 0
        for event in batch.events:
            if type(event) is BlockRemoved:
                medium = medium_of(event.medium)
                if not in_run or medium != run_medium:
                    in_run = True
                    run_medium = medium
                    run_map = maps.get((rank, medium))
                    run_keys = None
                hashes = event.block_hashes
                if run_map is None:
                    unknown += len(hashes)
                    continue
                pop = run_map.pop
                for block_hash in hashes:
                    key = pop(block_hash, None)
                    if key is None:
                        unknown += 1
                        continue
                    if run_keys is None:
                        run_keys = []
                        ops.append(IndexOp("remove", run_keys, medium))
                    run_keys.append(key)
                    removed += 1
                continue
            in_run = False
            if isinstance(event, BlockStored):
                self._stored(state, rank, event, result)
            elif isinstance(event, AllBlocksCleared):
                maps.clear()
                ops.append(IndexOp("clear"))
        result.removed_blocks += removed
        result.unknown_removals += unknown
        progress = self.progress
        for op in ops:
            if op.kind == "add" and op.medium == "GPU":
                progress.stored(pod, op.keys)
        return result

    def _stored(self, state: PodIngest, rank: int, event: BlockStored, out: ApplyResult) -> None:
        hashes = event.block_hashes
        if not hashes:
            return
        token_ids = event.token_ids
        block_size = event.block_size or len(token_ids) // len(hashes)
        if block_size <= 0 or len(token_ids) < block_size * len(hashes):
            out.malformed_events += 1
            return
        medium = medium_of(event.medium)
        maps = state.maps
        tier = (rank, medium)
        tier_map = maps.get(tier)
        if tier_map is None:
            tier_map = maps[tier] = {}
        parent = event.parent_block_hash
        if parent is None:
            seed = state.root(event.lora_name, cache_salt_of(event), block_size)
        else:
            found = tier_map.get(parent)
            if found is None:
                other = maps.get((rank, "CPU" if medium == "GPU" else "GPU"))
                found = None if other is None else other.get(parent)
            if found is None:
                out.orphan_blocks += len(hashes)
                return
            seed = found
        # extend_keys ignores tokens past the last full block, so no slicing is needed.
        try:
            keys = extend_keys(seed, token_ids, block_size)
        except OverflowError:  # a token id outside 0..2^32-1: no tokenizer produced it
            out.malformed_events += 1
            return
        if len(keys) != len(hashes):
            keys = keys[: len(hashes)]
        tier_map.update(zip(hashes, keys, strict=True))
        limit = self.max_hashes_per_tier
        if limit is not None and len(tier_map) > limit:
            out.evicted_hashes += _trim_oldest(tier_map, limit)
        state.block_size = block_size
        out.stored_blocks += len(keys)
        out.ops.append(IndexOp("add", keys, medium))


def _trim_oldest(tier_map: dict[BlockHash, int], limit: int) -> int:
    """Drops the oldest entries (dicts keep insertion order) to 1/16 below `limit`, so
    the next trims come in chunks rather than one per stored block."""
    excess = len(tier_map) - limit + max(1, limit // 16)
    excess = min(excess, len(tier_map))
    for block_hash in list(islice(tier_map, excess)):
        del tier_map[block_hash]
    return excess

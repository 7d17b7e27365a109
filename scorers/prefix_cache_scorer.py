"""prefix-cache-scorer: approximate prefix affinity from this gateway's routing history.

The Inference Extension's scheme: the prompt text is cut into `blockSize`-character
blocks (at most `maxPrefixBlocksToMatch`), each hashed with xxhash64 chained to the
previous block's hash, the chain seeded with the hash of the model name. Every routed
request adds its blocks to its pod's LRU (`lruCapacityPerServer` blocks per pod). A pod
scores the fraction of the prompt's blocks it holds as a consecutive run from the start.
It needs no KV events, and is only as good as the assumption that a pod still holds what
was last sent to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash
from pydantic import Field, model_validator

from ..framework.plugins import PluginParams, RoutingHook, SchedulingContext, Scorer
from ..framework.registry import register_plugin
from ..framework.types import LLMRequest, PodState

SCRATCH_KEY = "prefix-cache-scorer.hashes"
AUTO_TUNE_REFUSED = (
    "autoTune (sizing blocks and the LRU from the pods' cache metrics) is not implemented; "
    "set blockSize and lruCapacityPerServer instead"
)


class PrefixCacheParams(PluginParams):
    blockSize: int = Field(default=64, gt=0)
    hashBlockSize: int | None = Field(default=None, gt=0)
    maxPrefixBlocksToMatch: int = Field(default=256, gt=0)
    lruCapacityPerServer: int = Field(default=31250, gt=0)
    autoTune: bool = False
    # The producer whose matches this scorer scores (llm-d); the loader builds the scorer
    # that matches that producer's kind (approximate here, or precise from KV events).
    prefixMatchInfoProducerName: str | None = None

    @model_validator(mode="after")
    def _no_auto_tune(self) -> PrefixCacheParams:
        if self.autoTune:
            raise ValueError(AUTO_TUNE_REFUSED)
        return self

    @model_validator(mode="after")
    def _older_name(self) -> PrefixCacheParams:
        if self.hashBlockSize is not None and "blockSize" not in self.model_fields_set:
            object.__setattr__(self, "blockSize", self.hashBlockSize)
        return self


def prompt_block_hashes(request: LLMRequest, block_chars: int, max_blocks: int) -> list[int]:
    text = request.text_for_hashing().encode()
    usable = min(len(text) // block_chars, max_blocks) * block_chars
    prev = xxhash.xxh64_intdigest(request.model.encode())
    out: list[int] = []
    for start in range(0, usable, block_chars):
        prev = xxhash.xxh64_intdigest(
            text[start : start + block_chars] + prev.to_bytes(8, "little")
        )
        out.append(prev)
    return out


@register_plugin()
class PrefixCacheScorer(Scorer, RoutingHook):
    type_name = "prefix-cache-scorer"
    Params = PrefixCacheParams
    params: PrefixCacheParams

    def __init__(self, name: str, params: PrefixCacheParams) -> None:
        super().__init__(name, params)
        self._pods_of_block: dict[int, set[str]] = {}
        self._lru_of_pod: dict[str, OrderedDict[int, None]] = {}

    def _hashes(self, ctx: SchedulingContext) -> list[int]:
        hashes = ctx.scratch.get(SCRATCH_KEY)
        if hashes is None:
            hashes = prompt_block_hashes(
                ctx.request, self.params.blockSize, self.params.maxPrefixBlocksToMatch
            )
            ctx.scratch[SCRATCH_KEY] = hashes
        return hashes

    def matched_blocks(self, hashes: Sequence[int], addresses: set[str]) -> dict[str, int]:
        matched: dict[str, int] = {}
        alive = addresses
        for i, h in enumerate(hashes):
            holders = self._pods_of_block.get(h)
            if not holders:
                break
            alive = alive & holders
            if not alive:
                break
            for address in alive:
                matched[address] = i + 1
        return matched

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        hashes = self._hashes(ctx)
        if not hashes:
            return [0.0] * len(pods)
        matched = self.matched_blocks(hashes, {p.address for p in pods})
        total = len(hashes)
        return [matched.get(p.address, 0) / total for p in pods]

    def on_routed(self, ctx: SchedulingContext, chosen: PodState) -> None:
        address = chosen.address
        lru = self._lru_of_pod.setdefault(address, OrderedDict())
        for h in self._hashes(ctx):
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._pods_of_block.setdefault(h, set()).add(address)
        while len(lru) > self.params.lruCapacityPerServer:
            old, _ = lru.popitem(last=False)
            holders = self._pods_of_block.get(old)
            if holders is not None:
                holders.discard(address)
                if not holders:
                    del self._pods_of_block[old]

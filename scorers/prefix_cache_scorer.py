"""prefix-cache-scorer: approximate prefix affinity from this gateway's routing history.

The Inference Extension's / llm-d's approximate prefix plugin (llm-d-router
`approximateprefix`, 2026): with no tokenizer, a token is taken to be
`averageCharactersPerToken` = 4 characters, so a block of `blockSizeTokens` (default 16,
vLLM's block size) is 64 bytes of the prompt. With `autoTune` (the default) the block size
follows the pods' reported KV block size and each pod's LRU holds as many entries as the
pod has KV blocks. The prompt bytes (completion text, or the chat messages as JSON) are
truncated to `maxPrefixBlocksToMatch` blocks (or `maxPrefixTokensToMatch` tokens) and cut
into blocks, a last partial block included; each is hashed with xxhash64 chained to the
previous hash, the chain seeded with the hash of the model name and cache salt. Every
routed request adds its hashes to its pod's LRU (`lruCapacityPerServer` entries). A pod
scores its leading run of matching blocks over the prompt's block count.

Token-id prompts: upstream hashes the prompt's text, and a completions prompt given as
token ids has none (its plain text is empty, so the plugin abstains). In replays token ids
stand for the text a client would send, so each id is hashed as 4 bytes: the plugin's own
characters-per-token assumption, which keeps its blocks aligned to whole tokens.
The legacy `blockSize` (characters) is still accepted.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import xxhash
from pydantic import Field

from ..framework.plugins import PluginParams, PoolHook, RoutingHook, SchedulingContext, Scorer
from ..framework.registry import register_plugin
from ..framework.types import LLMRequest, PodState
from .routed_prefixes import RoutedPrefixTable

SCRATCH_KEY = "prefix-cache-scorer.hashes"
AVERAGE_CHARACTERS_PER_TOKEN = 4  # upstream's averageCharactersPerToken


class PrefixCacheParams(PluginParams):
    autoTune: bool = True
    blockSizeTokens: int = Field(default=16, gt=0)
    blockSize: int | None = Field(default=None, gt=0)  # legacy: characters per block
    hashBlockSize: int | None = Field(default=None, gt=0)  # older name of blockSize
    maxPrefixBlocksToMatch: int = Field(default=256, gt=0)
    maxPrefixTokensToMatch: int = Field(default=0, ge=0)
    lruCapacityPerServer: int = Field(default=31250, gt=0)
    # The producer whose matches this scorer scores (llm-d); the loader builds the scorer
    # that matches that producer's kind (approximate here, or precise from KV events).
    prefixMatchInfoProducerName: str | None = None

    def block_chars(self, pod_block_size: int | None) -> int:
        if self.autoTune and pod_block_size:
            return pod_block_size * AVERAGE_CHARACTERS_PER_TOKEN
        if "blockSizeTokens" not in self.model_fields_set:
            legacy = self.blockSize or self.hashBlockSize
            if legacy is not None:
                return legacy
        return self.blockSizeTokens * AVERAGE_CHARACTERS_PER_TOKEN

    def max_blocks(self, block_chars: int) -> int:
        if self.maxPrefixTokensToMatch > 0:
            tokens_per_block = max(1, block_chars // AVERAGE_CHARACTERS_PER_TOKEN)
            return max(1, self.maxPrefixTokensToMatch // tokens_per_block)
        return self.maxPrefixBlocksToMatch


def prompt_bytes(request: LLMRequest) -> bytes:
    """What upstream hashes: the completion text, or the chat messages as JSON; token ids
    at 4 bytes each (see the module doc)."""
    if request.prompt is not None:
        return request.prompt.encode()
    if request.messages is not None:
        return json.dumps(request.messages, separators=(",", ":"), ensure_ascii=False).encode()
    if request.prompt_token_ids is not None:
        ids = request.prompt_token_ids
        return struct.pack(f"<{len(ids)}I", *(t & 0xFFFFFFFF for t in ids))
    return request.text_for_hashing().encode()


def prompt_block_hashes(request: LLMRequest, block_chars: int, max_blocks: int) -> list[int]:
    data = prompt_bytes(request)
    if len(data) < block_chars:
        return []
    data = data[: max_blocks * block_chars]
    seed = request.model + (request.cache_salt or "")
    prev = xxhash.xxh64_intdigest(seed.encode())
    out: list[int] = []
    for start in range(0, len(data), block_chars):
        # The last block may be partial: it is hashed too.
        prev = xxhash.xxh64_intdigest(
            data[start : start + block_chars] + prev.to_bytes(8, "little")
        )
        out.append(prev)
    return out


@register_plugin()
class PrefixCacheScorer(Scorer, RoutingHook, PoolHook):
    type_name = "prefix-cache-scorer"
    Params = PrefixCacheParams
    params: PrefixCacheParams

    def __init__(self, name: str, params: PrefixCacheParams) -> None:
        super().__init__(name, params)
        self._routed = RoutedPrefixTable(params.lruCapacityPerServer)

    def _hashes(self, ctx: SchedulingContext, pods: Sequence[PodState] = ()) -> list[int]:
        hashes = ctx.scratch.get(SCRATCH_KEY)
        if hashes is None:
            # One pool, one configuration: the first pod's block size speaks for all.
            pod_block = next((p.metrics.block_size for p in pods if p.metrics.block_size), None)
            chars = self.params.block_chars(pod_block)
            hashes = prompt_block_hashes(ctx.request, chars, self.params.max_blocks(chars))
            ctx.scratch[SCRATCH_KEY] = hashes
        return hashes

    def matched_blocks(self, hashes: Sequence[int], addresses: set[str]) -> dict[str, int]:
        return self._routed.match(hashes, list(addresses))

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        hashes = self._hashes(ctx, pods)
        if not hashes:
            return [0.0] * len(pods)
        matched = self.matched_blocks(hashes, {p.address for p in pods})
        total = len(hashes)
        return [matched.get(p.address, 0) / total for p in pods]

    def on_routed(self, ctx: SchedulingContext, chosen: PodState) -> None:
        capacity = self.params.lruCapacityPerServer
        if self.params.autoTune and chosen.metrics.num_gpu_blocks:
            capacity = chosen.metrics.num_gpu_blocks
        self._routed.insert(chosen.address, self._hashes(ctx, [chosen]), capacity)

    def on_pod_removed(self, address: str) -> None:
        self._routed.remove_pod(address)

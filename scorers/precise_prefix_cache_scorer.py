"""precise-prefix-cache-scorer: prefix affinity from the pods' own KV-cache events.

The scheduler's prepare step tokenizes the prompt and looks up, per pod, the longest run
of the prompt's blocks that the pod has reported storing (at that pod's block size). A
pod's raw score is that run in blocks, weighted by the slowest tier along it (`gpuWeight`
1.0, `cpuWeight` 0.8 by default: CPU-resident blocks must be copied back). As in llm-d's
scorer (`indexedScoresToNormalizedScoredPods`), raw scores are min-max normalised over
the pods that hold any of the prompt: the best holder scores 1, the weakest holder 0, and
every holder 1 when they hold equally much; pods holding nothing score 0.
llm-d's indexer/KV-events settings are checked key by key: the block size is honoured,
the rest is satisfied by smart-epp's own index and subscribers (`INDEX_NOTES` says how)
and reported at start-up; an unknown key is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field, model_validator

from ..framework.plugins import PluginParams, SchedulingContext, Scorer
from ..framework.registry import register_plugin
from ..framework.types import PodState

# llm-d's settings of its own indexer library, and why smart-epp needs none of them.
INDEX_NOTES = {
    "indexerConfig.kvBlockIndexConfig.*": (
        "smart-epp's block index is chosen with --kv-index (memory or redis) and always "
        "exports its metrics"
    ),
    "indexerConfig.prefixStoreConfig.*": "smart-epp keeps no separate prefix store",
    "indexerConfig.tokenizersPoolConfig.*": (
        "tokenization is configured by token-producer / local-tokenizer plugins"
    ),
    "indexerConfig.tokenProcessorConfig.hashSeed": (
        "smart-epp keys blocks by token ids with its own hash, independent of the pods' "
        "PYTHONHASHSEED"
    ),
    "tokenProcessorConfig.hashSeed": (
        "smart-epp keys blocks by token ids with its own hash, independent of the pods' "
        "PYTHONHASHSEED"
    ),
    "indexerConfig.tokenProcessorConfig.blockSize": "honoured as the fallback block size",
    "indexerConfig.tokenProcessorConfig.blockSizeTokens": "honoured as the fallback block size",
    "kvEventsConfig.*": (
        "KV-event sockets come from the endpoints (pool file, pod annotations) or "
        "`epp serve --kv-events-mode central --kv-events-bind`"
    ),
}


class PrecisePrefixParams(PluginParams):
    gpuWeight: float = Field(default=1.0, ge=0.0)
    cpuWeight: float = Field(default=0.8, ge=0.0)
    # Fallback when neither the pod's events nor its metrics told its block size.
    blockSize: int | None = Field(default=None, gt=0)
    indexerConfig: dict[str, Any] | None = None
    kvEventsConfig: dict[str, Any] | None = None
    upstream_notes = INDEX_NOTES
    nested_parameters = frozenset({"indexerConfig", "kvEventsConfig"})

    @model_validator(mode="after")
    def _indexer_block_size(self) -> PrecisePrefixParams:
        nested = (self.indexerConfig or {}).get("tokenProcessorConfig") or {}
        size = nested.get("blockSize") or nested.get("blockSizeTokens")
        if self.blockSize is None and isinstance(size, int) and size > 0:
            object.__setattr__(self, "blockSize", size)
        return self


@register_plugin()
class PrecisePrefixCacheScorer(Scorer):
    type_name = "precise-prefix-cache-scorer"
    Params = PrecisePrefixParams
    params: PrecisePrefixParams
    needs_tokens = True
    needs_prefix_hits = True

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        hits = ctx.prefix_hits
        if not hits or ctx.prompt_tokens <= 0:
            return [0.0] * len(pods)
        raw: dict[str, float] = {}
        for p in pods:
            hit = hits.get(p.address)
            if hit is None or hit.blocks <= 0:
                continue
            weight = self.params.cpuWeight if hit.medium == "CPU" else self.params.gpuWeight
            raw[p.address] = weight * hit.blocks
        return min_max_over_holders([p.address for p in pods], raw)


def min_max_over_holders(addresses: Sequence[str], raw: dict[str, float]) -> list[float]:
    """llm-d's normalisation: (score - min) / (max - min) over the pods in `raw`, 1.0 for
    all of them when min == max, 0.0 for pods not in `raw`."""
    if not raw:
        return [0.0] * len(addresses)
    lo, hi = min(raw.values()), max(raw.values())
    span = hi - lo
    out: list[float] = []
    for address in addresses:
        score = raw.get(address)
        if score is None:
            out.append(0.0)
        elif span == 0:
            out.append(1.0)
        else:
            out.append((score - lo) / span)
    return out

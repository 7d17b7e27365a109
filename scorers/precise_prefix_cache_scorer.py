"""precise-prefix-cache-scorer: prefix affinity from the pods' own KV-cache events.

The scheduler's prepare step tokenizes the prompt and looks up, per pod, the longest run
of the prompt's blocks that the pod has reported storing (at that pod's block size). A
pod's raw score is that run in blocks, weighted by the slowest tier along it (`gpuWeight`
1.0, `cpuWeight` 0.8 by default: CPU-resident blocks must be copied back). As in llm-d's
scorer (`indexedScoresToNormalizedScoredPods`), raw scores are min-max normalised over
the pods that hold any of the prompt: the best holder scores 1, the weakest holder 0, and
every holder 1 when they hold equally much; pods holding nothing score 0.
llm-d's indexer/KV-events settings are accepted and ignored: smart-epp runs its own
index and subscribers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from ..framework.plugins import PluginParams, SchedulingContext, Scorer
from ..framework.registry import register_plugin
from ..framework.types import PodState


class PrecisePrefixParams(PluginParams):
    gpuWeight: float = Field(default=1.0, ge=0.0)
    cpuWeight: float = Field(default=0.8, ge=0.0)
    # Fallback when neither the pod's events nor its metrics told its block size.
    blockSize: int | None = Field(default=None, gt=0)
    indexerConfig: dict[str, Any] | None = None
    kvEventsConfig: dict[str, Any] | None = None


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

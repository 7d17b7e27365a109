"""precise-prefix-cache-scorer: prefix affinity from the pods' own KV-cache events.

The scheduler's prepare step tokenizes the prompt and looks up, per pod, the longest run
of the prompt's blocks that the pod has reported storing (at that pod's block size). The
score is the fraction of the prompt held, weighted by the slowest tier along the run
(`gpuWeight` 1.0, `cpuWeight` 0.8 by default: CPU-resident blocks must be copied back).
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
        out: list[float] = []
        for p in pods:
            hit = hits.get(p.address)
            if hit is None:
                out.append(0.0)
                continue
            weight = self.params.cpuWeight if hit.medium == "CPU" else self.params.gpuWeight
            out.append(min(1.0, weight * ctx.hit_tokens(p.address) / ctx.prompt_tokens))
        return out

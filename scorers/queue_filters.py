"""Queue and KV-cache filters of the Inference Extension.

`low-queue-filter`: keep pods whose waiting queue is at most `threshold` (default 128).
`least-queue-filter`: keep pods whose queue is within the lowest 1/N of the candidates'
range [min, min + (max - min) / N].
`least-kv-cache-filter`: the same on KV-cache usage.
Each keeps every pod rather than none when nothing qualifies.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import Filter, PluginParams, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import PodState


class LowQueueParams(PluginParams):
    threshold: int = Field(default=128, ge=0)


@register_plugin()
class LowQueueFilter(Filter):
    type_name = "low-queue-filter"
    Params = LowQueueParams
    params: LowQueueParams

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        kept = [p for p in pods if p.metrics.waiting <= self.params.threshold]
        return kept or list(pods)


def _lowest_band(pods: Sequence[PodState], values: Sequence[float]) -> list[PodState]:
    if not pods:
        return []
    lo, hi = min(values), max(values)
    limit = lo + (hi - lo) / len(pods)
    return [p for p, v in zip(pods, values, strict=True) if v <= limit]


@register_plugin()
class LeastQueueFilter(Filter):
    type_name = "least-queue-filter"

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        return _lowest_band(pods, [p.metrics.waiting for p in pods])


@register_plugin()
class LeastKVCacheFilter(Filter):
    type_name = "least-kv-cache-filter"

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        return _lowest_band(pods, [p.metrics.kv_usage for p in pods])

"""kv-cache-utilization-scorer: score = 1 - KV-cache usage (Inference Extension semantics)."""

from __future__ import annotations

from collections.abc import Sequence

from ..framework.plugins import SchedulingContext, Scorer
from ..framework.registry import register_plugin
from ..framework.types import PodState


@register_plugin()
class KVCacheUtilizationScorer(Scorer):
    type_name = "kv-cache-utilization-scorer"

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        return [min(1.0, max(0.0, 1.0 - p.metrics.kv_usage)) for p in pods]

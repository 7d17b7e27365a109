"""kv-cache-utilization-scorer: score = 1 - KV-cache usage (Inference Extension semantics)."""

from __future__ import annotations

from collections.abc import Sequence

from smart_epp.epp.config import register_plugin
from smart_epp.epp.types import PodState
from smart_epp.scorers.base import SchedulingContext, Scorer


@register_plugin()
class KVCacheUtilizationScorer(Scorer):
    type_name = "kv-cache-utilization-scorer"

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        return [min(1.0, max(0.0, 1.0 - p.metrics.kv_usage)) for p in pods]

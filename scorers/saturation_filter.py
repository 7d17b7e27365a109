"""saturation-filter: drop pods whose queue or KV cache is past a threshold.

A pod is saturated when its waiting queue exceeds `queueDepthThreshold` (default 5) or
its KV-cache usage exceeds `kvCacheUtilThreshold` (default 0.8), the Inference
Extension's saturation-detector defaults. The queue counts the larger of the scraped
waiting requests and the requests this gateway has in flight beyond the running ones,
so a burst between two scrapes is seen. When every pod is saturated all are kept
(`keepAllWhenSaturated`, default true) so the request still lands somewhere; set it to
false to answer 503 instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import Filter, PluginParams, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import PodState


class SaturationParams(PluginParams):
    queueDepthThreshold: int = Field(default=5, ge=0)
    kvCacheUtilThreshold: float = Field(default=0.8, ge=0.0, le=1.0)
    keepAllWhenSaturated: bool = True


def queued_requests(pod: PodState) -> int:
    """Requests waiting at the pod, counting this gateway's not-yet-scraped sends."""
    m = pod.metrics
    return max(m.waiting, pod.inflight.requests - m.running)


@register_plugin()
class SaturationFilter(Filter):
    type_name = "saturation-filter"
    Params = SaturationParams
    params: SaturationParams

    def saturated(self, pod: PodState) -> bool:
        return (
            queued_requests(pod) > self.params.queueDepthThreshold
            or pod.metrics.kv_usage > self.params.kvCacheUtilThreshold
        )

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        kept = [p for p in pods if not self.saturated(p)]
        if kept or not self.params.keepAllWhenSaturated:
            return kept
        return list(pods)

"""Load-aware scorers in llm-d's naming.

`load-aware-scorer`: from the pod's waiting queue; an empty queue scores 0.5, a queue at
or above `threshold` scores 0, linear in between (llm-d semantics).
`active-request-scorer`: from the requests this gateway itself has in flight to each
pod, which is current between /metrics scrapes; score = (max - n) / max, all 1 when idle.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import PluginParams, SchedulingContext, Scorer
from ..framework.registry import register_plugin
from ..framework.types import PodState

EMPTY_QUEUE_SCORE = 0.5


class LoadAwareParams(PluginParams):
    threshold: int = Field(default=128, gt=0)


@register_plugin()
class LoadAwareScorer(Scorer):
    type_name = "load-aware-scorer"
    Params = LoadAwareParams
    params: LoadAwareParams

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        threshold = self.params.threshold
        out: list[float] = []
        for p in pods:
            waiting = p.metrics.waiting
            out.append(EMPTY_QUEUE_SCORE * max(0.0, 1.0 - waiting / threshold))
        return out


@register_plugin()
class ActiveRequestScorer(Scorer):
    type_name = "active-request-scorer"

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        counts = [p.inflight.requests for p in pods]
        most = max(counts, default=0)
        if most <= 0:
            return [1.0] * len(pods)
        return [(most - n) / most for n in counts]

"""weighted-random-picker: chance proportional to score (A-Res weighted sampling).

Each pod draws key u^(1/score) with u uniform in (0, 1); the largest keys win, which gives
weighted sampling without replacement in one pass. Pods scoring 0 are chosen only when
every pod scores 0, then uniformly.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import Picker, PluginParams, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import PodState


class WeightedRandomPickerParams(PluginParams):
    maxNumOfEndpoints: int = Field(default=1, ge=1)


@register_plugin()
class WeightedRandomPicker(Picker):
    type_name = "weighted-random-picker"
    Params = WeightedRandomPickerParams
    params: WeightedRandomPickerParams

    def pick(
        self, ctx: SchedulingContext, pods: Sequence[PodState], scores: Sequence[float]
    ) -> list[PodState]:
        if not pods:
            return []
        k = min(self.params.maxNumOfEndpoints, len(pods))
        if all(s <= 0 for s in scores):
            return ctx.rng.sample(list(pods), k)
        keyed = []
        for pod, s in zip(pods, scores, strict=True):
            if s > 0:
                u = 1.0 - ctx.rng.random()  # in (0, 1]
                keyed.append((u ** (1.0 / s), pod))
        keyed.sort(key=lambda kv: kv[0], reverse=True)
        return [pod for _, pod in keyed[:k]]

"""max-score-picker: the highest total score wins; ties are broken at random.

`maxNumOfEndpoints` (default 1) endpoints are returned, best first, so the gateway can
offer fallbacks.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import Picker, PluginParams, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import PodState


class MaxScorePickerParams(PluginParams):
    maxNumOfEndpoints: int = Field(default=1, ge=1)


@register_plugin()
class MaxScorePicker(Picker):
    type_name = "max-score-picker"
    Params = MaxScorePickerParams
    params: MaxScorePickerParams

    def pick(
        self, ctx: SchedulingContext, pods: Sequence[PodState], scores: Sequence[float]
    ) -> list[PodState]:
        if not pods:
            return []
        if self.params.maxNumOfEndpoints == 1:
            # One pass with reservoir sampling among the tied best: no sort, no shuffle.
            best = max(scores)
            chosen = -1
            ties = 0
            for i, s in enumerate(scores):
                if s == best:
                    ties += 1
                    if ties == 1 or ctx.rng.randrange(ties) == 0:
                        chosen = i
            return [pods[chosen]]
        order = list(range(len(pods)))
        ctx.rng.shuffle(order)  # random order among equal scores after the stable sort
        order.sort(key=lambda i: scores[i], reverse=True)
        return [pods[i] for i in order[: self.params.maxNumOfEndpoints]]

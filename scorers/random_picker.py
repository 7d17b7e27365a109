"""random-picker: uniform choice, ignoring scores."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from smart_epp.epp.config import register_plugin
from smart_epp.epp.types import PodState
from smart_epp.scorers.base import Picker, PluginParams, SchedulingContext


class RandomPickerParams(PluginParams):
    maxNumOfEndpoints: int = Field(default=1, ge=1)


@register_plugin()
class RandomPicker(Picker):
    type_name = "random-picker"
    Params = RandomPickerParams
    params: RandomPickerParams

    def pick(
        self, ctx: SchedulingContext, pods: Sequence[PodState], scores: Sequence[float]
    ) -> list[PodState]:
        k = min(self.params.maxNumOfEndpoints, len(pods))
        return ctx.rng.sample(list(pods), k)

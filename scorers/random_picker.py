"""random-picker: uniform choice, ignoring scores."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import Picker, PluginParams, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import PodState


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

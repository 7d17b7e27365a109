"""round-robin-picker: the pods in turn, ignoring scores.

The Inference Extension's reference picker and the usual baseline: each request goes to
the next pod of the candidates ordered by address, so the rotation stays fair when the
candidate list arrives in another order or a pod leaves. `maxNumOfEndpoints` (default 1)
endpoints are returned, the rest of the rotation as fallbacks.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import Picker, PluginParams, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import PodState


class RoundRobinPickerParams(PluginParams):
    maxNumOfEndpoints: int = Field(default=1, ge=1)


@register_plugin()
class RoundRobinPicker(Picker):
    type_name = "round-robin-picker"
    Params = RoundRobinPickerParams
    params: RoundRobinPickerParams

    def __init__(self, name: str, params: PluginParams) -> None:
        super().__init__(name, params)
        self._next = 0

    def pick(
        self, ctx: SchedulingContext, pods: Sequence[PodState], scores: Sequence[float]
    ) -> list[PodState]:
        if not pods:
            return []
        ordered = sorted(pods, key=lambda p: p.address)
        start = self._next % len(ordered)
        self._next = start + 1
        rotation = ordered[start:] + ordered[:start]
        return rotation[: self.params.maxNumOfEndpoints]

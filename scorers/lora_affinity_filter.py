"""lora-affinity-filter: narrow LoRA requests to pods that run the adapter or can load it.

Inference Extension semantics: with probability `threshold` (default 0.999) keep the pods
where the adapter is already active; otherwise, or when none has it, keep the pods with
a free adapter slot; when neither group exists, keep every pod. The small chance of
skipping affinity lets a popular adapter spread to more pods. Base-model requests pass
through untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import Filter, PluginParams, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import PodState
from .lora_affinity_scorer import adapter_active, adapter_slot_free


class LoraAffinityFilterParams(PluginParams):
    threshold: float = Field(default=0.999, ge=0.0, le=1.0)


@register_plugin()
class LoraAffinityFilter(Filter):
    type_name = "lora-affinity-filter"
    Params = LoraAffinityFilterParams
    params: LoraAffinityFilterParams

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        adapter = ctx.request.adapter
        if adapter is None:
            return list(pods)
        with_adapter: list[PodState] = []
        with_room: list[PodState] = []
        for p in pods:
            if adapter_active(p, adapter):
                with_adapter.append(p)
            elif adapter_slot_free(p):
                with_room.append(p)
        if with_adapter and ctx.rng.random() < self.params.threshold:
            return with_adapter
        if with_room:
            return with_room
        return with_adapter or list(pods)

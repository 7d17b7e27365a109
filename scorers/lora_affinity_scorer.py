"""lora-affinity-scorer: prefer pods that already run the requested adapter.

Inference Extension semantics: 1.0 when the adapter is active on the pod, 0.6 when it is
only waiting there, 0.8 when the pod has a free adapter slot, 0.0 otherwise. Requests for
the base model score 1.0 everywhere (the signal does not apply). "Active" also counts the
adapter requests this gateway has in flight to the pod, because vLLM's
lora_requests_info omits queued requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..framework.plugins import SchedulingContext, Scorer
from ..framework.registry import register_plugin
from ..framework.types import PodState

ACTIVE = 1.0
WAITING = 0.6
HAS_CAPACITY = 0.8
FULL = 0.0


def adapter_active(pod: PodState, adapter: str) -> bool:
    return adapter in pod.metrics.running_adapters or pod.inflight.adapters.get(adapter, 0) > 0


def adapter_slot_free(pod: PodState) -> bool:
    """Whether the pod can load one more adapter without evicting (unknown max = yes)."""
    max_loras = pod.metrics.max_loras
    if max_loras <= 0:
        return True
    loaded = set(pod.metrics.running_adapters) | set(pod.metrics.waiting_adapters)
    loaded.update(a for a, n in pod.inflight.adapters.items() if n > 0)
    return len(loaded) < max_loras


def lora_affinity(pod: PodState, adapter: str | None) -> float:
    if adapter is None:
        return ACTIVE
    if adapter_active(pod, adapter):
        return ACTIVE
    if adapter in pod.metrics.waiting_adapters:
        return WAITING
    return HAS_CAPACITY if adapter_slot_free(pod) else FULL


@register_plugin()
class LoraAffinityScorer(Scorer):
    type_name = "lora-affinity-scorer"

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        adapter = ctx.request.adapter
        return [lora_affinity(p, adapter) for p in pods]

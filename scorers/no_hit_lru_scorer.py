"""no-hit-lru-scorer: spread requests that no pod has cached over the pods least recently
given such a request (llm-d's semantics).

A request is cold when no candidate holds any of its prompt blocks. A cold request scores
pods that never got a cold request highest (1, then falling in candidate order), then the
others from least to most recently used; a warm request scores every pod 0.5, leaving the
choice to the prefix scorers. Only cold requests move their pod to the recent end of the
LRU (of `lruSize` pods). Cache hits come from the KV index (the precise prefix match).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import PluginParams, PoolHook, RoutingHook, SchedulingContext, Scorer
from ..framework.registry import register_plugin
from ..framework.types import PodState

COLD_KEY = "no-hit-lru-scorer.cold"


class NoHitLRUParams(PluginParams):
    lruSize: int = Field(default=1024, gt=0)
    # Which producer's prefix matches decide "cold": smart-epp has one KV index.
    prefixMatchInfoProducerName: str | None = None
    upstream_notes = {
        "prefixPluginType": "smart-epp has one prefix match per request (the KV index)",
        "prefixPluginName": "smart-epp has one prefix match per request (the KV index)",
    }


@register_plugin()
class NoHitLRUScorer(Scorer, RoutingHook, PoolHook):
    type_name = "no-hit-lru-scorer"
    Params = NoHitLRUParams
    params: NoHitLRUParams
    needs_tokens = True
    needs_prefix_hits = True

    def __init__(self, name: str, params: NoHitLRUParams) -> None:
        super().__init__(name, params)
        # Oldest first: the front is the pod that least recently got a cold request.
        self._lru: OrderedDict[str, None] = OrderedDict()

    @staticmethod
    def is_cold(ctx: SchedulingContext, pods: Sequence[PodState]) -> bool:
        hits = ctx.prefix_hits or {}
        return not any((hit := hits.get(p.address)) is not None and hit.blocks > 0 for p in pods)

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        cold = self.is_cold(ctx, pods)
        ctx.scratch[COLD_KEY] = cold
        if not cold:
            return [0.5] * len(pods)
        if len(pods) == 1:
            return [1.0]
        position = {address: i for i, address in enumerate(self._lru)}
        unused = [p for p in pods if p.address not in position]
        span = len(pods) - 1
        scores: dict[str, float] = {p.address: 1.0 - i / span for i, p in enumerate(unused)}
        for p in pods:
            if p.address in position:
                rank = len(unused) + position[p.address]
                scores[p.address] = max(0.0, 1.0 - rank / span)
        return [scores[p.address] for p in pods]

    def on_routed(self, ctx: SchedulingContext, chosen: PodState) -> None:
        if not ctx.scratch.get(COLD_KEY, False):
            return
        self._lru[chosen.address] = None
        self._lru.move_to_end(chosen.address)
        while len(self._lru) > self.params.lruSize:
            self._lru.popitem(last=False)

    def on_pod_removed(self, address: str) -> None:
        self._lru.pop(address, None)

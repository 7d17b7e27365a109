"""SGLang router's cache-aware policy (also used by vllm-router), with its published
defaults: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5."""

from __future__ import annotations

from collections.abc import Sequence

from ....framework.types import Decision, LLMRequest, PodState
from ....scorers.routed_prefixes import RoutedPrefixTable, unit_chunk_keys
from .base import StatelessHooks, gateway_load, ranked
from .prefix_table import (
    prompt_units,
)

CHUNK = 16
# SGLang's max_tree_size is 2**26 characters; at ~4 characters a token that is 2**24 tokens.
MAX_TREE_TOKENS = 2**24


class SGLangCacheAware(StatelessHooks):
    name = "sglang-cache-aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self._tree = RoutedPrefixTable(MAX_TREE_TOKENS // CHUNK)

    def _imbalanced(self, candidates: Sequence[PodState]) -> bool:
        loads = [gateway_load(p) for p in candidates]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs and hi > lo * self.balance_rel

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        if not candidates:
            return Decision(endpoints=[], profile=self.name)
        units = prompt_units(request)
        keys = unit_chunk_keys(units, CHUNK, request.model)
        if self._imbalanced(candidates):
            pick = min(candidates, key=gateway_load)
        else:
            matched = self._tree.match(keys, [p.address for p in candidates])
            best = max(candidates, key=lambda p: matched[p.address])
            rate = matched[best.address] * CHUNK / max(1, len(units))
            if rate > self.cache_threshold:
                pick = best
            else:
                # The worker with the smallest tree has the most room left in its cache.
                pick = min(candidates, key=lambda p: self._tree.size(p.address))
        self._tree.insert(pick.address, keys)
        return ranked(pick, candidates, self.name)

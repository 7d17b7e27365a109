"""AIBrix's prefix-cache router with its documented defaults: the `character` tokenizer
(AIBRIX_PREFIX_CACHE_TOKENIZER_TYPE) with blocks of 128 characters
(AIBRIX_PREFIX_CACHE_BLOCK_SIZE, the size its docs recommend for that tokenizer), 200,000
blocks, imbalance when running requests differ by more than 16, and a matched pod skipped
when its running requests exceed mean + 2 standard deviations (v0.7.0's settings).
Replayed token ids count as 4 characters each (see `prefix_table.prompt_characters`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ....framework.types import Decision, LLMRequest, PodState
from .base import StatelessHooks, gateway_load, ranked
from .prefix_table import (
    RoutedPrefixTable,
    character_chunk_keys,
    prompt_characters,
)


class AIBrixPrefixCache(StatelessHooks):
    name = "aibrix-prefix-cache"

    def __init__(
        self,
        block_size: int = 128,
        max_blocks: int = 200_000,
        imbalance_abs_count: int = 16,
        load_factor: float = 2.0,
    ) -> None:
        self.block_size = block_size
        self.imbalance_abs = imbalance_abs_count
        self.load_factor = load_factor
        self._table = RoutedPrefixTable(max_blocks)

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        if not candidates:
            return Decision(endpoints=[], profile=self.name)
        keys = character_chunk_keys(prompt_characters(request), self.block_size, request.model)
        loads = {p.address: gateway_load(p) for p in candidates}
        least = min(candidates, key=lambda p: loads[p.address])
        pick: PodState | None = None
        if max(loads.values()) - min(loads.values()) <= self.imbalance_abs and keys:
            matched = self._table.match(keys, list(loads))
            mean = statistics.fmean(loads.values())
            std = statistics.pstdev(loads.values())
            ranked_matches = sorted(
                (p for p in candidates if matched[p.address] > 0),
                key=lambda p: (-matched[p.address], loads[p.address]),
            )
            for pod in ranked_matches:
                if loads[pod.address] <= mean + self.load_factor * std:
                    pick = pod
                    break
        if pick is None:
            pick = least
        self._table.insert(pick.address, keys)
        return ranked(pick, candidates, self.name)

"""Prompt -> how many of its leading blocks each candidate pod already holds.

`IndexPrefixMatcher` is the one prefix matcher of smart-epp: the scheduler's prepare step
asks it (live, against the memory or Redis index), and the replay asks the same object in
virtual time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

from ..framework.types import LLMRequest, PrefixHit
from .api import BlockIndex
from .keys import KeyScope, block_keys

log = logging.getLogger(__name__)

ModelOf = Callable[[str], str | None]  # pod address -> base model its KV events are keyed by
# Most candidates hold nothing of a prompt; one shared (immutable) answer for all of them
# saves building one per pod per request.
NO_HIT = PrefixHit(blocks=0)


class IndexPrefixMatcher:
    """Prefix matching against a `BlockIndex` with the KV index's key recipe.

    Keys depend on the block size and on the scope (base model, adapter, cache_salt), so
    pods are grouped by (block size, base model) and keys are computed once per group —
    normally one group for the whole pool. A pod's base model is what its KV events were
    keyed with (`model_of`, e.g. `IngestState.model`); otherwise the request's model for
    base-model requests, or `base_model` for adapter requests (whose `model` names the
    adapter). Every pod asked about is in the answer, with 0 blocks when nothing matched.
    """

    def __init__(
        self,
        index: BlockIndex,
        *,
        model_of: ModelOf | None = None,
        base_model: str | None = None,
    ) -> None:
        self.index = index
        self._pending: set[asyncio.Task[None]] = set()
        self._model_of = model_of
        self._base_model = base_model

    def _groups(
        self, token_ids: Sequence[int], request: LLMRequest, block_sizes: Mapping[str, int]
    ) -> list[tuple[int, list[int], list[str]]]:
        fallback = request.model if request.adapter is None else self._base_model or request.model
        model_of = self._model_of
        groups: dict[tuple[int, str], list[str]] = {}
        for address, size in block_sizes.items():
            if not size:  # a pod whose block size is unknown has published nothing yet
                continue
            model = (model_of(address) if model_of is not None else None) or fallback
            groups.setdefault((size, model), []).append(address)
        out = []
        for (size, model), addresses in groups.items():
            scope = KeyScope(model, request.adapter, request.cache_salt)
            out.append((size, block_keys(token_ids, size, scope), addresses))
        return out

    @staticmethod
    def _fill(
        hits: dict[str, PrefixHit],
        found: Mapping[str, PrefixHit],
        size: int,
        addresses: Sequence[str],
    ) -> None:
        for address in addresses:
            hit = found.get(address)
            hits[address] = (
                PrefixHit(blocks=hit.blocks, medium=hit.medium, tokens=hit.blocks * size)
                if hit is not None and hit.blocks > 0
                else NO_HIT
            )

    async def match(
        self,
        token_ids: Sequence[int],
        request: LLMRequest,
        block_sizes: Mapping[str, int],
        keys_out: dict[str, Sequence[int]] | None = None,
    ) -> Mapping[str, PrefixHit]:
        hits: dict[str, PrefixHit] = {}
        for size, keys, addresses in self._groups(token_ids, request, block_sizes):
            found = await self.index.lookup(keys, addresses) if keys else {}
            self._fill(hits, found, size, addresses)
            if keys_out is not None:
                keys_out.update(dict.fromkeys(addresses, keys))
        for address in block_sizes:
            hits.setdefault(address, NO_HIT)
        return hits

    def match_sync(
        self,
        token_ids: Sequence[int],
        request: LLMRequest,
        block_sizes: Mapping[str, int],
        keys_out: dict[str, Sequence[int]] | None = None,
    ) -> Mapping[str, PrefixHit] | None:
        lookup_sync = getattr(self.index, "lookup_sync", None)
        if lookup_sync is None:
            return None
        hits: dict[str, PrefixHit] = {}
        for size, keys, addresses in self._groups(token_ids, request, block_sizes):
            found = lookup_sync(keys, addresses) if keys else {}
            self._fill(hits, found, size, addresses)
            if keys_out is not None:
                keys_out.update(dict.fromkeys(addresses, keys))
        for address in block_sizes:
            hits.setdefault(address, NO_HIT)
        return hits

    def held_blocks(self, addresses: Collection[str]) -> Mapping[str, int] | None:
        """Blocks each pod holds in all (GPU tier, per its KV events), or None when the
        index cannot count them synchronously. Counted when asked: most policies never
        ask, and the one that does asks only about pods whose caches it prices."""
        held_blocks_sync = getattr(self.index, "held_blocks_sync", None)
        if held_blocks_sync is None:
            return None
        return _HeldBlocks(addresses, held_blocks_sync)

    def speculate(
        self,
        token_ids: Sequence[int],
        request: LLMRequest,
        address: str,
        block_size: int,
        ttl_s: float,
        keys: Sequence[int] | None = None,
    ) -> None:
        """Marks the prompt's blocks as held by `address` for `ttl_s` seconds; `keys`,
        when given, are the prompt's keys for that pod as `match` computed them.

        The pod's KV events confirm them only after its prefill; until then, a burst of
        requests sharing the prefix would otherwise each look uncached everywhere.
        """
        if keys is None:
            groups = self._groups(token_ids, request, {address: block_size})
            keys = groups[0][1] if groups else None
        if not keys:
            return
        add_sync = getattr(self.index, "add_speculative_sync", None)
        if add_sync is not None:
            add_sync(address, keys, ttl_s)
            return
        task = asyncio.get_running_loop().create_task(
            self.index.add_speculative(address, keys, ttl_s)
        )
        self._pending.add(task)
        task.add_done_callback(self._speculation_done)

    def _speculation_done(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("speculative index entry failed: %s", task.exception())


class _HeldBlocks(Mapping[str, int]):
    """Each of `addresses`' held-block count, read from the index on lookup."""

    __slots__ = ("_addresses", "_count")

    def __init__(self, addresses: Collection[str], count: Callable[[str], int]) -> None:
        self._addresses = addresses
        self._count = count

    def __getitem__(self, address: str) -> int:
        if address not in self._addresses:
            raise KeyError(address)
        return self._count(address)

    def get(self, address: str, default: int | None = None) -> int | None:  # type: ignore[override]
        # Mapping's own get goes through __getitem__ and a KeyError; this is asked once
        # per candidate per request.
        if address not in self._addresses:
            return default
        return self._count(address)

    def __iter__(self) -> Iterator[str]:
        return iter(self._addresses)

    def __len__(self) -> int:
        return len(self._addresses)

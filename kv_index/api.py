"""The interface every block-index backend implements."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from ..framework.types import Medium, PrefixHit


class BlockIndex(Protocol):
    """Maps smart-epp block keys to the pods that hold them.

    Keys are smart-epp's own chained 64-bit hashes (kv_index.keys), independent of the
    pods' hash algorithm; a key already encodes model, adapter, cache_salt, block size
    and the whole prefix before it.
    """

    async def add(self, pod: str, keys: Sequence[int], medium: Medium = "GPU") -> None: ...

    async def remove(self, pod: str, keys: Sequence[int], medium: Medium = "GPU") -> None: ...

    async def clear_pod(self, pod: str) -> None: ...

    async def add_speculative(self, pod: str, keys: Sequence[int], ttl_s: float) -> None: ...

    async def lookup(
        self, keys: Sequence[int], pods: Collection[str] | None = None
    ) -> dict[str, PrefixHit]: ...

"""Prompt -> how many of its leading tokens each candidate pod already holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from smart_epp.kv_index.api import BlockIndex, PrefixHit
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.memory import MemoryBlockIndex


def _by_block_size(pods: Mapping[str, int | None]) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for pod, size in pods.items():
        if size:  # a pod whose block size is unknown has published nothing yet
            groups.setdefault(size, []).append(pod)
    return groups


def _fill(
    pods: Mapping[str, int | None],
    groups: dict[int, list[str]],
    found: dict[int, dict[str, PrefixHit]],
) -> dict[str, PrefixHit]:
    """Every pod of `pods` in the answer, 0 blocks where nothing was found."""
    out: dict[str, PrefixHit] = {}
    for size, members in groups.items():
        hits = found.get(size, {})
        for pod in members:
            hit = hits.get(pod)
            out[pod] = (
                PrefixHit(blocks=hit.blocks, medium=hit.medium, tokens=hit.blocks * size)
                if hit is not None
                else PrefixHit(blocks=0)
            )
    for pod in pods:
        out.setdefault(pod, PrefixHit(blocks=0))
    return out


async def match_prefix(
    index: BlockIndex,
    token_ids: Sequence[int],
    scope: KeyScope,
    pods: Mapping[str, int | None],
) -> dict[str, PrefixHit]:
    """Per pod (address -> its block size), the longest cached prefix of `token_ids`.

    Keys are computed once per distinct block size. Every pod in `pods` is in the
    answer; pods with an unknown block size (None/0) get 0 blocks.
    """
    groups = _by_block_size(pods)
    found: dict[int, dict[str, PrefixHit]] = {}
    for size, members in groups.items():
        keys = block_keys(token_ids, size, scope)
        found[size] = await index.lookup(keys, members) if keys else {}
    return _fill(pods, groups, found)


def match_prefix_sync(
    index: MemoryBlockIndex,
    token_ids: Sequence[int],
    scope: KeyScope,
    pods: Mapping[str, int | None],
) -> dict[str, PrefixHit]:
    """`match_prefix` for the in-memory index without an event loop (virtual time)."""
    groups = _by_block_size(pods)
    found: dict[int, dict[str, PrefixHit]] = {}
    for size, members in groups.items():
        keys = block_keys(token_ids, size, scope)
        found[size] = index.lookup_sync(keys, members) if keys else {}
    return _fill(pods, groups, found)

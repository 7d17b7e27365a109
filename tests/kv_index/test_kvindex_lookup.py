from __future__ import annotations

from smart_epp.kv_index.api import PrefixHit
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.lookup import match_prefix, match_prefix_sync
from smart_epp.kv_index.memory import MemoryBlockIndex

TOKENS = list(range(64))
SCOPE = KeyScope("m")


def filled() -> MemoryBlockIndex:
    idx = MemoryBlockIndex()
    idx.add_sync("a:1", block_keys(TOKENS, 16, SCOPE))  # all 4 blocks of 16
    idx.add_sync("b:1", block_keys(TOKENS[:32], 32, SCOPE))  # 1 block of 32
    idx.add_sync("c:1", block_keys(TOKENS[:16], 16, SCOPE))
    return idx


async def test_pods_with_different_block_sizes() -> None:
    pods = {"a:1": 16, "b:1": 32, "c:1": 16, "d:1": None}
    got = await match_prefix(filled(), TOKENS, SCOPE, pods)
    assert got == {
        "a:1": PrefixHit(4, tokens=64),
        "b:1": PrefixHit(1, tokens=32),
        "c:1": PrefixHit(1, tokens=16),
        "d:1": PrefixHit(0),
    }
    assert match_prefix_sync(filled(), TOKENS, SCOPE, pods) == got


async def test_other_scope_or_short_prompt_matches_nothing() -> None:
    pods = {"a:1": 16}
    assert (await match_prefix(filled(), TOKENS, KeyScope("x"), pods))["a:1"].blocks == 0
    assert (await match_prefix(filled(), TOKENS[:10], SCOPE, pods))["a:1"].blocks == 0

from __future__ import annotations

import pytest

from smart_epp.framework.types import Api, LLMRequest, PrefixHit
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.lookup import IndexPrefixMatcher
from smart_epp.kv_index.memory import MemoryBlockIndex

TOKENS = list(range(64))
SCOPE = KeyScope("m")


def filled() -> MemoryBlockIndex:
    idx = MemoryBlockIndex()
    idx.add_sync("a:1", block_keys(TOKENS, 16, SCOPE))  # all 4 blocks of 16
    idx.add_sync("b:1", block_keys(TOKENS[:32], 32, SCOPE))  # 1 block of 32
    idx.add_sync("c:1", block_keys(TOKENS[:16], 16, SCOPE))
    return idx


def request(model: str = "m") -> LLMRequest:
    return LLMRequest("r", "/v1/completions", Api.COMPLETIONS, model)


async def test_pods_with_different_block_sizes() -> None:
    pods = {"a:1": 16, "b:1": 32, "c:1": 16, "d:1": 0}
    matcher = IndexPrefixMatcher(filled())
    got = await matcher.match(TOKENS, request(), pods)
    assert got == {
        "a:1": PrefixHit(4, tokens=64),
        "b:1": PrefixHit(1, tokens=32),
        "c:1": PrefixHit(1, tokens=16),
        "d:1": PrefixHit(0),
    }
    assert matcher.match_sync(TOKENS, request(), pods) == got


async def test_other_scope_or_short_prompt_matches_nothing() -> None:
    pods = {"a:1": 16}
    matcher = IndexPrefixMatcher(filled())
    assert (await matcher.match(TOKENS, request("x"), pods))["a:1"].blocks == 0
    assert (await matcher.match(TOKENS[:10], request(), pods))["a:1"].blocks == 0


def test_speculative_entries_are_found_until_they_expire() -> None:
    now = [0.0]
    index = MemoryBlockIndex(clock=lambda: now[0])
    matcher = IndexPrefixMatcher(index)
    matcher.speculate(TOKENS, request(), "a:1", 16, ttl_s=1.0)
    assert matcher.match_sync(TOKENS, request(), {"a:1": 16})["a:1"].blocks == 4
    now[0] = 2.0
    assert matcher.match_sync(TOKENS, request(), {"a:1": 16})["a:1"].blocks == 0


def test_held_blocks_answer_only_for_the_pods_asked_about() -> None:
    matcher = IndexPrefixMatcher(filled())
    held = matcher.held_blocks({"a:1": 16, "c:1": 16})
    assert held is not None
    assert (held.get("a:1"), held["c:1"], held.get("b:1"), held.get("b:1", -1)) == (4, 1, None, -1)
    assert sorted(held) == ["a:1", "c:1"]
    with pytest.raises(KeyError):
        held["b:1"]  # a pod not asked about has no count

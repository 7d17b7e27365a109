"""The peer routers in the replay follow their documented defaults."""

from __future__ import annotations

import asyncio

from smart_epp.benchmarks.replay.policies.aibrix import AIBrixPrefixCache
from smart_epp.benchmarks.replay.policies.prefix_table import (
    character_chunk_keys,
    prompt_characters,
)
from smart_epp.framework.types import Api, Endpoint, LLMRequest, PodState


def request(tokens: list[int] | None = None, prompt: str | None = None) -> LLMRequest:
    return LLMRequest(
        request_id=str(id(tokens or prompt)), path="/v1/completions", api=Api.COMPLETIONS,
        model="m", prompt=prompt, prompt_token_ids=tokens,
    )  # fmt: skip


def test_aibrix_blocks_are_128_characters_and_a_token_is_four():
    """AIBrix prefix-cache router docs: AIBRIX_PREFIX_CACHE_TOKENIZER_TYPE defaults to
    `character` and AIBRIX_PREFIX_CACHE_BLOCK_SIZE to 128 (tokens of that tokenizer, i.e.
    characters). Replayed token ids count as 4 characters, so a block is 32 tokens."""
    policy = AIBrixPrefixCache()
    assert policy.block_size == 128
    text = prompt_characters(request(prompt="x" * 300))
    assert len(character_chunk_keys(text, 128)) == 2  # 300 characters: two whole blocks
    tokens = prompt_characters(request(tokens=list(range(100))))
    assert len(tokens) == 4 * 400  # 400 characters at 4 bytes each
    assert len(character_chunk_keys(tokens, 128)) == 3  # 100 tokens = 3 whole 32-token blocks


def test_aibrix_follows_a_shared_block_only_once_a_whole_block_is_shared():
    pods = [PodState(endpoint=Endpoint(address=a)) for a in ("a:1", "b:1")]

    def route(tokens: list[int]) -> str:
        decision = asyncio.run(AIBrixPrefixCache.schedule(policy, request(tokens), pods))
        return decision.endpoints[0].address

    policy = AIBrixPrefixCache()
    base = list(range(500, 532))  # one 32-token (128-character) block
    assert route(base + [1] * 32) == "a:1"  # nothing matched: least loaded, first pod
    pods[0].inflight.requests = 3  # a is busier now, within the imbalance limit
    # Sharing a whole first block follows it despite the load ...
    assert route(base + [2] * 32) == "a:1"
    # ... sharing 31 tokens (124 characters) is not a block: the less loaded pod wins.
    assert route(base[:31] + [9] * 33) == "b:1"

"""The real vLLM 0.32 captures, pushed through decoder, stream logic and index."""

from __future__ import annotations

import pytest
from kvindex_captures import (
    CAPTURE_BLOCK_SIZE,
    CAPTURE_MODEL,
    CAPTURE_POD,
    frames,
    requests,
)

from smart_epp.kv_index import metrics
from smart_epp.kv_index.events import BlockRemoved, BlockStored, decode_batch
from smart_epp.kv_index.ingest import IngestState
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.memory import MemoryBlockIndex
from smart_epp.kv_index.subscriber import PodEventStream


async def replay_capture(scenario: str) -> tuple[MemoryBlockIndex, IngestState, dict[int, int]]:
    """Feeds every captured frame, in order, through one pod's stream (no replay socket).

    Returns the index, the ingest state and the map vLLM hash -> our key of every block
    any BlockStored carried.
    """
    index = MemoryBlockIndex()
    ingest = IngestState()
    stream = PodEventStream(CAPTURE_POD, CAPTURE_MODEL, ingest, index)
    stored: dict[int, int] = {}
    for frame in frames(scenario):
        await stream.handle(frame.seq, frame.payload)
        state = ingest.pod(CAPTURE_POD)
        assert state is not None
        for tier_map in state.maps.values():
            stored.update(tier_map)
    return index, ingest, stored


def request_keys(scenario: str) -> set[int]:
    keys: set[int] = set()
    for req in requests(scenario):
        scope = KeyScope(CAPTURE_MODEL, req.adapter)
        keys.update(block_keys(req.tokens, CAPTURE_BLOCK_SIZE, scope))
    return keys


@pytest.mark.parametrize("scenario", ["basic", "lora", "cbor", "eviction", "restart"])
async def test_every_stored_block_has_the_key_of_its_request_tokens(scenario: str) -> None:
    _, ingest, stored = await replay_capture(scenario)
    assert stored, "the capture stores blocks"
    # Keys computed from event tokens + parent chain equal keys computed from the
    # requests' own token ids: write side and read side agree.
    assert set(stored.values()) <= request_keys(scenario)
    assert ingest.block_size(CAPTURE_POD) == CAPTURE_BLOCK_SIZE


@pytest.mark.parametrize("scenario", ["basic", "lora", "cbor"])
async def test_every_request_is_found_from_its_token_ids(scenario: str) -> None:
    index, _, _ = await replay_capture(scenario)
    for req in requests(scenario):
        keys = block_keys(req.cached_tokens(), CAPTURE_BLOCK_SIZE, KeyScope("tiny", req.adapter))
        hits = index.lookup_sync(keys)
        assert hits[CAPTURE_POD].blocks == len(keys), req.name
        assert hits[CAPTURE_POD].medium == "GPU"


async def test_removed_blocks_are_gone_and_the_rest_match_the_pods_cache() -> None:
    index, _, stored = await replay_capture("eviction")
    live: set[int] = set()
    removed_ever = 0
    for frame in frames("eviction"):
        batch, _ = decode_batch(frame.payload)
        for event in batch.events:
            if isinstance(event, BlockStored):
                live.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                live.difference_update(event.block_hashes)
                removed_ever += len(event.block_hashes)
            else:
                live.clear()
    assert removed_ever == 66
    expected = {stored[h] for h in live}
    held = {k for k in stored.values() if index.holders_sync(k)}
    assert held == expected
    assert index.entries == len(expected)
    # Every block of the evicted first wave is gone (the cache was reset after it).
    evict_1 = next(r for r in requests("eviction") if r.name == "evict_1")
    keys = block_keys(evict_1.cached_tokens(), CAPTURE_BLOCK_SIZE, KeyScope("tiny"))
    assert index.lookup_sync(keys) == {}


async def test_restart_capture_resets_the_pod() -> None:
    before = metrics.RESTARTS.labels(CAPTURE_POD)._value.get()
    index, _, _ = await replay_capture("restart")
    assert metrics.RESTARTS.labels(CAPTURE_POD)._value.get() == before + 1
    second_instance_keys: set[int] = set()
    for req in requests("restart"):
        keys = block_keys(req.cached_tokens(), CAPTURE_BLOCK_SIZE, KeyScope("tiny"))
        if req.instance == 2:
            second_instance_keys.update(keys)
            assert index.lookup_sync(keys)[CAPTURE_POD].blocks == len(keys)
    i1_r2 = next(r for r in requests("restart") if r.name == "i1_r2")
    old_keys = block_keys(i1_r2.cached_tokens(), CAPTURE_BLOCK_SIZE, KeyScope("tiny"))
    only_old = [k for k in old_keys if k not in second_instance_keys]
    assert only_old, "the first instance held blocks the second never stored"
    assert all(not index.holders_sync(k) for k in only_old)
    assert index.entries == len(second_instance_keys)


async def test_lora_blocks_match_only_their_adapter() -> None:
    index, _, _ = await replay_capture("lora")
    reqs = {r.name: r for r in requests("lora")}
    lora_a = reqs["lora_a_1"]
    own = block_keys(lora_a.cached_tokens(), CAPTURE_BLOCK_SIZE, KeyScope("tiny", "lora-a"))
    assert index.lookup_sync(own)[CAPTURE_POD].blocks == len(own)
    # The same tokens under another adapter, or an adapter the pod never loaded, hit
    # nothing beyond what that scope itself stored.
    unknown = block_keys(lora_a.cached_tokens(), CAPTURE_BLOCK_SIZE, KeyScope("tiny", "lora-c"))
    assert index.lookup_sync(unknown) == {}
    scopes = {
        adapter: {
            k
            for r in reqs.values()
            if r.adapter == adapter
            for k in block_keys(r.tokens, CAPTURE_BLOCK_SIZE, KeyScope("tiny", adapter))
        }
        for adapter in (None, "lora-a", "lora-b")
    }
    assert not scopes[None] & scopes["lora-a"]
    assert not scopes["lora-a"] & scopes["lora-b"]
    held = {k for keys in scopes.values() for k in keys if index.holders_sync(k)}
    assert held & scopes["lora-a"] and held & scopes["lora-b"] and held & scopes[None]


async def test_model_scope_separates_pods_serving_other_models() -> None:
    index, _, _ = await replay_capture("basic")
    req = requests("basic")[0]
    keys = block_keys(req.cached_tokens(), CAPTURE_BLOCK_SIZE, KeyScope("other-model"))
    assert index.lookup_sync(keys) == {}
    sixteen = block_keys(req.cached_tokens(), 16, KeyScope("tiny"))
    assert index.lookup_sync(sixteen) == {}

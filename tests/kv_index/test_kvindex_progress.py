"""Prefill progress from KV events: a request's uncached blocks, followed as the pod's
BlockStored events arrive chunk by chunk, through the real ingest and key recipe."""

from __future__ import annotations

import pytest

from smart_epp.kv_index.events import BlockStored, EventBatch
from smart_epp.kv_index.ingest import IngestState
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.progress import PrefillProgress

BS = 4
POD = "10.0.0.1:8000"


def stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU"):
    event = BlockStored(hashes, parent, tokens, BS, medium=medium)
    return EventBatch(ts=1.0, events=[event], data_parallel_rank=0)


def test_a_chunked_prefill_is_followed_chunk_by_chunk() -> None:
    ingest = IngestState()
    prompt = list(range(100, 132))  # 8 blocks
    keys = block_keys(prompt, BS, KeyScope("m"))
    ingest.progress.watch("r1", POD, keys, BS)
    assert ingest.progress.computed("r1") == (0, 32)
    assert not ingest.progress.confirmed(POD)
    # First chunk: blocks 1-3 scheduled, their BlockStored goes out with that step.
    ingest.apply(POD, stored([1, 2, 3], None, prompt[:12]), "m")
    assert ingest.progress.computed("r1") == (12, 32)
    assert ingest.progress.confirmed(POD)
    ingest.apply(POD, stored([4, 5, 6, 7, 8], 3, prompt[12:]), "m")
    assert ingest.progress.computed("r1") == (32, 32)


def test_only_the_blocks_past_the_cached_prefix_and_only_the_gpu_tier_count() -> None:
    ingest = IngestState()
    prompt = list(range(32))
    keys = block_keys(prompt, BS, KeyScope("m"))
    ingest.apply(POD, stored([1, 2], None, prompt[:8]), "m")  # held before the request
    ingest.progress.watch("r1", POD, keys[2:], BS)
    ingest.apply(POD, stored([3, 4], 2, prompt[8:16], medium="CPU"), "m")
    assert ingest.progress.computed("r1") == (0, 24)  # offloaded copies are not prefill
    ingest.apply(POD, stored([3, 4], 2, prompt[8:16]), "m")
    assert ingest.progress.computed("r1") == (8, 24)


def test_another_pod_and_another_scope_do_not_move_it() -> None:
    ingest = IngestState()
    prompt = list(range(16))
    ingest.progress.watch("r1", POD, block_keys(prompt, BS, KeyScope("m")), BS)
    ingest.apply("10.0.0.2:8000", stored([1, 2, 3, 4], None, prompt), "m")
    ingest.apply(POD, stored([1, 2, 3, 4], None, prompt), "other-model")
    assert ingest.progress.computed("r1") == (0, 16)
    assert not ingest.progress.confirmed(POD)


def test_a_request_sharing_blocks_with_an_earlier_one_sees_them_through_its_own() -> None:
    progress = PrefillProgress()
    shared, own = [11, 12, 13], [21, 22]
    progress.watch("first", POD, shared, BS)
    progress.watch("second", POD, [*shared, *own], BS)  # sent before the first computed
    progress.stored(POD, shared)
    assert progress.computed("first") == (12, 12)
    assert progress.computed("second") == (0, 20)  # its shared blocks are the first's
    progress.stored(POD, own[:1])  # stored in order: everything before it is computed
    assert progress.computed("second") == (16, 20)


def test_forgotten_requests_leave_nothing_and_the_state_is_bounded() -> None:
    progress = PrefillProgress(max_requests=2, max_blocks=5)
    progress.watch("a", POD, [1, 2], BS)
    progress.watch("b", POD, [3, 4], BS)
    progress.watch("c", POD, [5, 6], BS)  # a third request: the oldest goes
    assert progress.computed("a") is None and len(progress) == 2
    progress.watch("d", POD, [7, 8, 9, 10], BS)  # 6 blocks would exceed 5
    assert progress.computed("b") is None and progress.computed("c") is None
    assert progress.blocks == 4
    progress.forget("d")
    assert len(progress) == 0 and progress.blocks == 0
    progress.stored(POD, [7, 8])  # blocks of a forgotten request: nothing to update
    assert not progress.confirmed(POD)


def test_a_restarted_pod_must_confirm_again_and_loses_its_requests() -> None:
    ingest = IngestState()
    prompt = list(range(8))
    ingest.progress.watch("r1", POD, block_keys(prompt, BS, KeyScope("m")), BS)
    ingest.apply(POD, stored([1], None, prompt[:4]), "m")
    assert ingest.progress.confirmed(POD)
    ingest.reset_pod(POD)
    assert not ingest.progress.confirmed(POD)
    assert ingest.progress.computed("r1") is None


def test_the_lag_of_a_pods_events_is_a_running_mean_forgotten_on_restart() -> None:
    progress = PrefillProgress()
    assert progress.lag_s(POD) == 0.0
    progress.heard(POD, 2.0)
    assert progress.lag_s(POD) == 2.0
    for _ in range(200):
        progress.heard(POD, 0.01)
    assert progress.lag_s(POD) == pytest.approx(0.01, abs=1e-3)
    progress.heard(POD, -0.5)  # a pod whose clock runs ahead of the gateway's
    assert 0.0 <= progress.lag_s(POD) < 0.01
    for corrupt in (float("inf"), float("-inf"), float("nan")):
        progress.heard(POD, corrupt)
    assert 0.0 <= progress.lag_s(POD) < 0.01
    assert progress.lag_s("other:1") == 0.0
    progress.reset_pod(POD)
    assert progress.lag_s(POD) == 0.0

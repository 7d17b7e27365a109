"""Property-based fuzz of KV event frames: decode cleanly or refuse, and always apply.

A few hundred seeds here; `python -m smart_epp.benchmarks.fuzz` runs 100,000+ frames.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smart_epp.benchmarks.fuzz import check_kv_frame, kv_frames, mutations
from smart_epp.kv_index.events import BlockStored, EventBatch, encode_batch
from smart_epp.kv_index.ingest import IngestState


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_frames, st.randoms(use_true_random=False))
def test_kv_frames_never_crash_the_ingest(payload: bytes, rnd: random.Random) -> None:
    state = IngestState()
    for case in [payload, *mutations(payload, rnd, 4)]:
        check_kv_frame(case, state)


def test_out_of_range_token_ids_count_as_malformed() -> None:
    state = IngestState()
    stored = BlockStored(block_hashes=[1], token_ids=[2**40, 1, 2, 3], block_size=4)
    result = state.apply("10.0.0.1:8000", EventBatch(ts=1.0, events=[stored]), "tiny")
    assert (result.malformed_events, result.stored_blocks, result.ops) == (1, 0, [])
    ok = BlockStored(block_hashes=[2], token_ids=[0, 1, 2, 2**32 - 1], block_size=4)
    result = state.apply("10.0.0.1:8000", EventBatch(ts=2.0, events=[ok]), "tiny")
    assert (result.malformed_events, result.stored_blocks) == (0, 1)
    assert encode_batch(EventBatch(ts=2.0, events=[ok]))  # round-trips through the wire format

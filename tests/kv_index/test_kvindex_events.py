from __future__ import annotations

import msgspec
import pytest
from kvindex_captures import SCENARIOS, decoded, frames

from smart_epp.kv_index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    decode_batch,
    encode_batch,
    encode_batch_positional,
)

_enc = msgspec.msgpack.Encoder()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_real_frames_decode_exactly(scenario: str) -> None:
    reference = decoded(scenario)
    raw = frames(scenario)
    assert len(raw) == len(reference)
    for frame, ref in zip(raw, reference, strict=True):
        batch, skipped = decode_batch(frame.payload)
        assert skipped == 0
        ts, events, rank = ref["payload"]
        assert batch.ts == ts and batch.data_parallel_rank == rank
        assert len(batch.events) == len(events)
        for ev, ref_ev in zip(batch.events, events, strict=True):
            assert type(ev).__name__ == ref_ev["type"]
            if isinstance(ev, BlockStored | BlockRemoved):
                assert ev.block_hashes == ref_ev["block_hashes"]  # exact uint64
                assert ev.medium == ref_ev["medium"]
            if isinstance(ev, BlockStored):
                assert ev.parent_block_hash == ref_ev["parent_block_hash"]
                assert ev.token_ids == ref_ev["token_ids"]
                assert ev.block_size == ref_ev["block_size"] == 32
                assert ev.lora_name == ref_ev["lora_name"]


def test_hashes_beyond_int64_survive() -> None:
    hashes = [
        h
        for f in frames("basic")
        for e in decode_batch(f.payload)[0].events
        if isinstance(e, BlockStored)
        for h in e.block_hashes
    ]
    assert any(h >= 2**63 for h in hashes)


def test_positional_encoding_of_older_vllm() -> None:
    batch = EventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[2**64 - 1], parent_block_hash=7, token_ids=[1, 2], block_size=2
            ),
            BlockRemoved(block_hashes=[3], medium="CPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    assert decode_batch(encode_batch_positional(batch)) == (batch, 0)
    # Oldest form: no rank, no medium, BlockStored without the later fields.
    oldest = _enc.encode(
        [2.0, [["BlockStored", [5], None, [1, 2], 2, None], ["BlockRemoved", [5]]]]
    )
    got, skipped = decode_batch(oldest)
    assert skipped == 0 and got.data_parallel_rank is None
    assert got.events == [
        BlockStored(block_hashes=[5], token_ids=[1, 2], block_size=2),
        BlockRemoved(block_hashes=[5]),
    ]


def test_bytes_hashes_missing_optionals_and_unknown_fields() -> None:
    payload = _enc.encode(
        [
            3.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01" * 32],
                    "token_ids": [1],
                    "block_size": 1,
                    "brand_new_field": {"x": 1},
                },
                {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32]},
            ],
            0,
            "extra trailing element",
        ]
    )
    batch, skipped = decode_batch(payload)
    assert skipped == 0
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [b"\x01" * 32] and stored.parent_block_hash is None
    assert stored.medium is None and stored.lora_name is None


def test_unknown_or_broken_events_are_skipped_and_counted_not_fatal() -> None:
    payload = _enc.encode(
        [
            4.0,
            [
                {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1},
                {"type": "SomethingNew", "x": 1},
                {"type": "BlockRemoved", "block_hashes": "not a list"},
                ["BlockRemoved", [1]],
            ],
            0,
        ]
    )
    batch, skipped = decode_batch(payload)
    assert skipped == 2
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", _enc.encode({"ts": 1}), _enc.encode([1.0]), _enc.encode(["x", [], 0])],
)
def test_malformed_frames_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_round_trip_of_the_vllm_0_32_encoding() -> None:
    batch = EventBatch(ts=1.0, events=[AllBlocksCleared()], data_parallel_rank=0)
    assert decode_batch(encode_batch(batch)) == (batch, 0)

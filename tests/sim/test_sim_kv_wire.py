"""The simulator's KV-event payloads are the bytes vLLM 0.32 puts on the wire."""

from __future__ import annotations

import msgspec
import pytest
from simfix import raw_frames

from smart_epp.benchmarks.sim.events import AllBlocksCleared, BlockRemoved, BlockStored
from smart_epp.benchmarks.sim.kv_events import encode_batch, event_to_wire, seq_bytes

_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
          "AllBlocksCleared": AllBlocksCleared}  # fmt: skip


def _as_events(wire_events: list[dict]) -> list:
    return [_TYPES[e["type"]](**{k: v for k, v in e.items() if k != "type"}) for e in wire_events]


@pytest.mark.parametrize("scenario", ["basic", "eviction", "lora", "restart", "cbor"])
def test_reencoding_captured_batches_gives_identical_bytes(scenario):
    frames = raw_frames(scenario)
    assert frames
    for topic, seq, payload in frames:
        ts, wire_events, rank = msgspec.msgpack.decode(payload)
        assert encode_batch(_as_events(wire_events), ts, data_parallel_rank=rank) == payload
        assert len(seq) == 8 and topic.startswith(b"kv@")


def test_every_event_type_and_optional_field_is_covered_by_the_captures():
    seen = set()
    for scenario in ("basic", "eviction", "lora"):
        for _, _, payload in raw_frames(scenario):
            for e in msgspec.msgpack.decode(payload)[1]:
                seen.add(e["type"])
                seen.update(k for k in e if k == "session_id" or e[k] is not None)
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared", "session_id", "lora_name"} <= seen


def test_session_id_is_omitted_when_unset_and_hashes_stay_unsigned():
    big = 2**64 - 1
    stored = BlockStored([big], None, list(range(4)), 4)
    wire = msgspec.msgpack.decode(encode_batch([stored], 1.5))
    assert "session_id" not in wire[1][0]
    assert wire[1][0]["block_hashes"] == [big]
    assert list(wire[1][0])[:2] == ["type", "block_hashes"]
    with_session = event_to_wire(BlockStored([1], 2, [0], 1, session_id="s"))
    assert with_session["session_id"] == "s"


def test_legacy_array_encoding_puts_the_tag_first():
    events = [
        BlockStored([1, 2], None, list(range(8)), 4, lora_id=3),
        BlockRemoved([2]),
        AllBlocksCleared(),
    ]
    ts, wire, rank = msgspec.msgpack.decode(encode_batch(events, 2.0, "array"))
    assert (ts, rank) == (2.0, 0)
    assert wire == [
        ["BlockStored", [1, 2], None, list(range(8)), 4, 3, "GPU"],
        ["BlockRemoved", [2], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_sequence_numbers_are_eight_byte_big_endian():
    assert seq_bytes(0) == b"\x00" * 8
    assert seq_bytes(258) == b"\x00" * 6 + b"\x01\x02"


async def test_replay_returns_every_buffered_batch_and_only_the_newest():
    import msgspec as _msgspec
    from simnet import replay
    from support.net import free_port

    from smart_epp.benchmarks.sim.kv_events import KVEventPublisher

    pub = KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}",
        "kv@test",
        f"tcp://127.0.0.1:{free_port()}",
        buffer_steps=2500,
    )
    pub.start()
    try:
        assert await replay(pub.replay_endpoint) == []
        for i in range(3000):
            assert pub.publish([BlockRemoved([i])], float(i)) == i
        assert pub.publish([], 1.0) is None  # an empty step publishes nothing
        batches = await replay(pub.replay_endpoint)
        assert [b["seq"] for b in batches] == list(range(500, 3000))
        assert batches[-1]["events"] == [_msgspec.msgpack.decode(
            encode_batch([BlockRemoved([2999])], 0.0))[1][0]]  # fmt: skip
        assert [b["seq"] for b in await replay(pub.replay_endpoint, 2990)] == list(
            range(2990, 3000)
        )
    finally:
        await pub.close()

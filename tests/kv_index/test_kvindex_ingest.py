from __future__ import annotations

from smart_epp.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from smart_epp.kv_index.ingest import IndexOp, IngestState, cache_salt_of
from smart_epp.kv_index.keys import KeyScope, block_keys


def batch(*events: object, rank: int = 0) -> EventBatch:
    return EventBatch(ts=1.0, events=list(events), data_parallel_rank=rank)  # type: ignore[arg-type]


def test_stored_chain_gives_read_side_keys_and_removal_finds_them() -> None:
    st = IngestState()
    tokens = list(range(8))
    r1 = st.apply("p", batch(BlockStored([11, 12], None, tokens[:4], 2)), "m")
    r2 = st.apply("p", batch(BlockStored([13, 14], 12, tokens[4:], 2, medium="CPU")), "m")
    expected = block_keys(tokens, 2, KeyScope("m"))
    assert r1.ops == [IndexOp("add", expected[:2], "GPU")]
    assert r2.ops == [IndexOp("add", expected[2:], "CPU")]
    assert st.block_size("p") == 2
    removed = st.apply("p", batch(BlockRemoved([14, 99], medium="CPU")))
    assert removed.ops == [IndexOp("remove", [expected[3]], "CPU")]
    assert removed.unknown_removals == 1


def test_orphans_malformed_and_clear() -> None:
    st = IngestState()
    r = st.apply("p", batch(BlockStored([5], 404, [1, 2], 2)), "m")
    assert r.orphan_blocks == 1 and r.ops == []
    r = st.apply("p", batch(BlockStored([6, 7], None, [1, 2, 3], 2)), "m")
    assert r.malformed_events == 1 and r.ops == []
    st.apply("p", batch(BlockStored([8], None, [1, 2], 0)), "m")  # size inferred
    assert st.block_size("p") == 2
    r = st.apply("p", batch(AllBlocksCleared(), BlockStored([8], None, [1, 2], 2)))
    assert [op.kind for op in r.ops] == ["clear", "add"]
    assert st.pod("p").hashes_known() == 1  # type: ignore[union-attr]


def test_adapter_and_salt_scope_the_root() -> None:
    st = IngestState()
    ev = BlockStored([1], None, [7, 7], 2, lora_name="lora-a", extra_keys=[["lora-a", "tenant"]])
    assert cache_salt_of(ev) == "tenant"
    r = st.apply("p", batch(ev), "m")
    assert r.ops[0].keys == block_keys([7, 7], 2, KeyScope("m", "lora-a", "tenant"))


def test_ranks_keep_separate_hash_maps() -> None:
    st = IngestState()
    st.apply("p", batch(BlockStored([1], None, [1, 2], 2), rank=0), "m")
    r = st.apply("p", batch(BlockRemoved([1]), rank=1))
    assert r.ops == [] and r.unknown_removals == 1


def test_consecutive_removals_from_one_tier_make_one_op_in_event_order() -> None:
    st = IngestState()
    tokens = list(range(12))
    st.apply("p", batch(BlockStored([1, 2, 3], None, tokens[:6], 2)), "m")
    st.apply("p", batch(BlockStored([4, 5, 6], None, tokens[6:], 2, medium="CPU")), "m")
    gpu = block_keys(tokens[:6], 2, KeyScope("m"))
    cpu = block_keys(tokens[6:], 2, KeyScope("m"))
    r = st.apply(
        "p",
        batch(
            BlockRemoved([3]),
            BlockRemoved([77]),  # never stored: counted, not an op
            BlockRemoved([2]),
            BlockRemoved([6], medium="CPU"),
            BlockRemoved([5], medium="CPU"),
            BlockStored([7], None, [9, 9], 2),
            BlockRemoved([1]),
        ),
    )
    assert r.ops == [
        IndexOp("remove", [gpu[2], gpu[1]], "GPU"),
        IndexOp("remove", [cpu[2], cpu[1]], "CPU"),
        IndexOp("add", block_keys([9, 9], 2, KeyScope("m")), "GPU"),
        IndexOp("remove", [gpu[0]], "GPU"),
    ]
    assert r.removed_blocks == 5 and r.unknown_removals == 1 and r.stored_blocks == 1
    assert st.pod("p").hashes_known() == 2  # type: ignore[union-attr]


def test_removals_of_an_unknown_tier_are_counted_without_ops() -> None:
    st = IngestState()
    r = st.apply("p", batch(BlockRemoved([1, 2]), BlockRemoved([3], medium="CPU")), "m")
    assert r.ops == [] and r.unknown_removals == 3 and r.removed_blocks == 0

"""The pure engine model, driven in virtual time."""

from __future__ import annotations

import pytest
from simfix import captured_requests, decoded_batches

from smart_epp.benchmarks.sim.engine import (
    EngineConfig,
    RequestRejected,
    SimEngine,
    SimRequest,
    StepOutcome,
)
from smart_epp.benchmarks.sim.events import AllBlocksCleared, BlockRemoved, BlockStored
from smart_epp.benchmarks.sim.kv_events import event_to_wire
from smart_epp.benchmarks.sim.profiles import PROFILES, get_profile
from smart_epp.benchmarks.sim.vllm_hash import BlockHasher, lora_extra_keys


def make_engine(**kw) -> SimEngine:
    kw.setdefault("block_size", 16)
    kw.setdefault("num_blocks", 1000)
    kw.setdefault("hash_seed", "vllm-none-hash")
    return SimEngine(EngineConfig(**kw))


def run_until_done(engine: SimEngine, now: float = 0.0) -> tuple[float, list[StepOutcome]]:
    outs = []
    for _ in range(100_000):
        if not engine.has_unfinished():
            return now, outs
        out = engine.step(now)
        outs.append(out)
        now = out.end
    raise AssertionError("engine did not finish")


def first_token_time(outs: list[StepOutcome], rid: str) -> float:
    return next(o.end for o in outs for p in o.progress if p.request_id == rid and p.first_token)


def test_shared_prefix_is_cached_and_answers_faster():
    engine = make_engine()
    prefix = list(range(100, 1100))
    engine.add_request(SimRequest("a", [*prefix, 1, 2, 3], max_tokens=4), 0.0)
    t, outs = run_until_done(engine)
    ttft_a = first_token_time(outs, "a")
    engine.add_request(SimRequest("b", [*prefix, 7, 8, 9], max_tokens=4), t)
    _, outs_b = run_until_done(engine, t)
    ttft_b = first_token_time(outs_b, "b") - t
    cached = next(p.num_cached_tokens for o in outs_b for p in o.progress if p.first_token)
    assert cached == (len(prefix) // 16) * 16
    assert ttft_b < ttft_a / 3
    stats = engine.stats
    assert stats.prefix_cache_hits == cached
    assert stats.prefix_cache_queries == 2 * (len(prefix) + 3)


def test_blocks_are_published_once_when_full_and_never_on_reuse():
    engine = make_engine(block_size=4)
    engine.add_request(SimRequest("a", list(range(10)), max_tokens=7), 0.0)
    t, outs = run_until_done(engine)
    stored = [e for o in outs for e in o.events if isinstance(e, BlockStored)]
    # 10 prompt + 6 computed outputs = 16 KV tokens -> 4 full blocks: 2 at prefill, 2 in decode
    assert [len(e.block_hashes) for e in stored] == [2, 1, 1]
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert stored[0].token_ids == list(range(8))
    hasher = BlockHasher(4, seed="vllm-none-hash")
    tokens = list(range(10)) + [t for o in outs for p in o.progress for t in p.new_token_ids]
    assert [h for e in stored for h in e.block_hashes] == hasher.chain_ids(tokens[:16])
    # The same prompt again reuses the two prompt blocks: nothing new for them.
    engine.add_request(SimRequest("b", list(range(10)), max_tokens=1), t)
    _, outs = run_until_done(engine, t)
    assert [e for o in outs for e in o.events] == []


def test_identical_request_republishes_its_decode_block():
    engine = make_engine(block_size=4)
    engine.add_request(SimRequest("a", list(range(6)), max_tokens=4), 0.0)
    t, first = run_until_done(engine)
    engine.add_request(SimRequest("b", list(range(6)), max_tokens=4), t)
    _, second = run_until_done(engine, t)
    first_ids = [h for o in first for e in o.events for h in e.block_hashes]
    second_ids = [h for o in second for e in o.events for h in e.block_hashes]
    assert second_ids == first_ids[1:]  # same greedy output -> same decode-block hash


def test_small_cache_evicts_least_recently_freed_blocks():
    engine = make_engine(block_size=4, num_blocks=9)  # 8 usable blocks
    engine.add_request(SimRequest("a", list(range(100, 116)), max_tokens=1), 0.0)
    t, outs = run_until_done(engine)
    a_ids = [h for o in outs for e in o.events for h in e.block_hashes]
    assert len(a_ids) == 4
    engine.add_request(SimRequest("b", list(range(200, 228)), max_tokens=1), t)
    _, outs = run_until_done(engine, t)
    removed = [e.block_hashes[0] for o in outs for e in o.events if isinstance(e, BlockRemoved)]
    # b needs 7 blocks; 4 were never cached, then a's blocks go tail-first.
    assert removed == [a_ids[3], a_ids[2], a_ids[1]]


def test_preemption_when_blocks_run_out_and_everything_still_finishes():
    engine = make_engine(block_size=4, num_blocks=13)  # 12 usable blocks = 48 tokens
    for i in range(3):
        engine.add_request(SimRequest(f"r{i}", list(range(i * 50, i * 50 + 10)), 20), 0.0)
    _, outs = run_until_done(engine)
    assert engine.stats.num_preemptions >= 1
    assert engine.stats.request_success["length"] == 3
    tokens = {}
    for o in outs:
        for p in o.progress:
            tokens.setdefault(p.request_id, []).extend(p.new_token_ids)
    assert {k: len(v) for k, v in tokens.items()} == {"r0": 20, "r1": 20, "r2": 20}
    assert engine.pool.usage() == 0.0


def test_chunked_prefill_respects_the_token_budget():
    engine = make_engine(max_num_batched_tokens=256)
    engine.add_request(SimRequest("long", list(range(1000)), max_tokens=2), 0.0)
    _, outs = run_until_done(engine)
    assert [o.num_prefill_tokens for o in outs[:4]] == [256, 256, 256, 232]
    assert sum(1 for o in outs for p in o.progress) == 2


def test_max_num_seqs_keeps_the_rest_waiting():
    engine = make_engine(max_num_seqs=2)
    for i in range(3):
        engine.add_request(SimRequest(f"r{i}", [i + 5] * 20, max_tokens=5), 0.0)
    engine.step(0.0)
    m = engine.snapshot_metrics()
    assert (m.num_requests_running, m.num_requests_waiting) == (2, 1)


def test_lora_slot_limit_makes_another_adapter_wait():
    engine = make_engine(loras={"a": "/m/a", "b": "/m/b"}, max_loras=1)
    engine.add_request(SimRequest("a1", [1] * 40, max_tokens=5, lora_name="a"), 0.0)
    engine.add_request(SimRequest("b1", [1] * 40, max_tokens=5, lora_name="b"), 0.0)
    engine.add_request(SimRequest("base", [1] * 40, max_tokens=5), 0.0)
    out = engine.step(0.0)
    m = engine.snapshot_metrics()
    assert (m.num_requests_running, m.num_requests_waiting) == (2, 1)
    assert (m.running_lora_adapters, m.waiting_lora_adapters) == (["a"], ["b"])
    assert m.num_waiting_deferred == 1
    # A later request for the loaded adapter overtakes the waiting one.
    engine.add_request(SimRequest("a2", [1] * 40, max_tokens=2, lora_name="a"), out.end)
    second = engine.step(out.end)
    assert engine.snapshot_metrics().num_requests_running == 3
    _, outs = run_until_done(engine, second.end)
    outs.insert(0, second)
    order = [p.request_id for o in outs for p in o.progress if p.first_token]
    assert order == ["a2", "b1"]
    b_first = first_token_time(outs, "b1")
    a_done = max(o.end for o in outs for p in o.progress if p.request_id == "a1" and p.finished)
    assert b_first > a_done


def test_lora_blocks_hash_with_the_adapter_path():
    engine = make_engine(block_size=4, loras={"lora-a": "/models/tiny-lora-a"})
    engine.add_request(SimRequest("x", list(range(8)), max_tokens=1, lora_name="lora-a"), 0.0)
    _, outs = run_until_done(engine)
    (event,) = [e for o in outs for e in o.events]
    hasher = BlockHasher(4, seed="vllm-none-hash")
    keys = lora_extra_keys("lora-a", "/models/tiny-lora-a")
    assert event.block_hashes == hasher.chain_ids(list(range(8)), keys)
    assert (event.lora_name, event.lora_id, event.extra_keys) == ("lora-a", 1, [["lora-a"]] * 2)


def test_reset_prefix_cache_clears_with_the_next_step_and_only_when_idle():
    engine = make_engine(block_size=4)
    engine.add_request(SimRequest("a", list(range(12)), max_tokens=3), 0.0)
    out = engine.step(0.0)
    assert engine.reset_prefix_cache() is False  # blocks in use
    t, _ = run_until_done(engine, out.end)
    assert engine.reset_prefix_cache() is True
    engine.add_request(SimRequest("b", list(range(12)), max_tokens=1), t)
    out = engine.step(t)
    assert isinstance(out.events[0], AllBlocksCleared)
    assert isinstance(out.events[1], BlockStored)  # nothing cached any more: stored again
    assert out.progress[0].num_cached_tokens == 0


def test_outputs_are_deterministic_and_can_be_forced():
    def outputs(req: SimRequest) -> list[int]:
        engine = make_engine()
        engine.add_request(req, 0.0)
        _, outs = run_until_done(engine)
        return [t for o in outs for p in o.progress for t in p.new_token_ids]

    one = outputs(SimRequest("a", [5, 6, 7], 6))
    assert one == outputs(SimRequest("b", [5, 6, 7], 6))
    assert one != outputs(SimRequest("c", [5, 6, 8], 6))
    assert outputs(SimRequest("d", [5], 3, output_token_ids=[40, 41]))[:2] == [40, 41]


def test_invalid_requests_are_rejected():
    engine = make_engine(max_model_len=64, loras={"a": "/a"})
    for req in (
        SimRequest("e", [], 4),
        SimRequest("z", [1], 0),
        SimRequest("long", [1] * 65, 1),
        SimRequest("full", [1] * 64, 1),
        SimRequest("huge", [1], 65),
        SimRequest("lora", [1], 1, lora_name="nope"),
    ):
        with pytest.raises(RequestRejected):
            engine.add_request(req, 0.0)
    assert not engine.has_unfinished()


def test_context_limit_rejects_and_clamps_like_vllm_0_32():
    engine = make_engine(max_model_len=64)
    with pytest.raises(RequestRejected) as err:
        engine.add_request(SimRequest("long", [1] * 70, 1), 0.0)
    assert str(err.value).startswith(
        "This model's maximum context length is 64 tokens. However, your prompt contains "
        "70 input tokens, which exceeds this limit even without any output tokens."
    )
    assert (err.value.param, err.value.reason) == (
        "input_tokens",
        "longer than max_model_len (64 tokens)",
    )
    with pytest.raises(RequestRejected, match="max_tokens must be at least 1, got 0") as err:
        engine.add_request(SimRequest("full", [1] * 64, 5), 0.0)
    assert err.value.param == "max_tokens"
    with pytest.raises(RequestRejected, match="cannot be greater than max_model_len=64"):
        engine.add_request(SimRequest("huge", [1] * 4, 100), 0.0)
    # A prompt that fits gets the room that is left: 60 + 10 asks for 70, generates 4.
    req = SimRequest("fits", [1] * 60, 10)
    engine.add_request(req, 0.0)
    assert req.max_tokens == 4
    _, outs = run_until_done(engine)
    assert sum(len(p.new_token_ids) for o in outs for p in o.progress) == 4


def test_abort_releases_blocks():
    engine = make_engine()
    engine.add_request(SimRequest("a", list(range(64)), max_tokens=50), 0.0)
    engine.step(0.0)
    assert engine.pool.usage() > 0
    assert engine.abort("a", 0.1) is True
    assert engine.pool.usage() == 0.0 and not engine.has_unfinished()
    assert engine.stats.request_success["abort"] == 1


def test_step_time_grows_with_batch_and_context():
    prof = get_profile("h100-llama3-8b")
    assert prof.step_seconds(0, 0, 1, 100) == pytest.approx(0.0065, rel=0.05)
    assert prof.step_seconds(0, 0, 64, 64 * 2000) > 2 * prof.step_seconds(0, 0, 1, 2000)
    assert prof.step_seconds(25_000, 0, 0, 0) == pytest.approx(1.0, rel=0.1)
    assert {"h100-llama3-8b", "a100-llama3-8b", "h100x4-llama3-70b-tp4"} <= set(PROFILES)
    with pytest.raises(ValueError):
        get_profile("nope")


def _wire_stored(batches) -> list[dict]:
    return [e for b in batches for e in b if e["type"] == "BlockStored"]


def test_sequential_capture_is_reproduced_event_for_event():
    """Replays the captured single requests and compares every KV-event batch."""
    captured = [r for r in captured_requests("basic") if not r.name.startswith("burst")]
    engine = SimEngine(
        EngineConfig(
            block_size=32,
            num_blocks=65536,
            profile=get_profile("cpu-tiny"),
            hash_seed="vllm-none-hash",
            vocab_size=745,
        )
    )
    now, batches = 0.0, []
    for r in captured:
        xargs = r.body.get("vllm_xargs", {})
        engine.add_request(
            SimRequest(
                r.name,
                r.prompt_token_ids,
                r.body["max_tokens"],
                output_token_ids=r.output_token_ids,
                session_id=xargs.get("session_id"),
                report_full=xargs.get("kv_cache_report_mode") == "full",
            ),
            now,
        )
        now, outs = run_until_done(engine, now)
        batches += [[event_to_wire(e) for e in o.events] for o in outs if o.events]
    real = [b["payload"][1] for b in decoded_batches("basic")][: len(batches)]
    assert batches == real


def replay_capture(scenario: str, engine: SimEngine) -> list[list[dict]]:
    """Feeds a capture's requests to ``engine`` at their captured send times (virtual)."""
    pending = sorted(captured_requests(scenario), key=lambda r: r.t_send)
    t0, now, batches = pending[0].t_send, 0.0, []
    while pending or engine.has_unfinished():
        while pending and pending[0].t_send - t0 <= now:
            r = pending.pop(0)
            if r.name == "after_reset":  # the capture reset the cache right before it
                assert engine.reset_prefix_cache()
            engine.add_request(
                SimRequest(r.name, r.prompt_token_ids, r.body["max_tokens"],
                           lora_name=r.lora_name, output_token_ids=r.output_token_ids),
                now,
            )  # fmt: skip
        if not engine.has_unfinished():
            now = pending[0].t_send - t0
            continue
        out = engine.step(now)
        now = out.end
        if out.events:
            batches.append([event_to_wire(e) for e in out.events])
    return batches


def _hashes(batches: list[list[dict]], kind: str) -> list[int]:
    return [h for b in batches for e in b if e["type"] == kind for h in e["block_hashes"]]


def test_eviction_capture_evicts_the_same_blocks_in_the_same_order():
    engine = SimEngine(
        EngineConfig(block_size=32, num_blocks=24, max_model_len=512,
                     profile=get_profile("cpu-tiny"), hash_seed="vllm-none-hash",
                     vocab_size=745)
    )  # fmt: skip
    mine = replay_capture("eviction", engine)
    real = [b["payload"][1] for b in decoded_batches("eviction")]
    assert _hashes(mine, "BlockRemoved") == _hashes(real, "BlockRemoved")
    assert sorted(_hashes(mine, "BlockStored")) == sorted(_hashes(real, "BlockStored"))
    kinds = [[e["type"] for e in b] for b in mine]
    assert kinds.count(["AllBlocksCleared", "BlockStored"]) == 1
    assert engine.stats.num_preemptions == 2  # vllm:num_preemptions_total in metrics.after.txt


def test_lora_capture_stores_the_same_blocks_and_lora_b_waits_for_lora_a():
    loras = {"lora-a": "/models/tiny-lora-a", "lora-b": "/models/tiny-lora-b"}
    engine = SimEngine(
        EngineConfig(block_size=32, num_blocks=65536, max_model_len=1024, loras=loras,
                     max_loras=1, profile=get_profile("cpu-tiny"),
                     hash_seed="vllm-none-hash", vocab_size=745)
    )  # fmt: skip
    mine = replay_capture("lora", engine)
    real = [b["payload"][1] for b in decoded_batches("lora")]
    assert sorted(_hashes(mine, "BlockStored")) == sorted(_hashes(real, "BlockStored"))
    for batches in (mine, real):
        names = [e["lora_name"] for b in batches for e in b]
        assert max(i for i, n in enumerate(names) if n == "lora-a") < names.index("lora-b")


@pytest.mark.parametrize("chunk", [32, 2048])
def test_idle_ttft_seconds_is_what_the_engine_takes_for_one_prompt(chunk):
    # LatencyProfile.idle_ttft_seconds is how benchmarks predict a lone prompt's TTFT
    # (sim_vs_live's pod slowdown); it must count one step per chunk, as the engine runs.
    profile = get_profile("h100-llama3-8b").model_copy(
        update={"max_num_batched_tokens": chunk, "prefill_s_per_request": 0.002}
    )
    engine = make_engine(profile=profile)
    prefix = list(range(100, 1100))
    engine.add_request(SimRequest("cold", [*prefix, 1, 2, 3], max_tokens=1), 0.0)
    t, outs = run_until_done(engine)
    assert first_token_time(outs, "cold") == pytest.approx(profile.idle_ttft_seconds(1003))
    engine.add_request(SimRequest("warm", [*prefix, 7, 8, 9], max_tokens=1), t)
    _, outs = run_until_done(engine, t)
    cached = (len(prefix) // 16) * 16
    expected = profile.idle_ttft_seconds(1003 - cached, cached)
    assert first_token_time(outs, "warm") - t == pytest.approx(expected)

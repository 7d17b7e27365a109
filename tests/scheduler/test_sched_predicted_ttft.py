"""The predicted-TTFT scorer's model, term by term (from its explain components)."""

from __future__ import annotations

import random

import pytest
from sched_helpers import pod, request

from smart_epp.epp.config import plugin_types
from smart_epp.framework.plugins import SchedulingContext
from smart_epp.framework.types import Outcome, PrefixHit, Usage
from smart_epp.scorers.predicted_ttft_scorer import (
    PredictedTTFTScorer,
    reusable_tokens,
    robust_rate,
)

RATE = 10_000.0  # the default prefill rate, tokens/s


def scorer(**params) -> PredictedTTFTScorer:
    cls = plugin_types()["predicted-ttft-scorer"]
    return cls("ttft", cls.Params.model_validate(params))  # type: ignore[return-value]


def ctx(tokens: int = 1000, *, adapter: str | None = None, hits=None, now: float = 100.0):
    req = request(tokens=list(range(tokens)), adapter=adapter)
    return SchedulingContext(
        request=req, now=now, prompt_tokens=tokens, token_ids=req.prompt_token_ids,
        prefix_hits=hits, block_sizes={"a:1": 16, "b:1": 16}, rng=random.Random(0),
        explain=True,
    )  # fmt: skip


def test_cached_tokens_are_not_prefilled_and_cpu_tier_costs_a_transfer():
    s = scorer(overheadSeconds=0.0, cpuTierTokensPerSecond=100_000)
    c = ctx(1000, hits={"a:1": PrefixHit(blocks=50), "b:1": PrefixHit(blocks=50, medium="CPU")})
    scores = s.score(c, [pod("a:1"), pod("b:1")])
    a, b = c.components["a:1"], c.components["b:1"]
    assert a["prefill_s"] == pytest.approx(200 / RATE)  # 800 of 1000 tokens held
    assert b["prefill_s"] == pytest.approx(200 / RATE + 800 / 100_000)
    assert scores[0] == 1.0 and scores[1] == pytest.approx(a["ttft_s"] / b["ttft_s"])


def test_queue_terms_use_scraped_waiting_and_routed_backlog():
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.001, meanPromptTokens=500)
    c = ctx(100)
    s.score(c, [pod("a:1", waiting=4, running=10), pod("b:1")])
    assert c.components["a:1"]["wait_s"] == pytest.approx(4 * 500 / RATE + 10 * 0.001)
    assert c.components["b:1"]["wait_s"] == 0.0
    # Routing to b leaves a backlog there that drains at the prefill rate.
    s.on_routed(c, pod("b:1"))
    later = ctx(100, now=100.005)
    s.score(later, [pod("a:1"), pod("b:1")])
    assert later.components["b:1"]["wait_s"] == pytest.approx((100 - RATE * 0.005) / RATE)


def test_stale_metrics_are_ignored_but_own_inflight_counts():
    s = scorer(overheadSeconds=0.0, staleAfterSeconds=1.0)
    stale = pod("a:1", waiting=50, running=20, inflight=3)
    stale.metrics.scraped_at = 90.0  # ten seconds before now
    c = ctx(100)
    s.score(c, [stale])
    assert c.components["a:1"]["wait_s"] == pytest.approx(3 * 0.0005)


def test_adapter_and_kv_pressure_penalties():
    s = scorer(overheadSeconds=0.0, adapterLoadSeconds=0.05, meanOutputTokens=100,
               decodeSecondsPerToken=0.01)  # fmt: skip
    drain = 0.5 * 100 * 0.01
    pods = [
        pod("loaded:1", adapters=("x",), max_loras=1),
        pod("room:1", max_loras=2, adapters=("y",)),
        pod("full:1", max_loras=1, adapters=("y",)),
        pod("kvfull:1", adapters=("x",), max_loras=1, kv=0.99, num_gpu_blocks=100),
    ]
    c = ctx(1000, adapter="x")
    c.block_sizes = {p.address: 16 for p in pods}
    s.score(c, pods)
    comp = c.components
    assert comp["loaded:1"]["adapter_s"] == 0.0
    assert comp["room:1"]["adapter_s"] == pytest.approx(0.05)
    assert comp["full:1"]["adapter_s"] == pytest.approx(0.05 + drain)
    # 1% of 100 blocks x 16 tokens free: 16 tokens, far below the 1000 the prompt needs,
    # and nothing running: one whole mean decode until space frees.
    assert comp["kvfull:1"]["kv_s"] == pytest.approx(100 * 0.01)
    assert comp["loaded:1"]["kv_s"] == 0.0


def test_completed_requests_come_off_a_scrape_taken_before_they_ended():
    s = scorer(overheadSeconds=0.0, meanPromptTokens=1000)
    a = pod("a:1", waiting=2)
    a.metrics.scraped_at = 99.9
    first = ctx(100, now=99.95)
    s.score(first, [a])
    s.on_routed(first, a)
    s.on_outcome(first, Outcome("a:1", True, 200, None, None, now=99.99))  # ended after the scrape
    c = ctx(100, now=100.0)
    s.score(c, [a])
    # One of the two scraped waiting requests was ours and has ended.
    assert c.components["a:1"]["wait_s"] == pytest.approx(s.mean_uncached_tokens / RATE)


def test_the_last_prompt_token_is_always_recomputed():
    assert reusable_tokens(1000, 63, 16) == 992  # 63 blocks cover 1008 > 1000 tokens
    assert reusable_tokens(1024, 64, 16) == 1008  # fully held: the last block recomputes
    assert reusable_tokens(1025, 64, 16) == 1024
    assert reusable_tokens(1, 1, 16) == 0
    s = scorer(overheadSeconds=0.0)
    c = ctx(1024, hits={"a:1": PrefixHit(blocks=64)})
    s.score(c, [pod("a:1")])
    assert c.components["a:1"]["hit_tokens"] == 1008
    assert c.components["a:1"]["prefill_s"] == pytest.approx(16 / RATE)


def learn(s: PredictedTTFTScorer, target, tokens: int, ttft: float, now: float, **kw) -> None:
    """Route one request to `target` at `now` and report its TTFT."""
    c = ctx(tokens, now=now, **kw)
    s.score(c, [target])
    s.on_routed(c, target)
    s.on_outcome(
        c, Outcome(target.address, True, 200, Usage(tokens, 10), ttft, now=now + ttft + 1.0)
    )


def test_prefill_rate_is_learned_only_from_requests_that_met_a_short_queue():
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0, meanPromptTokens=1000)
    busy = pod("a:1", waiting=8)  # 8 x 1000 tokens queued ahead of a 1000-token prompt
    learn(s, busy, 1000, ttft=3.0, now=100.0)
    assert s.pods["a:1"].prefill_tok_per_s is None  # the TTFT was mostly queueing
    idle = pod("b:1")
    learn(s, idle, 1000, ttft=0.05, now=100.0)
    assert s.pods["b:1"].prefill_tok_per_s == pytest.approx(1000 / 0.05)


def test_adapter_loads_and_tiny_prompts_are_not_learned_as_prefill():
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0)
    cold = pod("a:1", max_loras=2)  # the adapter is not loaded there
    learn(s, cold, 1000, ttft=1.0, now=100.0, adapter="x")
    assert s.pods["a:1"].prefill_tok_per_s is None
    learn(s, pod("b:1"), 100, ttft=1.0, now=100.0)  # below minSampleTokens
    assert s.pods["b:1"].prefill_tok_per_s is None


def test_learned_rate_stays_near_the_prior_until_samples_agree():
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0, rateBand=4.0,
               rateTrustSamples=5)  # fmt: skip
    a = pod("a:1")
    # Samples claiming the pod is 100x faster than configured are held to 4x ...
    for i in range(4):
        learn(s, a, 1000, ttft=1000 / (100 * RATE), now=100.0 + 10 * i)
    assert s.pods["a:1"].prefill_tok_per_s == pytest.approx(4 * RATE)
    # ... until five of them agree.
    learn(s, a, 1000, ttft=1000 / (100 * RATE), now=200.0)
    assert s.pods["a:1"].prefill_tok_per_s == pytest.approx(100 * RATE)


def test_disagreeing_samples_keep_the_band_and_the_median_ignores_outliers():
    prior = 10_000.0
    scattered = [1_000.0, 50_000.0, 2_000.0, 80_000.0, 3_000.0, 90_000.0]
    assert robust_rate(scattered, prior, 4.0, 5) == pytest.approx(26_500.0)  # median
    wild = [1e9, 12_000.0, 11_000.0, 13_000.0, 12_500.0, 11_500.0, 1.0]
    assert robust_rate(wild, prior, 4.0, 5) == pytest.approx(12_000.0)


def test_the_pods_own_rate_hint_is_the_prior():
    s = scorer(overheadSeconds=0.0, rateBand=4.0)
    fast = pod("a:1")
    fast.prefill_tok_per_s = 50_000.0
    c = ctx(1000)
    s.score(c, [fast])
    assert c.components["a:1"]["prefill_s"] == pytest.approx(1000 / 50_000)
    # A first fast sample is allowed up to 4x the hint, not 4x the configured rate.
    learn(s, fast, 1000, ttft=1000 / 150_000, now=100.0)
    assert s.pods["a:1"].prefill_tok_per_s == pytest.approx(150_000.0)


def test_kv_wait_grows_with_the_deficit_and_shrinks_with_more_requests_finishing():
    s = scorer(overheadSeconds=0.0, meanPromptTokens=900, meanOutputTokens=100,
               decodeSecondsPerToken=0.01)  # fmt: skip
    pods = [
        pod("small:1", kv=0.99, num_gpu_blocks=1000, running=10),  # 160 tokens free
        pod("many:1", kv=0.99, num_gpu_blocks=1000, running=40),
        pod("roomy:1", kv=0.5, num_gpu_blocks=1000, running=10),
        pod("queued:1", kv=0.99, num_gpu_blocks=1000, running=10, waiting=2),
    ]
    c = ctx(4160)  # 4000 tokens short of space: four mean requests (900 + 100) must end
    c.block_sizes = {p.address: 16 for p in pods}
    s.score(c, pods)
    comp = c.components
    assert comp["small:1"]["kv_s"] == pytest.approx(4 * 100 * 0.01 / 10)
    assert comp["many:1"]["kv_s"] == pytest.approx(4 * 100 * 0.01 / 40)
    assert comp["roomy:1"]["kv_s"] == 0.0
    # Two requests queue behind this one for KV: they wait for its prefill and for the
    # 4160 tokens of KV it holds (1 s of decode frees 10 x 1000 tokens).
    per_token = 100 * 0.01 / (10 * 1000)
    assert comp["queued:1"]["congestion_s"] == pytest.approx(2 * (4160 / RATE + 4160 * per_token))
    assert comp["roomy:1"]["congestion_s"] == 0.0


def test_prefixes_in_flight_count_as_held_until_answered_or_expired():
    s = scorer(overheadSeconds=0.0, routedPrefixSeconds=30.0, routedPrefixChunkTokens=256)
    a, b = pod("a:1"), pod("b:1")
    first = ctx(1000, now=100.0)
    s.score(first, [a, b])
    s.on_routed(first, b)
    # The same 1000-token prompt again, before any KV event: b was sent its first three
    # whole 256-token chunks.
    again = ctx(1000, now=100.01)
    s.score(again, [a, b])
    assert again.components["b:1"]["hit_tokens"] == 768
    assert again.components["a:1"]["hit_tokens"] == 0
    # A prompt that differs from the first token on shares nothing.
    other = SchedulingContext(
        request=request(tokens=[7] * 1000), now=100.02, prompt_tokens=1000,
        token_ids=[7] * 1000, block_sizes={"a:1": 16, "b:1": 16}, explain=True,
    )  # fmt: skip
    s.score(other, [a, b])
    assert other.components["b:1"]["hit_tokens"] == 0
    # Once answered, the KV index is the authority again.
    s.on_outcome(first, Outcome("b:1", True, 200, None, None, now=101.0))
    after = ctx(1000, now=101.0)
    s.score(after, [a, b])
    assert after.components["b:1"]["hit_tokens"] == 0
    # An answer that never comes stops counting after routedPrefixSeconds.
    s.on_routed(after, b)
    late = ctx(1000, now=131.5)
    s.score(late, [a, b])
    assert late.components["b:1"]["hit_tokens"] == 0


def test_prefixes_in_flight_are_left_to_the_index_by_default():
    s = scorer(overheadSeconds=0.0)
    first = ctx(1000, now=100.0)
    s.score(first, [pod("a:1"), pod("b:1")])
    s.on_routed(first, pod("b:1"))
    again = ctx(1000, now=100.01)
    s.score(again, [pod("a:1"), pod("b:1")])
    assert again.components["b:1"]["hit_tokens"] == 0


def test_a_long_queue_makes_a_cache_miss_cost_everyone_behind_it():
    def rank(weight: float) -> tuple[str, dict]:
        s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0, meanPromptTokens=1000,
                   congestionWeight=weight, routedPrefixSeconds=0.0)  # fmt: skip
        pods = [pod("a:1", waiting=10), pod("b:1", waiting=8)]
        c = ctx(1008, hits={"a:1": PrefixHit(blocks=57)})  # a holds 912 tokens: 96 to go
        scores = s.score(c, pods)
        return pods[scores.index(1.0)].address, c.components

    chosen, comp = rank(0.0)
    # By TTFT alone b is sooner: (8 x 1000 + 1008) vs (10 x 1000 + 96) tokens ahead.
    assert chosen == "b:1" and comp["b:1"]["ttft_s"] < comp["a:1"]["ttft_s"]
    chosen, comp = rank(1.0)
    # But b would prefill 1008 tokens ahead of 8 queued requests, a only 96 ahead of 10.
    assert comp["b:1"]["congestion_s"] == pytest.approx(8 * 1008 / RATE)
    assert comp["a:1"]["congestion_s"] == pytest.approx(10 * 96 / RATE)
    assert chosen == "a:1"

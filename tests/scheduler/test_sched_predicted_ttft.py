"""The predicted-TTFT scorer's model, term by term (from its explain components)."""

from __future__ import annotations

import random

import pytest
from sched_helpers import pod, request

from smart_epp.epp.config import plugin_types
from smart_epp.kv_index.api import PrefixHit
from smart_epp.scorers.base import SchedulingContext
from smart_epp.scorers.predicted_ttft_scorer import PredictedTTFTScorer

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
    # 1% of 100 blocks x 16 tokens free: 16 tokens, far below the 1000 the prompt needs.
    assert comp["kvfull:1"]["kv_s"] == pytest.approx(drain)
    assert comp["loaded:1"]["kv_s"] == 0.0


def test_completed_requests_come_off_a_scrape_taken_before_they_ended():
    s = scorer(overheadSeconds=0.0, meanPromptTokens=1000)
    a = pod("a:1", waiting=2)
    a.metrics.scraped_at = 99.9
    first = ctx(100, now=99.95)
    s.score(first, [a])
    s.on_routed(first, a)
    s.on_response(first, "a:1", None, None, True, now=99.99)  # ended after the scrape
    c = ctx(100, now=100.0)
    s.score(c, [a])
    # One of the two scraped waiting requests was ours and has ended.
    assert c.components["a:1"]["wait_s"] == pytest.approx(s.mean_uncached_tokens / RATE)

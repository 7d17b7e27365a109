"""The predicted-TTFT scorer's model, term by term (from its explain components)."""

from __future__ import annotations

import random

import pytest
from sched_helpers import pod, request

from smart_epp.epp.config import plugin_types
from smart_epp.framework.plugins import LearnedSample, SchedulingContext
from smart_epp.framework.types import Outcome, PodMetrics, PrefixHit, Usage
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.progress import PrefillProgress
from smart_epp.scorers.predicted_ttft_scorer import (
    PEER_REQUEST_GRACE_S,
    REQUEST_ANSWERED,
    REQUEST_ROUTED,
    PredictedTTFTScorer,
    RoutedPrefixes,
    reusable_tokens,
)
from smart_epp.scorers.ttft_model import attention_pairs

RATE = 10_000.0  # the default prior prefill rate, tokens/s


def scorer(**params) -> PredictedTTFTScorer:
    cls = plugin_types()["predicted-ttft-scorer"]
    return cls("ttft", cls.Params.model_validate(params))  # type: ignore[return-value]


def ctx(
    tokens: int = 1000,
    *,
    adapter: str | None = None,
    hits=None,
    now: float = 100.0,
    prompt: int = 0,
):
    # `prompt` tells prompts apart: equal values share every token, others share none.
    start = prompt * 1_000_000
    req = request(tokens=list(range(start, start + tokens)), adapter=adapter)
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
    assert b["prefill_s"] == pytest.approx(200 / RATE)
    assert b["cpu_s"] == pytest.approx(800 / 100_000) and a["cpu_s"] == 0.0
    assert scores[0] == 1.0 and scores[1] == pytest.approx(a["ttft_s"] / b["ttft_s"])


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


def test_prefixes_in_flight_count_by_default_and_can_be_left_to_the_index():
    # By default a prompt sent and not yet answered counts as held where it went: its
    # prefill may wait in the pod's queue far longer than the index's speculative entries.
    s = scorer(overheadSeconds=0.0)
    first = ctx(1000, now=100.0)
    s.score(first, [pod("a:1"), pod("b:1")])
    s.on_routed(first, pod("b:1"))
    later = ctx(1000, now=130.0)
    s.score(later, [pod("a:1"), pod("b:1")])
    assert later.components["b:1"]["hit_tokens"] == 768
    assert later.components["a:1"]["hit_tokens"] == 0
    off = scorer(overheadSeconds=0.0, routedPrefixSeconds=0.0)
    first = ctx(1000, now=100.0)
    off.score(first, [pod("a:1"), pod("b:1")])
    off.on_routed(first, pod("b:1"))
    again = ctx(1000, now=100.01)
    off.score(again, [pod("a:1"), pod("b:1")])
    assert again.components["b:1"]["hit_tokens"] == 0


def test_prefixes_in_flight_use_the_index_block_keys_at_chunk_granularity():
    # With the prefix lookup's block keys at hand, the routed prefix is every 16th block
    # key of a 16-token-block pod (256 tokens), and a prompt sharing the first 600 tokens
    # shares two whole chunks with it; a pod of 32-token blocks has its own keys.
    s = scorer(overheadSeconds=0.0)
    a, b, c = pod("a:1"), pod("b:1"), pod("c:1")
    sizes = {"a:1": 16, "b:1": 16, "c:1": 32}
    scope = KeyScope("m")

    def keyed(tokens: list[int], now: float, scope: KeyScope = scope) -> SchedulingContext:
        keys16, keys32 = block_keys(tokens, 16, scope), block_keys(tokens, 32, scope)
        return SchedulingContext(
            request=request(tokens=tokens), now=now, prompt_tokens=len(tokens),
            token_ids=tokens, block_sizes=sizes, explain=True,
            prompt_keys={"a:1": keys16, "b:1": keys16, "c:1": keys32},
        )  # fmt: skip

    first = keyed(list(range(1000)), 100.0)
    s.score(first, [a, b, c])
    s.on_routed(first, b)
    shared = keyed([*range(600), *range(5000, 5400)], 100.5)
    s.score(shared, [a, b, c])
    assert shared.components["b:1"]["hit_tokens"] == 512
    assert shared.components["a:1"]["hit_tokens"] == 0
    # The same tokens for another model (or adapter, or salt) are other KV values.
    other_model = keyed(list(range(1000)), 100.5, KeyScope("other"))
    s.score(other_model, [a, b, c])
    assert other_model.components["b:1"]["hit_tokens"] == 0
    s.on_routed(shared, c)
    again = keyed([*range(600), *range(7000, 7400)], 101.0)
    s.score(again, [a, b, c])
    assert again.components["c:1"]["hit_tokens"] == 512  # its own 256-token chunks
    assert again.components["b:1"]["hit_tokens"] == 512
    s.on_outcome(first, Outcome("b:1", True, 200, None, None, now=102.0))
    s.on_outcome(shared, Outcome("c:1", True, 200, None, None, now=102.0))
    after = keyed(list(range(1000)), 102.0)
    s.score(after, [a, b, c])
    assert all(after.components[x]["hit_tokens"] == 0 for x in sizes)


def test_routed_prefix_runs_with_a_prefix_every_pod_was_sent():
    # A system prompt (chunks 1-2) in flight on every pod, one longer prompt on one pod:
    # each pod's run is its deepest chunk, and an expired deepest entry drops the pod.
    table = RoutedPrefixes(ttl_s=10.0)
    pods = [f"p{i}:1" for i in range(50)]
    for address in pods:
        table.add([1, 2], address, now=0.0)
    table.add([1, 2, 3, 4], "p7:1", now=5.0)
    runs = table.matched_chunks([1, 2, 3, 4, 5], now=6.0)
    assert runs == {**dict.fromkeys(pods, 2), "p7:1": 4}
    # At 11 s the system prompt's first entries have expired, p7's refresh has not.
    assert table.matched_chunks([1, 2, 3, 4], now=11.0) == {"p7:1": 4}
    table.release([1, 2, 3, 4], "p7:1")
    table.release([1, 2], "p7:1")
    assert "p7:1" not in table.matched_chunks([1, 2], now=1.0)


def test_queue_terms_use_scraped_waiting_and_own_sends():
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.001, meanPromptTokens=500)
    c = ctx(100)
    s.score(c, [pod("a:1", waiting=4, running=10), pod("b:1")])
    # Four waiting requests this gateway did not send, at the mean size, and the batch.
    assert c.components["a:1"]["wait_s"] == pytest.approx(4 * 500 / RATE + 10 * 0.001)
    assert c.components["b:1"]["wait_s"] == 0.0
    # A request sent to b after b's last scrape is ahead of the next one there.
    b = pod("b:1")
    b.metrics.scraped_at = 99.99
    s.on_routed(c, b)
    later = ctx(100, now=100.005)
    s.score(later, [pod("a:1"), b])
    assert later.components["b:1"]["wait_s"] == pytest.approx(100 / RATE)
    assert later.components["b:1"]["queued"] == 1.0
    # The next scrape says nothing waits at b: the request was admitted, and its own
    # predicted prefill (10 ms from the scrape) drains from there.
    b.metrics.scraped_at = 100.006
    s.score(again := ctx(100, now=100.011), [b])
    assert again.components["b:1"]["wait_s"] == pytest.approx(0.5 * 100 / RATE)


def test_stale_metrics_are_ignored_but_own_inflight_counts():
    s = scorer(overheadSeconds=0.0, staleAfterSeconds=1.0)
    stale = pod("a:1", waiting=50, running=20, inflight=3)
    stale.metrics.scraped_at = 90.0  # ten seconds before now
    c = ctx(100)
    s.score(c, [stale])
    assert c.components["a:1"]["wait_s"] == pytest.approx(3 * 0.0005)


def test_a_pool_scraped_every_few_seconds_is_read_between_its_scrapes():
    s = scorer(overheadSeconds=0.0, staleAfterSeconds=1.0, meanPromptTokens=1000)
    slow = pod("a:1", waiting=4)
    for scraped_at in (94.0, 96.0, 98.0):  # every 2 s, longer than staleAfterSeconds
        slow.metrics.mark_scraped(scraped_at, slow.metrics)
        s.score(ctx(100, now=scraped_at + 0.01), [slow])
    # 1.5 s after the last scrape the next is not yet due: its 4 waiting requests count.
    c = ctx(100, now=99.5)
    s.score(c, [slow])
    assert c.components["a:1"]["wait_s"] == pytest.approx(4 * s.mean_uncached_tokens / RATE)
    # A pod whose scrapes stop is stale a second past the one it missed.
    late = ctx(100, now=101.1)
    s.score(late, [slow])
    assert late.components["a:1"]["wait_s"] == 0.0


def test_a_scrape_records_the_interval_since_the_one_before():
    before = PodMetrics()
    first = PodMetrics()
    first.mark_scraped(10.0, before)
    assert (first.scraped_at, first.scrape_interval_s) == (10.0, 0.0)  # none before it
    second = PodMetrics()
    second.mark_scraped(12.5, first)
    assert second.scrape_interval_s == 2.5
    second.mark_scraped(13.0, second)  # copied into the same object, as the replay does
    assert (second.scraped_at, second.scrape_interval_s) == (13.0, 0.5)
    reset = PodMetrics()
    reset.mark_scraped(1.0, second)  # a clock that went back keeps the interval known
    assert reset.scrape_interval_s == 0.5


def test_completed_requests_come_off_a_scrape_taken_before_they_ended():
    s = scorer(overheadSeconds=0.0, meanPromptTokens=1000)
    a = pod("a:1", waiting=2)
    a.metrics.scraped_at = 99.9
    first = ctx(100, now=99.95)
    s.score(first, [a])
    s.on_routed(first, a)
    s.on_outcome(first, Outcome("a:1", True, 200, None, None, now=99.99))  # ended after scrape
    c = ctx(100, now=100.0)
    s.score(c, [a])
    # One of the two scraped waiting requests ended since: one other remains.
    assert c.components["a:1"]["wait_s"] == pytest.approx(s.mean_uncached_tokens / RATE)


def answer(s: PredictedTTFTScorer, target, tokens: int, ttft: float, now: float, **kw):
    """Route one request to `target` at `now` and report its TTFT and usage."""
    cached = kw.pop("cached", None)
    c = ctx(tokens, now=now, **kw)
    s.score(c, [target])
    s.on_routed(c, target)
    usage = Usage(tokens, 10, cached_tokens=cached)
    s.on_outcome(c, Outcome(target.address, True, 200, usage, ttft, now=now + ttft + 1.0))


def test_the_scorer_learns_a_pods_speed_from_its_answers():
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0)
    fast = pod("a:1")
    rng = random.Random(0)
    for i in range(60):
        n = rng.randint(500, 8000)
        # 40 us per token plus 1 ns per attention pair: 2.5x faster than the prior.
        answer(
            s, fast, n, ttft=0.002 + 40e-6 * n + 1e-9 * attention_pairs(n, 0), now=100.0 + 30 * i
        )
    c = ctx(16_000, now=5000.0)
    s.score(c, [fast])
    expected = 0.002 + 40e-6 * 16_000 + 1e-9 * attention_pairs(16_000, 0)
    assert c.components["a:1"]["ttft_s"] == pytest.approx(expected, rel=0.1)


def test_a_pod_that_leaves_the_pool_is_forgotten():
    s = scorer(overheadSeconds=0.0, routedPrefixSeconds=30.0)
    a, b = pod("a:1"), pod("b:1")
    for i in range(20):
        # b answers 3x slower than a.
        answer(s, a, 2000, ttft=0.1, now=100.0 + i, prompt=i)
        answer(s, b, 2000, ttft=0.3, now=100.5 + i, prompt=100 + i)
    assert set(s.learned_cold_ttft(1024)) == {"a:1", "b:1"}
    in_flight = ctx(1000, now=200.0, prompt=7)
    s.score(in_flight, [b])
    s.on_routed(in_flight, b)
    s.on_pod_removed("b:1")
    assert set(s.learned_cold_ttft(1024)) == {"a:1"}
    # A pod serving from b's address again is priced as a new pod of the pool: like a,
    # with no queue, and holding none of what was sent to the old one.
    again = ctx(1000, now=200.1, prompt=7)
    s.score(again, [a, b])
    assert again.components["b:1"]["hit_tokens"] == 0
    assert again.components["b:1"]["ttft_s"] == pytest.approx(
        again.components["a:1"]["ttft_s"], rel=0.01
    )
    # The old pod's late answer teaches nothing about the new one.
    s.on_outcome(in_flight, Outcome("b:1", True, 200, Usage(1000, 10), 5.0, now=206.0))
    assert set(s.learned_cold_ttft(1024)) == {"a:1"}


def test_pods_coming_and_going_leave_no_state_behind():
    s = scorer(routedPrefixSeconds=30.0)
    for i in range(300):
        p = pod(f"10.0.{i // 250}.{i % 250}:8000")
        answer(s, p, 1000, ttft=0.1, now=100.0 + i, prompt=i)
        late = ctx(1000, now=100.5 + i, prompt=1000 + i)
        s.score(late, [p])
        s.on_routed(late, p)  # still in flight when the pod goes
        s.on_pod_removed(p.address)
    assert not s.pods and not s.learner.pods and not len(s.routed_prefixes)
    assert not s._pending


def test_learned_cold_ttft_reports_each_answered_pods_learned_cost():
    """What the metric shows: per pod that answered, the learned TTFT of a cold prompt."""
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0)
    fast, slow = pod("a:1"), pod("b:1")
    assert s.learned_cold_ttft(1024) == {}
    rng = random.Random(3)
    for i in range(60):
        n = rng.randint(500, 4000)
        answer(s, fast, n, ttft=50e-6 * n, now=100.0 + 30 * i)
        answer(s, slow, n, ttft=150e-6 * n, now=101.0 + 30 * i)
    learned = s.learned_cold_ttft(1024)
    assert learned["a:1"] == pytest.approx(50e-6 * 1024, rel=0.2)
    assert learned["b:1"] == pytest.approx(150e-6 * 1024, rel=0.2)


def test_cached_tokens_reported_by_the_pod_win_over_the_index_guess():
    """A pod that served 900 of 1000 tokens from cache answered in 10 ms: learned as 100
    tokens of prefill (0.1 ms/token), not as 1000 tokens (0.01 ms/token)."""
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0)
    a = pod("a:1")
    for i in range(40):
        answer(s, a, 1000, ttft=100 * 1e-4, now=100.0 + 30 * i, cached=900)
    c = ctx(1000, now=5000.0)
    s.score(c, [a])
    assert c.components["a:1"]["prefill_s"] == pytest.approx(1000 * 1e-4, rel=0.25)


def test_adapter_loads_and_kv_waits_are_not_learned_as_prefill():
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0)
    cold = pod("a:1", max_loras=2)  # the adapter is not loaded there
    for i in range(20):
        answer(s, cold, 1000, ttft=5.0, now=100.0 + 10 * i, adapter="x")
    assert "a:1" not in s.learner.pods


def test_with_idle_pods_a_request_follows_its_cached_prefix():
    s = scorer()
    pods = [pod("a:1"), pod("b:1", block_size=16), pod("c:1")]
    c = ctx(4000, hits={"b:1": PrefixHit(blocks=200)})  # b holds 3200 tokens
    c.block_sizes = {p.address: 16 for p in pods}
    scores = s.score(c, pods)
    assert scores[1] == 1.0 and max(scores[0], scores[2]) < 1.0
    # No queue anywhere: the ranking is the TTFT alone.
    assert all(comp["congestion_s"] == 0.0 for comp in c.components.values())


def test_pods_priced_alike_go_to_the_one_holding_most_of_the_prompt():
    # A fit whose answers were all fixed cost prices prefill at nothing: every idle pod
    # then costs the same, and the tie goes to the pods holding the prompt, most first.
    s = scorer()
    s.learner.pool.coef = [0.04, 0.0, 0.0, 0.0]
    s.learner.pool._sync()
    pods = [pod("a:1"), pod("b:1"), pod("c:1")]
    c = ctx(4000, hits={"b:1": PrefixHit(blocks=200), "c:1": PrefixHit(blocks=100)})
    c.block_sizes = {p.address: 16 for p in pods}
    costs = s.predict(c, pods).ttft_s
    assert costs[0] == costs[1] == costs[2]  # the price alone cannot tell them apart
    scores = s.score(c, pods)
    assert scores[1] == 1.0 > scores[2] > scores[0]


def test_pods_priced_alike_go_to_the_one_sent_the_least_prefill_lately():
    # Idle pods alike in speed and holding nothing price a new prompt the same: it goes to
    # the pod this picker and the other pickers sent the least prefill in the last second,
    # so that the prefixes new prompts start are spread over the pool.
    s = scorer(runningRequestStepSeconds=0.0)
    pods = [pod("a:1"), pod("b:1"), pod("c:1")]
    for k, sent_to in enumerate((pods[0], pods[0], pods[1])):  # 0.1 s of prefill each
        sent = ctx(1000, now=99.2 + 0.01 * k, prompt=k + 1)
        s.score(sent, [sent_to])
        s.on_routed(sent, sent_to)
    pods[2].inflight.peer_prefill_rate = 0.15  # another picker's share
    c = ctx(1000, now=99.9)
    ttfts = s.predict(c, pods).ttft_s
    assert ttfts[0] == ttfts[1] == ttfts[2]  # answered all done: nothing ahead anywhere
    scores = s.score(c, pods)
    assert scores[1] == 1.0 > scores[2] > scores[0]
    # Once this picker's sends have left the window, only the other picker's share counts.
    later = s.score(ctx(1000, now=100.5), pods)
    assert later[0] == later[1] == 1.0 > later[2]


def test_a_busy_pool_waits_for_a_held_prefix_instead_of_computing_it_again():
    """a holds 1,984 of the prompt's 2,000 tokens behind 2 waiting requests; b is idle and
    would answer a moment sooner by computing all 2,000 again. An idle pool does that
    (nothing waits for b's time); a pool whose prefill work fills 61% of the candidates'
    time follows the prefix: the duplicated work is what later requests would queue on."""

    def chosen(cold_requests_routed: int) -> tuple[str, dict]:
        s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0, meanPromptTokens=1024)
        pods = [pod("a:1", waiting=2), pod("b:1")]
        elsewhere = pod("c:1")  # the recent traffic went to a pod outside this choice
        for k in range(cold_requests_routed):  # 1,024 cold tokens: 0.1024 s of prefill
            sent = ctx(1024, now=99.05 + 0.08 * k, prompt=k + 1)
            s.score(sent, [elsewhere])
            s.on_routed(sent, elsewhere)
        c = ctx(2000, hits={"a:1": PrefixHit(blocks=124)}, now=100.0)
        c.block_sizes = {"a:1": 16, "b:1": 16}
        scores = s.score(c, pods)
        return pods[scores.index(1.0)].address, c.components

    address, comp = chosen(0)
    assert address == "b:1" and comp["b:1"]["utilisation"] == 0.0
    assert comp["b:1"]["ttft_s"] < comp["a:1"]["ttft_s"]
    address, comp = chosen(12)
    # 12 x 0.1024 s of prefill in the last second over 2 candidates.
    assert comp["b:1"]["utilisation"] == pytest.approx(12 * 0.1024 / 2)
    assert comp["b:1"]["duplicated_s"] == pytest.approx(1984 / RATE)
    assert comp["a:1"]["duplicated_s"] == 0.0
    assert address == "a:1"


def test_a_prefix_reused_lately_shares_its_duplication_price_with_its_followers():
    """The busy pool above, with a 4 requests deep: a copy of its 1,984-token prefix on
    idle b is priced at rho / (1 - rho) x its prefill, so the request waits on a. When
    other requests reused that prefix in the last second (on c, outside this choice), a
    copy on b would serve the followers to come as well: the price is shared with those
    that would find b free (1 - rho of them) and b computes it. Not when b's prefix cache
    is full, where the copy would push out prefixes that are reused too."""

    def chosen(followers: int, b_held_blocks: int = 0, share: bool = True) -> tuple[str, dict]:
        # A slow running mean keeps the followers' small uncached parts from shrinking
        # the mean request, which prices a's queue.
        s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0, learningRate=0.001,
                   meanPromptTokens=1024, shareDuplicationPrice=share)  # fmt: skip
        a, b = pod("a:1", waiting=4, num_gpu_blocks=1000), pod("b:1", num_gpu_blocks=1000)
        elsewhere = pod("c:1")
        for k in range(12):  # 1,024 cold tokens: 0.1024 s of prefill each
            sent = ctx(1024, now=99.05 + 0.08 * k, prompt=k + 1)
            s.score(sent, [elsewhere])
            s.on_routed(sent, elsewhere)
        for k in range(followers):  # the same prompt, held on c
            follower = ctx(2000, hits={"c:1": PrefixHit(blocks=124)}, now=99.5 + 0.01 * k)
            follower.block_sizes = {"c:1": 16}
            s.score(follower, [elsewhere])
            s.on_routed(follower, elsewhere)
        c = ctx(2000, hits={"a:1": PrefixHit(blocks=124)}, now=100.0)
        c.held_blocks = {"a:1": 500, "b:1": b_held_blocks}
        scores = s.score(c, [a, b])
        return ("a:1", "b:1")[scores.index(1.0)], c.components

    address, comp = chosen(0)
    assert address == "a:1"
    assert comp["b:1"]["duplicated_s"] == pytest.approx(1984 / RATE)
    address, comp = chosen(4)
    b = comp["b:1"]
    delayed = max(b["utilisation"] / (1 - b["utilisation"]), b["queue_ratio"])
    # Of the 4 followers, those that would find b free: the pool's idle share, 1 - rho.
    assert b["duplicated_s"] == pytest.approx(1984 / RATE / (1 + 4 / (1 + delayed)))
    assert address == "b:1"
    address, comp = chosen(4, b_held_blocks=1000)
    assert comp["b:1"]["duplicated_s"] == pytest.approx(1984 / RATE)
    assert address == "a:1"
    # Turned off, the copy is charged whole as before.
    address, comp = chosen(4, share=False)
    assert comp["b:1"]["duplicated_s"] == pytest.approx(1984 / RATE)
    assert address == "a:1"


def test_a_pool_backed_up_on_most_pods_waits_for_a_held_prefix():
    """a holds 1,984 of the prompt's 2,000 tokens behind 6 waiting requests; b is idle and
    answers sooner by computing all 2,000 again. Nothing was routed lately, so the routed
    prefill says the pool is idle; but c and d have 4 requests waiting each, so the median
    pod has 4 mean requests of work ahead, and a copy made on b is waited for as by them
    (rho / (1 - rho) = 4 at the queue's estimate). With c and d idle, only a's prefix is
    hot and the pool has room: b computes it."""

    def chosen(others_waiting: int) -> tuple[str, dict]:
        s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0, meanPromptTokens=1024)
        pods = [pod("a:1", waiting=6), pod("b:1"), pod("c:1", waiting=others_waiting),
                pod("d:1", waiting=others_waiting)]  # fmt: skip
        c = ctx(2000, hits={"a:1": PrefixHit(blocks=124)}, now=100.0)
        c.block_sizes = {p.address: 16 for p in pods}
        scores = s.score(c, pods)
        return pods[scores.index(1.0)].address, c.components

    address, comp = chosen(0)
    assert address == "b:1" and comp["b:1"]["queue_ratio"] == 0.0
    address, comp = chosen(4)
    assert comp["b:1"]["utilisation"] == 0.0
    assert comp["b:1"]["queue_ratio"] == pytest.approx(4.0)
    assert comp["b:1"]["ttft_s"] < comp["a:1"]["ttft_s"]
    assert address == "a:1"


def test_prefill_other_pickers_routed_counts_toward_the_pools_utilisation():
    """The same choice as above when this picker routed nothing itself and its peers
    (shared pool state) routed 1.23 s of prefill per second to the two candidates: each
    picker decides only its share of the pool's requests, so its own count alone would
    leave a saturated pool looking idle."""
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0, meanPromptTokens=1024)
    pods = [pod("a:1", waiting=2), pod("b:1")]
    c = ctx(2000, hits={"a:1": PrefixHit(blocks=124)}, now=100.0)
    c.block_sizes = {"a:1": 16, "b:1": 16}
    assert s.score(c, pods)[1] == 1.0  # no peer load: b computes the prefix again
    pods[0].inflight.peer_prefill_rate = 0.8
    pods[1].inflight.peer_prefill_rate = 0.43
    c = ctx(2000, hits={"a:1": PrefixHit(blocks=124)}, now=100.0)
    c.block_sizes = {"a:1": 16, "b:1": 16}
    scores = s.score(c, pods)
    assert c.components["b:1"]["utilisation"] == pytest.approx(1.23 / 2)
    assert scores[0] == 1.0


def test_with_the_cached_pod_overloaded_a_request_goes_elsewhere():
    s = scorer(meanPromptTokens=4000)
    pods = [pod("a:1"), pod("b:1", waiting=30, running=20), pod("c:1")]
    c = ctx(4000, hits={"b:1": PrefixHit(blocks=200)})
    c.block_sizes = {p.address: 16 for p in pods}
    scores = s.score(c, pods)
    assert scores[1] < 1.0 and max(scores[0], scores[2]) == 1.0


def test_a_cache_miss_on_a_busy_pod_costs_the_requests_behind_it():
    """Both candidates are busy; a holds most of the prompt. By its own TTFT the request
    would go to the shorter queue (b), but there its 1008 tokens of prefill delay the
    8 requests that queue behind it, where a adds only 96 tokens ahead of 10."""

    def rank(weight: float) -> tuple[str, dict]:
        s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0, meanPromptTokens=1000,
                   congestionWeight=weight)  # fmt: skip
        pods = [pod("a:1", waiting=10), pod("b:1", waiting=8)]
        c = ctx(1008, hits={"a:1": PrefixHit(blocks=57)})  # a holds 912 tokens: 96 to go
        scores = s.score(c, pods)
        return pods[scores.index(1.0)].address, c.components

    chosen, comp = rank(0.0)
    assert chosen == "b:1" and comp["b:1"]["ttft_s"] < comp["a:1"]["ttft_s"]
    chosen, comp = rank(1.0)
    # b would also compute again the 912 tokens a holds, priced at the median pod's queue:
    # 8 requests of the mean size ahead, so 8 mean services delayed per second of it.
    assert comp["b:1"]["queue_ratio"] == pytest.approx(8.0)
    assert comp["b:1"]["congestion_s"] == pytest.approx(8 * 1008 / RATE + 8 * 912 / RATE)
    assert comp["a:1"]["congestion_s"] == pytest.approx(10 * 96 / RATE)
    assert chosen == "a:1"


def test_kv_wait_grows_with_the_deficit_and_shrinks_with_more_requests_finishing():
    s = scorer(overheadSeconds=0.0, meanPromptTokens=900, meanOutputTokens=100,
               decodeSecondsPerToken=0.01)  # fmt: skip
    pods = [
        pod("small:1", kv=0.99, num_gpu_blocks=1000, running=10),  # 160 tokens free
        pod("many:1", kv=0.99, num_gpu_blocks=1000, running=40),
        pod("roomy:1", kv=0.5, num_gpu_blocks=1000, running=10),
    ]
    c = ctx(4160)  # 4000 tokens short of space: four mean requests (900 + 100) must end
    c.block_sizes = {p.address: 16 for p in pods}
    s.score(c, pods)
    comp = c.components
    assert comp["small:1"]["kv_s"] == pytest.approx(4 * 100 * 0.01 / 10)
    assert comp["many:1"]["kv_s"] == pytest.approx(4 * 100 * 0.01 / 40)
    assert comp["roomy:1"]["kv_s"] == 0.0


def _faster_a_and_reuse(reused_share: float) -> PredictedTTFTScorer:
    """A scorer that learned pod a answers cold prompts 10% faster than pod b, from answers
    that found `reused_share` of their prompt cached."""
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0)
    fast, slow = pod("a:1"), pod("b:1")
    rng = random.Random(5)
    for i in range(60):
        n = rng.randint(500, 4000)
        cached = int(reused_share * n)
        answer(s, fast, n, ttft=90e-6 * (n - cached), now=100.0 + 30 * i, cached=cached)
        answer(s, slow, n, ttft=100e-6 * (n - cached), now=101.0 + 30 * i, cached=cached)
    return s


def test_a_new_prefix_goes_where_it_evicts_nothing_when_cached_prefixes_are_reused():
    # Pod a is a little faster but its prefix cache is full: a new 1,000-token prompt
    # there pushes out 62 held blocks, which later requests would compute again. Pod b has
    # room. Without the price, every new prefix went to the faster pod until its cache
    # held more prefixes than fit.
    s = _faster_a_and_reuse(0.7)
    pods = [pod("a:1", num_gpu_blocks=256), pod("b:1", num_gpu_blocks=256)]
    c = ctx(1000, now=5000.0)
    c.held_blocks = {"a:1": 256, "b:1": 40}
    scores = s.score(c, pods)
    a, b = c.components["a:1"], c.components["b:1"]
    assert a["ttft_s"] < b["ttft_s"]  # a still answers this request first
    assert a["displaced_s"] > 0 and b["displaced_s"] == 0.0
    assert scores[1] == 1.0 > scores[0]


def test_a_new_prefix_goes_to_the_faster_pod_when_nothing_cached_is_reused_or_both_are_full():
    pods = [pod("a:1", num_gpu_blocks=256), pod("b:1", num_gpu_blocks=256)]
    unshared = _faster_a_and_reuse(0.0)  # answers never find anything cached
    c = ctx(1000, now=5000.0)
    c.held_blocks = {"a:1": 256, "b:1": 40}
    assert unshared.score(c, pods)[0] == 1.0
    assert c.components["a:1"]["displaced_s"] == 0.0
    shared = _faster_a_and_reuse(0.7)
    c = ctx(1000, now=5000.0)
    c.held_blocks = {"a:1": 256, "b:1": 256}  # both full: either placement evicts as much
    assert shared.score(c, pods)[0] == 1.0
    assert c.components["a:1"]["displaced_s"] == pytest.approx(c.components["b:1"]["displaced_s"])


def test_the_queue_follows_a_pods_kv_events_once_they_have_confirmed_a_prefill():
    """An 8,000-token prompt sent to pod a at t=100 (0.8 s of predicted prefill), and a
    scrape at t=109 that saw nothing waiting: it was admitted, and by its prediction its
    prefill is over at t=110. Once the pod's events show half of its blocks stored and no
    more, it is half ahead of the next request; once they show all, nothing is."""
    progress = PrefillProgress()
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0)
    a = pod("a:1")
    routed = ctx(8000, now=100.0)
    routed.prefill_progress = progress
    routed.prompt_keys = {"a:1": list(range(500))}
    s.score(routed, [a])
    s.on_routed(routed, a)
    a.metrics.scraped_at = 109.0

    def wait_at(now: float) -> float:
        c = ctx(100, now=now)
        c.prefill_progress = progress
        s.score(c, [a])
        return c.components["a:1"]["wait_s"]

    assert wait_at(110.0) == pytest.approx(0.0)  # no event yet: the predicted drain
    progress.stored("a:1", range(250))
    assert progress.confirmed("a:1")
    assert wait_at(110.0) == pytest.approx(4000 / RATE)
    progress.stored("a:1", range(250, 500))
    assert wait_at(110.0) == pytest.approx(0.0)
    # Its answer ends the watch.
    s.on_outcome(routed, Outcome(address="a:1", ok=True, ttft_s=9.5, now=110.0))
    assert progress.computed(routed.request.request_id) is None


def test_a_prompt_nothing_holds_goes_where_it_stalls_the_fewest_decodes():
    """Idle queues, alike in speed: without the stall term a new prompt costs the same
    everywhere but for the running requests' share of its prefill steps, which a fit can
    learn as nothing. Its prefill stalls the decodes of every request running on the pod
    it goes to, so it goes to the pod decoding fewest, priced at `decodeStallWeight`."""

    def choose(stall_weight: float) -> tuple[str, dict]:
        s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0,
                   decodeStallWeight=stall_weight)  # fmt: skip
        pods = [pod("a:1", running=30), pod("b:1", running=12), pod("c:1", running=20)]
        c = ctx(2000)
        scores = s.score(c, pods)
        return pods[scores.index(1.0)].address, c.components

    address, comp = choose(0.0)
    assert comp["a:1"]["ttft_s"] == comp["b:1"]["ttft_s"] == comp["c:1"]["ttft_s"]
    assert all(row["decode_stall_s"] == 0.0 for row in comp.values())
    address, comp = choose(0.1)
    assert address == "b:1"
    assert comp["b:1"]["decode_stall_s"] == pytest.approx(0.1 * 12 * 2000 / RATE)
    assert comp["a:1"]["decode_stall_s"] == pytest.approx(0.1 * 30 * 2000 / RATE)
    assert comp["a:1"]["congestion_s"] == 0.0  # nothing queued: the stall is its own term


def test_a_cached_prefix_still_wins_over_a_pod_decoding_fewer_requests():
    """The stall scales with the prefill a placement computes: on the pod holding 1,984
    of 2,000 tokens, 16 tokens stall its 30 decodes less than 2,000 stall b's 10."""
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0)
    pods = [pod("a:1", running=30), pod("b:1", running=10)]
    c = ctx(2000, hits={"a:1": PrefixHit(blocks=124)})
    scores = s.score(c, pods)
    assert scores[0] == 1.0 > scores[1]
    comp = c.components
    assert comp["a:1"]["decode_stall_s"] < comp["b:1"]["decode_stall_s"]


def test_answers_teach_the_decode_slope_with_prefill_chunks_divided_out():
    """Requests sent at batch sizes 4..28, each answered with the time per output token a
    batch of that size takes (8 ms + 0.3 ms per running request): the scorer learns the
    0.3 ms. Its own routed prefill (half of the pod's second at most) is the prefill share
    it divides out, so the time it is given is stretched by that share first."""
    s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0)
    for i in range(200):
        running = 4 + (i * 7) % 25
        now = 100.0 + 10.0 * i  # far apart: no routed prefill left in the window
        c = ctx(100, now=now)
        a = pod("a:1", running=running)
        s.score(c, [a])
        s.on_routed(c, a)
        share = s._prefill_share(s.pods["a:1"], now)
        tpot = (0.008 + 0.0003 * running) / (1.0 - share)
        usage = Usage(prompt_tokens=100, completion_tokens=65)
        ended = now + 0.01 + tpot * 64
        s.on_outcome(c, Outcome(address="a:1", ok=True, ttft_s=0.01, now=ended, usage=usage))
    assert s.decode_slope.slope == pytest.approx(0.0003, rel=0.05)


def test_decode_crowding_moves_a_follower_off_a_crowded_pod_only_when_priced():
    """A prompt whose first 1,984 tokens pod a holds; a decodes 60 requests, b 2. With the
    learned slope (0.3 ms per running request per token, 256-token answers) priced at 0.1,
    60 requests crowded by another 256 tokens outweigh b's 1,984 tokens of prefill; at 0
    the cached prefix wins."""

    def choose(weight: float) -> tuple[str, dict]:
        s = scorer(overheadSeconds=0.0, runningRequestStepSeconds=0.0,
                   decodeCrowdingWeight=weight, meanOutputTokens=256)  # fmt: skip
        for running in range(0, 40):
            s.decode_slope.observe(0.008 + 0.0003 * running, float(running))
        pods = [pod("a:1", running=60), pod("b:1", running=2)]
        c = ctx(2000, hits={"a:1": PrefixHit(blocks=124)})
        scores = s.score(c, pods)
        return pods[scores.index(1.0)].address, c.components

    address, comp = choose(0.0)
    assert address == "a:1"
    assert comp["a:1"]["decode_stall_s"] == pytest.approx(0.1 * 60 * 16 / RATE)
    assert comp["a:1"]["decode_crowding_s"] == 0.0
    address, comp = choose(0.1)
    assert address == "b:1"
    crowding = 0.1 * 0.0003 * 256
    assert comp["a:1"]["decode_stall_s"] == pytest.approx(0.1 * 60 * 16 / RATE)
    assert comp["a:1"]["decode_crowding_s"] == pytest.approx(crowding * 60)
    assert comp["b:1"]["decode_crowding_s"] == pytest.approx(crowding * 2)


def _peer_pair():
    """Two pickers' instances of the scorer with `sharedQueue` on, the second fed the
    first's records as the shared pool state does."""
    routing = scorer(overheadSeconds=0.0, sharedQueue=True)
    peer = scorer(overheadSeconds=0.0, sharedQueue=True)
    peer.take_learned(0.0)
    return routing, peer


def test_by_default_requests_are_neither_handed_on_nor_taken_from_peers():
    routing, peer = scorer(overheadSeconds=0.0), scorer(overheadSeconds=0.0)
    first = ctx(4000, now=100.0)
    routing.score(first, [pod("b:1")])
    routing.on_routed(first, pod("b:1"))
    assert routing.take_learned(100.0) == []
    record = LearnedSample("ttft", "b:1", (REQUEST_ROUTED, 4000.0, 8e6, 0.4, 0.4, 0.0), "r")
    peer.learn_from_peers([record], now=100.0)
    assert not peer.pods and peer.rejected_samples == 0


def test_a_peers_routed_request_waits_ahead_on_this_pickers_queue_model_until_answered():
    routing, peer = _peer_pair()
    a, b = pod("a:1"), pod("b:1")
    first = ctx(4000, now=100.0)
    routing.score(first, [a, b])
    routing.on_routed(first, b)
    peer.learn_from_peers(routing.take_learned(100.01), now=100.01)
    # The peer prices b's queue with the 4000-token prompt ahead, as the router does:
    # taken to drain over its predicted prefill from when it was routed (handed on with
    # its age), not from when the peer heard of it.
    c = ctx(1000, now=100.03, prompt=1)
    peer.score(c, [a, b])
    assert c.components["b:1"]["queued"] == 1.0
    assert c.components["b:1"]["wait_s"] == pytest.approx(4000 / RATE - 0.03, rel=0.01)
    assert c.components["a:1"]["wait_s"] == 0.0
    # Its answer takes it off the peer's model too.
    routing.on_outcome(first, Outcome("b:1", True, 200, None, None, now=100.5))
    peer.learn_from_peers(routing.take_learned(100.51), now=100.52)
    after = ctx(1000, now=100.53, prompt=1)
    peer.score(after, [a, b])
    assert after.components["b:1"]["queued"] == 0.0
    assert peer.rejected_samples == 0


def test_a_peers_request_whose_answer_never_comes_leaves_after_its_predicted_ttft():
    routing, peer = _peer_pair()
    b = pod("b:1")
    first = ctx(4000, now=100.0)
    routing.score(first, [b])
    predicted = first.components["b:1"]["ttft_s"]
    routing.on_routed(first, b)
    peer.learn_from_peers(routing.take_learned(100.0), now=100.0)
    assert peer.pods["b:1"].queue.items and peer.pods["b:1"].peer_requests == 1
    peer.learn_from_peers([], now=100.0 + predicted + PEER_REQUEST_GRACE_S - 0.1)
    assert peer.pods["b:1"].peer_requests == 1
    peer.learn_from_peers([], now=100.0 + predicted + PEER_REQUEST_GRACE_S + 0.1)
    assert not peer.pods["b:1"].queue.items and peer.pods["b:1"].peer_requests == 0
    # Each leaves at its own time, whatever order they were heard in.
    slow = LearnedSample("ttft", "b:1", (REQUEST_ROUTED, 1.0, 1.0, 0.1, 50.0, 0.0), "slow")
    fast = LearnedSample("ttft", "b:1", (REQUEST_ROUTED, 1.0, 1.0, 0.1, 1.0, 0.0), "fast")
    peer.learn_from_peers([slow, fast], now=200.0)
    peer.learn_from_peers([], now=200.0 + 1.0 + PEER_REQUEST_GRACE_S + 0.1)
    assert list(peer.pods["b:1"].queue.items) == ["slow"]


def test_a_peers_record_read_again_keeps_its_place_in_the_admission_order():
    """A peer's long prompt, then two short ones, all admitted by the scrape at t=100:
    the short ones' prefills end after the long one's. The middle record delivered a
    second time must not be taken for done, hiding the long prefill before it."""
    _, peer = _peer_pair()
    b = pod("b:1")
    b.metrics.scraped_at = 100.0
    records = [("long", 8000.0, 0.8, 0.7), ("mid", 100.0, 0.01, 0.6), ("last", 100.0, 0.01, 0.5)]
    routed = {
        name: LearnedSample("ttft", "b:1", (REQUEST_ROUTED, tokens, 0.0, prefill, 0.9, age), name)
        for name, tokens, prefill, age in records
    }
    peer.learn_from_peers(list(routed.values()), now=99.95)

    def wait_at(now: float) -> float:
        c = ctx(100, now=now, prompt=1)
        peer.score(c, [b])
        return c.components["b:1"]["wait_s"]

    before = wait_at(100.4)
    assert before > 0.3  # the long prefill, admitted at 100.0, runs until 100.8
    peer.learn_from_peers([routed["mid"]], now=100.4)
    assert wait_at(100.4) == pytest.approx(before)
    assert peer.pods["b:1"].peer_requests == 3


def test_malformed_request_records_are_counted_and_change_nothing():
    _, peer = _peer_pair()
    bad = [
        LearnedSample("ttft", "b:1", (REQUEST_ROUTED, 1.0, 1.0), "r1"),  # too short
        LearnedSample("ttft", "b:1", (REQUEST_ROUTED, -1.0, 1.0, 1.0, 1.0, 0.0), "r2"),
        LearnedSample("ttft", "b:1", (7.0,), "r3"),  # no such kind
        LearnedSample("ttft", "b:1", (REQUEST_ANSWERED, float("nan")), "r4"),
    ]
    peer.learn_from_peers(bad, now=100.0)
    assert peer.rejected_samples == 4
    assert all(not m.queue.items for m in peer.pods.values())
    # An answer for a request never heard of is not an error: it was routed before this
    # picker joined, or its record was dropped.
    peer.learn_from_peers([LearnedSample("ttft", "b:1", (REQUEST_ANSWERED,), "r5")], now=100.0)
    assert peer.rejected_samples == 4

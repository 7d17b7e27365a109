"""The online TTFT learner: it recovers known cost coefficients, stays bounded, follows a
pod that slows down, and reads the queue ahead from the pod's scraped waiting count."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from smart_epp.kv_index.progress import PrefillProgress
from smart_epp.scorers.ttft_model import (
    Inflight,
    PodQueue,
    Prior,
    Snapshot,
    TTFTLearner,
    attention_pairs,
)

# A pod whose true cost is 10 ms + 40 us per token + 1.05 ns per attention pair + 0.3 ms per
# running request (an H100-like prefill with Llama-3-8B's attention cost).
TRUE = (0.010, 40e-6, 1.05e-9, 0.0003)


def true_ttft(tokens: float, pairs: float, running: float, coef=TRUE) -> float:
    return coef[0] + coef[1] * tokens + coef[2] * pairs + coef[3] * running


def synthetic(rng: random.Random, coef=TRUE, noise: float = 0.03):
    """One observation: prompt, cached, what was ahead, and the TTFT it took."""
    prompt = rng.randint(100, 60_000)
    cached = rng.randint(0, prompt - 1) if rng.random() < 0.5 else 0
    tokens_ahead = rng.choice([0, 0, rng.randint(0, 50_000)])
    pairs_ahead = tokens_ahead * rng.randint(0, 20_000)
    running = rng.randint(0, 40)
    own = prompt - cached
    ttft = true_ttft(
        tokens_ahead + own, pairs_ahead + attention_pairs(own, cached), running, coef
    ) * (1 + rng.gauss(0, noise))
    return ttft, prompt, cached, Snapshot(tokens_ahead, pairs_ahead, running)


def learner() -> TTFTLearner:
    # The scorer's default priors: 10k tokens/s, attention unknown (0).
    return TTFTLearner(Prior.from_rates(0.005, 10_000, 0.0, 0.0005), forgetting=0.97)


def test_attention_pairs_count_causal_query_key_pairs():
    # 4 new tokens after 2 cached: token k (0-based) attends to 2 + k + 1 keys.
    assert attention_pairs(4, 2) == sum(2 + k + 1 for k in range(4)) - 4 / 2
    assert attention_pairs(1000, 0) == 500_000


def test_recovers_linear_and_quadratic_coefficients():
    rng = random.Random(0)
    model = learner()
    for _ in range(300):
        model.observe("a:1", *synthetic(rng))
    _, per_ktoken, per_mpair, _ = model.coefficients("a:1")
    assert per_ktoken == pytest.approx(TRUE[1] * 1e3, rel=0.1)
    assert per_mpair == pytest.approx(TRUE[2] * 1e6, rel=0.1)
    # And it predicts a long cold prompt (mostly attention) and a short one well.
    for prompt in (2_000, 100_000):
        expected = true_ttft(prompt, attention_pairs(prompt, 0), 4)
        predicted = model.predict("a:1", prompt, attention_pairs(prompt, 0), 4)
        assert predicted == pytest.approx(expected, rel=0.1)


def test_state_stays_bounded_and_non_negative():
    model = learner()
    # The same sample forever: no information on three of four directions, which plain
    # RLS with forgetting would let the covariance blow up along.
    for _ in range(5_000):
        model.observe("a:1", 0.05, 1000, 0, Snapshot(0.0, 0.0, 0.0))
    m = model.pool
    limit = np.maximum(m.cov_limit, np.square(m.coef))
    assert np.all(np.diag(m.cov) <= limit * (1 + 1e-9))
    assert np.all(np.isfinite(m.cov)) and np.all(np.array(m.coef) >= 0)
    assert model.predict("a:1", 1000, attention_pairs(1000, 0), 0) == pytest.approx(0.05, rel=0.01)
    # Nonsense observations (a negative TTFT would ask for negative costs) are clipped.
    for _ in range(100):
        model.observe("a:1", 1e-6, 50_000, 0, Snapshot(0.0, 0.0, 30.0))
    assert np.all(np.array(model.pool.coef) >= 0)
    assert 0 < model.scale("a:1") < float("inf")
    # Bounded number of pods: the oldest model goes.
    small = TTFTLearner(model.prior, max_pods=3)
    for i in range(10):
        small.observe(f"p{i}:1", 0.05, 1000, 0, Snapshot(0.0, 0.0, 0.0))
    assert list(small.pods) == ["p7:1", "p8:1", "p9:1"]


def test_a_pod_that_slows_down_is_noticed_within_fifteen_requests():
    rng = random.Random(1)
    model = learner()
    for _ in range(200):
        model.observe("a:1", *synthetic(rng))
    slow = tuple(c * 2 for c in TRUE)  # e.g. thermal throttling or a noisy neighbour
    probe = (8_000, attention_pairs(8_000, 0), 4)
    noticed_after = None
    for n in range(1, 16):
        model.observe("a:1", *synthetic(rng, slow))
        if model.predict("a:1", *probe) >= 0.85 * true_ttft(*probe, slow):
            noticed_after = n
            break
    assert noticed_after is not None, "still predicting the old speed after 15 requests"


def test_one_outlier_does_not_flip_the_fit():
    rng = random.Random(2)
    model = learner()
    for _ in range(100):
        model.observe("a:1", *synthetic(rng))
    probe = (8_000, attention_pairs(8_000, 0), 4)
    before = model.predict("a:1", *probe)
    model.observe("a:1", 60.0, 8_000, 0, Snapshot(0.0, 0.0, 4.0))  # a paused request
    assert model.predict("a:1", *probe) == pytest.approx(before, rel=0.25)


def test_a_new_pod_starts_from_what_its_peers_showed():
    rng = random.Random(3)
    model = learner()
    for _ in range(200):
        model.observe("a:1", *synthetic(rng))
    # Never answered: the pool-wide model predicts for it, not the configured prior.
    probe = (8_000, attention_pairs(8_000, 0), 4)
    assert model.predict("new:1", *probe) == pytest.approx(true_ttft(*probe), rel=0.15)


def test_a_pod_serving_only_cache_hits_still_prices_a_miss_from_the_pool():
    # "hits:1" answers only requests whose uncached part is 1,200 tokens behind an empty
    # queue: on its own it cannot tell a fixed cost from a per-token one. Its peers answer
    # cold prompts of every length; the shape they show prices a 7,200-token miss on it.
    rng = random.Random(4)
    model = learner()
    for _ in range(300):
        model.observe("cold:1", *synthetic(rng))
        model.observe("hits:1", true_ttft(1200, attention_pairs(1200, 6000), 2), 7200, 6000,
                      Snapshot(0.0, 0.0, 2.0))  # fmt: skip
    miss = (7200, attention_pairs(7200, 0), 2)
    assert model.predict("hits:1", *miss) == pytest.approx(true_ttft(*miss), rel=0.15)


def test_a_slower_pod_gets_its_own_factor_and_leaves_the_shape_alone():
    rng = random.Random(5)
    model = learner()
    slow = tuple(1.5 * c for c in TRUE)
    for _ in range(400):
        model.observe("fast:1", *synthetic(rng))
        model.observe("slow:1", *synthetic(rng, slow))
    probe = (8_000, attention_pairs(8_000, 0), 4)
    assert model.scale("slow:1") / model.scale("fast:1") == pytest.approx(1.5, rel=0.1)
    assert model.predict("fast:1", *probe) == pytest.approx(true_ttft(*probe), rel=0.15)
    assert model.predict("slow:1", *probe) == pytest.approx(true_ttft(*probe, slow), rel=0.15)


def test_identical_pods_with_noisy_answers_are_priced_alike_and_a_slower_one_is_not():
    """Four identical pods whose answers vary by 25% (queueing behind others' requests):
    their raw factors drift apart by chance, and ranking by them would send every new
    prefix to whichever looked fastest lately. Priced within their noise, they are far
    closer; a fifth pod 1.5x slower keeps its own price. Over ten seeds, since a chance
    drift is what is measured."""
    raw_spreads, priced_spreads = [], []
    for seed in range(10):
        rng = random.Random(seed)
        model = learner()
        identical = [f"same-{i}:1" for i in range(4)]
        slow = tuple(1.5 * c for c in TRUE)
        for _ in range(300):
            for address in identical:
                model.observe(address, *synthetic(rng, noise=0.25))
            model.observe("slow:1", *synthetic(rng, slow, noise=0.25))
        raw = [model.pods[a].scale for a in identical]
        priced = [model.scale(a) for a in identical]
        raw_spreads.append(max(raw) / min(raw) - 1)
        priced_spreads.append(max(priced) / min(priced) - 1)
        assert 1.25 < model.scale("slow:1") / max(priced) < 1.65
    assert statistics.median(raw_spreads) > 0.05  # the raw factors did drift apart
    assert statistics.median(priced_spreads) < statistics.median(raw_spreads) / 3


def test_a_few_token_first_answer_teaches_the_fixed_cost_not_the_pods_speed():
    """A pod's first answer is a 2-token probe that took 40 ms (connection set-up, not
    prefill): it says nothing about how fast that pod prefills. Identical pods then answer
    cold 1,600-token prompts; the probed pod must be priced like them for the next one."""
    model = learner()
    model.observe("probed:1", 0.040, 2, 0, Snapshot(0.0, 0.0, 0.0))
    cold = (1600, attention_pairs(1600, 0), 0)
    for address in ("b:1", "c:1", "d:1"):
        model.observe(address, 0.300, 1600, 0, Snapshot(0.0, 0.0, 0.0))
    others = [model.predict(a, *cold) for a in ("b:1", "c:1", "d:1")]
    assert model.predict("probed:1", *cold) == pytest.approx(min(others), rel=0.25)
    # It is not taken for a slower pod than the ones that answered real prompts.
    assert model.scale("probed:1") < 1.1 * min(model.scale(a) for a in ("b:1", "c:1", "d:1"))


def item(tokens: float, routed_at: float, prefill_s: float = 1.0) -> Inflight:
    return Inflight(tokens, attention_pairs(tokens, 0), routed_at, prefill_s, routed_at + 10)


def test_queue_ahead_follows_the_scraped_waiting_count():
    q = PodQueue()
    sent = ((1000, 0.0, 2.5), (2000, 1.0, 1.0), (3000, 2.0, 1.0), (4000, 2.55, 1.0))
    for i, (tokens, routed_at, prefill_s) in enumerate(sent):
        q.items[f"r{i}"] = item(tokens, routed_at=routed_at, prefill_s=prefill_s)
    # A scrape at 0.5 saw r0 admitted: its 2.5 s prefill is taken to run from then, to 3.0.
    q.ahead(now=0.6, waiting=0, scraped_at=0.5)
    # Scraped at 2.5 with one request waiting: of the three sent before, the newest
    # (3000) waits; 4000 was sent after the scrape; 2000 was admitted behind r0, so its
    # 1 s prefill runs from 3.0, all of it still ahead at 2.6; 1000 has 0.4 s of 2.5 left.
    tokens, pairs, count, others = q.ahead(now=2.6, waiting=1, scraped_at=2.5)
    assert tokens == pytest.approx(3000 + 4000 + 2000 + 0.16 * 1000)
    assert pairs == pytest.approx(
        attention_pairs(3000, 0)
        + attention_pairs(4000, 0)
        + attention_pairs(2000, 0)
        + 0.16 * attention_pairs(1000, 0)
    )
    assert (count, others) == (2, 0)
    # More waiting than this gateway sent: the rest came from elsewhere.
    assert q.ahead(now=2.6, waiting=5, scraped_at=2.5)[2:] == (4, 2)
    # r1's first token at 3.3, not 4.0: the prefill ahead of it ended 0.7 s sooner. r2,
    # admitted by the scrape at 3.2, starts at 3.3 and has 0.9 s left at 3.4 (at 5.0, and
    # all of it left, without the answer); r3 follows it.
    q.remove("r1", answered_at=3.3)
    tokens, _, count, _ = q.ahead(now=3.4, waiting=0, scraped_at=3.2)
    assert count == 0 and tokens == pytest.approx(0.9 * 3000 + 4000)
    # Without a scrape each request drains over its predicted prefill before its
    # predicted first token (routed_at + 10).
    tokens, _, count, _ = q.ahead(now=11.5, waiting=None, scraped_at=0.0)
    assert count == 2 and tokens == pytest.approx(0.5 * 3000 + 1.0 * 4000)


def test_a_short_request_admitted_behind_a_long_one_waits_for_its_prefill():
    # Two requests sent to an idle pod, a cold 8,000-token prompt then a 500-token cache
    # hit, both admitted by the next scrape: the pod prefills them in order, so the long
    # prefill is ahead of a new request until it ends, and the short one after it.
    for peer in (False, True):
        q = PodQueue()
        q.items["long"] = Inflight(8000.0, attention_pairs(8000, 0), 0.0, 0.97, 1.0, peer=peer)
        q.items["short"] = Inflight(500.0, attention_pairs(500, 0), 0.24, 0.06, 1.25, peer=peer)
        # Both taken to start at the scrape (0.25): the long one ends at 1.22, the short
        # one at 1.28.
        tokens, _, count, others = q.ahead(now=0.32, waiting=0, scraped_at=0.25)
        assert tokens == pytest.approx(8000 * 0.9 / 0.97 + 500)
        assert (count, others) == (0, 0)
        assert q.ahead(now=1.25, waiting=0, scraped_at=0.9)[0] == pytest.approx(500 * 0.5)
        assert q.ahead(now=1.3, waiting=0, scraped_at=0.9)[0] == 0.0


def test_queue_ahead_follows_the_prefill_the_pods_events_show():
    progress = PrefillProgress()
    pod = "10.0.0.1:8000"
    q = PodQueue()
    for i, tokens in enumerate((1600, 3200, 4800, 6400)):
        q.items[f"r{i}"] = item(tokens, routed_at=float(i), prefill_s=1.0)
        progress.watch(f"r{i}", pod, [1000 * i + b for b in range(tokens // 16)], 16)
    progress.watch("tiny", pod, [], 16)  # nothing uncached to store
    q.items["tiny"] = item(10, routed_at=29.5, prefill_s=1.0)  # sent after the scrape
    progress.stored(pod, range(0, 100))  # r0 computed
    progress.stored(pod, range(2000, 2150))  # r2: half of its 300 blocks
    # At 30 s the predicted first tokens of r0-r3 are long past (routed_at + 10), so the
    # predicted queue holds only the tiny request; the events say r2 has half of its
    # prefill left, and r1, sent before r2, was admitted before it.
    assert q.ahead(30.0, waiting=None, scraped_at=0.0)[2] == 1
    # The scrape at 29 s saw one waiting: r3, the newest sent before it, which shows
    # nothing; the tiny request was sent after the scrape and is waiting too.
    tokens, pairs, count, others = q.ahead(30.0, waiting=1, scraped_at=29.0, progress=progress)
    assert tokens == pytest.approx(10 + 6400 + 0.5 * 4800)
    assert pairs == pytest.approx(
        attention_pairs(10, 0) + attention_pairs(6400, 0) + 0.5 * attention_pairs(4800, 0)
    )
    assert (count, others) == (2, 0)  # queued: r3 and the tiny one; r2 is computing
    # Had the scrape seen none waiting, r3 was admitted then with nothing stored yet: it
    # drains over its predicted prefill from the scrape (half of it left at 29.5 s).
    tokens, _, _, others = q.ahead(29.5, waiting=0, scraped_at=29.0, progress=progress)
    assert tokens == pytest.approx(10 + 0.5 * 6400 + 0.5 * 4800) and others == 0
    # More waiting than this gateway's requests explain: the rest came from elsewhere.
    # r3 and the requests that have started since (r2, r0) may have been among the four.
    assert q.ahead(30.0, waiting=4, scraped_at=29.0, progress=progress)[3] == 1


def test_events_that_arrive_late_are_aged_by_their_lag():
    # The pod's events arrive 1 s after it stores the blocks: at 11.5 s they show it as
    # at 10.5 s, half-way through r0, with r1 and r2 not begun. It has prefilled since:
    # the rest of r0 (0.25 s) and r1 (0.5 s) by 11.25 s, then r2 from its sending at
    # 11.4 s, 0.1 of its 0.5 s done.
    progress = PrefillProgress()
    pod = "10.0.0.1:8000"
    q = PodQueue()
    for i, routed_at in enumerate((10.0, 10.1, 11.4)):
        q.items[f"r{i}"] = item(1600, routed_at=routed_at, prefill_s=0.5)
        progress.watch(f"r{i}", pod, [1000 * i + b for b in range(100)], 16)
    progress.stored(pod, range(0, 50))  # r0: half of its blocks
    fresh = q.ahead(11.5, waiting=0, scraped_at=9.0, progress=progress)
    assert fresh[0] == pytest.approx(0.5 * 1600 + 1600 + 1600) and fresh[2] == 2
    progress.heard(pod, 1.0)
    assert progress.lag_s(pod) == 1.0
    tokens, pairs, count, _ = q.ahead(11.5, 0, 9.0, progress, progress.lag_s(pod))
    assert tokens == pytest.approx(0.8 * 1600)
    assert pairs == pytest.approx(0.8 * attention_pairs(1600, 0))
    assert count == 1  # r2: r1 is done by now, though no event shows it yet


def test_a_request_still_prefilling_by_its_prediction_holds_back_those_behind_it():
    # r0 shows nothing in the events, but the scrape at 10.05 s no longer counted it
    # waiting: admitted then, its 2 s prefill has 0.55 s left at 11.5 s by prediction.
    # The pod prefills in admission order, so the second of lag does not reach r1.
    progress = PrefillProgress()
    pod = "10.0.0.1:8000"
    progress.watch("earlier", pod, [7], 16)
    progress.stored(pod, [7])  # the pod's events are flowing
    q = PodQueue()
    q.items["r0"] = item(1600, routed_at=10.0, prefill_s=2.0)
    q.items["r1"] = item(1600, routed_at=10.1, prefill_s=0.5)
    for i in range(2):
        progress.watch(f"r{i}", pod, [1000 * i + b for b in range(100)], 16)
    tokens, _, count, _ = q.ahead(11.5, 0, 10.05, progress, lag_s=1.0)
    assert tokens == pytest.approx(0.275 * 1600 + 1600) and count == 1


def test_another_pickers_request_sent_after_the_scrape_drains_over_its_prediction():
    # This picker's own request sent after the pod's last scrape is waiting in full; one
    # another picker sent then was heard of late and may have been answered already, so
    # it drains over its predicted prefill and adds nothing past its predicted first token.
    progress = PrefillProgress()
    for peer in (False, True):
        q = PodQueue()
        q.items["r"] = Inflight(1000.0, attention_pairs(1000, 0), 10.0, 0.4, 10.4, peer=peer)
        expected = {10.2: 500.0, 10.5: 0.0} if peer else {10.2: 1000.0, 10.5: 1000.0}
        for now, tokens in expected.items():
            assert q.ahead(now, waiting=0, scraped_at=9.9)[0] == pytest.approx(tokens)
            with_events = q.ahead(now, waiting=0, scraped_at=9.9, progress=progress)
            assert with_events[0] == pytest.approx(tokens)

"""How a replay's throughput is counted (over the whole run, to the last completion, and
over the arrivals alone) and how unevenly its pods were loaded."""

from __future__ import annotations

import pytest

from smart_epp.benchmarks.replay.report import RequestResult, summarize, tokens_out_by


def result(index: int, arrival: float, ttft: float, e2e: float, tokens: int) -> RequestResult:
    return RequestResult(
        index, arrival, "pod", ok=True, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens
    )


def test_tokens_are_spread_from_the_first_to_the_last() -> None:
    r = result(0, 1.0, 0.5, 2.5, 11)  # first token at 1.5 s, last at 3.5 s
    assert tokens_out_by(r, 1.4) == 0.0
    assert tokens_out_by(r, 1.5) == 1.0
    assert tokens_out_by(r, 2.5) == pytest.approx(6.0)
    assert tokens_out_by(r, 9.0) == 11.0
    failed = RequestResult(1, 0.0, None, ok=False)
    assert tokens_out_by(failed, 9.0) == 0.0


def test_one_long_answer_at_the_end_sets_the_whole_run_rate_not_the_arriving_rate() -> None:
    # Ten short answers while requests arrive over 10 s; the last request's answer runs
    # on for 30 s more.
    steady = [result(i, float(i), 0.1, 0.9, 100) for i in range(10)]
    quick_tail = [*steady, result(10, 10.0, 0.1, 1.0, 100)]
    slow_tail = [*steady, result(10, 10.0, 0.1, 31.0, 100)]
    quick, slow = summarize(quick_tail, []), summarize(slow_tail, [])
    assert slow.output_tok_per_s < 0.5 * quick.output_tok_per_s
    assert slow.output_tok_per_s_while_arriving == quick.output_tok_per_s_while_arriving
    assert quick.output_tok_per_s_while_arriving == pytest.approx(1000 / 10)
    assert summarize(steady[:1], []).output_tok_per_s_while_arriving is None


def computed(pod: str, prompt: int, cached: int) -> RequestResult:
    return RequestResult(
        0,
        0.0,
        pod,
        ok=True,
        ttft_s=0.1,
        e2e_s=0.2,
        output_tokens=2,
        prompt_tokens=prompt,
        cached_tokens=cached,
    )


def test_prefill_imbalance_counts_the_tokens_computed_not_the_requests() -> None:
    # Pod a computes one long cold prompt; pod b serves three requests that are mostly
    # cache hits. By requests b is the busier; by prefill work a is, by far.
    results = [
        computed("a", 12_000, 0),
        *(computed("b", 2_000, 1_900) for _ in range(3)),
    ]
    s = summarize(results, ["a", "b"])
    assert s.load_imbalance == pytest.approx(3 / 2)
    assert s.prefill_imbalance == pytest.approx(12_000 / ((12_000 + 300) / 2))
    # A pod that computed nothing still counts in the mean.
    three = summarize(results, ["a", "b", "c"])
    assert three.prefill_imbalance == pytest.approx(12_000 / (12_300 / 3))
    all_cached = [computed("a", 100, 100), computed("b", 100, 100)]
    assert summarize(all_cached, ["a", "b"]).prefill_imbalance is None

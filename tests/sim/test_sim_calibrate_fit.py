"""The calibration fit on synthetic timings whose coefficients are known."""

from __future__ import annotations

import random

import pytest

from smart_epp.benchmarks.calibrate.fit import (
    COEFFICIENTS,
    Sample,
    decode_sample,
    fit,
    median_abs_pct_error,
    prefill_sample,
)
from smart_epp.benchmarks.sim.profiles import get_profile

TRUE = {
    "step_overhead_s": 0.0065,
    "prefill_s_per_token": 4.0e-5,
    "prefill_attention_s_per_token_pair": 1.05e-9,
    "decode_s_per_seq": 5.0e-5,
    "decode_kv_read_s_per_token": 3.91e-8,
    "prefill_s_per_request": 0.003,
}


def synthetic(noise: float, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    shapes = [prefill_sample("cold prefill", n, 0, 8192, 0.0) for n in
              (500, 1200, 3000, 7000, 12000, 20000, 31000)]  # fmt: skip
    shapes += [prefill_sample("warm prefix", 31000 - c, c, 8192, 0.0) for c in (0, 15488, 27888)]
    shapes += [decode_sample(b, b * ctx, 0.0) for b in (1, 4, 8) for ctx in (52, 15520)]
    out = []
    for s in shapes:
        exact = sum(TRUE[k] * f for k, f in zip(COEFFICIENTS, s.features, strict=True))
        out.append(Sample(s.group, s.features, exact * (1 + rng.gauss(0, noise))))
    return out


def test_exact_timings_give_back_every_coefficient():
    result = fit(synthetic(noise=0.0))
    for name, value in TRUE.items():
        assert result.coefficients[name] == pytest.approx(value, rel=1e-6), name
    for group in result.groups:
        assert group.median_abs_pct_error < 1e-4
        assert group.r2 == pytest.approx(1.0)


def test_noisy_timings_give_back_the_coefficients_within_a_few_percent():
    result = fit(synthetic(noise=0.01, seed=4))
    for name in ("step_overhead_s", "prefill_s_per_token", "prefill_attention_s_per_token_pair"):
        assert result.coefficients[name] == pytest.approx(TRUE[name], rel=0.1), name
    assert result.coefficients["prefill_s_per_request"] == pytest.approx(0.003, abs=0.002)
    assert {g.group for g in result.groups} == {"cold prefill", "warm prefix", "decode"}
    assert all(g.median_abs_pct_error < 3 for g in result.groups)


def test_the_quadratic_term_is_found_only_where_it_exists():
    linear = {**TRUE, "prefill_attention_s_per_token_pair": 0.0}
    samples = [
        Sample(s.group, s.features, sum(linear[k] * f for k, f in
                                        zip(COEFFICIENTS, s.features, strict=True)))
        for s in synthetic(noise=0.0)
    ]  # fmt: skip
    result = fit(samples)
    assert result.coefficients["prefill_attention_s_per_token_pair"] == pytest.approx(0, abs=1e-15)
    assert result.coefficients["prefill_s_per_token"] == pytest.approx(4.0e-5, rel=1e-6)


def test_coefficients_are_never_negative():
    # Timings that fall with prompt length would need a negative per-token cost.
    samples = [prefill_sample("cold prefill", n, 0, 8192, 0.1 - n * 1e-6) for n in (100, 1000)]
    result = fit(samples)
    assert all(v >= 0 for v in result.coefficients.values())


def test_chunks_count_steps_and_attention_over_earlier_chunks():
    s = prefill_sample("cold prefill", 10_000, 0, 4096, 1.0)
    assert s.features[0] == 3  # 4096 + 4096 + 1808
    assert s.features[2] == pytest.approx(10_000**2 / 2)
    warm = prefill_sample("warm prefix", 1000, 3000, 8192, 1.0)
    assert warm.features[2] == pytest.approx(1000 * (3000 + 500))
    profile = get_profile("h100-llama3-8b")
    assert warm.features[2] * profile.prefill_attention_s_per_token_pair == pytest.approx(
        profile.prefill_seconds(1000, 3000) - 1000 * profile.prefill_s_per_token
    )


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no measurements"):
        fit([])
    with pytest.raises(ValueError, match="positive"):
        fit([decode_sample(1, 10, 0.0)])
    assert median_abs_pct_error([1.0, 2.0, 4.0], [1.1, 2.0, 3.0]) == pytest.approx(10.0)

"""The decode slope: seconds per output token that one more running request adds."""

from __future__ import annotations

import math
import random

import pytest

from smart_epp.scorers.decode_model import SLOPE_FORGETTING, DecodeSlope


def test_recovers_a_known_slope_from_noisy_answers():
    rng = random.Random(7)
    fit = DecodeSlope()
    for _ in range(2000):
        running = rng.uniform(0, 40)
        fit.observe(0.008 + 0.0003 * running + rng.gauss(0, 0.001), running)
    assert fit.slope == pytest.approx(0.0003, rel=0.1)


def test_follows_a_pod_that_slows_within_a_few_hundred_answers():
    rng = random.Random(3)
    fit = DecodeSlope()
    for slope in (0.0002, 0.0006):
        for _ in range(400):
            running = rng.uniform(0, 30)
            fit.observe(0.007 + slope * running, running)
        assert fit.slope == pytest.approx(slope, rel=0.05)


def test_never_negative_and_silent_without_spread_in_batch_sizes():
    fit = DecodeSlope()
    for running in range(1, 30):  # answers that got faster as batches grew: noise, not a gain
        fit.observe(0.02 - 0.0001 * running, float(running))
    assert fit.slope == 0.0
    flat = DecodeSlope()
    for _ in range(100):
        flat.observe(0.01, 12.0)
    assert flat.slope == 0.0


def test_state_stays_bounded_over_a_long_run():
    fit = DecodeSlope()
    for i in range(200_000):
        fit.observe(0.01 + 0.0002 * (i % 20), float(i % 20))
    assert fit.weight <= 1.0 / (1.0 - SLOPE_FORGETTING) + 1e-6
    assert all(math.isfinite(v) for v in (fit.sum_x, fit.sum_xx, fit.sum_xy, fit.slope))
    assert fit.slope == pytest.approx(0.0002, rel=0.01)

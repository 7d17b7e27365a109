"""benchmarks/miss_significance.py: paired block bootstrap of the grid's misses and wins."""

from __future__ import annotations

import numpy as np
import pytest

from smart_epp.benchmarks.miss_significance import (
    block_bootstrap_ratios,
    comparisons,
    judge,
    percentile_of,
    replay,
    ttfts_in_arrival_order,
)
from smart_epp.benchmarks.policy_grid import Cell, build_parser, run_cell


def _lognormal(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(-1.0, 0.8, n)


def test_a_policy_slower_on_every_request_is_worse_in_every_resample():
    best = _lognormal(200, 1)
    row = judge(1.2 * best, best, 90, resamples=500, block=20)
    assert row["interval_95"] == [pytest.approx(1.2), pytest.approx(1.2)]
    assert row["worse_than_best"] and row["beyond_goal"]
    assert not row["better_than_best_other"]


def test_two_draws_of_one_distribution_are_not_told_apart():
    """Same distribution, independent requests: the interval holds 1 and no verdict is given,
    while the point ratio alone would count a miss or a win."""
    mine, best = _lognormal(200, 2), _lognormal(200, 3)
    row = judge(mine, best, 90, resamples=2000, block=20)
    assert row["ratio"] != pytest.approx(1.0, abs=0.03)
    lo, hi = row["interval_95"]
    assert lo < 1.0 < hi
    assert not (row["worse_than_best"] or row["better_than_best_other"])


def test_a_block_as_long_as_the_cell_only_rotates_it():
    """Circular blocks: one block of all the requests is the whole cell from another start,
    so every resample has the cell's own percentiles."""
    mine, best = _lognormal(50, 4), _lognormal(50, 5)
    ratios = block_bootstrap_ratios(mine, best, 90, resamples=100, block=50)
    expected = np.percentile(mine, 90) / np.percentile(best, 90)
    assert ratios == pytest.approx(np.full(100, expected))


def test_failed_requests_are_left_out_of_both_percentiles():
    mine = np.array([0.1, np.nan, 0.3, 0.2])
    ratios = block_bootstrap_ratios(mine, np.array([0.1, 0.2, np.nan, 0.2]), 50, 10, 2)
    assert np.isfinite(ratios).all()
    assert percentile_of(mine, 50) == 0.2


def _cell(**p90s: float) -> dict[str, dict[str, float]]:
    return {name: {"ttft_p90_s": v, "ttft_p50_s": 1.0} for name, v in p90s.items()}


def test_misses_face_the_best_policy_and_wins_the_runner_up():
    cells = {
        "lost": _cell(default=1.10, a=1.00, b=1.05),
        "won": _cell(default=0.90, a=1.00, b=0.95),
        "close": _cell(default=1.02, a=1.00, b=1.50),
    }
    p90 = [(key, other, kind) for key, q, other, kind in comparisons(cells) if q == 90]
    assert p90 == [("lost", "a", "miss"), ("won", "b", "win")]


def test_a_replayed_cell_gives_the_figures_the_grid_recorded():
    """The bootstrap runs on a replay of the cell, so the replay must be the recorded run."""
    args = build_parser().parse_args(["--requests", "40", "--pods", "2"])
    cell = Cell("shared-prefix", 1.1, 1.0)
    recorded = run_cell(cell, ["default", "round-robin"], 40, 2, 0, (), None, args.profile)
    for policy in ("default", "round-robin"):
        ttfts = ttfts_in_arrival_order(replay(cell, policy, args))
        for q, field in ((90, "ttft_p90_s"), (50, "ttft_p50_s")):
            assert percentile_of(ttfts, q) == recorded[policy][field]

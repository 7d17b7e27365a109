"""benchmarks/miss_significance.py: paired block bootstrap of the grid's misses and wins."""

from __future__ import annotations

import numpy as np
import pytest

from smart_epp.benchmarks.miss_significance import (
    ALL_GRIDS,
    GOALS,
    RESULTS,
    block_bootstrap_ratios,
    comparisons,
    judge,
    percentile_of,
)
from smart_epp.benchmarks.policy_grid import Cell, build_parser, run_cell, simulate_cell

P90, P50, TOKENS = GOALS


def _lognormal(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(-1.0, 0.8, n)


def test_a_policy_slower_on_every_request_is_worse_in_every_resample():
    best = _lognormal(200, 1)
    row = judge(1.2 * best, best, P90, resamples=500, block=20)
    assert row["interval_95"] == [pytest.approx(1.2), pytest.approx(1.2)]
    assert row["worse_than_best"] and row["beyond_goal"]
    assert not row["better_than_best_other"]


def test_fewer_tokens_on_every_request_is_worse_for_a_goal_where_higher_is_better():
    best = _lognormal(200, 6) * 100
    row = judge(0.9 * best, best, TOKENS, resamples=500, block=20)
    assert row["ratio"] == pytest.approx(0.9)
    assert row["worse_than_best"] and row["beyond_goal"]
    assert row["share_within_goal"] == 0.0
    ahead = judge(best, 0.9 * best, TOKENS, resamples=500, block=20)
    assert ahead["better_than_best_other"] and not ahead["worse_than_best"]


def test_two_draws_of_one_distribution_are_not_told_apart():
    """Same distribution, independent requests: the interval holds 1 and no verdict is given,
    while the point ratio alone would count a miss or a win."""
    mine, best = _lognormal(200, 2), _lognormal(200, 3)
    row = judge(mine, best, P90, resamples=2000, block=20)
    assert row["ratio"] != pytest.approx(1.0, abs=0.03)
    lo, hi = row["interval_95"]
    assert lo < 1.0 < hi
    assert not (row["worse_than_best"] or row["better_than_best_other"])


def test_a_block_as_long_as_the_cell_only_rotates_it():
    """Circular blocks: one block of all the requests is the whole cell from another start,
    so every resample has the cell's own percentiles."""
    mine, best = _lognormal(50, 4), _lognormal(50, 5)
    ratios = block_bootstrap_ratios(mine, best, P90.statistic, resamples=100, block=50)
    expected = np.percentile(mine, 90) / np.percentile(best, 90)
    assert ratios == pytest.approx(np.full(100, expected))


def test_failed_requests_are_left_out_of_both_percentiles():
    mine = np.array([0.1, np.nan, 0.3, 0.2])
    ratios = block_bootstrap_ratios(mine, np.array([0.1, 0.2, np.nan, 0.2]), P50.statistic, 10, 2)
    assert np.isfinite(ratios).all()
    assert percentile_of(mine, 50) == pytest.approx(0.2)


def _cell(p90: float, tokens: float) -> dict[str, float]:
    return {"ttft_p90_s": p90, "ttft_p50_s": 1.0, "output_tok_per_s_while_arriving": tokens}


def test_misses_face_the_best_policy_and_wins_the_runner_up():
    cells = {
        "lost": {"default": _cell(1.10, 97), "a": _cell(1.00, 100), "b": _cell(1.05, 99)},
        "won": {"default": _cell(0.90, 101), "a": _cell(1.00, 99), "b": _cell(0.95, 100)},
        "close": {"default": _cell(1.02, 99), "a": _cell(1.00, 100), "b": _cell(1.50, 50)},
    }
    found = [(key, goal.name, other, kind) for key, goal, other, kind in comparisons(cells)]
    assert found == [
        ("lost", "p90", "a", "miss"),
        ("lost", TOKENS.name, "a", "miss"),
        ("won", "p90", "b", "win"),
        ("won", TOKENS.name, "b", "win"),
    ]


def test_a_replayed_cell_gives_the_figures_the_grid_recorded():
    """The bootstrap runs on a replay of the cell, so the replay must be the recorded run."""
    args = build_parser().parse_args(["--requests", "40", "--pods", "2"])
    cell = Cell("shared-prefix", 1.1, 1.0)
    recorded = run_cell(cell, ["default", "round-robin"], 40, 2, 0, (), None, args.profile)
    for policy in ("default", "round-robin"):
        results = simulate_cell(cell, policy, args)
        for goal in GOALS:
            assert round(goal.exact(results), 6) == recorded[policy][goal.field]
        tokens = TOKENS.per_request(results)
        window = max(r.arrival_s for r in results) - min(r.arrival_s for r in results)
        assert tokens.sum() / window == pytest.approx(recorded[policy][TOKENS.field], rel=1e-6)


def test_every_grid_resampled_by_default_is_committed():
    assert all((RESULTS / f"{stem}.json").exists() for stem in ALL_GRIDS)

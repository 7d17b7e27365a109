"""benchmarks/weight_sweep.py: the default varied in one parameter, peers as recorded."""

from __future__ import annotations

import pytest

from smart_epp.benchmarks.policy_grid import Cell, build_parser, grid_args, run_cell
from smart_epp.benchmarks.weight_sweep import (
    DEFAULT_GRIDS,
    RESULTS,
    grid_role,
    run_variant,
    summarize_variant,
    variant_config,
)
from smart_epp.epp.config import instantiate, load_config
from smart_epp.scorers.predicted_ttft_scorer import PredictedTTFTParams


def test_a_variant_is_the_default_config_with_one_scorer_parameter_set(tmp_path):
    path = variant_config("decodeStallWeight", 0.25, tmp_path)
    (scorer,) = instantiate(load_config(path)).of_type("predicted-ttft-scorer")
    assert scorer.params.decodeStallWeight == 0.25
    with pytest.raises(Exception, match="noSuchWeight"):
        variant_config("noSuchWeight", 1.0, tmp_path)


def test_a_recorded_grid_command_gives_back_its_options():
    doc = {"command": "benchmarks/policy_grid.py --jobs 2 --seed 1 --kv-tokens 65536 "
                      "--pod-slowdowns 1,1,1.25,1.5 --name x --out /tmp/grids"}  # fmt: skip
    args = grid_args(doc)
    assert (args.seed, args.kv_tokens, args.pod_slowdowns) == (1, 65536, (1.0, 1.0, 1.25, 1.5))
    assert args.requests == build_parser().parse_args([]).requests


def test_the_defaults_own_value_reproduces_the_recorded_default(tmp_path):
    """Deterministic cells: replaying `default` with its scorer's default value gives the
    figures the grid recorded for it, so a sweep's differences are the parameter's."""
    args = build_parser().parse_args(["--requests", "40", "--pods", "2"])
    cell = Cell("shared-prefix", 0.75, 1.0)
    recorded = run_cell(cell, ["default", "round-robin"], 40, 2, 0, (), None, args.profile)
    own_value = PredictedTTFTParams().decodeStallWeight
    config = variant_config("decodeStallWeight", own_value, tmp_path)
    mine = run_variant(cell, config, args)
    for field in ("ttft_p90_s", "ttft_p50_s", "prefix_hit_rate", "output_tok_per_s_while_arriving"):
        assert mine[field] == recorded["default"][field]
    row = summarize_variant({cell.key: recorded}, {cell.key: mine})
    best_p90 = min(s["ttft_p90_s"] for s in recorded.values())
    assert row["p90_over_best_geomean"] == pytest.approx(
        recorded["default"]["ttft_p90_s"] / best_p90, abs=1e-4
    )


def test_seed_0_grids_tune_and_later_seeds_and_mooncake_stretches_are_held_out():
    assert grid_role({"seed": 0}) == "tuning"
    assert grid_role({"seed": 0, "mooncake_start": 0}) == "tuning"
    assert grid_role({"seed": 1}) == "held-out"
    assert grid_role({"seed": 0, "mooncake_start": 600}) == "held-out"
    # Every grid a sweep reads by default is committed.
    assert all((RESULTS / f"{stem}.json").exists() for stem in DEFAULT_GRIDS)

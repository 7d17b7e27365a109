"""benchmarks/ttft_prediction_error.py: measured over predicted TTFT per grid cell."""

from __future__ import annotations

import json
from pathlib import Path

from smart_epp.benchmarks.policy_grid import build_parser, grid_cells
from smart_epp.benchmarks.ttft_prediction_error import cell_errors, main


def test_a_saturated_cell_has_long_waits_whose_errors_are_counted() -> None:
    args = build_parser().parse_args(
        ["--requests", "120", "--trace", "shared-prefix", "--load", "1.5", "--attention", "1"]
    )
    args.error_policy = "default"
    row = cell_errors(grid_cells(args)[0], args)
    assert 0 < row["requests_with_a_prediction"] <= 120
    assert 0 < row["predicted_over_1s"] <= row["requests_with_a_prediction"]
    quantiles = row["predicted_over_1s_ratio_quantiles"]
    assert 0 < quantiles["p50"] <= quantiles["p90"] <= quantiles["p95"] <= quantiles["p99"]
    assert 0.0 <= row["predicted_over_1s_share_above_margin"] <= 1.0


def test_a_policy_without_predictions_reports_none_and_the_file_is_written(
    tmp_path: Path,
) -> None:
    argv = ["--requests", "40", "--trace", "multi-turn", "--load", "0.3", "--attention", "1"]
    assert main([*argv, "--error-policy", "least-queue", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "ttft_prediction_error.json").read_text())
    (row,) = doc["cells"].values()
    assert row["requests_with_a_prediction"] == 0
    assert row["ratio_quantiles"] is None and row["predicted_over_1s_share_above_margin"] is None
    assert doc["policy"] == "least-queue" and doc["margin"] > 1

"""How far a policy's predicted TTFT is from the TTFT its requests got, in the policy grid's
cells: the figure behind how long a routed prompt's speculative index entries last.

    .venv/bin/python benchmarks/ttft_prediction_error.py [--requests N] [--seed N]
        [--trace T ...] [--load L ...] [--attention A ...] [--error-policy NAME] [--out DIR]

A prompt sent to a pod counts as held there (speculatively) until its KV events confirm
it, which they can do once its prefill has run: about its TTFT after routing. The
scheduler keeps the entries for `SPECULATIVE_TTFT_MARGIN` times the predicted TTFT
(`epp/scheduler.py`), at least the default life (2 s). So what matters is, for requests
predicted to wait longer than half that floor (over 1 s, where the margin sets the life),
the ratio of measured to predicted TTFT, both counted from the routing decision: its
percentiles per cell and the share of requests above the margin, whose entries expire
before their prefill.

Cells are replayed as `benchmarks/policy_grid.py` builds them (same options). Writes
`benchmarks/results/ttft_prediction_error.json` by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from smart_epp.benchmarks.policy_grid import Cell, build_parser, grid_cells, simulate_cell
from smart_epp.benchmarks.replay.sim import SimConfig
from smart_epp.epp.scheduler import SPECULATIVE_TTFT_MARGIN

ROOT = Path(__file__).resolve().parent
QUANTILES = (0.5, 0.9, 0.95, 0.99)
# Below this predicted wait the 2 s floor, not the margin, sets an entry's life.
LONG_WAIT_S = 1.0


def cell_errors(cell: Cell, args: argparse.Namespace) -> dict[str, Any]:
    latency = SimConfig().routing_latency_s  # the replay charges it before routing
    ratios: list[float] = []
    long_ratios: list[float] = []
    for r in simulate_cell(cell, args.error_policy, args):
        if not r.ok or r.ttft_s is None or r.predicted_ttft_s is None:
            continue
        predicted = r.predicted_ttft_s - latency
        if predicted <= 0:
            continue
        ratio = (r.ttft_s - latency) / predicted
        ratios.append(ratio)
        if predicted > LONG_WAIT_S:
            long_ratios.append(ratio)
    return {
        "requests_with_a_prediction": len(ratios),
        "ratio_quantiles": _quantiles(ratios),
        "predicted_over_1s": len(long_ratios),
        "predicted_over_1s_ratio_quantiles": _quantiles(long_ratios),
        "predicted_over_1s_share_above_margin": (
            round(float(np.mean(np.array(long_ratios) > SPECULATIVE_TTFT_MARGIN)), 4)
            if long_ratios
            else None
        ),
    }


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    points = np.quantile(np.array(values), QUANTILES)
    return {
        f"p{round(q * 100)}": round(float(v), 3) for q, v in zip(QUANTILES, points, strict=True)
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.description = __doc__.split("\n")[0]
    parser.add_argument(
        "--error-policy",
        default="default",
        help="the policy whose predictions are compared (default: %(default)s)",
    )
    parser.set_defaults(load=[0.75, 1.1], attention=[1.0], out=ROOT / "results")
    parser.set_defaults(name="ttft_prediction_error")
    args = parser.parse_args(argv)
    cells = grid_cells(args)
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {c.key: pool.submit(cell_errors, c, args) for c in cells}
        results = {key: fut.result() for key, fut in futures.items()}
    for key, row in results.items():
        print(
            f"{key}: over 1 s {row['predicted_over_1s']}, "
            f"{row['predicted_over_1s_ratio_quantiles']}, "
            f"above margin {row['predicted_over_1s_share_above_margin']}",
            file=sys.stderr,
        )
    doc = {
        "what": "measured / predicted TTFT (from the routing decision) per grid cell, sim mode",
        "command": "benchmarks/ttft_prediction_error.py " + " ".join(argv or sys.argv[1:]),
        "policy": args.error_policy,
        "margin": SPECULATIVE_TTFT_MARGIN,
        "requests_per_cell": args.requests,
        "seed": args.seed,
        "wall_s": round(time.perf_counter() - started, 1),
        "cells": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

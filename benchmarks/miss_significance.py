"""How sure the policy grid's verdicts are: which of `default`'s misses and wins would a
different sample of the same workload confirm, and which are within a cell's noise.

    .venv/bin/python benchmarks/miss_significance.py [--grids STEM ...] [--resamples N]
        [--block N] [--jobs N] [--out FILE]

For every cell of a committed grid file (`benchmarks/results/<STEM>.json`) where `default`
misses a TTFT goal (p90 over 1.03x the best policy's, p50 over 1.10x), the cell is replayed
again for `default` and for the policy that was best there; where `default` is the best,
for `default` and the runner-up, so that its wins face the same test as its misses. The
replays use the options the file records. Cells are deterministic, so a replay must give
the file's figures; one that does not is reported as not reproduced and left out of the
counts.

Both policies served the same requests, so they are compared request by request: a
moving-block bootstrap over the requests in arrival order (blocks of `--block` consecutive
requests, drawn with replacement, the same draws for both policies) gives the distribution
of the ratio of their percentiles. Blocks keep requests that queued together together,
since one request's TTFT depends on its neighbours'; a plain bootstrap would treat them as
independent. The interval is the sampling spread of a cell of this many requests under
this workload, not a bound on the policies' long-run difference: the grids' other seeds
and the 600-request cells are the other check.

Per comparison it reports the ratio, its 95% interval, the share of resamples within the
goal, and three verdicts: `worse_than_best` (the whole interval above 1), `beyond_goal`
(the whole interval above the goal's ratio) and `better_than_best_other` (the whole
interval below 1). Writes `benchmarks/results/miss_significance.json` by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from smart_epp.benchmarks.policy_grid import Cell, grid_args, grid_cells, simulate_cell
from smart_epp.benchmarks.replay.report import RequestResult, percentile
from smart_epp.benchmarks.weight_sweep import DEFAULT_GRIDS

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
# The goals `policy_grid.py` counts misses against: TTFT percentile -> most x the best.
GOALS = {90: 1.03, 50: 1.10}
FIELDS = {90: "ttft_p90_s", 50: "ttft_p50_s"}
# The 600-request grids as well: a longer cell is a smaller sample error, the same test.
ALL_GRIDS = (*DEFAULT_GRIDS, "policy_grid_600", "policy_grid_600_seed1")


def comparisons(cells: dict[str, dict[str, Any]]) -> list[tuple[str, int, str, str]]:
    """(cell, percentile, other policy, "miss" or "win"): every TTFT goal `default` misses,
    against the cell's best policy; and every cell where `default` is the best, against
    the runner-up, so that its wins face the same test as its losses."""
    out = []
    for key, per_policy in cells.items():
        for q, limit in GOALS.items():
            field = FIELDS[q]
            values = {name: s[field] for name, s in per_policy.items() if s[field]}
            others = sorted((n for n in values if n != "default"), key=values.__getitem__)
            mine, best = values["default"], values[others[0]]
            if mine > limit * best:
                out.append((key, q, others[0], "miss"))
            elif mine < best:
                out.append((key, q, others[0], "win"))
    return out


def ttfts_in_arrival_order(results: Sequence[RequestResult]) -> np.ndarray:
    """Each request's TTFT by request index (NaN where it failed); requests are indexed in
    arrival order."""
    ttft = np.full(max(r.index for r in results) + 1, np.nan)
    for r in results:
        if r.ok and r.ttft_s is not None:
            ttft[r.index] = r.ttft_s
    return ttft


def block_bootstrap_ratios(
    mine: np.ndarray, best: np.ndarray, q: int, resamples: int, block: int, seed: int = 0
) -> np.ndarray:
    """Ratios of the `q`th percentiles of `mine` over `best` (per request, same order) in
    `resamples` circular moving-block resamples of the requests."""
    n = len(mine)
    rng = np.random.default_rng(seed)
    blocks = -(-n // block)
    starts = rng.integers(0, n, size=(resamples, blocks))
    idx = (starts[:, :, None] + np.arange(block)[None, None, :]).reshape(resamples, -1)[:, :n] % n
    return np.nanpercentile(mine[idx], q, axis=1) / np.nanpercentile(best[idx], q, axis=1)


def replay(cell: Cell, policy: str, args: argparse.Namespace) -> list[RequestResult]:
    """One policy's results in one cell, with the grid's options."""
    return simulate_cell(
        cell,
        policy,
        args.requests,
        args.pods,
        args.seed,
        args.pod_slowdowns,
        args.kv_tokens,
        args.profile,
    )


def percentile_of(ttfts: np.ndarray, q: int) -> float | None:
    """The percentile as the grid's summary reports it: the same method, over the requests
    that were answered, rounded as its JSON is (6 decimals)."""
    value = percentile([float(t) for t in ttfts if not np.isnan(t)], q)
    return None if value is None else round(value, 6)


def judge(mine: np.ndarray, best: np.ndarray, q: int, resamples: int, block: int) -> dict[str, Any]:
    ratios = block_bootstrap_ratios(mine, best, q, resamples, block)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    point = np.nanpercentile(mine, q) / np.nanpercentile(best, q)
    return {
        "ratio": round(float(point), 4),
        "interval_95": [round(float(lo), 4), round(float(hi), 4)],
        "share_within_goal": round(float(np.mean(ratios <= GOALS[q])), 3),
        "worse_than_best": bool(lo > 1.0),
        "beyond_goal": bool(lo > GOALS[q]),
        "better_than_best_other": bool(hi < 1.0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grids", nargs="+", default=list(ALL_GRIDS), metavar="STEM")
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--block", type=int, default=20, help="requests per bootstrap block")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "what": "default's TTFT goal misses per grid cell, replayed, with a paired "
        f"moving-block bootstrap ({args.block}-request blocks, {args.resamples} resamples) "
        "of default's percentile over the cell's best policy's",
        "command": "benchmarks/miss_significance.py " + " ".join(argv or sys.argv[1:]),
        "goals": {f"p{q}": limit for q, limit in GOALS.items()},
        "grids": {},
    }
    totals = {
        f"p{q}": {
            "misses": 0,
            "misses_worse_than_best": 0,
            "misses_beyond_goal": 0,
            "wins": 0,
            "wins_better_than_runner_up": 0,
        }
        for q in GOALS
    }
    not_reproduced = 0
    for stem in args.grids:
        doc = json.loads((RESULTS / f"{stem}.json").read_text())
        gargs = grid_args(doc)
        cells = {c.key: c for c in grid_cells(gargs)}
        found = comparisons(doc["cells"])
        needed = sorted({(key, "default") for key, *_ in found} | {(k, o) for k, _, o, _ in found})
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = {kp: pool.submit(replay, cells[kp[0]], kp[1], gargs) for kp in needed}
            replays = {kp: ttfts_in_arrival_order(f.result()) for kp, f in futures.items()}
        rows = []
        for key, q, other, kind in found:
            mine, theirs = replays[key, "default"], replays[key, other]
            field = FIELDS[q]
            recorded = doc["cells"][key]
            row: dict[str, Any] = {"cell": key, "percentile": q, "kind": kind, "against": other}
            replayed = (percentile_of(mine, q), percentile_of(theirs, q))
            if replayed != (recorded["default"][field], recorded[other][field]):
                row["reproduced"] = False
                not_reproduced += 1
            else:
                row |= judge(mine, theirs, q, args.resamples, args.block)
                total = totals[f"p{q}"]
                if kind == "miss":
                    total["misses"] += 1
                    total["misses_worse_than_best"] += row["worse_than_best"]
                    total["misses_beyond_goal"] += row["beyond_goal"]
                else:
                    total["wins"] += 1
                    total["wins_better_than_runner_up"] += row["better_than_best_other"]
            rows.append(row)
        print(f"{stem}: {len(rows)} comparisons", file=sys.stderr, flush=True)
        report["grids"][stem] = rows
    report["totals"] = totals
    report["not_reproduced"] = not_reproduced
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out = args.out or RESULTS / "miss_significance.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"totals": totals, "not_reproduced": not_reproduced}, indent=1))
    print(f"wall {report['wall_s']} s; wrote {out}")
    return 0 if not_reproduced == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

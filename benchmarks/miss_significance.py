"""How sure the policy grid's verdicts are: which of `default`'s misses and wins would a
different sample of the same workload confirm, and which are within a cell's noise.

    .venv/bin/python benchmarks/miss_significance.py [--grids STEM ...] [--resamples N]
        [--block N] [--jobs N] [--out FILE]

For every cell of a committed grid file (`benchmarks/results/<STEM>.json`) where `default`
misses a goal (TTFT p90 over 1.03x the best policy's, p50 over 1.10x, output tokens/s while
the requests arrive under 0.98x), the cell is replayed again for `default` and for the
policy that was best there; where `default` is the best, for `default` and the runner-up,
so that its wins face the same test as its misses. The replays use the options the file
records. Cells are deterministic, so a replay must give
the file's figures; one that does not is reported as not reproduced and left out of the
counts.

Both policies served the same requests, so they are compared request by request: a
moving-block bootstrap over the requests in arrival order (blocks of `--block` consecutive
requests, drawn with replacement, the same draws for both policies) gives the distribution
of the ratio of their figures (percentiles; tokens/s as the tokens each request had
delivered by the last arrival, summed). Blocks keep requests that queued together together,
since one request's TTFT depends on its neighbours'; a plain bootstrap would treat them as
independent. The interval is the sampling spread of a cell of this many requests under
this workload, not a bound on the policies' long-run difference: the grids' other seeds
and the 600-request cells are the other check.

Per comparison it reports the ratio, its 95% interval, the share of resamples within the
goal, and three verdicts: `worse_than_best` (the whole interval on the worse side of 1),
`beyond_goal` (the whole interval past the goal's ratio) and `better_than_best_other` (the
whole interval on the better side of 1). Ratios are `default`'s figure over the other's:
for tokens/s, below 1 is worse. Writes `benchmarks/results/miss_significance.json` by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from smart_epp.benchmarks.policy_grid import (
    P50_GOAL,
    P90_GOAL,
    TOKENS_GOAL,
    grid_args,
    grid_cells,
    simulate_cell,
)
from smart_epp.benchmarks.replay.report import (
    RequestResult,
    percentile,
    tokens_out_by,
    tokens_per_s_while_arriving,
)
from smart_epp.benchmarks.weight_sweep import DEFAULT_GRIDS

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
# The 600-request grids as well: a longer cell is a smaller sample error, the same test.
ALL_GRIDS = (
    *DEFAULT_GRIDS,
    "policy_grid_600",
    "policy_grid_600_seed1",
    *(f"policy_grid_600_mooncake_from{start}" for start in range(600, 3001, 600)),
)


@dataclass(frozen=True)
class Goal:
    """One of the goals `policy_grid.py` counts misses against, as a per-request quantity
    whose statistic over a resample is the grid's figure."""

    name: str
    field: str  # the grid summary's figure
    limit: float  # default's figure over the best's that is still within the goal
    higher_is_better: bool
    per_request: Callable[[Sequence[RequestResult]], np.ndarray]
    statistic: Callable[[np.ndarray], np.ndarray]  # over the last axis; NaN: not counted
    exact: Callable[[Sequence[RequestResult]], float | None]  # as the summary computes it


def ttfts_in_arrival_order(results: Sequence[RequestResult]) -> np.ndarray:
    """Each request's TTFT by request index (NaN where it failed); requests are indexed in
    arrival order."""
    ttft = np.full(max(r.index for r in results) + 1, np.nan)
    for r in results:
        if r.ok and r.ttft_s is not None:
            ttft[r.index] = r.ttft_s
    return ttft


def tokens_by_last_arrival(results: Sequence[RequestResult]) -> np.ndarray:
    """Each request's output tokens delivered by the cell's last arrival, by request index:
    their sum over the arrival window is the grid's output tokens/s while arriving, and
    the window is the same for every policy (the same arrivals), so it cancels in a ratio."""
    end = max(r.arrival_s for r in results)
    out = np.zeros(max(r.index for r in results) + 1)
    for r in results:
        out[r.index] = tokens_out_by(r, end)
    return out


def percentile_of(ttfts: np.ndarray, q: int) -> float | None:
    """The percentile as the grid's summary computes it: the same method, over the
    requests that were answered."""
    return percentile([float(t) for t in ttfts if not np.isnan(t)], q)


def _ttft_goal(q: int, limit: float) -> Goal:
    return Goal(
        name=f"p{q}",
        field=f"ttft_p{q}_s",
        limit=limit,
        higher_is_better=False,
        per_request=ttfts_in_arrival_order,
        statistic=lambda x: np.nanpercentile(x, q, axis=-1),
        exact=lambda results: percentile_of(ttfts_in_arrival_order(results), q),
    )


GOALS = (
    _ttft_goal(90, P90_GOAL),
    _ttft_goal(50, P50_GOAL),
    Goal(
        name="tokens/s while arriving",
        field="output_tok_per_s_while_arriving",
        limit=TOKENS_GOAL,
        higher_is_better=True,
        per_request=tokens_by_last_arrival,
        statistic=lambda x: x.sum(axis=-1),
        exact=tokens_per_s_while_arriving,
    ),
)


def comparisons(cells: dict[str, dict[str, Any]]) -> list[tuple[str, Goal, str, str]]:
    """(cell, goal, other policy, "miss" or "win"): every goal `default` misses, against
    the cell's best policy; and every cell where `default` is the best, against the
    runner-up, so that its wins face the same test as its misses."""
    out = []
    for key, per_policy in cells.items():
        for goal in GOALS:
            values = {name: s[goal.field] for name, s in per_policy.items() if s[goal.field]}
            sign = -1.0 if goal.higher_is_better else 1.0
            others = sorted((n for n in values if n != "default"), key=lambda n: sign * values[n])
            mine, best = values["default"], values[others[0]]
            ratio = mine / best
            if (ratio < goal.limit) if goal.higher_is_better else (ratio > goal.limit):
                out.append((key, goal, others[0], "miss"))
            elif (ratio > 1.0) if goal.higher_is_better else (ratio < 1.0):
                out.append((key, goal, others[0], "win"))
    return out


def block_bootstrap_ratios(
    mine: np.ndarray,
    best: np.ndarray,
    statistic: Callable[[np.ndarray], np.ndarray],
    resamples: int,
    block: int,
    seed: int = 0,
) -> np.ndarray:
    """Ratios of `statistic` of `mine` over that of `best` (per request, same order) in
    `resamples` circular moving-block resamples of the requests."""
    n = len(mine)
    rng = np.random.default_rng(seed)
    blocks = -(-n // block)
    starts = rng.integers(0, n, size=(resamples, blocks))
    idx = (starts[:, :, None] + np.arange(block)[None, None, :]).reshape(resamples, -1)[:, :n] % n
    ratios: np.ndarray = statistic(mine[idx]) / statistic(best[idx])
    return ratios


def judge(
    mine: np.ndarray, best: np.ndarray, goal: Goal, resamples: int, block: int
) -> dict[str, Any]:
    """Default's figure over the other's, its 95% interval and verdicts. For a goal where
    higher is better (tokens/s) the ratio is still default's over the other's, so below 1
    is worse."""
    ratios = block_bootstrap_ratios(mine, best, goal.statistic, resamples, block)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    point = float(goal.statistic(mine) / goal.statistic(best))
    if goal.higher_is_better:
        worse, beyond, better = hi < 1.0, hi < goal.limit, lo > 1.0
        within = np.mean(ratios >= goal.limit)
    else:
        worse, beyond, better = lo > 1.0, lo > goal.limit, hi < 1.0
        within = np.mean(ratios <= goal.limit)
    return {
        "ratio": round(point, 4),
        "interval_95": [round(float(lo), 4), round(float(hi), 4)],
        "share_within_goal": round(float(within), 3),
        "worse_than_best": bool(worse),
        "beyond_goal": bool(beyond),
        "better_than_best_other": bool(better),
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
        "what": "default's goal misses and wins per grid cell, replayed, with a paired "
        f"moving-block bootstrap ({args.block}-request blocks, {args.resamples} resamples) "
        "of default's figure over the cell's best (or runner-up) policy's",
        "command": "benchmarks/miss_significance.py " + " ".join(argv or sys.argv[1:]),
        "goals": {g.name: g.limit for g in GOALS},
        "grids": {},
    }
    totals = {
        g.name: {
            "misses": 0,
            "misses_worse_than_best": 0,
            "misses_beyond_goal": 0,
            "wins": 0,
            "wins_better_than_runner_up": 0,
        }
        for g in GOALS
    }
    not_reproduced = 0
    for stem in args.grids:
        doc = json.loads((RESULTS / f"{stem}.json").read_text())
        gargs = grid_args(doc)
        cells = {c.key: c for c in grid_cells(gargs)}
        found = comparisons(doc["cells"])
        needed = sorted({(key, "default") for key, *_ in found} | {(k, o) for k, _, o, _ in found})
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = {kp: pool.submit(simulate_cell, cells[kp[0]], kp[1], gargs) for kp in needed}
            replays = {kp: f.result() for kp, f in futures.items()}
        rows = []
        for key, goal, other, kind in found:
            mine, theirs = replays[key, "default"], replays[key, other]
            recorded = doc["cells"][key]
            row: dict[str, Any] = {"cell": key, "goal": goal.name, "kind": kind, "against": other}
            # The grid's JSON rounds its figures to 6 decimals.
            replayed = tuple(_round6(goal.exact(r)) for r in (mine, theirs))
            if replayed != (recorded["default"][goal.field], recorded[other][goal.field]):
                row["reproduced"] = False
                not_reproduced += 1
            else:
                arrays = goal.per_request(mine), goal.per_request(theirs)
                row |= judge(*arrays, goal, args.resamples, args.block)
                total = totals[goal.name]
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


def _round6(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


if __name__ == "__main__":
    raise SystemExit(main())

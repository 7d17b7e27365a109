"""How one policy's figures moved between two sets of policy grids, cell by cell.

A change to a policy is measured by replaying it over copies of the written grids
(`policy_grid.py --update COPY --policy default`: the other policies' figures stay, so
each cell compares the changed policy against the same peers) and comparing each copy
with the grid it was copied from:

    python -m smart_epp.benchmarks.grid_change --before benchmarks/results \\
        --after /tmp/regrid [--policy default] [--out FILE]

Every grid file present in both folders is compared. Per grid: the policy's misses of
the goals (TTFT p90 within 3% of the best policy's, p50 within 10%, output tokens/s while
the requests arrive within 2%), its mean rank by p90, the geometric mean over the cells of
its p90 relative to the best other policy, and its worst cell. Over all grids: that
relative p90's geometric change per workload, and the cells it moved by more than 10%.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from smart_epp.benchmarks.policy_grid import P50_GOAL, P90_GOAL, TOKENS_GOAL, relative_p90

BIG_MOVE = 1.10


def _best_other(per_policy: Mapping[str, Mapping[str, Any]], policy: str, field: str) -> float:
    values = [s[field] for name, s in per_policy.items() if name != policy and s[field]]
    return min(values) if values else math.nan


def grid_figures(doc: Mapping[str, Any], policy: str) -> dict[str, Any]:
    """The policy's goal misses, mean rank, and p90 relative to the best other policy."""
    cells = {key: per_policy for key, per_policy in doc["cells"].items() if policy in per_policy}
    to_best = relative_p90(cells)
    misses = {"p90": 0, "p50": 0, "tokens_while_arriving": 0}
    relative: dict[str, float] = {}
    ranks: list[int] = []
    for key, per_policy in cells.items():
        mine = per_policy[policy]
        ranks.append(sorted(to_best[key].values()).index(to_best[key][policy]) + 1)
        if to_best[key][policy] > P90_GOAL:
            misses["p90"] += 1
        best_p50 = min(s["ttft_p50_s"] for s in per_policy.values() if s["ttft_p50_s"])
        if mine["ttft_p50_s"] > P50_GOAL * best_p50:
            misses["p50"] += 1
        arriving = [s.get("output_tok_per_s_while_arriving") for s in per_policy.values()]
        best_arriving = max(arriving) if None not in arriving else None
        if best_arriving and mine["output_tok_per_s_while_arriving"] < TOKENS_GOAL * best_arriving:
            misses["tokens_while_arriving"] += 1
        relative[key] = mine["ttft_p90_s"] / _best_other(per_policy, policy, "ttft_p90_s")
    worst = max(relative, key=lambda k: relative[k]) if relative else None
    return {
        "cells": len(relative),
        "misses": misses,
        "mean_rank_p90": round(sum(ranks) / len(ranks), 2) if ranks else None,
        "p90_over_best_other_geomean": _geomean(relative.values()),
        "worst_cell": {"cell": worst, "p90_over_best_other": relative[worst]} if worst else None,
        "p90_over_best_other": relative,
    }


def _geomean(values: Any) -> float | None:
    logs = [math.log(v) for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(logs) / len(logs)) if logs else None


def compare(before: Path, after: Path, policy: str) -> dict[str, Any]:
    grids: dict[str, Any] = {}
    moves: list[tuple[float, str, str, float, float]] = []
    by_workload: dict[str, list[float]] = defaultdict(list)
    for path in sorted(after.glob("*.json")):
        old_path = before / path.name
        if not old_path.exists():
            continue
        new_doc, old_doc = json.loads(path.read_text()), json.loads(old_path.read_text())
        if "cells" not in new_doc or new_doc.get("cells", {}).keys() != old_doc["cells"].keys():
            continue
        old, new = grid_figures(old_doc, policy), grid_figures(new_doc, policy)
        if not old["cells"] or old["cells"] != new["cells"]:
            continue  # the policy was not in the written grid: nothing to compare with
        for key, ratio in new["p90_over_best_other"].items():
            was = old["p90_over_best_other"][key]
            change = math.log(ratio / was)
            moves.append((change, path.stem, key, was, ratio))
            by_workload[key.split(" ")[0]].append(change)
        grids[path.stem] = {
            "before": {k: v for k, v in old.items() if k != "p90_over_best_other"},
            "after": {k: v for k, v in new.items() if k != "p90_over_best_other"},
        }
    moves.sort()
    big = math.log(BIG_MOVE)
    totals = {
        side: {
            goal: sum(g[side]["misses"][goal] for g in grids.values())
            for goal in ("p90", "p50", "tokens_while_arriving")
        }
        for side in ("before", "after")
    }
    return {
        "policy": policy,
        "before": str(before),
        "after": str(after),
        "grids": grids,
        "misses_in_all": totals,
        "cells": len(moves),
        "p90_over_best_other_change_geomean": math.exp(sum(m[0] for m in moves) / len(moves))
        if moves
        else None,
        "by_workload": {
            w: {"cells": len(v), "change_geomean": math.exp(sum(v) / len(v))}
            for w, v in sorted(by_workload.items())
        },
        "moved_worse_beyond_10pct": [
            {"grid": g, "cell": c, "before": b, "after": a} for d, g, c, b, a in moves if d > big
        ][::-1],
        "moved_better_beyond_10pct": [
            {"grid": g, "cell": c, "before": b, "after": a} for d, g, c, b, a in moves if d < -big
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="folder of the written grids")
    ap.add_argument("--after", type=Path, required=True, help="folder of the re-run copies")
    ap.add_argument("--policy", default="default")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    result = compare(args.before, args.after, args.policy)
    if not result["grids"]:
        ap.error(f"no grid file is in both {args.before} and {args.after}")
    for name, grid in result["grids"].items():
        b, a = grid["before"], grid["after"]
        print(
            f"{name:45s} misses {'/'.join(str(v) for v in b['misses'].values()):>8s} -> "
            f"{'/'.join(str(v) for v in a['misses'].values()):8s} rank "
            f"{b['mean_rank_p90']:.2f} -> {a['mean_rank_p90']:.2f}  worst "
            f"{b['worst_cell']['p90_over_best_other']:.2f} -> "
            f"{a['worst_cell']['p90_over_best_other']:.2f}"
        )
    print("misses (p90/p50/tokens) in all:", result["misses_in_all"])
    change = result["p90_over_best_other_change_geomean"]
    print(f"p90 over the best other, geometric change: {change:.4f}")
    for workload, figures in result["by_workload"].items():
        print(f"  {workload}: {figures['cells']} cells, {figures['change_geomean']:.4f}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

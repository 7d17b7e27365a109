"""The default policy with one predicted-ttft-scorer parameter varied, over committed grids.

    .venv/bin/python benchmarks/weight_sweep.py --param decodeStallWeight \\
        --values 0 0.05 0.1 0.15 0.25 1 [--grids STEM ...] [--jobs N] [--out FILE]

Each committed grid file (`benchmarks/results/<STEM>.json`, written by `policy_grid.py`) is
replayed again for `default` alone, with the parameter set to each value, in the same
cells: the options come from the command the file records. Every other policy's figures
are read from the file; they do not depend on the default's parameters (each policy runs
on a fresh simulated pool). Per grid and value it reports `default`'s mean rank by TTFT
p90 among all the file's policies, its goal misses as `policy_grid.py` counts them (p90
over 1.03x the best, p50 over 1.10x, output tokens/s while arriving under 0.98x), and the
geometric means over the cells of its p90 / the best p90 and of its tokens/s while arriving
/ the best. Grids whose seed is 0 are labelled `tuning` (a value is chosen on those), the
others, and those of later stretches of the Mooncake trace, `held-out`. Writes
`benchmarks/results/weight_sweep_<param>.json` by default.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from smart_epp.benchmarks.policy_grid import (
    Cell,
    goals,
    grid_args,
    grid_cells,
    relative_p90,
    run_cell_with_options,
)
from smart_epp.epp.config import builtin_config_text, load_config

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
SCORER = "predicted-ttft-scorer"
DEFAULT_GRIDS = (
    "policy_grid",
    "policy_grid_h200_forward",
    "policy_grid_kv64k",
    "policy_grid_pod_slowdowns",
    "policy_grid_zipf",
    "policy_grid_seed1",
    "policy_grid_seed2",
    "policy_grid_h200_forward_seed1",
    "policy_grid_kv64k_seed1",
    "policy_grid_pod_slowdowns_seed1",
    "policy_grid_zipf_seed1",
    "policy_grid_seed3",
    "policy_grid_pod_slowdowns_seed2",
    "policy_grid_kv64k_seed2",
    "policy_grid_zipf_seed2",
    # Held out since they were written: seeds no variant was ever tried on, without
    # Mooncake cells (those replay the same trace requests under every seed).
    "policy_grid_seed4",
    "policy_grid_seed5",
    "policy_grid_seed6",
    "policy_grid_kv64k_seed3",
    "policy_grid_pod_slowdowns_seed3",
    "policy_grid_zipf_seed3",
    "policy_grid_zipf_seed4",
    "policy_grid_zipf_seed5",
    # Ten times the default cell (2000 requests, 1x attention): past saturation the queues
    # last minutes there, which 200-request cells do not reach.
    "policy_grid_2000",
    "policy_grid_2000_seed1",
    "policy_grid_2000_seed2",
    # Later stretches of the Mooncake trace (its requests 600-799, 1200-1399, ...), held out
    # since they were written: every other grid's Mooncake cells are its first 200.
    *(f"policy_grid_mooncake_from{start}" for start in range(600, 3601, 600)),
)


def variant_config(param: str, value: float, folder: Path) -> str:
    """The default EndpointPickerConfig with `param` of its TTFT scorer set to `value`."""
    doc = yaml.safe_load(builtin_config_text("default"))
    scorers = [p for p in doc["plugins"] if p["type"] == SCORER]
    if len(scorers) != 1:
        raise SystemExit(f"the default config has {len(scorers)} {SCORER} plugins, expected 1")
    scorers[0].setdefault("parameters", {})[param] = value
    path = folder / f"default-{param}-{value:g}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    load_config(str(path))  # an unknown parameter fails here, before any cell runs
    return str(path)


def grid_role(doc: dict[str, Any]) -> str:
    """`tuning` for a seed-0 grid of the Mooncake trace's first requests, else `held-out`."""
    return "tuning" if doc["seed"] == 0 and not doc.get("mooncake_start") else "held-out"


def run_variant(cell: Cell, config: str, args: argparse.Namespace) -> dict[str, Any]:
    return run_cell_with_options(cell, [config], args)[config]


def summarize_variant(
    committed: dict[str, dict[str, Any]], variant: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    cells = {key: {**per, "default": variant[key]} for key, per in committed.items()}
    g = goals(cells, "default")
    p90_ratios = [rel["default"] for rel in relative_p90(cells).values()]
    tput_ratios = []
    for per in cells.values():
        mine = per["default"]
        best = max(s["output_tok_per_s_while_arriving"] for s in per.values())
        tput_ratios.append(mine["output_tok_per_s_while_arriving"] / best)
    return {
        "mean_rank_p90": g["mean_rank_p90"]["default"],
        "p90_misses": sum(": p90 " in m for m in g["misses"]),
        "p50_misses": sum(": p50 " in m for m in g["misses"]),
        "tok_per_s_while_arriving_misses": len(g["output_tok_per_s_while_arriving_misses"]),
        "p90_over_best_geomean": round(_geomean(p90_ratios), 4),
        "p90_over_best_worst": round(max(p90_ratios), 3),
        "tok_per_s_while_arriving_over_best_geomean": round(_geomean(tput_ratios), 4),
    }


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--param", required=True, help=f"a parameter of {SCORER}")
    ap.add_argument("--values", nargs="+", type=float, required=True)
    ap.add_argument("--grids", nargs="+", default=list(DEFAULT_GRIDS), metavar="STEM")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    docs = {stem: json.loads((RESULTS / f"{stem}.json").read_text()) for stem in args.grids}
    for stem, doc in docs.items():
        cells = doc["cells"].values()
        if any(
            s.get("output_tok_per_s_while_arriving") is None for per in cells for s in per.values()
        ):
            raise SystemExit(f"{stem}.json predates output_tok_per_s_while_arriving: re-run it")
    report: dict[str, Any] = {
        "what": f"default with {SCORER} {args.param} varied; other policies as committed",
        "command": "benchmarks/weight_sweep.py " + " ".join(argv or sys.argv[1:]),
        "grids": {},
    }
    # A worker's memory grows with the cells it has run (each builds its own traces and
    # pools), so each grid gets a fresh pool of workers.
    variants: dict[tuple[str, float], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        configs = {v: variant_config(args.param, v, Path(tmp)) for v in args.values}
        for stem, doc in docs.items():
            gargs = grid_args(doc)
            with ProcessPoolExecutor(args.jobs) as pool:
                futures = {
                    (value, cell.key): pool.submit(run_variant, cell, config, gargs)
                    for value, config in configs.items()
                    for cell in grid_cells(gargs)
                }
                for (value, key), fut in futures.items():
                    variants.setdefault((stem, value), {})[key] = fut.result()
    totals: dict[str, dict[float, list[dict[str, Any]]]] = {"tuning": {}, "held-out": {}}
    for stem, doc in docs.items():
        role = grid_role(doc)
        rows = {}
        for value in args.values:
            row = summarize_variant(doc["cells"], variants[stem, value])
            rows[f"{value:g}"] = row
            totals[role].setdefault(value, []).append(row | {"cells": len(doc["cells"])})
            print(f"{stem:34s} {role:8s} {args.param}={value:g}: {row}", file=sys.stderr)
        report["grids"][stem] = {"role": role, "seed": doc["seed"], "by_value": rows}
    report["totals"] = {
        role: {f"{v:g}": _total(rows) for v, rows in by_value.items()}
        for role, by_value in totals.items()
        if by_value
    }
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out = args.out or RESULTS / f"weight_sweep_{args.param}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["totals"], indent=1))
    print(f"wall {report['wall_s']} s; wrote {out}")
    return 0


def _total(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Misses summed; rank and geometric means weighted by the grids' cell counts."""
    cells = sum(r["cells"] for r in rows)

    def weighted_geomean(field: str) -> float:
        return round(math.exp(sum(r["cells"] * math.log(r[field]) for r in rows) / cells), 4)

    return {
        "grids": len(rows),
        "cells": cells,
        "mean_rank_p90": round(sum(r["cells"] * r["mean_rank_p90"] for r in rows) / cells, 3),
        "p90_misses": sum(r["p90_misses"] for r in rows),
        "p50_misses": sum(r["p50_misses"] for r in rows),
        "tok_per_s_while_arriving_misses": sum(r["tok_per_s_while_arriving_misses"] for r in rows),
        "p90_over_best_geomean": weighted_geomean("p90_over_best_geomean"),
        "p90_over_best_worst": max(r["p90_over_best_worst"] for r in rows),
        "tok_per_s_while_arriving_over_best_geomean": weighted_geomean(
            "tok_per_s_while_arriving_over_best_geomean"
        ),
    }


if __name__ == "__main__":
    raise SystemExit(main())

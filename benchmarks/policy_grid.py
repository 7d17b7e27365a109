"""Every routing policy over a grid of workloads x loads x prefill-attention costs.

    .venv/bin/python benchmarks/policy_grid.py [--requests N] [--pods N] [--jobs N]
        [--seed S] [--pod-slowdowns F,F,...] [--kv-tokens N] [--mooncake-start I]
        [--scrape-interval S] [--kv-event-delay S] [--name STEM]

Cells: traces {Mooncake synthetic (N consecutive requests of the real trace, its first
unless `--mooncake-start` says otherwise, with their own arrival pattern time-scaled), an
llm-d-shaped shared-prefix workload (distinct prompts, no prompt repeated), a ShareGPT-style
multi-turn chat workload (seeded log-normal turn lengths)}
x offered load {30%, 75%, 110% of the pool's raw prefill capacity: prompt tokens/s offered
over pods / prefill_s_per_token, before any cache hit} x prefill attention per token pair
{0, the profile value, 2x it}. Each cell replays the same requests, arrivals and seed for
every policy in the discrete-event simulator (`epp replay`'s engine, virtual time).

Cells are small on purpose (200 requests on 4 pods by default, 27 cells x 8 policies) so
the grid fits a shared machine: it took 27 minutes with --jobs 2 on this project's 2-core
machine at a load average near 20. A cell is a sample, not a long-run average, and its
numbers move with the seed. Writes `benchmarks/results/policy_grid.json` and a heat map of
each policy's TTFT p90 relative to the best policy of its cell
(`benchmarks/results/policy_grid_ttft_p90.png`).

The pool is identical pods with the profile's large KV cache unless told otherwise:
`--pod-slowdowns` makes some pods slower (mixed GPUs; the offered load then counts the
pool's capacity at those speeds) and `--kv-tokens` gives every pod a smaller cache, so
prefixes are evicted (`policy_grid_pod_slowdowns*.json`, `policy_grid_kv64k*.json`).
The routers hear of the pods as `epp serve` does by default (a scrape every 50 ms, KV events
50 ms after their step) unless `--scrape-interval` and `--kv-event-delay` make that later.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from smart_epp.benchmarks.replay.arrivals import poisson_arrivals, scaled_arrivals
from smart_epp.benchmarks.replay.cli import Workload, simulate_policy
from smart_epp.benchmarks.replay.report import RequestResult, summarize
from smart_epp.benchmarks.replay.sim import SimConfig, parse_slowdowns, pod_address
from smart_epp.benchmarks.replay.traces import (
    SharedPrefixSpec,
    TraceRequest,
    _seeded_tokens,
    generate_shared_prefix,
    load_trace,
)
from smart_epp.benchmarks.sim.profiles import PROFILES

ROOT = Path(__file__).resolve().parent
MOONCAKE = ROOT / "traces" / "mooncake_synthetic_trace.jsonl"
BASE_PROFILE = "h100-llama3-8b"
ATTENTION_FACTORS = (0.0, 1.0, 2.0)
LOADS = (0.3, 0.75, 1.1)
TRACES = ("mooncake", "shared-prefix", "multi-turn")
# The goals set for the default policy (benchmarks/RESULTS.md, "Routing policies"), as its
# figure over the best policy's in a cell: TTFT p90 and p50 at most, output tokens/s at least.
P90_GOAL = 1.03
P50_GOAL = 1.10
TOKENS_GOAL = 0.98
# Not in the default grid: the shared-prefix shape with groups of unequal popularity.
EXTRA_TRACES = ("shared-prefix-zipf",)
POLICIES = (
    "default",
    "llmd-precise",
    "gie-default",
    "aibrix-prefix-cache",
    "sglang-cache-aware",
    "least-queue",
    "round-robin",
    "full-information",
)
MODEL = "model"
BLOCK_SIZE = SimConfig().block_size
# The signals' timing every grid runs with unless told otherwise.
SIGNALS = SimConfig()


def grid_profile(factor: float, base_name: str = BASE_PROFILE) -> str:
    """Registers the base profile with `factor` x its prefill attention cost (the default
    base's is a roofline estimate, hence the 0x and 2x cells) and returns the variant's
    name."""
    name = f"{base_name}-attn{factor:g}x"
    if name not in PROFILES:
        base = PROFILES[base_name]
        PROFILES[name] = base.model_copy(
            update={
                "name": name,
                "prefill_attention_s_per_token_pair": factor
                * base.prefill_attention_s_per_token_pair,
            }
        )
    return name


class _Shape(TypedDict):
    system_prompt_len: int
    question_len: int
    output_len: int


# llm-d's benchmark shape: 6,000-token system prompts, 1,200-token questions.
LLMD_SHAPE: _Shape = {"system_prompt_len": 6000, "question_len": 1200, "output_len": 200}


def shared_prefix_workload(n: int, seed: int) -> list[TraceRequest]:
    """llm-d's benchmark shape (6,000-token system prompts, 1,200-token questions) scaled
    to `n` distinct prompts: 5 per group, so every request is a different prompt."""
    spec = SharedPrefixSpec(
        num_groups=max(1, n // 5),
        num_prompts_per_group=5,
        **LLMD_SHAPE,
    )
    return generate_shared_prefix(spec, seed=seed, model=MODEL)[:n]


def zipf_shared_prefix_workload(n: int, seed: int) -> list[TraceRequest]:
    """The shared-prefix shape with groups of unequal popularity, as real system prompts
    are: `n` distinct prompts over n // 5 groups, group k's share of them proportional to
    1 / k (Zipf, exponent 1), in a seeded random order."""
    groups = max(1, n // 5)
    weights = [1.0 / (k + 1) for k in range(groups)]
    total = sum(weights)
    quota = [max(1, round(n * w / total)) for w in weights]
    spec = SharedPrefixSpec(
        num_groups=groups,
        num_prompts_per_group=max(quota),
        **LLMD_SHAPE,
    )
    kept = dict.fromkeys(range(groups), 0)
    out: list[TraceRequest] = []
    for request in generate_shared_prefix(spec, seed=seed, model=MODEL):
        g = int((request.group or "group-0").removeprefix("group-"))
        if kept[g] < quota[g]:
            kept[g] += 1
            request.index = len(out)
            out.append(request)
    return out[:n]


def multi_turn_workload(n: int, seed: int) -> list[TraceRequest]:
    """ShareGPT-like chats: each turn carries the conversation so far. Turn lengths are
    log-normal (user median ~120 tokens, assistant ~250, heavy tails), 2-8 turns per chat,
    a 500-token system prompt shared by all; conversations interleave turn by turn."""
    rng = np.random.default_rng(seed)
    system = _seeded_tokens(f"mt:{seed}:system", 500)
    chats: list[list[TraceRequest]] = []
    total = 0
    c = 0
    while total < n:
        history: list[Any] = [system]
        turns: list[TraceRequest] = []
        for k in range(int(rng.integers(2, 9))):
            user = int(min(4000, max(8, rng.lognormal(math.log(120), 1.0))))
            answer = int(min(2000, max(8, rng.lognormal(math.log(250), 0.8))))
            history.append(_seeded_tokens(f"mt:{seed}:{c}:u{k}", user))
            turns.append(TraceRequest(0, 0.0, answer, tuple(history), MODEL, f"chat-{c}"))
            history.append(_seeded_tokens(f"mt:{seed}:{c}:a{k}", answer))
        chats.append(turns)
        total += len(turns)
        c += 1
    # A turn follows the previous turn of its chat: round-robin over live chats.
    out: list[TraceRequest] = []
    depth = 0
    while len(out) < n:
        for turns in chats:
            if depth < len(turns) and len(out) < n:
                req = turns[depth]
                req.index = len(out)
                out.append(req)
        depth += 1
    return out


def mooncake_window(n: int, start: int = 0) -> list[TraceRequest]:
    """Requests `start` to `start + n` of the Mooncake trace, indexed from 0 and their
    timestamps from the first one's: a later stretch of the same service's traffic, as a
    freshly started pool would see it. The seed does not choose the stretch (every seed's
    Mooncake cells replay the same requests); this does."""
    if start < 0:
        raise ValueError("the window's start must be >= 0")
    requests = load_trace(MOONCAKE, "mooncake", start + n, 0, MODEL)[start:]
    if len(requests) < n:
        raise ValueError(f"the Mooncake trace has no {n} requests from request {start}")
    t0 = min(r.timestamp_s for r in requests)
    for i, r in enumerate(requests):
        r.index = i
        r.timestamp_s -= t0
    return requests


def request_index(text: str) -> int:
    """An argparse type: a request's index in a trace (an int >= 0)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a request index (an integer >= 0)")
    return value


def signal_delay(text: str) -> float:
    """An argparse type: how late the router hears of a pod, in seconds (a number > 0)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a delay in seconds (a number > 0)")
    return value


def load_workload(trace: str, n: int, seed: int, mooncake_start: int = 0) -> list[TraceRequest]:
    if trace == "mooncake":
        return mooncake_window(n, mooncake_start)
    if trace == "shared-prefix":
        return shared_prefix_workload(n, seed)
    if trace == "shared-prefix-zipf":
        return zipf_shared_prefix_workload(n, seed)
    return multi_turn_workload(n, seed)


def pool_speed(pods: int, slowdowns: tuple[float, ...]) -> float:
    """The pool's prefill capacity in pods of the profile's speed."""
    config = SimConfig(pods=pods, pod_slowdowns=slowdowns)
    return sum(1.0 / config.slowdown(i) for i in range(pods))


def arrivals_for_load(
    trace: str,
    requests: Sequence[TraceRequest],
    load: float,
    pods: int,
    seed: int,
    slowdowns: tuple[float, ...] = (),
    profile: str = BASE_PROFILE,
) -> list[float]:
    """Arrival times offering `load` x the pool's raw prefill capacity in prompt tokens/s."""
    capacity = pool_speed(pods, slowdowns) / PROFILES[profile].prefill_s_per_token
    tokens = sum(r.input_tokens for r in requests)
    if trace == "mooncake":
        natural = scaled_arrivals(requests, 1.0)
        span = max(natural) - min(natural) or 1.0
        speedup = (tokens / span) / (load * capacity)
        return scaled_arrivals(requests, 1.0 / speedup)
    qps = load * capacity / (tokens / len(requests))
    return poisson_arrivals(len(requests), qps, seed)


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    trace: str
    load: float
    attention: float

    @property
    def key(self) -> str:
        return f"{self.trace} load={self.load:g} attn={self.attention:g}x"


def cell_setup(
    cell: Cell,
    n: int,
    pods: int,
    seed: int,
    slowdowns: tuple[float, ...] = (),
    kv_tokens: int | None = None,
    profile: str = BASE_PROFILE,
    mooncake_start: int = 0,
    context_limits: bool = False,
    scrape_interval_s: float = SIGNALS.scrape_interval_s,
    kv_event_delay_s: float = SIGNALS.kv_event_delay_s,
) -> tuple[Workload, SimConfig]:
    """One cell's requests with their arrivals, and its pool."""
    requests = load_workload(cell.trace, n, seed, mooncake_start)
    arrivals = arrivals_for_load(cell.trace, requests, cell.load, pods, seed, slowdowns, profile)
    # Requests longer than the profile's context are rejected, the same ones for every policy.
    config = SimConfig(
        pods=pods,
        profile=grid_profile(cell.attention, profile),
        model=MODEL,
        pod_slowdowns=slowdowns,
        num_blocks=None if kv_tokens is None else kv_tokens // BLOCK_SIZE,
        context_limits=context_limits,
        scrape_interval_s=scrape_interval_s,
        kv_event_delay_s=kv_event_delay_s,
    )
    return Workload(requests, arrivals), config


def cell_setup_with_options(cell: Cell, args: argparse.Namespace) -> tuple[Workload, SimConfig]:
    """`cell_setup` with the pool and workload options of a parsed grid command line."""
    return cell_setup(
        cell,
        args.requests,
        args.pods,
        args.seed,
        args.pod_slowdowns,
        args.kv_tokens,
        args.profile,
        args.mooncake_start,
        args.context_limits,
        args.scrape_interval,
        args.kv_event_delay,
    )


def simulate_cell(cell: Cell, policy: str, args: argparse.Namespace) -> list[RequestResult]:
    """One policy over one cell's requests on a fresh pool, with a grid command line's
    options: every request's result."""
    workload, config = cell_setup_with_options(cell, args)
    return simulate_policy(policy, workload, config, args.seed)


def run_policies(
    workload: Workload, config: SimConfig, policies: Sequence[str], seed: int
) -> dict[str, dict[str, Any]]:
    """Each policy's summary over the same requests, each on a fresh pool."""
    addresses = [pod_address(i) for i in range(config.pods)]
    out: dict[str, dict[str, Any]] = {}
    for name in policies:
        started = time.perf_counter()
        results = simulate_policy(name, workload, config, seed)
        summary = summarize(results, addresses).as_json()
        summary["wall_s"] = round(time.perf_counter() - started, 2)
        out[name] = summary
    return out


def run_cell(
    cell: Cell,
    policies: Sequence[str],
    n: int,
    pods: int,
    seed: int,
    slowdowns: tuple[float, ...] = (),
    kv_tokens: int | None = None,
    profile: str = BASE_PROFILE,
) -> dict[str, dict[str, Any]]:
    workload, config = cell_setup(cell, n, pods, seed, slowdowns, kv_tokens, profile)
    return run_policies(workload, config, policies, seed)


def run_cell_with_options(
    cell: Cell, policies: Sequence[str], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """`run_cell` with the pool and workload options of a parsed grid command line."""
    workload, config = cell_setup_with_options(cell, args)
    return run_policies(workload, config, policies, args.seed)


def relative_p90(cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    rel: dict[str, dict[str, float]] = {}
    for key, per_policy in cells.items():
        p90 = {n: s["ttft_p90_s"] for n, s in per_policy.items() if s["ttft_p90_s"]}
        best = min(p90.values())
        rel[key] = {n: v / best for n, v in p90.items()}
    return rel


def plot(rel: dict[str, dict[str, float]], policies: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(rel)
    data = np.array([[rel[k].get(p, np.nan) for p in policies] for k in keys])
    fig, ax = plt.subplots(figsize=(1.1 * len(policies) + 3, 0.38 * len(keys) + 1.8))
    shown = np.clip(data, 1.0, 3.0)
    im = ax.imshow(shown, cmap="RdYlGn_r", vmin=1.0, vmax=3.0, aspect="auto")
    ax.set_xticks(range(len(policies)), policies, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(keys)), keys, fontsize=8)
    for i in range(len(keys)):
        for j in range(len(policies)):
            v = data[i, j]
            if not np.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="TTFT p90 / best policy's in the cell (clipped at 3)")
    ax.set_title("TTFT p90 relative to the best policy per cell (1.00 = best)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goals(cells: dict[str, dict[str, Any]], policy: str) -> dict[str, Any]:
    """How `policy` fares against the goals set for the default policy
    (benchmarks/RESULTS.md, "Routing policies"), per cell."""
    rel = relative_p90(cells)
    ranks: dict[str, list[int]] = {}
    misses: list[str] = []
    # The same 2% rule on output tokens/s while the requests arrive: a cell whose
    # arrivals end long before its longest answers has its makespan rate set by a few
    # decodes at the end (benchmarks/RESULTS.md, "Routing policies").
    arriving_misses: list[str] = []
    for key, per_policy in cells.items():
        order = sorted(rel[key], key=lambda n: rel[key][n])
        for n in order:
            ranks.setdefault(n, []).append(order.index(n) + 1)
        best_p50 = min(s["ttft_p50_s"] for s in per_policy.values() if s["ttft_p50_s"])
        best_tput = max(s["output_tok_per_s"] for s in per_policy.values())
        mine = per_policy[policy]
        if rel[key][policy] > P90_GOAL:
            misses.append(f"{key}: p90 {rel[key][policy]:.2f}x best")
        if mine["ttft_p50_s"] > P50_GOAL * best_p50:
            misses.append(f"{key}: p50 {mine['ttft_p50_s'] / best_p50:.2f}x best")
        if mine["output_tok_per_s"] < TOKENS_GOAL * best_tput:
            misses.append(f"{key}: output tok/s {mine['output_tok_per_s'] / best_tput:.3f}x best")
        arriving = [s["output_tok_per_s_while_arriving"] for s in per_policy.values()]
        if None not in arriving:
            ratio = mine["output_tok_per_s_while_arriving"] / max(arriving)
            if ratio < TOKENS_GOAL:
                arriving_misses.append(f"{key}: output tok/s while arriving {ratio:.3f}x best")
    mean_rank = {n: round(float(np.mean(r)), 2) for n, r in ranks.items()}
    return {
        "mean_rank_p90": dict(sorted(mean_rank.items(), key=lambda kv: kv[1])),
        "misses": misses,
        "output_tok_per_s_while_arriving_misses": arriving_misses,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per cell")
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2, help="cells run in parallel")
    ap.add_argument("--trace", nargs="+", choices=TRACES + EXTRA_TRACES, default=list(TRACES))
    ap.add_argument("--load", nargs="+", type=float, default=list(LOADS))
    ap.add_argument("--attention", nargs="+", type=float, default=list(ATTENTION_FACTORS))
    ap.add_argument("--policy", nargs="+", default=list(POLICIES))
    ap.add_argument(
        "--pod-slowdowns",
        type=parse_slowdowns,
        default=(),
        metavar="F,F,...",
        help="each pod's step time as a multiple of the profile's, pod 0 first (default: "
        "identical pods); the offered load counts the pool's capacity at these speeds",
    )
    ap.add_argument(
        "--kv-tokens",
        type=int,
        metavar="N",
        help="each pod's KV-cache capacity in tokens (default: the profile's, "
        f"{PROFILES[BASE_PROFILE].kv_tokens:,}); smaller caches put prefixes under eviction "
        "pressure, as on GPUs with less memory left after the weights",
    )
    ap.add_argument(
        "--profile",
        default=BASE_PROFILE,
        choices=sorted(n for n in PROFILES if "-attn" not in n),
        help="the pods' latency profile, whose attention cost the grid scales "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--mooncake-start",
        type=request_index,
        default=0,
        metavar="I",
        help="the Mooncake cells replay the trace's requests from request I on (default: "
        "its first): the seed varies the generated workloads but not this trace, so "
        "later stretches of it are the held-out Mooncake data",
    )
    ap.add_argument(
        "--context-limits",
        action="store_true",
        help="smart-epp's pickers check each prompt against the pods' context length, as "
        "`epp serve` does: a prompt longer than the profile's (a tenth to a quarter of "
        "each Mooncake stretch) is refused by the picker instead of by a pod, and is not "
        "priced meanwhile; off by default, as the committed grids were run",
    )
    ap.add_argument(
        "--scrape-interval",
        type=signal_delay,
        default=SIGNALS.scrape_interval_s,
        metavar="S",
        help="every router reads the pods' /metrics this often (default: %(default)s s)",
    )
    ap.add_argument(
        "--kv-event-delay",
        type=signal_delay,
        default=SIGNALS.kv_event_delay_s,
        metavar="S",
        help="a pod's KV events reach the routers that read them this long after the step "
        "that stored the blocks (default: %(default)s s); with --scrape-interval, how stale "
        "the routers' view of the pool is",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.add_argument("--name", default="policy_grid")
    ap.add_argument(
        "--update",
        type=Path,
        metavar="FILE",
        help="re-run only --policy on the cells of a written grid FILE, with the pool and "
        "workload options recorded in it, and replace those policies' figures there (the "
        "others' stay: each policy replays the same requests on a fresh pool, so one "
        "policy's change moves no other's figures); the file's heat map is redrawn",
    )
    return ap


def grid_args(doc: dict[str, Any]) -> argparse.Namespace:
    """The options a committed grid file was written with."""
    words = shlex.split(doc["command"])[1:]
    return build_parser().parse_args(words)


def grid_cells(args: argparse.Namespace) -> list[Cell]:
    return [Cell(t, ld, a) for t in args.trace for ld in args.load for a in args.attention]


def update_grid(path: Path, policies: Sequence[str], jobs: int, command: str) -> dict[str, Any]:
    """Re-runs `policies` on the cells of the grid file at `path` and writes their figures
    over the file's, recomputing what derives from them; returns the updated document."""
    doc: dict[str, Any] = json.loads(path.read_text())
    args = grid_args(doc)
    cells = [c for c in grid_cells(args) if c.key in doc["cells"]]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {c.key: pool.submit(run_cell_with_options, c, policies, args) for c in cells}
        for key, fut in futures.items():
            doc["cells"][key].update(fut.result())
    doc["ttft_p90_relative_to_best"] = relative_p90(doc["cells"])
    if "goals_default" in doc:
        doc["goals_default"] = goals(doc["cells"], "default")
    doc.setdefault("updates", []).append({"policies": list(policies), "command": command})
    path.write_text(json.dumps(doc, indent=1) + "\n")
    heat_map = path.with_name(f"{path.stem}_ttft_p90.png")
    if heat_map.exists():
        shown = list(next(iter(doc["cells"].values())))
        plot(doc["ttft_p90_relative_to_best"], shown, heat_map)
    return doc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.update is not None:
        command = "benchmarks/policy_grid.py " + " ".join(argv or sys.argv[1:])
        doc = update_grid(args.update, args.policy, args.jobs, command)
        print(json.dumps(doc.get("goals_default", {}), indent=1))
        print(f"updated {', '.join(args.policy)} in {args.update}")
        return 0
    cells = grid_cells(args)
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {c.key: pool.submit(run_cell_with_options, c, args.policy, args) for c in cells}
        for key, fut in futures.items():
            results[key] = fut.result()
            best = min(s["ttft_p90_s"] for s in results[key].values())
            line = ", ".join(f"{n} {s['ttft_p90_s'] / best:.2f}" for n, s in results[key].items())
            print(f"{key}: p90/best {line}", file=sys.stderr, flush=True)
    rel = relative_p90(results)
    doc = {
        "what": "TTFT/throughput per policy per cell, sim mode (virtual time)",
        "command": "benchmarks/policy_grid.py " + " ".join(argv or sys.argv[1:]),
        "requests_per_cell": args.requests,
        "pods": args.pods,
        "pod_slowdowns": list(args.pod_slowdowns),
        "kv_tokens_per_pod": args.kv_tokens or PROFILES[args.profile].kv_tokens,
        "seed": args.seed,
        "mooncake_start": args.mooncake_start,
        "context_limits": args.context_limits,
        "scrape_interval_s": args.scrape_interval,
        "kv_event_delay_s": args.kv_event_delay,
        "profile": args.profile,
        "profile_attention_s_per_pair": PROFILES[args.profile].prefill_attention_s_per_token_pair,
        "load_definition": "offered prompt tokens/s / (pods / prefill_s_per_token)",
        "wall_s": round(time.perf_counter() - started, 1),
        "cells": results,
        "ttft_p90_relative_to_best": rel,
    }
    if "default" in args.policy:
        doc["goals_default"] = goals(results, "default")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(rel, args.policy, args.out / f"{args.name}_ttft_p90.png")
    print(json.dumps(doc.get("goals_default", {}), indent=1))
    print(f"wall {doc['wall_s']} s; wrote {args.out / args.name}.json and _ttft_p90.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

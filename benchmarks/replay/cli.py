"""`epp replay`: replay a workload through simulated pods (every policy side by side) or
against a live OpenAI endpoint, and report TTFT, throughput and cache behaviour."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ...epp.config import ConfigError, LoadedConfig, load_config
from ...epp.flowcontrol.objectives import ObjectiveTable
from ..sim.profiles import (
    DEFAULT_PROFILE,
    ProfileError,
    builtin_names,
    get_profile,
)
from ..sim.routing_latency import DEFAULT_ROUTING_LATENCY_S
from .arrivals import (
    Stage,
    ladder_arrivals,
    parse_ladder,
    poisson_arrivals,
    scaled_arrivals,
    stage_times,
)
from .live import LiveOptions, run_live
from .objectives import (
    MixEntry,
    ObjectiveSummary,
    assign_objectives,
    objective_summaries,
    parse_objective_mix,
    parse_slo,
    render_objective_table,
)
from .policies.context import PolicyContext, policy_label
from .policies.registry import (
    ALL_POLICIES,
    UnknownPolicy,
    build_pickers,
    known_policy,
)
from .report import (
    PolicySummary,
    RequestResult,
    plot_ladder,
    plot_ttft_cdf,
    render_ladder_table,
    render_table,
    results_json,
    stage_summaries,
    summarize,
    write_json,
)
from .sim import SimConfig, SimPool, Simulation, parse_slowdowns, pod_address
from .traces import (
    TRACE_FORMATS,
    TraceError,
    TraceRequest,
    infinite_cache_hit_rate,
    load_trace,
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay a trace and compare routing policies (sim) or measure an endpoint (live)",
        description=__doc__,
    )
    p.add_argument("--trace", required=True, type=Path, help="trace or workload file")
    p.add_argument("--format", choices=TRACE_FORMATS, help="trace format (default: detect)")
    p.add_argument("--pods", type=int, default=8, help="simulated pods (sim mode)")
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        metavar="NAME|FILE",
        help=f"latency profile of the simulated pods: {', '.join(builtin_names())}, or a profile "
        "YAML file (default: %(default)s)",
    )
    p.add_argument(
        "--policy",
        nargs="+",
        action="extend",
        metavar="NAME",
        help=f"policies to compare in sim mode: {', '.join(ALL_POLICIES)}, or an "
        "EndpointPickerConfig file (default: all); in live mode, the label of the target",
    )
    p.add_argument("--mode", choices=("sim", "live"), default="sim")
    p.add_argument("--target", help="base URL of the OpenAI endpoint (live mode)")
    p.add_argument("--speedup", type=float, default=1.0, help="divide trace timestamps by X")
    p.add_argument("--qps", type=float, help="Poisson arrivals at Q requests/s instead")
    p.add_argument("--ladder", help="comma-separated QPS stages, e.g. 2,4,8 (Poisson each)")
    p.add_argument("--stage-duration", type=float, default=60.0, help="seconds per ladder stage")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--out", type=Path, default=Path("replay-results"), help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=64, help="live mode: requests in flight")
    p.add_argument("--block-size", type=int, default=16, help="sim mode: KV block size")
    p.add_argument(
        "--kv-event-delay", type=float, default=0.05, help="sim mode: KV event delivery delay (s)"
    )
    p.add_argument(
        "--scrape-interval", type=float, default=0.05, help="sim mode: metrics scrape period (s)"
    )
    p.add_argument("--max-model-len", type=int, help="sim mode: lower the profile's context limit")
    p.add_argument(
        "--context-limits",
        action="store_true",
        help="sim mode: smart-epp's pickers check each prompt against the pods' context "
        "length, as `epp serve` does (a prompt no pod holds is refused by the picker, "
        "not sent); off by default, as the committed policy grids were run",
    )
    p.add_argument(
        "--pod-slowdowns",
        type=parse_slowdowns,
        default=(),
        metavar="F,F,...",
        help="sim mode: each pod's step time as a multiple of the profile's, pod 0 first "
        "(default: identical pods), e.g. 1,1,1.1,1.25 for a pool with two slower cards",
    )
    p.add_argument(
        "--routing-latency",
        type=float,
        default=DEFAULT_ROUTING_LATENCY_S,
        metavar="S",
        help="sim mode: seconds from a request's arrival to the pod receiving it "
        "(tokenization + decision; default %(default)s, measured by "
        "benchmarks/decision_latency.py)",
    )
    p.add_argument("--model", help="model name to send (default: the trace's, else 'model')")
    p.add_argument("--name", help="stem of the output files (default: replay_<trace name>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--objective-mix",
        metavar="NAME:PRIORITY=SHARE,...",
        help="give requests InferenceObjectives drawn with these shares (seeded), e.g. "
        "critical:2=0.3,standard:0=0.5,batch:-1=0.2; a negative priority is sheddable",
    )
    p.add_argument(
        "--slo-ttft-ms",
        metavar="MS|NAME=MS,...",
        help="TTFT SLO for every request, or per objective (critical=2000,standard=2000); "
        "the report adds goodput, the requests per second served within their SLO",
    )
    p.add_argument(
        "--flow-control",
        metavar="CONFIG",
        help="sim mode: also run every policy with the admission and flow control of this "
        "EndpointPickerConfig (a file, or a built-in such as default-flow-control), "
        "reported as <policy>+fc",
    )
    p.set_defaults(func=run)


@dataclasses.dataclass(slots=True)
class Workload:
    requests: list[TraceRequest]
    arrivals: list[float]
    stages: list[Stage] | None = None

    def stage_of(self) -> list[int | None] | None:
        if self.stages is None:
            return None
        out: list[int | None] = [None] * len(self.requests)
        for k, stage in enumerate(self.stages):
            for i in stage.requests:
                out[i] = k
        return out


def objective_mix(args: argparse.Namespace) -> list[MixEntry] | None:
    return parse_objective_mix(args.objective_mix) if args.objective_mix else None


def build_workload(args: argparse.Namespace) -> Workload:
    model = args.model or "model"
    requests = load_trace(args.trace, args.format, args.limit, args.seed, model)
    if not requests:
        raise TraceError(f"{args.trace}: no requests")
    mix = objective_mix(args)
    slo = parse_slo(args.slo_ttft_ms) if args.slo_ttft_ms else {}
    if mix or slo:
        requests = assign_objectives(requests, mix, slo, args.seed)
    if args.ladder:
        stages = ladder_arrivals(parse_ladder(args.ladder), args.stage_duration)
        total = stages[-1].requests.stop
        # A ladder needs as many requests as its stages send: reuse the workload in order.
        cycled = [dataclasses.replace(requests[i % len(requests)], index=i) for i in range(total)]
        return Workload(cycled, stage_times(stages, args.seed), stages)
    if args.qps is not None:
        return Workload(requests, poisson_arrivals(len(requests), args.qps, args.seed))
    if all(r.timestamp_s == 0 for r in requests) and len(requests) > 1:
        raise TraceError(f"{args.trace}: the trace has no timestamps; pass --qps or --ladder")
    return Workload(requests, scaled_arrivals(requests, args.speedup))


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def simulate_policy(
    name: str,
    workload: Workload,
    config: SimConfig,
    seed: int,
    progress: Progress | None = None,
    hooks: Sequence[object] = (),
    flow_control: LoadedConfig | None = None,
    objectives: ObjectiveTable | None = None,
    label: str | None = None,
) -> list[RequestResult]:
    """One policy over the whole workload on a fresh pool; deterministic for a seed.

    `hooks` are request-lifecycle hooks registered on the simulation's request flow,
    exactly as `epp serve` registers its own; `flow_control` a config whose admission and
    flow control the simulation's flow runs, with `objectives` for priorities."""
    pool = SimPool.build(config)
    clock_box: list[Simulation] = []
    ctx = PolicyContext(
        pool,
        lambda: clock_box[0].now if clock_box else 0.0,
        seed,
        config.model,
        config.context_limits,
    )
    pickers = build_pickers(name, ctx)
    shown = label or policy_label(name)
    task = progress.add_task(shown, total=len(workload.requests)) if progress else None

    def done(_: RequestResult) -> None:
        if progress is not None and task is not None:
            progress.advance(task)

    sim = Simulation(
        config,
        pickers,
        pool,
        on_request_done=done,
        hooks=hooks,
        flow_control=flow_control,
        objectives=objectives,
    )
    clock_box.append(sim)
    return asyncio.run(sim.run(workload.requests, workload.arrivals, workload.stage_of()))


def max_request_len(requests: Sequence[TraceRequest]) -> int:
    return max(r.input_tokens + r.output_tokens for r in requests)


def run_sim(args: argparse.Namespace, workload: Workload, console: Console) -> int:
    names = args.policy or list(ALL_POLICIES)
    if len({policy_label(n) for n in names}) != len(names):
        console.print("[red]error:[/red] a policy is named twice")
        return 2
    for name in names:
        if not known_policy(name):
            console.print(f"[red]error:[/red] unknown policy {name!r}")
            return 2
    model = workload.requests[0].model
    try:
        profile = get_profile(args.profile)
    except ProfileError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    # The pods keep their model's limit: longer requests are rejected, as vLLM rejects them.
    if args.max_model_len and args.max_model_len > profile.max_model_len:
        console.print(
            f"[red]error:[/red] --max-model-len {args.max_model_len} is above the "
            f"{profile.max_model_len} tokens of profile {profile.name}; pick a profile "
            "whose model accepts longer requests"
        )
        return 2
    config = SimConfig(
        pods=args.pods,
        profile=args.profile,
        block_size=args.block_size,
        kv_event_delay_s=args.kv_event_delay,
        scrape_interval_s=args.scrape_interval,
        max_model_len=args.max_model_len,
        model=model,
        routing_latency_s=args.routing_latency,
        pod_slowdowns=args.pod_slowdowns,
        context_limits=args.context_limits,
    )
    flow_control: LoadedConfig | None = None
    if args.flow_control:
        try:
            flow_control = load_config(args.flow_control)
        except (ConfigError, OSError) as exc:
            console.print(f"[red]error:[/red] {exc}")
            return 2
    mix = objective_mix(args)
    objectives = ObjectiveTable({e.objective.name: e.objective for e in mix or ()})
    runs: list[tuple[str, str, LoadedConfig | None]] = []
    for name in names:
        runs.append((name, policy_label(name), None))
        if flow_control is not None:
            runs.append((name, f"{policy_label(name)}+fc", flow_control))
    per_policy: dict[str, list[RequestResult]] = {}
    wall_s: dict[str, float] = {}
    with progress_bar(console) as progress:
        for name, label, admission_config in runs:
            started = time.perf_counter()
            try:
                results = simulate_policy(
                    name,
                    workload,
                    config,
                    args.seed,
                    progress,
                    flow_control=admission_config,
                    objectives=objectives,
                    label=label,
                )
            except UnknownPolicy as exc:
                console.print(f"[red]error:[/red] {exc}")
                return 2
            per_policy[label] = results
            wall_s[label] = round(time.perf_counter() - started, 2)
    console.print(
        "simulation time per policy: " + ", ".join(f"{n} {s:.1f}s" for n, s in wall_s.items())
    )
    ceiling = infinite_cache_hit_rate(workload.requests, args.block_size)
    pods = [pod_address(i) for i in range(args.pods)]
    # Wall time is about this machine, not the result: kept apart from the policies.
    _report(args, console, per_policy, pods, ceiling, workload, "sim", {"sim_wall_s": wall_s})
    return 0


def run_live_mode(args: argparse.Namespace, workload: Workload, console: Console) -> int:
    if not args.target:
        console.print("[red]error:[/red] --mode live needs --target URL")
        return 2
    label = (args.policy or ["live"])[0]
    opts = LiveOptions(target=args.target, concurrency=args.concurrency, model=args.model)
    with progress_bar(console) as progress:
        task = progress.add_task(label, total=len(workload.requests))
        results = asyncio.run(
            run_live(
                workload.requests,
                workload.arrivals,
                opts,
                on_done=lambda _: progress.advance(task),
                stages=workload.stage_of(),
            )
        )
    pods = sorted({r.pod for r in results if r.pod})
    _report(args, console, {label: results}, pods, None, workload, "live")
    return 0 if all(r.ok for r in results) else 1


def _report(
    args: argparse.Namespace,
    console: Console,
    per_policy: dict[str, list[RequestResult]],
    pods: list[str],
    ceiling: float | None,
    workload: Workload,
    mode: str,
    extra: dict[str, object] | None = None,
) -> None:
    summaries = {name: summarize(rs, pods) for name, rs in per_policy.items()}
    ladder: dict[str, dict[float, PolicySummary]] | None = None
    if workload.stages is not None:
        ladder = {}
        for name, rs in per_policy.items():
            by_stage = stage_summaries(rs, pods)
            ladder[name] = {workload.stages[k].qps: s for k, s in by_stage.items()}
    title = f"{args.trace.name}: {mode}, {len(pods) or args.pods} pods, {args.profile}"
    console.print(render_table(summaries, ceiling, title))
    by_objective: dict[str, dict[str, ObjectiveSummary]] = {}
    if any(r.objective or r.slo_ttft_s for rs in per_policy.values() for r in rs):
        by_objective = {name: objective_summaries(rs) for name, rs in per_policy.items()}
        console.print(render_objective_table(by_objective))
    if ladder:
        console.print(render_ladder_table(ladder))
    stem = args.name or f"replay_{args.trace.stem}"
    doc = results_json(
        str(args.trace),
        args.pods if mode == "sim" else len(pods),
        args.profile if mode == "sim" else "live",
        summaries,
        mode=mode,
        ceiling=ceiling,
        ladder=ladder,
        extra={
            "requests": len(workload.requests),
            "seed": args.seed,
            "speedup": None if (args.qps or args.ladder) else args.speedup,
            "qps": args.qps,
            "block_size": args.block_size,
            "kv_event_delay_s": args.kv_event_delay,
            "scrape_interval_s": args.scrape_interval,
            "objective_mix": args.objective_mix,
            "slo_ttft_ms": args.slo_ttft_ms,
            "flow_control": args.flow_control,
            **(
                {
                    "objectives": {
                        name: {o: s.as_json() for o, s in per.items()}
                        for name, per in by_objective.items()
                    }
                }
                if by_objective
                else {}
            ),
            "routing_latency_s": args.routing_latency,
            "pod_slowdowns": list(args.pod_slowdowns),
            **(extra or {}),
        },
    )
    out_json = args.out / f"{stem}.json"
    write_json(doc, out_json)
    written = [out_json]
    if not args.no_plots:
        cdf = args.out / f"{stem}_ttft_cdf.png"
        plot_ttft_cdf(per_policy, cdf, f"TTFT CDF: {args.trace.name}")
        written.append(cdf)
        if ladder:
            lad = args.out / f"{stem}_ttft_p90_vs_qps.png"
            plot_ladder(ladder, lad, f"TTFT p90 vs QPS: {args.trace.name}")
            written.append(lad)
    console.print("wrote " + ", ".join(str(p) for p in written))


def run(args: argparse.Namespace) -> int:
    # A pipe or a log file gets the full table width rather than rich's 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 150)
    try:
        workload = build_workload(args)
    except (TraceError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    if args.mode == "live":
        return run_live_mode(args, workload, console)
    return run_sim(args, workload, console)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epp")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["replay", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))

"""``epp calibrate``: measure a live vLLM pod (or `epp sim`) and write a latency profile.

``--from-forward FILE...`` fits one to ``benchmarks/calibrate/gpu_forward.py``'s timings of
a model's forward steps on a GPU instead of measuring a pod."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from ..sim.profiles import LatencyProfile
    from .fit import Fit
    from .measure import Plan
    from .probe import PodInfo


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "calibrate",
        help="measure a live vLLM pod and write a latency profile for `epp sim` / `epp replay`",
        description=__doc__,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", metavar="URL", help="the pod's base URL")
    source.add_argument("--from-forward", type=Path, nargs="+", metavar="FILE",
                        help="fit benchmarks/calibrate/gpu_forward.py's measurements of a "
                        "model's forward steps on a GPU instead of measuring a pod")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=32768,
                   help="with --from-forward: the serving limit to write "
                   "(default %(default)s)")  # fmt: skip
    p.add_argument("--model", default="", help="served model name (default: the first listed)")
    p.add_argument("--out", type=Path, help="profile file to write (default: <name>.yaml)")
    p.add_argument("--name", help="profile name (default: calibrated-<model>)")
    p.add_argument("--max-prompt-tokens", type=int, help="longest prompt to send (default: limit)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="the pod's --max-num-batched-tokens: its prefill chunk (not visible "
                   "over HTTP; default %(default)s)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=256, help="the pod's --max-num-seqs")
    p.add_argument("--repeats", type=int, default=3, help="runs of every measurement")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--scrape-interval", type=float, default=0.0, metavar="S",
                   help="GET the pod's /metrics every S seconds while measuring, as the "
                   "gateway will (epp serve scrapes every 0.05 s): each scrape costs the "
                   "pod CPU time, which a profile for pods behind smart-epp should include "
                   "(default: no scraping)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: every `epp` command builds this parser, and numpy/scipy/aiohttp are
    # slow to import; only calibration needs them.
    import aiohttp

    from .probe import ProbeError

    console = Console(stderr=True)
    for flag in ("max_num_batched_tokens", "max_num_seqs", "repeats"):
        if getattr(args, flag) < 1:
            console.print(f"[red]error:[/red] --{flag.replace('_', '-')} must be at least 1")
            return 2
    if args.scrape_interval < 0:
        console.print("[red]error:[/red] --scrape-interval must not be negative")
        return 2
    if args.from_forward:
        return from_forward(args, console)
    try:
        profile, result = asyncio.run(calibrate(args, console))
    except (ProbeError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    except aiohttp.ClientError as exc:
        console.print(f"[red]error:[/red] cannot reach {args.target}: {exc}")
        return 1
    return write_profile(profile, result, args.out, console)


def write_profile(profile: LatencyProfile, result: Fit, out: Path | None, console: Console) -> int:
    console.print(fit_table(result))
    out = out or Path(f"{profile.name}.yaml")
    out.write_text(profile.to_yaml())
    console.print(f"wrote {out} (load it with `epp sim --profile {out}`)")
    return 0


def from_forward(args: argparse.Namespace, console: Console) -> int:
    from .forward import forward_profile

    if args.max_model_len < 1:
        console.print("[red]error:[/red] --max-model-len must be at least 1")
        return 2
    name = args.name or args.from_forward[0].stem
    try:
        profile, result = forward_profile(
            args.from_forward, name, args.max_model_len, args.max_num_batched_tokens,
            args.max_num_seqs,
        )  # fmt: skip
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    return write_profile(profile, result, args.out, console)


async def calibrate(args: argparse.Namespace, console: Console) -> tuple[LatencyProfile, Fit]:
    import aiohttp
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from ..sim.profiles import LatencyProfile
    from .fit import fit
    from .measure import make_plan, measure
    from .probe import Probe

    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        probe = Probe(session, args.target, args.model)
        info = await probe.pod_info()
        plan = make_plan(
            info, args.max_prompt_tokens, args.max_num_seqs, args.max_num_batched_tokens,
            args.repeats,
        )  # fmt: skip
        console.print(
            f"{args.target}: model {info.model}, max_model_len {info.max_model_len}, "
            f"KV cache {info.kv_tokens} tokens (block {info.block_size})"
        )
        with Progress(
            TextColumn("{task.description:<14}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            task = progress.add_task("measuring", total=plan.steps)
            async with scraping(session, args.target, args.scrape_interval):
                samples = await measure(
                    probe, info, plan, args.seed,
                    lambda what: progress.update(task, advance=1, description=what),
                )  # fmt: skip
    result = fit(samples)
    name = args.name or f"calibrated-{info.model}".replace("/", "-")
    profile = LatencyProfile(
        name=name,
        kv_tokens=info.kv_tokens,
        max_model_len=info.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        **{k: _round(v) for k, v in result.coefficients.items()},
        source=describe(args.target, info, plan, result, args.scrape_interval),
    )
    return profile, result


@contextlib.asynccontextmanager
async def scraping(session: Any, target: str, interval_s: float) -> AsyncIterator[None]:
    """GETs the pod's /metrics every `interval_s` (0: never) while the block runs."""
    if interval_s <= 0:
        yield
        return

    import aiohttp

    async def loop() -> None:
        url = target.rstrip("/") + "/metrics"
        while True:
            # A failed scrape is the gateway's problem, not the measurement's.
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url) as resp:
                    await resp.read()
            await asyncio.sleep(interval_s)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _round(value: float) -> float:
    return float(f"{value:.4g}")


def describe(
    target: str, info: PodInfo, plan: Plan, result: Fit, scrape_interval_s: float = 0.0
) -> str:
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    lines = [
        f"Measured by `epp calibrate` against {target} (model {info.model}) on {today}.",
        f"cold prefill: time to first token of unique prompts of {plan.cold_lengths} tokens;",
        f"warm prefix: {plan.warm_length}-token prompts with "
        f"{', '.join(f'{f:.0%}' for f in plan.warm_fractions)} of them cached just before;",
        f"decode: median inter-token gap of {plan.decode_batches} concurrent streams at "
        f"{plan.decode_contexts}-token contexts, {plan.decode_tokens} tokens each;",
        f"each run {plan.repeats}x and the median kept, minus the median GET /health round trip.",
        *(
            [f"/metrics scraped every {scrape_interval_s:g} s throughout, as a gateway does."]
            if scrape_interval_s > 0
            else []
        ),
        "step_overhead_s, prefill_s_per_token, prefill_attention_s_per_token_pair, "
        "decode_s_per_seq, decode_kv_read_s_per_token: non-negative least squares on "
        "relative error over all of them; fit quality per group:",
    ]
    for g in result.groups:
        r2 = "-" if g.r2 is None else f"{g.r2:.3f}"
        lines.append(
            f"  {g.group}: {g.samples} samples, R^2 {r2}, "
            f"median abs error {g.median_abs_pct_error:.1f}%"
        )
    lines += [
        f"kv_tokens: vllm:cache_config_info num_gpu_blocks x block_size {info.block_size}.",
        "max_model_len: /v1/models. max_num_batched_tokens, max_num_seqs: as given to "
        "epp calibrate (not visible over HTTP).",
    ]
    return "\n".join(lines) + "\n"


def fit_table(result: Fit) -> Table:
    table = Table(title="fit")
    for col in ("group", "samples", "R²", "median |error|"):
        table.add_column(col, justify="left" if col == "group" else "right")
    for g in result.groups:
        r2 = "-" if g.r2 is None else f"{g.r2:.3f}"
        table.add_row(g.group, str(g.samples), r2, f"{g.median_abs_pct_error:.1f}%")
    table.caption = "  ".join(f"{k} {v:.4g}" for k, v in result.coefficients.items())
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epp")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["calibrate", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))

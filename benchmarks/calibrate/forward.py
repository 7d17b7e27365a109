"""A latency profile fitted to ``gpu_forward.py``'s timings of a model's forward steps.

Each timed prefill chunk is one engine step of ``n`` prompt tokens after ``c`` cached ones;
each timed decode step reads ``batch x context`` cached tokens. Both go to the same
non-negative least-squares fit as ``epp calibrate``'s live measurements (``fit.py``), so a
profile from a GPU forward pass and one from a live pod are the same kind of object. The
KV-cache size applies vLLM's rule (``gpu_memory_utilization`` of the card, less the weights
and the largest step's activations) to the memory the run measured.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..sim.profiles import LatencyProfile, prefill_token_pairs
from .fit import Fit, Sample, decode_sample, fit

# vLLM's default --gpu-memory-utilization: the share of the card the engine may take.
GPU_MEMORY_UTILIZATION = 0.9
_RUN_KEYS = ("model", "device", "shape", "kv_bytes_per_token", "prefill", "decode")


def load_runs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The measurement files, checked to describe one model on one kind of GPU."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        try:
            run = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc
        missing = [k for k in _RUN_KEYS if not isinstance(run, dict) or k not in run]
        if missing:
            raise ValueError(f"{path}: not a gpu_forward.py result (missing {', '.join(missing)})")
        runs.append(run)
    if not runs:
        raise ValueError("no measurement files given")
    first = runs[0]
    for path, run in zip(paths, runs, strict=True):
        for key in ("model", "device", "shape"):
            if run[key] != first[key]:
                raise ValueError(f"{path}: {key} {run[key]!r} differs from {first[key]!r}")
    return runs


def samples(run: dict[str, Any]) -> list[Sample]:
    out: list[Sample] = []
    try:
        for p in run["prefill"]:
            n, c, seconds = int(p["new_tokens"]), int(p["cached_tokens"]), float(p["seconds"])
            features = (1.0, float(n), prefill_token_pairs(n, c), 0.0, 0.0, 0.0)
            out.append(Sample("prefill", features, seconds))
        for d in run["decode"]:
            batch, context = int(d["batch"]), int(d["context_tokens"])
            out.append(decode_sample(batch, float(batch * context), float(d["seconds"])))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed measurement ({exc!r})") from exc
    return out


def kv_tokens(run: dict[str, Any]) -> int:
    """vLLM's KV-cache size for this card and model, from the run's measured memory."""
    try:
        total = float(run["gpu_memory_total_bytes"])
        peak = float(run["peak_prefill_bytes"])
    except KeyError as exc:
        raise ValueError(f"the run recorded no GPU memory ({exc}): was it on a GPU?") from exc
    free = GPU_MEMORY_UTILIZATION * total - peak
    if free <= 0:
        raise ValueError("the weights and activations leave no memory for a KV cache")
    return int(free // int(run["kv_bytes_per_token"]))


def forward_profile(
    paths: Sequence[Path],
    name: str,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> tuple[LatencyProfile, Fit]:
    runs = load_runs(paths)
    measured = [s for run in runs for s in samples(run)]
    result = fit(measured)
    profile = LatencyProfile(
        name=name,
        kv_tokens=kv_tokens(runs[0]),
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        **{k: float(f"{v:.4g}") for k, v in result.coefficients.items()},
        source=describe(paths, runs, measured, result),
    )
    return profile, result


def describe(
    paths: Sequence[Path], runs: Sequence[dict[str, Any]], measured: Sequence[Sample], result: Fit
) -> str:
    run = runs[0]
    prefill = sorted({(p["new_tokens"], p["cached_tokens"]) for r in runs for p in r["prefill"]})
    decode = sorted({(d["batch"], d["context_tokens"]) for r in runs for d in r["decode"]})
    chunks = sorted({n for n, _ in prefill})
    cached = sorted({c for _, c in prefill})
    batches = sorted({b for b, _ in decode})
    contexts = sorted({c for _, c in decode})
    lines = [
        f"Measured forward steps, not vLLM: {run['model']} ({run.get('parameters', '?')} "
        f"parameters, {run.get('dtype', '?')}) on one {run['device']}, torch "
        f"{run.get('torch', '?')}, attention {run.get('attention_backend', '?')}, "
        f"{run.get('measured_on', '?')}; benchmarks/calibrate/gpu_forward.py, files "
        f"{', '.join(p.name for p in paths)}.",
        f"prefill: one step of {chunks} new tokens after {cached} cached ones "
        f"({len(prefill)} shapes); decode: one step of {batches} sequences of {contexts} "
        f"context tokens ({len(decode)} shapes); each the median of "
        f"{'/'.join(str(r.get('repeats', '?')) for r in runs)} CUDA-graph replays (per file).",
        "Not included, and added by a vLLM step: the scheduler and input preparation, "
        "paged attention, sampling."
        + (
            " The attention kernel is PyTorch's FlashAttention (FA2); vLLM on Hopper can run "
            "FlashAttention-3, which its authors report faster."
            if run.get("attention_backend") == "FLASH_ATTENTION"
            else ""
        ),
        "step_overhead_s, prefill_s_per_token, prefill_attention_s_per_token_pair, "
        "decode_s_per_seq, decode_kv_read_s_per_token: non-negative least squares on relative "
        "error over all of them (benchmarks/calibrate/fit.py); fit quality per group:",
    ]
    for g in result.groups:
        r2 = "-" if g.r2 is None else f"{g.r2:.3f}"
        worst = max(
            abs(result.predict(s) - s.seconds) / s.seconds * 100
            for s in measured
            if s.group == g.group
        )
        lines.append(
            f"  {g.group}: {g.samples} samples, R^2 {r2}, "
            f"median abs error {g.median_abs_pct_error:.1f}%, largest {worst:.0f}%"
        )
    lines.append(
        f"kv_tokens: ({GPU_MEMORY_UTILIZATION} x {run.get('gpu_memory_total_bytes')} B "
        f"measured total - {run.get('peak_prefill_bytes')} B measured peak of weights and "
        f"the largest step) / {run['kv_bytes_per_token']} B per token, vLLM's rule; vLLM "
        "also reserves CUDA-graph and non-torch memory, so a real pod holds somewhat fewer."
    )
    lines.append(
        "max_model_len, max_num_batched_tokens, max_num_seqs: serving limits chosen for "
        "this profile (as given to epp calibrate)."
    )
    return "\n".join(lines) + "\n"

"""Per-request results, their per-policy summary, and how they are shown: a terminal
table, the JSON results file, and PNG plots."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table


@dataclass(slots=True)
class RequestResult:
    """What happened to one request, measured the way a client sees it."""

    index: int
    arrival_s: float
    pod: str | None
    ok: bool
    status: int | str = 200  # HTTP status, or a short error name when none came back
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    stage: int | None = None  # ladder stage, when there is one
    objective: str | None = None  # the request's InferenceObjective, when it named one
    slo_ttft_s: float | None = None  # its TTFT SLO, when it had one
    refused: str | None = None  # why admission refused it (saturated, queue-full, ttl-expired)
    error: str | None = None  # why the server refused it (a short label), when it did
    # What the policy predicted for `ttft_s` (from arrival) when it routed the request, for
    # policies that predict one.
    predicted_ttft_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(slots=True)
class PolicySummary:
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    e2e_p50_s: float | None
    output_tok_per_s: float
    completed: int
    failed: int
    prefix_hit_rate: float
    load_imbalance: float
    rejected: int = 0  # refused by the server as invalid (HTTP 400), counted in ``failed``
    rejected_reasons: dict[str, int] = field(default_factory=dict)
    # Median factor between predicted and measured TTFT (exp of the median |log ratio|:
    # 1.25 = typically 25% off either way), for policies that predict TTFT; else None.
    ttft_prediction_factor: float | None = None
    # Output tokens/s from the first arrival to the last (None with fewer than two
    # arrivals). `output_tok_per_s` runs to the last completion, so when the arrivals end
    # long before the longest answers do, it measures how the last few decodes went.
    output_tok_per_s_while_arriving: float | None = None
    # The busiest pod's prompt tokens computed (prompt less cached, answered requests: a
    # refused prompt computes nothing) over the mean pod's. Requests per pod
    # (`load_imbalance`) can be even while one pod computes most of the long prompts;
    # None when nothing was computed.
    prefill_imbalance: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: _round(v) for k, v in asdict(self).items()}


def _round(v: Any) -> Any:
    return round(v, 6) if isinstance(v, float) else v


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), `q` in 0..100."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: Sequence[RequestResult], pods: Sequence[str]) -> PolicySummary:
    done = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [t for r in done if (t := r.tpot_s) is not None]
    e2es = [r.e2e_s for r in done if r.e2e_s is not None]
    if done:
        start = min(r.arrival_s for r in results)
        end = max(r.arrival_s + (r.e2e_s or 0.0) for r in done)
        span = max(end - start, 1e-9)
        tok_per_s = sum(r.output_tokens for r in done) / span
    else:
        tok_per_s = 0.0
    prompt = sum(r.prompt_tokens for r in done)
    per_pod = Counter(r.pod for r in results if r.pod is not None)
    counts = [per_pod.get(p, 0) for p in pods] if pods else list(per_pod.values())
    mean = sum(counts) / len(counts) if counts else 0.0
    computed = Counter[str]()
    for r in done:
        if r.pod is not None:
            computed[r.pod] += max(0, r.prompt_tokens - r.cached_tokens)
    work = [computed.get(p, 0) for p in pods] if pods else list(computed.values())
    mean_work = sum(work) / len(work) if work else 0.0
    rejected = [r for r in results if r.status == 400]
    reasons = Counter(r.error or "HTTP 400" for r in rejected)
    log_errors = [
        abs(math.log(r.predicted_ttft_s / r.ttft_s))
        for r in done
        if r.predicted_ttft_s is not None and r.predicted_ttft_s > 0 and r.ttft_s
    ]
    return PolicySummary(
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        tpot_p50_s=percentile(tpots, 50),
        e2e_p50_s=percentile(e2es, 50),
        output_tok_per_s=tok_per_s,
        completed=len(done),
        failed=len(results) - len(done),
        prefix_hit_rate=sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        load_imbalance=max(counts) / mean if mean else 0.0,
        rejected=len(rejected),
        rejected_reasons=dict(sorted(reasons.items())),
        ttft_prediction_factor=(math.exp(statistics.median(log_errors)) if log_errors else None),
        output_tok_per_s_while_arriving=tokens_per_s_while_arriving(results),
        prefill_imbalance=max(work) / mean_work if mean_work else None,
    )


def tokens_out_by(r: RequestResult, t: float) -> float:
    """Output tokens `r` had delivered by time `t`: its first at its TTFT, the rest spread
    evenly up to its completion (a result holds no per-token times, so this is an
    interpolation, not a count)."""
    if not r.ok or r.ttft_s is None or r.e2e_s is None or r.output_tokens < 1:
        return 0.0
    first = r.arrival_s + r.ttft_s
    if t < first:
        return 0.0
    last = r.arrival_s + r.e2e_s
    if t >= last or r.output_tokens == 1:
        return float(r.output_tokens)
    return 1.0 + (r.output_tokens - 1) * (t - first) / (last - first)


def tokens_per_s_while_arriving(results: Sequence[RequestResult]) -> float | None:
    if not results:
        return None
    start = min(r.arrival_s for r in results)
    end = max(r.arrival_s for r in results)
    if end <= start:
        return None
    return sum(tokens_out_by(r, end) for r in results) / (end - start)


def stage_summaries(
    results: Sequence[RequestResult], pods: Sequence[str]
) -> dict[int, PolicySummary]:
    by_stage: dict[int, list[RequestResult]] = {}
    for r in results:
        if r.stage is not None:
            by_stage.setdefault(r.stage, []).append(r)
    return {k: summarize(v, pods) for k, v in sorted(by_stage.items())}


# ---------------------------------------------------------------------------------------
# Output


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def render_table(
    summaries: Mapping[str, PolicySummary], ceiling: float | None, title: str
) -> Table:
    table = Table(title=title)
    for col in (
        "policy",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "TPOT p50",
        "E2E p50",
        "out tok/s",
        "done",
        "failed",
        "rejected",
        "prefix hit",
        "imbalance",
        "prefill imbalance",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, s in summaries.items():
        table.add_row(
            name,
            _ms(s.ttft_p50_s),
            _ms(s.ttft_p90_s),
            _ms(s.ttft_p99_s),
            _ms(s.tpot_p50_s),
            _ms(s.e2e_p50_s),
            f"{s.output_tok_per_s:.0f}",
            str(s.completed),
            str(s.failed),
            str(s.rejected),
            f"{s.prefix_hit_rate:.1%}",
            f"{s.load_imbalance:.2f}",
            "-" if s.prefill_imbalance is None else f"{s.prefill_imbalance:.2f}",
        )
    caption = "latencies in ms; imbalance = max/mean requests per pod"
    caption += "; prefill imbalance = max/mean prompt tokens computed per pod"
    caption += "; rejected (HTTP 400, part of failed)"
    reasons: Counter[str] = Counter()
    for summary in summaries.values():
        reasons.update(summary.rejected_reasons)
    if reasons:
        caption += ": " + ", ".join(sorted(reasons))
    if ceiling is not None:
        caption += f"; infinite-cache prefix hit rate (ceiling): {ceiling:.1%}"
    table.caption = caption
    return table


def render_ladder_table(ladder: Mapping[str, Mapping[float, PolicySummary]]) -> Table:
    rates = sorted({q for stages in ladder.values() for q in stages})
    table = Table(title="TTFT p90 (ms) per QPS stage")
    table.add_column("policy")
    for q in rates:
        table.add_column(f"{q:g} qps", justify="right")
    for name, stages in ladder.items():
        table.add_row(name, *(_ms(stages[q].ttft_p90_s) if q in stages else "-" for q in rates))
    return table


def results_json(
    trace: str,
    pods: int,
    profile: str,
    summaries: Mapping[str, PolicySummary],
    *,
    mode: str = "sim",
    ceiling: float | None = None,
    ladder: Mapping[str, Mapping[float, PolicySummary]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "trace": trace,
        "pods": pods,
        "profile": profile,
        "mode": mode,
        "policies": {name: s.as_json() for name, s in summaries.items()},
    }
    if ceiling is not None:
        doc["infinite_cache_prefix_hit_rate"] = round(ceiling, 6)
    if ladder:
        doc["ladder"] = {
            name: {f"{q:g}": s.as_json() for q, s in sorted(stages.items())}
            for name, stages in ladder.items()
        }
    if extra:
        doc.update(extra)
    return doc


def write_json(doc: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _new_axes() -> tuple[Any, Any]:
    # Imported here: matplotlib is slow to import and only the plotting commands need it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.5))


def _save(fig: Any, ax: Any, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft_cdf(results: Mapping[str, Sequence[RequestResult]], path: Path, title: str) -> None:
    fig, ax = _new_axes()
    for name, rs in results.items():
        ttfts = sorted(r.ttft_s for r in rs if r.ok and r.ttft_s is not None)
        if not ttfts:
            continue
        ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        ax.plot(ttfts, ys, label=name, linewidth=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    _save(fig, ax, title, path)


def plot_ladder(
    ladder: Mapping[str, Mapping[float, PolicySummary]], path: Path, title: str
) -> None:
    fig, ax = _new_axes()
    for name, stages in ladder.items():
        qs = sorted(q for q, s in stages.items() if s.ttft_p90_s is not None)
        ax.plot(qs, [stages[q].ttft_p90_s for q in qs], marker="o", label=name)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("TTFT p90 (s)")
    ax.set_yscale("log")
    _save(fig, ax, title, path)

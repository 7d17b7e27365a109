"""Objectives and TTFT SLOs in a replay, and the per-objective report.

`--objective-mix critical:2=0.3,standard:0=0.5,batch:-1=0.2` gives each request an
objective drawn (seeded) with those shares and the objective's priority; recorded
traffic can carry an `objective` column instead. `--slo-ttft-ms 2000` (every objective)
or `critical=2000,standard=2000` sets TTFT SLOs. Goodput is the requests per second that
completed within their TTFT SLO; requests without an SLO are reported but not counted.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from ...epp.flowcontrol.objectives import Objective
from .report import RequestResult, percentile
from .traces import TraceRequest


@dataclass(frozen=True, slots=True)
class MixEntry:
    objective: Objective
    share: float


def parse_objective_mix(text: str) -> list[MixEntry]:
    """`name:priority=share,...` (priority optional, default 0); shares are normalised."""
    entries: list[MixEntry] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        head, sep, share_text = part.partition("=")
        name, _, priority_text = head.partition(":")
        try:
            share = float(share_text) if sep else 1.0
            priority = int(priority_text) if priority_text else 0
        except ValueError:
            raise ValueError(
                f"bad objective mix entry {part!r}: want name:priority=share"
            ) from None
        if not name or share < 0:
            raise ValueError(f"bad objective mix entry {part!r}: want name:priority=share")
        entries.append(MixEntry(Objective(name.strip(), priority), share))
    total = sum(e.share for e in entries)
    if not entries or total <= 0:
        raise ValueError(f"objective mix {text!r} has no positive share")
    names = [e.objective.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"objective mix {text!r} names an objective twice")
    return [MixEntry(e.objective, e.share / total) for e in entries]


def parse_slo(text: str) -> dict[str | None, float]:
    """TTFT SLOs in seconds: `2000` (every objective: key None) or `name=ms,...`."""
    out: dict[str | None, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.rpartition("=")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad TTFT SLO {part!r}: want MS or name=MS") from None
        if ms <= 0:
            raise ValueError(f"bad TTFT SLO {part!r}: must be positive")
        out[name if sep else None] = ms / 1000.0
    return out


def assign_objectives(
    requests: Sequence[TraceRequest],
    mix: Sequence[MixEntry] | None,
    slo: Mapping[str | None, float],
    seed: int,
) -> list[TraceRequest]:
    """The requests with objectives (drawn from `mix` unless a request has one) and SLOs."""
    rng = random.Random(f"objectives:{seed}")
    names = [e.objective.name for e in mix] if mix else []
    weights = [e.share for e in mix] if mix else []
    out: list[TraceRequest] = []
    for req in requests:
        objective = req.objective
        if objective is None and mix:
            objective = rng.choices(names, weights)[0]
        ttft_slo = req.slo_ttft_s
        if ttft_slo is None:
            ttft_slo = slo.get(objective, slo.get(None))
        out.append(dataclasses.replace(req, objective=objective, slo_ttft_s=ttft_slo))
    return out


@dataclass(slots=True)
class ObjectiveSummary:
    requests: int
    served: int
    shed: int  # refused by admission: saturated and sheddable, or the queue full
    expired: int  # waited in the flow-control queue past its TTL
    failed: int  # any other error
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    met_slo: int
    goodput_rps: float | None  # None: no request of the group had an SLO

    def as_json(self) -> dict[str, Any]:
        return {
            k: round(v, 6) if isinstance(v, float) else v
            for k, v in dataclasses.asdict(self).items()
        }


def _summary(results: Sequence[RequestResult], span: float) -> ObjectiveSummary:
    served = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in served if r.ttft_s is not None]
    with_slo = [r for r in results if r.slo_ttft_s is not None]
    met = sum(
        1
        for r in with_slo
        if r.ok and r.ttft_s is not None and r.slo_ttft_s is not None and r.ttft_s <= r.slo_ttft_s
    )
    shed = sum(1 for r in results if r.refused in ("saturated", "queue-full"))
    expired = sum(1 for r in results if r.refused == "ttl-expired")
    return ObjectiveSummary(
        requests=len(results),
        served=len(served),
        shed=shed,
        expired=expired,
        failed=len(results) - len(served) - shed - expired,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        met_slo=met,
        goodput_rps=(met / span if span > 0 else 0.0) if with_slo else None,
    )


def objective_summaries(results: Sequence[RequestResult]) -> dict[str, ObjectiveSummary]:
    """Per objective, plus "all"; goodput over the whole run's span (first arrival to the
    last completion), the same denominator for every objective."""
    if not results:
        return {}
    start = min(r.arrival_s for r in results)
    end = max((r.arrival_s + (r.e2e_s or 0.0) for r in results), default=start)
    span = end - start
    by_objective: dict[str, list[RequestResult]] = {}
    for r in results:
        by_objective.setdefault(r.objective or "-", []).append(r)
    out = {name: _summary(rs, span) for name, rs in sorted(by_objective.items())}
    out["all"] = _summary(results, span)
    return out


def render_objective_table(per_policy: Mapping[str, Mapping[str, ObjectiveSummary]]) -> Table:
    table = Table(title="per objective: TTFT, outcomes and goodput (requests/s within SLO)")
    for col in (
        "policy",
        "objective",
        "TTFT p50",
        "TTFT p90",
        "served",
        "shed",
        "expired",
        "failed",
        "met SLO",
        "goodput/s",
    ):
        table.add_column(col, justify="left" if col in ("policy", "objective") else "right")
    for policy, by_objective in per_policy.items():
        for name, s in by_objective.items():
            table.add_row(
                policy,
                name,
                "-" if s.ttft_p50_s is None else f"{s.ttft_p50_s * 1000:.0f}",
                "-" if s.ttft_p90_s is None else f"{s.ttft_p90_s * 1000:.0f}",
                str(s.served),
                str(s.shed),
                str(s.expired),
                str(s.failed),
                str(s.met_slo),
                "-" if s.goodput_rps is None else f"{s.goodput_rps:.2f}",
            )
    table.caption = "TTFT in ms; shed = refused at admission (429); expired = queue TTL passed"
    return table

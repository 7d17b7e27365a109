"""When each request is sent: the trace's own clock sped up, Poisson at a fixed rate, or a
ladder of rates. Pure functions of the requests and a seed."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from .traces import TraceRequest


@dataclass(frozen=True, slots=True)
class Stage:
    """One step of a QPS ladder: the requests numbered `requests` sent at `qps` from
    `start_s` on."""

    qps: float
    start_s: float
    requests: range  # indices into the arrival list


def scaled_arrivals(requests: Sequence[TraceRequest], speedup: float = 1.0) -> list[float]:
    """The trace timestamps divided by `speedup`.

    Requests that share a timestamp are spread evenly over the gap to the next distinct
    timestamp (the bucket): traces recorded at coarse granularity, such as Mooncake's
    3-second buckets, would otherwise arrive as bursts the original traffic never had.
    """
    if speedup <= 0:
        raise ValueError("--speedup must be positive")
    order = sorted(range(len(requests)), key=lambda i: (requests[i].timestamp_s, i))
    times = [0.0] * len(requests)
    i = 0
    while i < len(order):
        t = requests[order[i]].timestamp_s
        j = i
        while j < len(order) and requests[order[j]].timestamp_s == t:
            j += 1
        group = j - i
        if group > 1:
            if j < len(order):
                bucket = requests[order[j]].timestamp_s - t
            else:
                bucket = _typical_gap(requests) * group
            for k in range(group):
                times[order[i + k]] = (t + bucket * k / group) / speedup
        else:
            times[order[i]] = t / speedup
        i = j
    return times


def _typical_gap(requests: Sequence[TraceRequest]) -> float:
    """The median gap between distinct timestamps (bucket width of the last bucket)."""
    distinct = sorted({r.timestamp_s for r in requests})
    gaps = sorted(b - a for a, b in pairwise(distinct))
    if not gaps:
        return 0.0
    return gaps[len(gaps) // 2]


def poisson_arrivals(n: int, qps: float, seed: int = 0, start_s: float = 0.0) -> list[float]:
    """`n` arrival times of a Poisson process at `qps` requests per second."""
    if qps <= 0:
        raise ValueError("--qps must be positive")
    rng = random.Random(seed)
    t = start_s
    out = []
    for _ in range(n):
        t += rng.expovariate(qps)
        out.append(t)
    return out


def parse_ladder(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--ladder wants comma-separated rates, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError("--ladder rates must be positive")
    return rates


def ladder_arrivals(rates: Sequence[float], stage_duration_s: float) -> list[Stage]:
    """Back-to-back Poisson stages, one per rate, each `stage_duration_s` long (the same
    pool stays warm across stages, as in inference-perf's load ladders)."""
    if stage_duration_s <= 0:
        raise ValueError("stage duration must be positive")
    stages: list[Stage] = []
    first = 0
    for k, qps in enumerate(rates):
        start = k * stage_duration_s
        n = max(1, round(qps * stage_duration_s))
        stages.append(Stage(qps, start, range(first, first + n)))
        first += n
    return stages


def stage_times(stages: Sequence[Stage], seed: int = 0) -> list[float]:
    """Arrival times for every request of every stage, in request order."""
    times: list[float] = []
    for k, stage in enumerate(stages):
        times.extend(poisson_arrivals(len(stage.requests), stage.qps, seed + k, stage.start_s))
    return times

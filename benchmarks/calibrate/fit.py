"""Fitting a latency profile's step-cost coefficients to measured timings. Pure, no I/O.

Every measurement is one linear equation in the six step-cost coefficients of the profile
schema: its features are how many times it pays each cost (steps, prompt tokens, attention
pairs, decoding sequences, context tokens read, new requests), its value the seconds it
took. A time to first token pays the per-request cost once; a decode step never does, which
is what separates it from the per-step overhead. The fit is
non-negative least squares on relative error (each equation divided by its measured
value), so a 10 ms prompt weighs as much as a 1 s one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from ..sim.profiles import STEP_COEFFICIENTS, prefill_token_pairs

COEFFICIENTS = STEP_COEFFICIENTS


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured timing and what it paid for, in the order of ``COEFFICIENTS``."""

    group: str
    features: tuple[float, float, float, float, float, float]
    seconds: float


def prefill_sample(
    group: str, new_tokens: int, cached_tokens: int, chunk_tokens: int, seconds: float
) -> Sample:
    """Time to first token of one prompt on an idle pod: its chunks, one step each."""
    steps, pairs, done, left = 0, 0.0, cached_tokens, new_tokens
    while left > 0:
        n = min(left, chunk_tokens)
        pairs += prefill_token_pairs(n, done)
        done += n
        left -= n
        steps += 1
    return Sample(group, (float(steps), float(new_tokens), pairs, 0.0, 0.0, 1.0), seconds)


def decode_sample(batch: int, context_tokens: float, seconds: float) -> Sample:
    """One decode step of ``batch`` sequences reading ``context_tokens`` in all."""
    return Sample("decode", (1.0, 0.0, 0.0, float(batch), context_tokens, 0.0), seconds)


@dataclass(frozen=True, slots=True)
class GroupFit:
    group: str
    samples: int
    r2: float | None  # None: too few distinct values to say
    median_abs_pct_error: float


@dataclass(frozen=True, slots=True)
class Fit:
    coefficients: dict[str, float]
    groups: list[GroupFit]

    def predict(self, sample: Sample) -> float:
        return sum(c * f for c, f in zip(self.coefficients.values(), sample.features, strict=True))


def fit(samples: Sequence[Sample]) -> Fit:
    if not samples:
        raise ValueError("no measurements to fit")
    if any(s.seconds <= 0 for s in samples):
        raise ValueError("every measured time must be positive")
    a = np.array([s.features for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    weighted = a / y[:, None]
    # Columns differ by ~10 orders of magnitude (steps vs. token pairs): scale them to 1.
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(weighted / scale, np.ones_like(y))
    coefficients = dict(zip(COEFFICIENTS, (float(v) for v in solution / scale), strict=True))
    result = Fit(coefficients, [])
    for group in dict.fromkeys(s.group for s in samples):
        members = [s for s in samples if s.group == group]
        result.groups.append(_group_fit(group, members, result))
    return result


def _group_fit(group: str, members: Sequence[Sample], model: Fit) -> GroupFit:
    measured = np.array([s.seconds for s in members])
    predicted = np.array([model.predict(s) for s in members])
    errors = np.abs(predicted - measured) / measured * 100
    total = float(((measured - measured.mean()) ** 2).sum())
    r2 = None
    if len(members) > 1 and total > 0:
        r2 = 1.0 - float(((measured - predicted) ** 2).sum()) / total
    return GroupFit(group, len(members), r2, float(np.median(errors)))


def median_abs_pct_error(measured: Sequence[float], predicted: Sequence[float]) -> float:
    errors = sorted(abs(p - m) / m * 100 for m, p in zip(measured, predicted, strict=True))
    mid = len(errors) // 2
    if not errors:
        return math.nan
    return errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2

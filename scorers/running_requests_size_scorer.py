"""running-requests-size-scorer: fewer running requests score higher, min-max normalised."""

from __future__ import annotations

from collections.abc import Sequence

from ..framework.plugins import SchedulingContext, Scorer, min_max_inverted
from ..framework.registry import register_plugin
from ..framework.types import PodState


@register_plugin()
class RunningRequestsSizeScorer(Scorer):
    type_name = "running-requests-size-scorer"

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        return min_max_inverted([p.metrics.running for p in pods])

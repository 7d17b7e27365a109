"""queue-scorer: fewer waiting requests score higher (Inference Extension semantics).

Score = (max_waiting - waiting) / (max_waiting - min_waiting) over the candidates; all 1
when every candidate has the same queue.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..framework.plugins import SchedulingContext, Scorer, min_max_inverted
from ..framework.registry import register_plugin
from ..framework.types import PodState


@register_plugin()
class QueueScorer(Scorer):
    type_name = "queue-scorer"

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        return min_max_inverted([p.metrics.waiting for p in pods])

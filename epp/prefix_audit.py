"""The live prefix-prediction audit: did the pod hold what the KV index said it held?

For every response that carries `usage.prompt_tokens_details.cached_tokens`, the cached
tokens the pod reported are compared with the cached tokens the index predicted for it
when the request was routed (recorded by the scheduler in the request's context). A
drifting index — a pod whose KV events stopped reaching the picker, a cache reset that
sent no event — shows up here long before it shows up in latency.

Series (per pod address):
- `smart_epp_prefix_prediction_error_tokens` histogram of reported minus predicted;
- `smart_epp_prefix_predictions_total{result="exact"|"over"|"under"}` (over: the index
  predicted more than the pod had);
- `smart_epp_prefix_mispredicted_tokens_total{result="over"|"under"}`, the tokens missed
  (the histogram has negative buckets, so Prometheus gives it no `_sum`);
and a warning, at most once a minute per pod, when a pod's recent predictions miss.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from ..framework.lifecycle import FlowRequest, OutcomeObserver
from ..framework.plugins import SchedulingContext
from ..framework.types import Outcome
from .scheduler import PREDICTED_CACHED_TOKENS

log = logging.getLogger(__name__)

_ERROR_BUCKETS = (
    -16384, -4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096, 16384,
)  # fmt: skip
WINDOW = 20  # recent predictions per pod considered by the warning
MISSES_TO_WARN = 3
WARN_EVERY_S = 60.0


class PrefixAudit(OutcomeObserver):
    def __init__(
        self, registry: CollectorRegistry, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.error = Histogram(
            "smart_epp_prefix_prediction_error_tokens",
            "Cached prompt tokens the pod reported minus those the KV index predicted.",
            ("pod",),
            buckets=_ERROR_BUCKETS,
            registry=registry,
        )
        self.predictions = Counter(
            "smart_epp_prefix_predictions",
            "Audited predictions of cached prompt tokens: exact, over (the index predicted "
            "more than the pod had) or under.",
            ("pod", "result"),
            registry=registry,
        )
        self.missed_tokens = Counter(
            "smart_epp_prefix_mispredicted_tokens",
            "Prompt tokens by which audited predictions missed, over or under.",
            ("pod", "result"),
            registry=registry,
        )
        self._clock = clock
        self._recent: dict[str, deque[bool]] = {}
        self._warned_at: dict[str, float] = {}

    def on_outcome(self, flow: FlowRequest, outcome: Outcome) -> None:
        decision = flow.decision
        usage = outcome.usage
        if decision is None or usage is None or usage.cached_tokens is None or not outcome.ok:
            return
        ctx = decision.context
        if not isinstance(ctx, SchedulingContext):
            return
        predicted = ctx.kept.get(PREDICTED_CACHED_TOKENS)
        # A fallback that answered was not the pod the prediction was made for.
        if predicted is None or outcome.address != flow.primary:
            return
        self.record(outcome.address, int(predicted), usage.cached_tokens)

    def record(self, pod: str, predicted: int, reported: int) -> None:
        difference = reported - predicted
        self.error.labels(pod).observe(difference)
        result = "exact" if difference == 0 else ("over" if difference < 0 else "under")
        self.predictions.labels(pod, result).inc()
        if difference:
            self.missed_tokens.labels(pod, result).inc(abs(difference))
        recent = self._recent.setdefault(pod, deque(maxlen=WINDOW))
        recent.append(difference == 0)
        misses = recent.count(False)
        if difference == 0 or misses < MISSES_TO_WARN:
            return
        now = self._clock()
        if now - self._warned_at.get(pod, -WARN_EVERY_S) < WARN_EVERY_S:
            return
        self._warned_at[pod] = now
        log.warning(
            "pod %s: %d of its last %d prefix predictions missed (last: predicted %d cached "
            "tokens, the pod reported %d); its KV events may not be reaching the picker",
            pod,
            misses,
            len(recent),
            predicted,
            reported,
        )


__all__ = ["PrefixAudit"]

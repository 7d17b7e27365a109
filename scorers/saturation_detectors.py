"""Saturation detectors: how full the pool is, for admission and flow control.

Both follow llm-d's detectors (names, parameters, defaults). A detector answers two
questions:

- `saturation(pods, now, reserved)`: the pool's load as a fraction; 1.0 or more means
  saturated. Admission rejects sheddable requests and flow control holds the others
  while it is; a held request is dispatched as soon as it drops below 1.0. `reserved`
  (requests, prompt tokens) counts what was admitted but is not yet booked on a pod (it
  is being scheduled), so a burst of dispatches cannot overshoot between two bookings.
- as a scheduling `Filter`, which pods are past their safety limit (threshold x
  (1 + headroom)); when every pod is, all are kept (fail open), as upstream.

`utilization-detector` reads the scraped metrics: per pod
`max(queue / queueDepthThreshold, kv_usage / kvCacheUtilThreshold)`, where the queue adds
the requests this gateway sent that the last scrape does not show yet, and a pod whose
metrics are older than `metricsStalenessThreshold` scores 1.0; the pool's saturation is
the mean over pods. `concurrency-detector` counts what this gateway has itself in flight:
requests (or prompt tokens) over `maxConcurrency` (`maxTokenConcurrency`) per pod, summed
over the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from pydantic import Field, field_validator

from ..framework.plugins import Filter, PluginParams, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import PodState
from ..framework.units import parse_duration


class Reserved(NamedTuple):
    requests: int = 0
    tokens: int = 0


NOTHING_RESERVED = Reserved()


class SaturationDetector(Filter):
    """A pool-saturation signal that is also a candidate filter."""

    def saturation(
        self, pods: Sequence[PodState], now: float, reserved: Reserved = NOTHING_RESERVED
    ) -> float:
        raise NotImplementedError

    def over_limit(self, pod: PodState, now: float) -> bool:
        raise NotImplementedError

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        kept = [p for p in pods if not self.over_limit(p, ctx.now)]
        return kept or list(pods)


class UtilizationParams(PluginParams):
    queueDepthThreshold: int = Field(default=5, gt=0)
    kvCacheUtilThreshold: float = Field(default=0.8, gt=0.0, le=1.0)
    # Seconds once validated; configs write Go durations ("200ms").
    metricsStalenessThreshold: float = Field(default=0.2, gt=0.0)
    headroom: float = Field(default=0.0, ge=0.0)

    @field_validator("metricsStalenessThreshold", mode="before")
    @classmethod
    def _duration(cls, value: object) -> float:
        return parse_duration(value)


def queue_with_unscraped(pod: PodState) -> int:
    """Waiting requests, plus those this gateway sent that the last scrape does not show."""
    m = pod.metrics
    return m.waiting + max(0, pod.inflight.requests - (m.waiting + m.running))


@register_plugin()
class UtilizationDetector(SaturationDetector):
    type_name = "utilization-detector"
    Params = UtilizationParams
    params: UtilizationParams

    def __init__(self, name: str, params: UtilizationParams) -> None:
        super().__init__(name, params)
        # Plain floats: this runs for every pod on every request's admission.
        self._queue = float(params.queueDepthThreshold)
        self._kv = params.kvCacheUtilThreshold
        self._stale = params.metricsStalenessThreshold

    def pod_score(self, pod: PodState, now: float) -> float:
        m = pod.metrics
        if m.scraped_at == 0.0 or now - m.scraped_at > self._stale:
            return 1.0
        unscraped = pod.inflight.requests - m.waiting - m.running
        queue = m.waiting + unscraped if unscraped > 0 else m.waiting
        queue_score = queue / self._queue
        kv_score = m.kv_usage / self._kv
        return queue_score if queue_score > kv_score else kv_score

    def saturation(
        self, pods: Sequence[PodState], now: float, reserved: Reserved = NOTHING_RESERVED
    ) -> float:
        if not pods:
            return 0.0
        # pod_score, inlined: this loop runs for every pod on every request's admission.
        threshold, kv_threshold, stale = self._queue, self._kv, self._stale
        total = 0.0
        for pod in pods:
            m = pod.metrics
            scraped = m.scraped_at
            if scraped == 0.0 or now - scraped > stale:
                total += 1.0
                continue
            waiting = m.waiting
            unscraped = pod.inflight.requests - waiting - m.running
            queue = (waiting + unscraped if unscraped > 0 else waiting) / threshold
            kv = m.kv_usage / kv_threshold
            total += queue if queue > kv else kv
        # A reserved request will join some pod's queue: spread it over the pool.
        return (total + reserved.requests / threshold) / len(pods)

    def over_limit(self, pod: PodState, now: float) -> bool:
        p = self.params
        m = pod.metrics
        if m.scraped_at == 0.0 or now - m.scraped_at > self._stale:
            return True
        return queue_with_unscraped(pod) > self._queue * (1 + p.headroom) or (
            m.kv_usage > min(1.0, self._kv * (1 + p.headroom))
        )


class ConcurrencyParams(PluginParams):
    concurrencyMode: Literal["requests", "tokens", "hybrid"] = "requests"
    maxConcurrency: int = Field(default=100, gt=0)
    maxTokenConcurrency: int = Field(default=1_000_000, gt=0)
    headroom: float = Field(default=0.0, ge=0.0)


@register_plugin()
class ConcurrencyDetector(SaturationDetector):
    type_name = "concurrency-detector"
    Params = ConcurrencyParams
    params: ConcurrencyParams

    def saturation(
        self, pods: Sequence[PodState], now: float, reserved: Reserved = NOTHING_RESERVED
    ) -> float:
        if not pods:
            return 0.0
        p = self.params
        mode = p.concurrencyMode
        result = 0.0
        if mode != "tokens":
            requests = sum(pod.inflight.requests for pod in pods) + reserved.requests
            result = requests / (p.maxConcurrency * len(pods))
        if mode != "requests":
            tokens = sum(pod.inflight.prompt_tokens for pod in pods) + reserved.tokens
            result = max(result, tokens / (p.maxTokenConcurrency * len(pods)))
        return result

    def over_limit(self, pod: PodState, now: float) -> bool:
        p = self.params
        scale = 1 + p.headroom
        mode = p.concurrencyMode
        if mode != "tokens" and pod.inflight.requests >= p.maxConcurrency * scale:
            return True
        return mode != "requests" and pod.inflight.prompt_tokens >= p.maxTokenConcurrency * scale


class PrefillBacklogParams(PluginParams):
    prefillTokensPerSecond: float = Field(default=10_000.0, gt=0)
    maxPrefillSeconds: float = Field(default=1.0, gt=0)
    kvCacheUtilThreshold: float = Field(default=0.8, gt=0.0, le=1.0)
    headroom: float = Field(default=0.0, ge=0.0)


@register_plugin()
class PrefillBacklogDetector(SaturationDetector):
    """prefill-backlog-detector (smart-epp's own): a pod is full when the prompts this
    gateway sent it that have not produced a first byte yet would take more than
    `maxPrefillSeconds` to prefill at `prefillTokensPerSecond`, or when its KV cache is
    fuller than `kvCacheUtilThreshold` (a new prompt would wait for KV memory); the pool
    is saturated when every pod is full.

    This is the queue in front of a request's first token, which is what a TTFT SLO is
    about: unlike the scraped waiting queue it sees requests vLLM has already taken into
    its running batch but not prefilled (chunked prefill), and unlike in-flight counts it
    ignores requests that are only decoding. Prompts are counted whole (cache hits are
    not subtracted), so it errs towards holding requests back. A non-streaming response
    produces its first byte at the end, so its request counts until it finishes.
    """

    type_name = "prefill-backlog-detector"
    Params = PrefillBacklogParams
    params: PrefillBacklogParams

    def __init__(self, name: str, params: PrefillBacklogParams) -> None:
        super().__init__(name, params)
        # Plain floats: this runs for every pod on every request's admission.
        self._rate = params.prefillTokensPerSecond
        self._budget_tokens = params.prefillTokensPerSecond * params.maxPrefillSeconds
        self._kv = params.kvCacheUtilThreshold

    def pod_seconds(self, pod: PodState) -> float:
        return pod.inflight.prefilling_tokens / self._rate

    def pod_score(self, pod: PodState, extra_tokens: float = 0.0) -> float:
        backlog = (pod.inflight.prefilling_tokens + extra_tokens) / self._budget_tokens
        kv = pod.metrics.kv_usage / self._kv
        return backlog if backlog > kv else kv

    def saturation(
        self, pods: Sequence[PodState], now: float, reserved: Reserved = NOTHING_RESERVED
    ) -> float:
        """The least-loaded pod's score: the pool has room while one pod has (flow control
        then sends the request to a pod with room). Reserved prompts count on that pod."""
        if not pods:
            return 0.0
        # pod_score, inlined: this loop runs for every pod on every request's admission.
        budget, kv_threshold, extra = self._budget_tokens, self._kv, reserved.tokens
        least = float("inf")
        for pod in pods:
            backlog = pod.inflight.prefilling_tokens + extra
            kv = pod.metrics.kv_usage / kv_threshold * budget
            value = backlog if backlog > kv else kv
            if value < least:
                least = value
        return least / budget

    def over_limit(self, pod: PodState, now: float) -> bool:
        return self.pod_score(pod) > 1 + self.params.headroom

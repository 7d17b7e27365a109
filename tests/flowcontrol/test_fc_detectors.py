"""Saturation detectors: thresholds, staleness, in-flight compensation, the filter role."""

from __future__ import annotations

import pytest
from fchelpers import Clock, pool, set_load

from smart_epp.epp.config import instantiate, parse_config
from smart_epp.framework.plugins import SchedulingContext
from smart_epp.scorers.saturation_detectors import (
    ConcurrencyDetector,
    Reserved,
    UtilizationDetector,
)


def utilization(**params: object) -> UtilizationDetector:
    return UtilizationDetector("u", UtilizationDetector.Params.model_validate(params))


def concurrency(**params: object) -> ConcurrencyDetector:
    return ConcurrencyDetector("c", ConcurrencyDetector.Params.model_validate(params))


def test_utilization_defaults_match_upstream() -> None:
    p = utilization().params
    assert (p.queueDepthThreshold, p.kvCacheUtilThreshold, p.metricsStalenessThreshold) == (
        5,
        0.8,
        0.2,
    )
    assert p.headroom == 0.0


def test_utilization_queue_and_kv_thresholds() -> None:
    clock = Clock()
    detector = utilization()
    pods = pool(clock, waiting=4).pods()
    assert detector.saturation(pods, clock()) == pytest.approx(0.8)
    for pod in pods:
        set_load(pod, clock, waiting=5)
    assert detector.saturation(pods, clock()) == pytest.approx(1.0)
    # KV utilisation is the binding term when higher: 0.88 / 0.8 = 1.1.
    for pod in pods:
        set_load(pod, clock, waiting=0, kv=0.88)
    assert detector.saturation(pods, clock()) == pytest.approx(1.1)
    # The pool is the mean: one idle pod keeps a pool of two below saturation.
    set_load(pods[0], clock, waiting=0, kv=0.0)
    set_load(pods[1], clock, waiting=10, kv=0.0)
    assert detector.saturation(pods, clock()) == pytest.approx(1.0)
    set_load(pods[1], clock, waiting=9, kv=0.0)
    assert detector.saturation(pods, clock()) < 1.0


def test_stale_metrics_count_as_saturated() -> None:
    clock = Clock()
    detector = utilization(metricsStalenessThreshold="200ms")
    pods = pool(clock).pods()
    assert detector.saturation(pods, clock()) == 0.0
    clock.now += 0.199
    assert detector.saturation(pods, clock()) == 0.0
    clock.now += 0.002
    assert detector.saturation(pods, clock()) == pytest.approx(1.0)
    never_scraped = pool(clock).pods()
    for pod in never_scraped:
        pod.metrics.scraped_at = 0.0
    assert detector.saturation(never_scraped, clock()) == pytest.approx(1.0)


def test_requests_sent_since_the_last_scrape_count_in_the_queue() -> None:
    clock = Clock()
    detector = utilization(queueDepthThreshold=2)
    pods = pool(clock).pods()
    pods[0].metrics.running = 1
    pods[0].inflight.requests = 4  # 1 running, 3 the scrape has not seen
    assert detector.pod_score(pods[0], clock()) == pytest.approx(1.5)
    # Reserved (admitted, not yet booked) requests are spread over the pool.
    assert detector.saturation(pods, clock(), Reserved(2, 0)) == pytest.approx((1.5 + 1.0) / 2)


def test_utilization_filter_drops_pods_past_the_limit_and_fails_open() -> None:
    clock = Clock()
    detector = utilization(queueDepthThreshold=4, headroom=0.5)
    pods = pool(clock).pods()
    set_load(pods[0], clock, waiting=6)  # limit 4 x 1.5 = 6: still allowed
    set_load(pods[1], clock, waiting=7)
    ctx = SchedulingContext(request=None, now=clock(), prompt_tokens=1)  # type: ignore[arg-type]
    assert [p.address for p in detector.filter(ctx, pods)] == [pods[0].address]
    set_load(pods[0], clock, waiting=7)
    assert detector.filter(ctx, pods) == pods  # all over the limit: keep all


def test_concurrency_detector_modes() -> None:
    clock = Clock()
    pods = pool(clock).pods()
    pods[0].inflight.requests, pods[0].inflight.prompt_tokens = 3, 900
    pods[1].inflight.requests, pods[1].inflight.prompt_tokens = 1, 100
    by_requests = concurrency(maxConcurrency=4)
    assert by_requests.saturation(pods, clock()) == pytest.approx(4 / 8)
    assert by_requests.saturation(pods, clock(), Reserved(4, 0)) == pytest.approx(1.0)
    by_tokens = concurrency(concurrencyMode="tokens", maxTokenConcurrency=500)
    assert by_tokens.saturation(pods, clock()) == pytest.approx(1000 / 1000)
    hybrid = concurrency(concurrencyMode="hybrid", maxConcurrency=100, maxTokenConcurrency=800)
    assert hybrid.saturation(pods, clock()) == pytest.approx(1000 / 1600)
    assert by_requests.over_limit(pods[0], clock()) is False
    pods[0].inflight.requests = 4
    assert by_requests.over_limit(pods[0], clock()) is True
    assert concurrency().params.maxConcurrency == 100
    assert concurrency().params.maxTokenConcurrency == 1_000_000


def test_detectors_load_from_a_config_by_type_name() -> None:
    loaded = parse_config(
        """
plugins:
  - type: utilization-detector
    parameters: {queueDepthThreshold: 3, metricsStalenessThreshold: 1s}
  - type: concurrency-detector
    parameters: {concurrencyMode: tokens, maxTokenConcurrency: 5000}
  - type: max-score-picker
"""
    )
    plugins = instantiate(loaded).plugins
    util = plugins["utilization-detector"]
    assert isinstance(util, UtilizationDetector)
    assert util.params.queueDepthThreshold == 3
    assert util.params.metricsStalenessThreshold == 1.0


def test_prefill_backlog_detector_has_room_while_one_pod_has() -> None:
    from smart_epp.scorers.saturation_detectors import PrefillBacklogDetector

    clock = Clock()
    detector = PrefillBacklogDetector(
        "p",
        PrefillBacklogDetector.Params(prefillTokensPerSecond=1000, maxPrefillSeconds=2.0),
    )
    pods = pool(clock).pods()
    pods[0].inflight.prefilling_tokens = 4000  # 4 s of prefill queued: full
    pods[1].inflight.prefilling_tokens = 1000  # 1 s: room
    assert detector.saturation(pods, clock()) == pytest.approx(0.5)
    assert detector.over_limit(pods[0], clock()) and not detector.over_limit(pods[1], clock())
    # A reserved 1,000-token prompt fills the pod with room.
    assert detector.saturation(pods, clock(), Reserved(1, 1000)) == pytest.approx(1.0)
    pods[1].metrics.kv_usage = 0.88  # KV nearly full: no room there either
    assert detector.saturation(pods, clock()) == pytest.approx(1.1)

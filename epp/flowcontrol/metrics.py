"""Prometheus series of admission and flow control, registered on the gateway's registry.

Queue length and bytes per priority band and the pool's saturation are read when
/metrics is scraped, so the request path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .admission import AdmissionController, Reason

_WAIT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
)  # fmt: skip


class _QueueState(Collector):
    def __init__(self, admission: AdmissionController) -> None:
        self._admission = admission

    def collect(self) -> Iterator[GaugeMetricFamily]:
        admission = self._admission
        requests = GaugeMetricFamily(
            "smart_epp_flow_control_queue_requests",
            "Requests waiting in the flow-control queue, per priority band.",
            labels=["priority"],
        )
        size = GaugeMetricFamily(
            "smart_epp_flow_control_queue_bytes",
            "Bytes of the requests waiting in the flow-control queue, per priority band.",
            labels=["priority"],
        )
        for priority, (count, nbytes) in sorted(admission.queue.band_usage().items()):
            requests.add_metric([str(priority)], count)
            size.add_metric([str(priority)], nbytes)
        yield requests
        yield size
        saturation = admission.saturation()
        yield GaugeMetricFamily(
            "smart_epp_pool_saturation",
            "The saturation detector's pool load (1 or more: saturated).",
            value=saturation,
        )
        yield GaugeMetricFamily(
            "smart_epp_pool_saturated",
            "1 while the saturation detector says the pool is saturated.",
            value=1.0 if saturation >= 1.0 else 0.0,
        )


class FlowControlMetrics:
    """The admission observer that records dispatches, rejections and queue waits."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.dispatches = Counter(
            "smart_epp_flow_control_dispatched_total",
            "Requests dispatched from the flow-control queue, per priority band.",
            ["priority"],
            registry=registry,
        )
        self.rejections = Counter(
            "smart_epp_flow_control_rejected_total",
            "Requests refused by admission or flow control, per priority and reason "
            "(saturated, queue-full, ttl-expired, disconnected).",
            ["priority", "reason"],
            registry=registry,
        )
        self.wait = Histogram(
            "smart_epp_flow_control_queue_wait_seconds",
            "Time dispatched requests waited in the flow-control queue.",
            ["priority"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.unknown_objectives = Counter(
            "smart_epp_objective_unknown_total",
            "Requests naming an objective no InferenceObjective defines (default priority).",
            registry=registry,
        )
        self._registry = registry

    def watch(self, admission: AdmissionController) -> None:
        """Exposes the queue and saturation state of `admission`."""
        self._registry.register(_QueueState(admission))

    def dispatched(self, priority: int, waited_s: float) -> None:
        label = str(priority)
        self.dispatches.labels(label).inc()
        self.wait.labels(label).observe(waited_s)

    def rejected(self, priority: int, reason: Reason) -> None:
        self.rejections.labels(str(priority), reason.value).inc()

    def unknown_objective(self, _name: str) -> None:
        self.unknown_objectives.inc()

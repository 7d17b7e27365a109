"""Prometheus metrics of the gateway, named as the Gateway API Inference Extension names them.

Each GatewayMetrics owns its registry, so several servers (tests, benchmarks) can live
in one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..framework.lifecycle import FlowRequest, OutcomeObserver
from ..framework.types import Outcome

_LATENCY_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10,
    15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
_TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
    262144, 524288, 1048576,
)  # fmt: skip
_SCHEDULER_BUCKETS = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
)  # fmt: skip

_OBJECTIVE_LABELS = ("model_name", "target_model_name")


class _ReadyPods(Collector):
    def __init__(self, pool_name: str, count: Callable[[], int]) -> None:
        self._pool_name = pool_name
        self._count = count

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "inference_pool_ready_pods", "The number of ready pods in the pool.", labels=["name"]
        )
        family.add_metric([self._pool_name], self._count())
        yield family


@dataclass(frozen=True, slots=True)
class ObjectiveMetrics:
    """The labelled children for one (model, target model), looked up once."""

    requests: Any
    duration: Any
    input_tokens: Any
    output_tokens: Any


_OBJECTIVE_CACHE_LIMIT = 10_000


class GatewayMetrics:
    def __init__(self, pool_name: str = "default", ready_pods: Callable[[], int] = lambda: 0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "inference_objective_request_total",
            "Requests received, per model and target model.",
            _OBJECTIVE_LABELS,
            registry=r,
        )
        self.errors = Counter(
            "inference_objective_request_error_total",
            "Requests answered with an error by the gateway or the model server.",
            (*_OBJECTIVE_LABELS, "error_code"),
            registry=r,
        )
        self.duration = Histogram(
            "inference_objective_request_duration_seconds",
            "Time from request headers to the end of the response.",
            _OBJECTIVE_LABELS,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.input_tokens = Histogram(
            "inference_objective_input_tokens",
            "Prompt tokens per request, from the response's usage.",
            _OBJECTIVE_LABELS,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "inference_objective_output_tokens",
            "Completion tokens per request, from the response's usage.",
            _OBJECTIVE_LABELS,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.scheduler_e2e = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "Time the scheduler took to pick endpoints.",
            buckets=_SCHEDULER_BUCKETS,
            registry=r,
        )
        self.discovery_errors = Counter(
            "smart_epp_endpoints_file_errors_total",
            "Endpoints-file loads that failed (the previous pool stayed in place).",
            registry=r,
        )
        r.register(_ReadyPods(pool_name, ready_pods))
        self._http: tuple[WSGIServer, threading.Thread] | None = None
        self._objectives: dict[tuple[str, str], ObjectiveMetrics] = {}

    def objective(self, model: str, target: str) -> ObjectiveMetrics:
        """Per-request metrics of a model; the label lookup is cached (it costs
        microseconds per call on the hot path otherwise)."""
        key = (model, target)
        found = self._objectives.get(key)
        if found is None:
            found = ObjectiveMetrics(
                self.requests.labels(model, target),
                self.duration.labels(model, target),
                self.input_tokens.labels(model, target),
                self.output_tokens.labels(model, target),
            )
            if len(self._objectives) < _OBJECTIVE_CACHE_LIMIT:
                self._objectives[key] = found
        return found

    def outcome_recorder(self) -> OutcomeMetrics:
        """The request-flow hook that records each routed request's outcome here."""
        return OutcomeMetrics(self)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Exposes /metrics on `port` (0 picks one); returns the bound port."""
        server, thread = start_http_server(port, host, registry=self.registry)
        self._http = (server, thread)
        return server.server_port

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None


class OutcomeMetrics(OutcomeObserver):
    """Request duration, token counts and error responses, per objective, from outcomes."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def on_outcome(self, flow: FlowRequest, outcome: Outcome) -> None:
        request = flow.request
        metrics = self._metrics
        target = request.adapter or request.model
        objective = metrics.objective(request.model, target)
        objective.duration.observe(max(0.0, outcome.now - flow.received_at))
        usage = outcome.usage
        if usage is not None:
            objective.input_tokens.observe(usage.prompt_tokens)
            objective.output_tokens.observe(usage.completion_tokens)
        if not outcome.ok and outcome.status >= 400:
            metrics.errors.labels(request.model, target, str(outcome.status)).inc()

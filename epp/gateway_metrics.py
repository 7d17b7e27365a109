"""Prometheus metrics of the gateway, named as the Gateway API Inference Extension names them.

Each GatewayMetrics owns its registry, so several servers (tests, benchmarks) can live
in one process. Per-request series are fed from the request flow (`OutcomeMetrics`, a
routed and outcome observer); the pool averages are computed from the datastore when
Prometheus scrapes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..framework.lifecycle import FlowRequest, OutcomeObserver, RoutedObserver
from ..framework.types import Outcome, PodState

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

_TTFT_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10,
    15, 20, 30, 45, 60, 120,
)  # fmt: skip
_NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

_OBJECTIVE_LABELS = ("model_name", "target_model_name")
# llm-d's request labels: objective, fairness id, priority (and whether it streamed).
_TTFT_LABELS = (*_OBJECTIVE_LABELS, "fairness_id", "priority", "streaming")
_ATTEMPT_LABELS = ("status", "target_model_name", "pod_name", "namespace", "port")
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"


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


class _PoolAverages(Collector):
    """The pool's mean KV-cache usage, queue and running requests over ready pods, as of
    their last scrape (the Inference Extension's pool gauges)."""

    def __init__(self, pool_name: str, pods: Callable[[], Sequence[PodState]]) -> None:
        self._pool_name = pool_name
        self._pods = pods

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pods = [p for p in self._pods() if p.metrics.scraped_at > 0]
        n = len(pods) or 1
        for name, help_text, value in (
            (
                "inference_pool_average_kv_cache_utilization",
                "The average KV-cache utilization of the pool's ready pods.",
                sum(p.metrics.kv_usage for p in pods) / n,
            ),
            (
                "inference_pool_average_queue_size",
                "The average number of requests waiting in the pool's model server queues.",
                sum(p.metrics.waiting for p in pods) / n,
            ),
            (
                "inference_pool_average_running_requests",
                "The average number of running requests across the pool's model servers.",
                sum(p.metrics.running for p in pods) / n,
            ),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["name"])
            family.add_metric([self._pool_name], value)
            yield family


@dataclass(frozen=True, slots=True)
class ObjectiveMetrics:
    """The labelled children for one (model, target model), looked up once."""

    requests: Any
    duration: Any
    input_tokens: Any
    output_tokens: Any


_OBJECTIVE_CACHE_LIMIT = 10_000


# The reference prompt of smart_epp_pod_learned_cold_ttft_seconds.
LEARNED_TTFT_REFERENCE_TOKENS = 1024


class LearnedCosts(Collector):
    """`smart_epp_pod_learned_cold_ttft_seconds{pod}`: what each cost-learning plugin
    predicts for a 1,024-token prompt nothing holds on an idle pod, read at scrape time."""

    def __init__(self, plugins: Callable[[], Sequence[Any]]) -> None:
        self.plugins = plugins

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "smart_epp_pod_learned_cold_ttft_seconds",
            f"Learned time to first token of a {LEARNED_TTFT_REFERENCE_TOKENS}-token prompt "
            "that no pod holds, on the idle pod, by the plugin that learned it",
            labels=("pod", "plugin"),
        )
        for plugin in self.plugins():
            learned = getattr(plugin, "learned_cold_ttft", None)
            if learned is None:
                continue
            for pod, seconds in sorted(learned(LEARNED_TTFT_REFERENCE_TOKENS).items()):
                family.add_metric((pod, plugin.name), seconds)
        yield family


class GatewayMetrics:
    def __init__(
        self,
        pool_name: str = "default",
        ready_pods: Callable[[], int] = lambda: 0,
        pods: Callable[[], Sequence[PodState]] = lambda: (),
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "llm_d_epp_request_ttft_seconds",
            "Time to first token: request received to first response byte.",
            _TTFT_LABELS,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Histogram(
            "inference_objective_prompt_cached_tokens",
            "Prompt tokens the model server reported as cached, per request.",
            _OBJECTIVE_LABELS,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "inference_objective_running_requests",
            "Requests routed and not yet finished, per model.",
            ("model_name",),
            registry=r,
        )
        self.ntpot = Histogram(
            "inference_objective_normalized_time_per_output_token_seconds",
            "Request latency divided by its output tokens.",
            _OBJECTIVE_LABELS,
            buckets=_NTPOT_BUCKETS,
            registry=r,
        )
        self.scheduler_attempts = Counter(
            "inference_extension_scheduler_attempts_total",
            "Scheduling attempts by outcome and, on success, the endpoint chosen.",
            _ATTEMPT_LABELS,
            registry=r,
        )
        self.info = Gauge(
            "inference_extension_info",
            "Build of the endpoint picker (smart-epp's version as build_ref).",
            ("commit", "build_ref"),
            registry=r,
        )
        self.config_info = Gauge(
            "smart_epp_config_info",
            "The scheduler configuration in use (1 for the current one).",
            ("version", "config", "api_version"),
            registry=r,
        )
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
        r.register(_PoolAverages(pool_name, pods))
        self.info.labels("", smart_epp_version()).set(1)
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

    def record_config(self, source: str, api_version: str) -> None:
        self.config_info.labels(smart_epp_version(), source, api_version).set(1)

    def record_attempt(self, target_model: str, chosen: str | None) -> None:
        """One scheduling attempt: `chosen` is the endpoint picked, None on failure."""
        if chosen is None:
            self.scheduler_attempts.labels("failure", target_model, "", "", "").inc()
            return
        host, _, port = chosen.rpartition(":")
        # smart-epp knows endpoints by address; the host stands for the pod name.
        self.scheduler_attempts.labels("success", target_model, host, "", port).inc()


def smart_epp_version() -> str:
    try:
        from importlib.metadata import version

        return version("smart-epp")
    except Exception:  # not installed as a distribution (a source checkout)
        return "unknown"


class OutcomeMetrics(RoutedObserver, OutcomeObserver):
    """Per-request series from the flow: running requests while routed; duration, TTFT,
    tokens, cached tokens, normalized time per output token and errors at the end."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self._running: set[int] = set()  # ids of the flows counted as running

    def on_routed(self, flow: FlowRequest) -> None:
        self._running.add(id(flow))
        self._metrics.running.labels(flow.request.model).inc()

    def on_outcome(self, flow: FlowRequest, outcome: Outcome) -> None:
        request = flow.request
        metrics = self._metrics
        if id(flow) in self._running:
            self._running.discard(id(flow))
            metrics.running.labels(request.model).dec()
        target = request.adapter or request.model
        objective = metrics.objective(request.model, target)
        duration = max(0.0, outcome.now - flow.received_at)
        objective.duration.observe(duration)
        if flow.first_byte_at is not None:
            fairness = request.headers.get(FAIRNESS_HEADER, "")
            metrics.ttft.labels(
                request.model, target, fairness, "", "true" if request.stream else "false"
            ).observe(max(0.0, flow.first_byte_at - flow.received_at))
        usage = outcome.usage
        if usage is not None:
            objective.input_tokens.observe(usage.prompt_tokens)
            objective.output_tokens.observe(usage.completion_tokens)
            if usage.cached_tokens is not None:
                metrics.cached_tokens.labels(request.model, target).observe(usage.cached_tokens)
            if outcome.ok and usage.completion_tokens > 0:
                metrics.ntpot.labels(request.model, target).observe(
                    duration / usage.completion_tokens
                )
        if not outcome.ok and outcome.status >= 400:
            metrics.errors.labels(request.model, target, str(outcome.status)).inc()

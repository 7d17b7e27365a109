"""The pod's /metrics page with vLLM 0.32's metric names, labels and semantics.

Built per scrape from an engine snapshot by a prometheus_client collector in a per-pod
registry, so N pods in one process never share series. `process_start_time_seconds` is
the pod's own start time, so a restarted pod (a new SimPod) reports a new value as a
restarted vLLM process does. Latency histograms are in the engine's (simulated GPU)
seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .engine import FINISH_REASONS, EngineMetrics, SimEngine
from .histogram import Histogram

LoraInfoMode = Literal["vllm", "exact"]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True)
class LoraInfoSeries:
    """``vllm:lora_requests_info``: one gauge per label combination ever seen, valued with
    the wall-clock time it was last set (vLLM never removes stale combinations).

    ``mode="vllm"`` mirrors vLLM 0.32, which reports the adapters of scheduled requests as
    both running and waiting and ignores requests still queued; ``"exact"`` reports running
    and waiting adapters separately.
    """

    max_loras: int
    mode: LoraInfoMode = "vllm"
    series: dict[tuple[str, str], float] = field(default_factory=dict)

    def record(self, m: EngineMetrics, wall_ts: float) -> None:
        running = ",".join(m.running_lora_adapters)
        waiting = running if self.mode == "vllm" else ",".join(m.waiting_lora_adapters)
        self.series[(running, waiting)] = wall_ts


class SimMetricsCollector:
    def __init__(
        self,
        engine: SimEngine,
        model_name: str,
        lora_info: LoraInfoSeries | None,
        cache_labels: dict[str, str],
        start_time: float | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self.engine = engine
        self.clock = clock  # the engine's clock: gauges show the last step that ended by then
        self.model_name = model_name
        self.lora_info = lora_info
        self.cache_labels = cache_labels
        # Pods share one OS process, so each pod reports its own start as its process's.
        self.start_time = time.time() if start_time is None else start_time

    def collect(self) -> Iterator[Metric]:
        m = self.engine.snapshot_metrics(self.clock() if self.clock is not None else None)
        s = m.stats
        names, values = ["engine", "model_name"], ["0", self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        def histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
            f = HistogramMetricFamily(name, doc, labels=names)
            f.add_metric(values, buckets=h.cumulative(), sum_value=h.sum)
            return f

        start = GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
        )
        start.add_metric([], self.start_time)
        yield start
        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            m.num_requests_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            m.num_requests_waiting,
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            labels=[*names, "reason"],
        )
        by_reason.add_metric([*values, "capacity"], m.num_waiting_for_capacity)
        by_reason.add_metric([*values, "deferred"], m.num_waiting_deferred)
        yield by_reason
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            m.kv_cache_usage_perc,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.num_preemptions,
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["engine", "finished_reason", "model_name"],
        )
        for reason in FINISH_REASONS:
            success.add_metric(["0", reason, self.model_name], s.request_success[reason])
        yield success
        yield histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            s.ttft,
        )
        yield histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            s.itl,
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            s.e2e,
        )
        yield histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            s.queue_time,
        )
        if self.lora_info is not None:
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            for (running, waiting), ts in self.lora_info.series.items():
                info.add_metric([str(self.lora_info.max_loras), running, waiting], ts)
            yield info
        cache = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=sorted(self.cache_labels),
        )
        cache.add_metric([self.cache_labels[k] for k in sorted(self.cache_labels)], 1.0)
        yield cache


def cache_config_labels(engine: SimEngine, gpu_memory_utilization: float = 0.9) -> dict[str, str]:
    cfg = engine.config
    return {
        "block_size": str(engine.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "engine": "0",
        "gpu_memory_utilization": str(gpu_memory_utilization),
        "kv_cache_size_tokens": str(engine.pool.num_usable * engine.block_size),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(engine.pool.num_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": cfg.hash_algo,
        "sliding_window": "None",
    }


class PodMetrics:
    """A pod's metrics registry; ``render()`` is the /metrics body."""

    def __init__(
        self,
        engine: SimEngine,
        model_name: str,
        *,
        lora_info_mode: LoraInfoMode = "vllm",
        with_lora: bool = False,
        clock: Callable[[], float] | None = None,
    ):
        self.lora_info = LoraInfoSeries(engine.max_loras, lora_info_mode) if with_lora else None
        self.registry = CollectorRegistry(auto_describe=False)
        labels = cache_config_labels(engine)
        self.registry.register(
            SimMetricsCollector(engine, model_name, self.lora_info, labels, clock=clock)
        )

    def record_step(self, engine: SimEngine, wall_ts: float) -> None:
        if self.lora_info is not None:
            self.lora_info.record(engine.snapshot_metrics(), wall_ts)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Pod signals from /metrics: a pure parser and a concurrent keep-alive scraper.

`parse_vllm_metrics(text)` reads the few series the scheduler needs from a vLLM (or
SGLang) Prometheus page. It seeks the known names instead of parsing every metric
family: a vLLM page is ~50 kB of histograms, and a 50 ms scrape interval across many
pods makes a general parser (prometheus_client's takes ~10 ms a page) the bottleneck.

`MetricsScraper` polls every pod of a datastore concurrently over one keep-alive HTTP
session (one task per pod, so a slow pod delays only itself). A pod whose scrape fails
`failure_threshold` times in a row is marked not ready — it leaves the candidate set —
and comes back with its first good scrape. A pod whose `process_start_time_seconds`
changes between two scrapes restarted; `on_restart` hears of it (the KV index then drops
what the old process published, even if the event stream never showed the restart).

Several pickers of one pool share their scrapes (`epp.shared_state`): `should_scrape`
then says which pods this picker fetches itself, `on_fetched` hears of each fetch, and
another picker's scrape of a pod is applied with `apply_scrape` / `apply_failures`,
exactly as one of this picker's own would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import aiohttp
from prometheus_client import Counter, Histogram

from ..framework.types import PodMetrics, PodState

log = logging.getLogger(__name__)

SCRAPES = Counter("smart_epp_metrics_scrapes_total", "Pod /metrics scrapes by outcome", ["result"])
MALFORMED_LINES = Counter(
    "smart_epp_metrics_malformed_lines_total",
    "Lines of a pod /metrics page with a known name that could not be parsed (dropped)",
)
POD_RESTARTS = Counter(
    "smart_epp_pod_restarts_total",
    "Pod restarts seen as a new process_start_time_seconds on the pod's /metrics",
    ["pod"],
)
SCRAPE_DURATION = Histogram(
    "smart_epp_metrics_scrape_duration_seconds",
    "Time to fetch and parse one pod /metrics page",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)


class MetricsParseError(ValueError):
    """The page holds none of the series a model server exposes."""


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

# name -> field; counts add up across engines (data-parallel ranks), usage takes the max.
_SUMMED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
}
_MAXED = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # before vLLM 0.10
    "sglang:token_usage": "kv_usage",
}
_LORA_INFO = "vllm:lora_requests_info"
_CACHE_CONFIG = "vllm:cache_config_info"
_PROCESS_START = "process_start_time_seconds"
_KNOWN = frozenset((*_SUMMED, *_MAXED, _LORA_INFO, _CACHE_CONFIG))
_INTEGER_FIELDS = frozenset(("waiting", "running"))


def _sample_lines(text: str, name: str) -> Iterator[str]:
    """Every line of `text` that is a sample of series `name` (str.find runs in C, so
    the ~50 kB of histogram lines around them cost next to nothing)."""
    needle = "\n" + name
    at = 0 if text.startswith(name) else text.find(needle)
    while at >= 0:
        begin = at if at == 0 and text.startswith(name) else at + 1
        end = text.find("\n", begin)
        line = text[begin:] if end < 0 else text[begin:end]
        follower = line[len(name) : len(name) + 1]
        if follower in ("{", " ", "\t"):
            yield line
        if end < 0:
            return
        at = text.find(needle, end)


def _split_sample(line: str) -> tuple[str, float]:
    """(raw label block, value) of one sample line; ValueError if malformed."""
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            raise ValueError("unclosed label set")
        labels, rest = line[brace + 1 : close], line[close + 1 :]
    else:
        labels, rest = "", line.partition(" ")[2]
    fields = rest.split()
    if not fields:
        raise ValueError("no value")
    value = float(fields[0])
    if math.isnan(value):
        raise ValueError("NaN")
    return labels, value


def _labels(raw: str) -> dict[str, str]:
    return {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(raw)}


def _adapters(value: str) -> frozenset[str]:
    return frozenset(a.strip() for a in value.split(",") if a.strip())


def _samples(text: str, name: str) -> Iterator[tuple[str, float]]:
    for line in _sample_lines(text, name):
        try:
            yield _split_sample(line)
        except ValueError:
            MALFORMED_LINES.inc()


def parse_vllm_metrics(text: str) -> PodMetrics:
    """The scheduler's signals from a vLLM or SGLang /metrics page.

    `lora_requests_info` is a gauge whose value is the time its label set was last
    written, and old label sets are never removed, so the current adapters are those of
    the series with the largest value. Malformed lines of known series are counted and
    dropped; a page with none of the known series raises MetricsParseError.
    """
    out = PodMetrics()
    seen = False
    for name, field in _SUMMED.items():
        for _, value in _samples(text, name):
            seen = True
            current = getattr(out, field)
            setattr(out, field, current + (int(value) if field in _INTEGER_FIELDS else value))
    for name in _MAXED:
        for _, value in _samples(text, name):
            seen = True
            out.kv_usage = max(out.kv_usage, min(1.0, max(0.0, value)))
    if not seen:
        raise MetricsParseError("no vLLM or SGLang scheduler metrics on the page")
    newest = -math.inf
    for raw_labels, value in _samples(text, _LORA_INFO):
        if value > newest:
            newest = value
            labels = _labels(raw_labels)
            out.running_adapters = _adapters(labels.get("running_lora_adapters", ""))
            out.waiting_adapters = _adapters(labels.get("waiting_lora_adapters", ""))
            max_lora = labels.get("max_lora", "0") or "0"
            out.max_loras = int(max_lora) if max_lora.isdigit() else 0
    for _, value in _samples(text, _PROCESS_START):
        out.process_start_time = value
    for raw_labels, _ in _samples(text, _CACHE_CONFIG):
        labels = _labels(raw_labels)
        if labels.get("block_size", "").isdigit():
            out.block_size = int(labels["block_size"])
        if labels.get("num_gpu_blocks", "").isdigit():
            out.num_gpu_blocks = int(labels["num_gpu_blocks"])
    return out


# --------------------------------------------------------------------------- scraper

PodLister = Callable[[], Iterable[PodState]]


def pod_lister(datastore: Any) -> PodLister:
    """Adapts a datastore (with `pods()`, or `pods` as a mapping/sequence) or a callable."""
    if callable(datastore):
        return cast(PodLister, datastore)
    pods = getattr(datastore, "pods", None)
    if callable(pods):
        return cast(PodLister, pods)
    if isinstance(pods, dict):
        return lambda: list(pods.values())
    if pods is not None:
        return lambda: list(pods)
    raise TypeError("the datastore must expose pods() or be a callable returning PodStates")


def polling_session(timeout_s: float) -> aiohttp.ClientSession:
    """One keep-alive HTTP session for polling every pod of a pool: no cap on connections
    (each pod keeps its own), and `timeout_s` bounding each whole request."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


class MetricsScraper:
    """Keeps every pod's `PodState.metrics` and `ready` current from its /metrics page."""

    def __init__(
        self,
        datastore: Any,
        interval_s: float = 0.05,
        timeout_s: float = 0.5,
        stale_after_s: float = 1.0,
        failure_threshold: int = 3,
        *,
        clock: Callable[[], float] = time.monotonic,
        session_factory: Callable[[], aiohttp.ClientSession] | None = None,
        on_restart: Callable[[PodState], None] | None = None,
        on_scraped: Callable[[PodState], None] | None = None,
    ) -> None:
        self._list_pods = pod_lister(datastore)
        # Called when a pod's process_start_time_seconds changes between two scrapes: the
        # pod restarted, even if nothing else (e.g. its KV-event numbering) showed it.
        self.on_restart = on_restart
        # Called after every successful scrape (flow control's dispatch trigger).
        self.on_scraped = on_scraped
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stale_after_s = stale_after_s
        self.failure_threshold = failure_threshold
        self.clock = clock
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None
        self._pods: dict[str, PodState] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._unready_by_us: set[str] = set()
        self._supervisor: asyncio.Task[None] | None = None
        # Which pods this picker fetches itself (None: all of them).
        self.should_scrape: Callable[[str], bool] | None = None
        # Hears of each of this picker's own fetches: the metrics, or None when it failed.
        self.on_fetched: Callable[[PodState, PodMetrics | None], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._supervisor is not None:
            return
        factory = self._session_factory or (lambda: polling_session(self.timeout_s))
        self._session = factory()
        self._sync_pods()
        self._supervisor = asyncio.create_task(self._supervise(), name="metrics-scraper")

    async def stop(self) -> None:
        tasks = [t for t in (self._supervisor, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._supervisor = None
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ state

    def stale(self, pod: PodState) -> bool:
        """True when the pod's metrics are older than `stale_after_s` (or never came)."""
        scraped = pod.metrics.scraped_at
        return scraped == 0.0 or self.clock() - scraped > self.stale_after_s

    def _sync_pods(self) -> None:
        current = {p.address: p for p in self._list_pods()}
        self._pods = current
        for address in list(self._tasks):
            if address not in current:
                self._tasks.pop(address).cancel()
                self._unready_by_us.discard(address)
                with contextlib.suppress(KeyError):
                    POD_RESTARTS.remove(address)
        for address in current:
            if address not in self._tasks:
                self._tasks[address] = asyncio.create_task(
                    self._scrape_loop(address), name=f"scrape {address}"
                )

    async def _supervise(self) -> None:
        # Pods come and go with discovery; pick the changes up at the scrape cadence.
        while True:
            await asyncio.sleep(max(self.interval_s, 0.05))
            try:
                self._sync_pods()
            except Exception:
                log.exception("listing pods for the metrics scraper failed")

    async def _scrape_loop(self, address: str) -> None:
        while True:
            started = time.perf_counter()
            pod = self._pods.get(address)
            if pod is None:
                return
            if self.should_scrape is None or self.should_scrape(address):
                await self.scrape_once(pod)
            elapsed = time.perf_counter() - started
            await asyncio.sleep(max(0.0, self.interval_s - elapsed))

    async def scrape_once(self, pod: PodState) -> bool:
        """Fetches and applies one scrape; True on success."""
        assert self._session is not None, "start() first"
        started = time.perf_counter()
        try:
            async with self._session.get(pod.endpoint.metrics_url) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(
                        resp.request_info, (), status=resp.status, message=resp.reason or ""
                    )
                text = await resp.text()
            metrics = parse_vllm_metrics(text)
        except MetricsParseError as exc:
            SCRAPES.labels("malformed").inc()
            self._failed(pod, exc)
            self._fetched(pod, None)
            return False
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError) as exc:
            SCRAPES.labels("error").inc()
            self._failed(pod, exc)
            self._fetched(pod, None)
            return False
        SCRAPE_DURATION.observe(time.perf_counter() - started)
        SCRAPES.labels("ok").inc()
        self.apply_scrape(pod, metrics, self.clock())
        self._fetched(pod, metrics)
        return True

    def _fetched(self, pod: PodState, metrics: PodMetrics | None) -> None:
        if self.on_fetched is not None:
            try:
                self.on_fetched(pod, metrics)
            except Exception:
                log.exception("fetch listener failed for %s", pod.address)

    def apply_scrape(self, pod: PodState, metrics: PodMetrics, scraped_at: float) -> None:
        """A successful scrape of `pod` taken at `scraped_at` (this scraper's clock), by
        this picker or another: the pod's metrics, restart and readiness follow it."""
        metrics.mark_scraped(scraped_at, pod.metrics)
        previous_start = pod.metrics.process_start_time
        pod.metrics = metrics
        started_at = metrics.process_start_time
        if previous_start is not None and started_at is not None and started_at != previous_start:
            self._restarted(pod)
        if pod.address in self._unready_by_us:
            self._unready_by_us.discard(pod.address)
            pod.ready = True
            log.info("pod %s answers /metrics again; back in the candidate set", pod.address)
        if self.on_scraped is not None:
            try:
                self.on_scraped(pod)
            except Exception:
                log.exception("scrape listener failed for %s", pod.address)

    def apply_failures(self, pod: PodState, failures: int, scraper: str) -> None:
        """Another picker's scrapes of `pod` failed `failures` times in a row: the pod
        leaves the candidate set at the same threshold as for this picker's own."""
        if failures <= pod.metrics.consecutive_failures:
            return
        pod.metrics.consecutive_failures = failures - 1
        self._failed(pod, RuntimeError(f"reported by picker {scraper}"))

    def _restarted(self, pod: PodState) -> None:
        POD_RESTARTS.labels(pod.address).inc()
        log.info("pod %s restarted (new process_start_time_seconds)", pod.address)
        if self.on_restart is not None:
            try:
                self.on_restart(pod)
            except Exception:
                log.exception("restart listener failed for %s", pod.address)

    def _failed(self, pod: PodState, exc: BaseException) -> None:
        pod.metrics.consecutive_failures += 1
        failures = pod.metrics.consecutive_failures
        if failures >= self.failure_threshold and pod.ready:
            pod.ready = False
            self._unready_by_us.add(pod.address)
            log.warning(
                "pod %s failed %d /metrics scrapes in a row (%r); out of the candidate set",
                pod.address,
                failures,
                exc,
            )

"""`epp serve`: the endpoint picker as a process. `serve()` is the one place where the
datastore, discovery, model catalog, metrics scraper, KV-event ingestion, block index,
scheduler and server are put together.

Every Prometheus series of the process (the gateway's own, the scheduler's, the
scraper's, the KV index's, the model catalog's) is served on the one --metrics-port.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..framework.types import PodState
from ..kv_index import metrics as kv_metrics
from ..kv_index.api import BlockIndex
from ..kv_index.catch_up import DEFAULT_CATCH_UP_TIMEOUT_S, CatchUp
from ..kv_index.curve import CurveServerConfig
from ..kv_index.ingest import IngestState
from ..kv_index.manager import KVEventManager
from ..kv_index.memory import DEFAULT_CAPACITY, DEFAULT_SPECULATIVE_TTL_S, MemoryBlockIndex
from ..kv_index.redis_backend import RedisBlockIndex
from .config import BUILTIN_CONFIGS, ConfigError, load_config
from .datastore import Datastore
from .discovery import EndpointsFileWatcher, endpoints_from_addresses, parse_address
from .drain import DEFAULT_DRAIN_NOTICE_S, DEFAULT_DRAIN_TIMEOUT_S, drain
from .flags import add_secure_serving, boolean
from .flow import RequestFlow
from .flowcontrol.admission import AdmissionController
from .flowcontrol.build import build_admission, flow_control_enabled
from .flowcontrol.edge import run_admission_clock, watch_objectives
from .flowcontrol.k8s_objectives import KubernetesObjectivesWatcher
from .flowcontrol.metrics import FlowControlMetrics
from .flowcontrol.objectives import (
    ObjectivesError,
    ObjectivesFileWatcher,
    ObjectiveTable,
    parse_objectives,
)
from .gateway_metrics import GatewayMetrics, LearnedCosts
from .k8s_discovery import (
    KubernetesDiscoveryOptions,
    KubernetesPoolWatcher,
    kubernetes_discovery_options,
)
from .model_catalog import ModelCatalog, ModelCatalogPoller, ServedModels
from .model_routing import ServedModelFilter
from .prefix_audit import PrefixAudit
from .readiness import ready_when_caught_up
from .request_limits import DEFAULT_ALLOWED_PATHS, RequestLimits
from .scheduler import build_scheduler
from .scrape import MetricsScraper
from .server import DEFAULT_MAX_BODY_BYTES, EppServer, ServerOptions
from .shared_state.records import RecordRelay
from .shared_state.sync import DEFAULT_INTERVAL_S as DEFAULT_SHARED_SYNC_S
from .shared_state.sync import DEFAULT_MAX_STALENESS_S as DEFAULT_SHARED_MAX_STALENESS_S
from .shared_state.sync import DEFAULT_NOTICE_GAP_S as DEFAULT_SHARED_NOTICE_GAP_S
from .shared_state.wiring import SharedStateKind, connect_shared_state
from .tls import TlsOptions, server_credentials
from .tokenization import TokenizerRouter
from .tokenizer_discovery import TokenizerDiscovery
from .traffic_recorder import TrafficRecorder

log = logging.getLogger(__name__)

# Two endpoints after the primary: a retry survives one more dead pod than it needs to.
DEFAULT_FALLBACKS = 2

KVEventsMode = Literal["dial", "central", "off"]
KVIndexKind = Literal["memory", "redis"]
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass
class ServeOptions:
    grpc_port: int = 9002
    health_port: int = 9003
    metrics_port: int = 9090
    host: str = "0.0.0.0"
    # ext_proc over TLS (None: plaintext); the health and metrics ports stay plaintext.
    tls: TlsOptions | None = field(default_factory=TlsOptions)
    # SIGTERM: open streams get this long to finish; new ones are decided meanwhile.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    drain_notice_s: float = DEFAULT_DRAIN_NOTICE_S
    # EndpointPickerConfig: a YAML path or a built-in name; None means the built-in default.
    config: Path | str | None = None
    endpoints: list[str] = field(default_factory=list)
    endpoints_file: Path | None = None
    endpoints_poll_s: float = 0.5
    # The pool from an InferencePool's pods over the Kubernetes API; None = static pool.
    k8s: KubernetesDiscoveryOptions | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    pool_name: str = "default"
    # Base model for KV key scope when no topic or endpoint label names it; None = the
    # base model each pod lists on /v1/models.
    model: str | None = None
    kv_events_mode: KVEventsMode = "dial"
    kv_events_bind: str = "tcp://*:5557"
    kv_events_port: int = 5557  # dial mode, for endpoints that name no kv_events
    kv_replay_port: int = 5558  # for endpoints that name no kv_replay
    kv_index: KVIndexKind = "memory"
    kv_index_capacity: int = DEFAULT_CAPACITY
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Health stays NOT_SERVING until every pod's index caught up, at most this long.
    catch_up_timeout_s: float = DEFAULT_CATCH_UP_TIMEOUT_S
    scrape_interval_s: float = 0.05
    models_poll_s: float = 2.0
    # Recorded-traffic JSONL for `epp replay --format recorded`; None = not recorded.
    record_traffic: Path | None = None
    record_prompts: bool = False  # prompts are user data: sizes and timing only by default
    # InferenceObjective YAML (priorities by objective name), reloaded on change.
    objectives_file: Path | None = None
    # Central mode: only publishers with an allowed CURVE key may connect; None = open.
    kv_events_curve: CurveServerConfig | None = None
    # Paths forwarded to the pods; any other is answered 404 by the picker.
    allowed_paths: tuple[str, ...] = DEFAULT_ALLOWED_PATHS
    # Endpoints sent after the primary, for Envoy to retry on when the primary refuses.
    fallbacks: int = DEFAULT_FALLBACKS
    # OTLP/gRPC collector for request traces; None = OTEL_EXPORTER_OTLP_ENDPOINT, if set.
    otlp_endpoint: str | None = None
    # In-flight load and routed prefixes shared with the other pickers of the pool
    # (local: this picker alone); the Redis server is `shared_state_url`, else redis_url.
    shared_state: SharedStateKind = "local"
    shared_state_url: str | None = None
    shared_state_sync_s: float = DEFAULT_SHARED_SYNC_S
    shared_state_max_staleness_s: float = DEFAULT_SHARED_MAX_STALENESS_S
    # Exchanges that change loads or routed prefixes wake the other pickers' reads, at
    # most one notice (and one exchange woken by notices) per gap.
    shared_state_notices: bool = True
    shared_state_notice_gap_s: float = DEFAULT_SHARED_NOTICE_GAP_S
    # A worker of `--workers N` (set by the supervisor, epp/workers.py): binds the
    # ext_proc port with SO_REUSEPORT and hands access-log records it did not route on.
    reuse_port: bool = False
    hand_on_records: bool = False
    # Models with no local-tokenizer plugin: look for their tokenizer in these folders and
    # the Hugging Face hub cache, and use it once it agrees with the pods.
    tokenizer_discovery: bool = True
    tokenizers_dirs: tuple[Path, ...] = ()


def _start_tracing(
    options: ServeOptions, flow: RequestFlow, server: EppServer, scheduler: Any
) -> Any:
    """Request traces over OTLP when an endpoint is configured; None (and nothing
    imported or recorded) otherwise."""
    endpoint = options.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    from .tracing import RequestTracing

    tracing = RequestTracing(endpoint)
    flow.add_hook(tracing)
    server.record_marks = True
    if hasattr(scheduler, "record_timings"):
        scheduler.record_timings = True
    log.info("tracing: exporting request spans over OTLP/gRPC to %s", endpoint)
    return tracing


class _ForeignMetrics(Collector):
    """Serves another registry's series (the process-wide default one, where the
    scraper, KV-index, tokenizer and catalog metrics live) from the gateway's registry,
    minus the names the gateway's registry already has."""

    def __init__(self, source: CollectorRegistry, own: CollectorRegistry) -> None:
        self._source = source
        self._skip = {family.name for family in own.collect()}

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            if family.name not in self._skip:
                yield family


def _warn_on_shared_default_sockets(pods: list[PodState], port: int) -> None:
    """Pods without their own kv_events are dialled at <host>:port; pods sharing a host
    would all hear one publisher and share its blocks, so say so."""
    hosts: dict[str, int] = {}
    for pod in pods:
        if pod.endpoint.kv_events is None:
            host = pod.address.rsplit(":", 1)[0]
            hosts[host] = hosts.get(host, 0) + 1
    for host, count in hosts.items():
        if count > 1:
            log.warning(
                "%d endpoints on %s name no kv_events; they would all subscribe to "
                "tcp://%s:%d. List each pod's kv_events and kv_replay in --endpoints-file.",
                count,
                host,
                host,
                port,
            )


def _build_index(options: ServeOptions) -> BlockIndex:
    if options.kv_index == "redis":
        return RedisBlockIndex.from_url(options.redis_url, capacity=options.kv_index_capacity)
    return MemoryBlockIndex(options.kv_index_capacity)


class _Background:
    """Fire-and-forget tasks that are still cancelled and awaited at shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def keep(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve(
    options: ServeOptions,
    *,
    stop: asyncio.Event | None = None,
    on_started: Callable[[EppServer], None] | None = None,
) -> None:
    """Runs the picker until `stop` is set (or SIGINT/SIGTERM when no event is given)."""
    loaded = load_config(options.config)  # a bad config fails before anything starts
    for note in loaded.notes:
        log.info("config %s: %s", loaded.source, note)
    # So do bad certificate files.
    credentials = None if options.tls is None else server_credentials(options.tls)
    datastore = Datastore()
    background = _Background()
    metrics = GatewayMetrics(
        options.pool_name, lambda: len(datastore.ready_pods()), datastore.ready_pods
    )
    metrics.record_config(loaded.source, loaded.config.apiVersion)

    index = _build_index(options)
    if isinstance(index, RedisBlockIndex):
        background.spawn(index.maintain())  # reconnects, re-seeds an emptied store
    ingest = IngestState(max_hashes_per_tier=options.kv_index_capacity)
    progress = ingest.progress
    kv_metrics.PREFILL_REQUESTS.set_function(lambda: len(progress))
    kv_metrics.PREFILL_CONFIRMED_PODS.set_function(progress.confirmed_pods)
    catalog = ModelCatalog(datastore.pods)

    def scope_model(address: str) -> str | None:
        """The base model a pod's KV keys are scoped by (the same rule on every replica)."""
        pod = datastore.get(address)
        label = pod.endpoint.label("model") if pod is not None else None
        return ingest.model(address) or label or options.model or catalog.base_model_of_pod(address)

    shared, scheduler_index = connect_shared_state(
        options.shared_state,
        url=options.shared_state_url or options.redis_url,
        pool_name=options.pool_name,
        datastore=datastore,
        index=index,
        registry=metrics.registry,
        interval_s=options.shared_state_sync_s,
        speculative_ttl_s=DEFAULT_SPECULATIVE_TTL_S,
        max_staleness_s=options.shared_state_max_staleness_s,
        notices=options.shared_state_notices,
        notice_gap_s=options.shared_state_notice_gap_s,
    )
    scheduler = build_scheduler(
        loaded,
        index=scheduler_index,
        ingest_state=ingest,
        model_of=scope_model,
        base_model=options.model,
        registry=metrics.registry,
        record_e2e=False,  # the server times the whole scheduling call under that name
        fallbacks=options.fallbacks,
        tokenizer_discovery=(
            TokenizerDiscovery(options.tokenizers_dirs) if options.tokenizer_discovery else None
        ),
        context_limit_of=catalog.context_limit,
    )
    metrics.registry.register(LearnedCosts(lambda: list(scheduler.plugins.plugins.values())))
    if shared is not None:
        shared.share_learning(lambda: scheduler.plugins.plugins.values())
    events: KVEventManager | None = None
    if options.kv_events_mode != "off":
        events = KVEventManager(
            index,
            ingest,
            mode=options.kv_events_mode,
            bind=options.kv_events_bind,
            default_model=options.model or "",
            default_events_port=options.kv_events_port,
            default_replay_port=options.kv_replay_port,
            curve=options.kv_events_curve,
            model_of=None
            if options.model
            else (lambda endpoint: catalog.base_model_of_pod(endpoint.address)),
        )

    def models_changed(address: str, served: ServedModels) -> None:
        base = catalog.base_model_of_pod(address)
        if base is None or options.model:
            return
        tokenizer = scheduler.tokenizer
        if isinstance(tokenizer, TokenizerRouter) and tokenizer.base_model is None:
            tokenizer.base_model = base  # adapter requests use their base's tokenizer
        if events is not None:
            background.spawn(events.set_model(address, base))

    poller = ModelCatalogPoller(catalog, options.models_poll_s, on_change=models_changed)

    def pod_restarted(pod: PodState) -> None:
        if events is not None:
            background.spawn(events.reset_pod(pod.address))
        poller.refresh_soon(pod.address)

    admission: AdmissionController | None = None
    objectives_watcher: ObjectivesFileWatcher | None = None
    if flow_control_enabled(loaded) or options.objectives_file is not None:
        flow_metrics = FlowControlMetrics(metrics.registry)
        objectives = ObjectiveTable(on_unknown=flow_metrics.unknown_objective)
        # The scraper stamps metrics with time.monotonic: staleness is judged on that clock.
        admission = build_admission(
            loaded,
            datastore.ready_pods,
            clock=time.monotonic,
            objectives=objectives,
            observer=flow_metrics,
        )
        flow_metrics.watch(admission)
        if options.objectives_file is not None:
            pool = options.k8s.pool_name if options.k8s is not None else None
            objectives_watcher = ObjectivesFileWatcher(options.objectives_file, objectives, pool)
            objectives_watcher.poll()  # the objectives are in place before the first request
    flow = RequestFlow(
        scheduler,
        datastore,
        destination_count=1 + options.fallbacks,
        hooks=[ServedModelFilter(catalog), PrefixAudit(metrics.registry)],
        admission=admission,
    )
    if shared is not None and options.shared_state_max_staleness_s != float("inf"):
        flow.refresh = shared.refresh  # read the store before each decision
    scraper = MetricsScraper(
        datastore,
        interval_s=options.scrape_interval_s,
        on_restart=pod_restarted,
        on_scraped=(lambda _pod: flow.pump()) if admission is not None else None,
    )
    if shared is not None:
        shared.share_scrapes(scraper)  # one picker of the pool fetches each pod's /metrics
    recorder: TrafficRecorder | None = None
    if options.record_traffic is not None:
        recorder = TrafficRecorder.to_file(
            options.record_traffic, include_content=options.record_prompts
        )
        flow.add_hook(recorder)
    server = EppServer(
        flow,
        adapter_resolver=catalog.resolve_adapter,
        options=ServerOptions(
            max_body_bytes=options.max_body_bytes,
            pool_name=options.pool_name,
            request_limits=RequestLimits.with_paths(options.allowed_paths),
            reuse_port=options.reuse_port,
        ),
        metrics=metrics,
    )
    relay: RecordRelay | None = None
    if options.hand_on_records and shared is not None:
        response_log = server.response_log
        relay = RecordRelay(
            options.shared_state_url or options.redis_url,
            options.pool_name,
            shared.picker_id,
            lambda records: response_log.on_records(records, handed_on=True),
        )
        response_log.on_unmatched = relay.hand_on
    tracing = _start_tracing(options, flow, server, scheduler)
    metrics.registry.register(_ForeignMetrics(REGISTRY, metrics.registry))

    datastore.add_listener(poller.on_endpoint_added, poller.on_endpoint_removed)
    datastore.add_departure_listener(scheduler.on_pod_removed)
    if options.endpoints:
        datastore.set_endpoints(endpoints_from_addresses(options.endpoints))
    if options.endpoints_file is not None:
        watcher = EndpointsFileWatcher(
            options.endpoints_file,
            datastore,
            options.endpoints_poll_s,
            on_error=lambda _exc: metrics.discovery_errors.inc(),
        )
        watcher.poll()  # the first pool is in place before the first request
        background.keep(asyncio.create_task(watcher.run(), name="endpoints-file-watcher"))
    if admission is not None:
        background.keep(asyncio.create_task(run_admission_clock(admission), name="admission"))
    if objectives_watcher is not None:
        background.keep(
            asyncio.create_task(watch_objectives(objectives_watcher), name="objectives-watcher")
        )
    pool_watcher: KubernetesPoolWatcher | None = None
    if options.k8s is not None:
        pool_watcher = KubernetesPoolWatcher(options.k8s, datastore)
        background.keep(asyncio.create_task(pool_watcher.run(), name="k8s-pool-watcher"))
        if admission is not None and objectives_watcher is None:
            # In Kubernetes the objectives are InferenceObjective objects of the pool.
            k8s_objectives = KubernetesObjectivesWatcher(options.k8s, objectives)
            background.keep(
                asyncio.create_task(k8s_objectives.run(), name="k8s-objectives-watcher")
            )

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    if options.kv_events_mode == "dial":
        _warn_on_shared_default_sockets(datastore.pods(), options.kv_events_port)

    started: list[Callable[[], Coroutine[Any, Any, None]]] = []
    serving = False
    try:
        if pool_watcher is not None and not await pool_watcher.wait_synced(10.0):
            log.warning("no pool from the Kubernetes API yet; serving, and still watching")
        # The pool's models first: KV keys are scoped by each pod's base model.
        await poller.start()
        started.append(poller.stop)
        if events is not None:
            datastore.add_listener(events.on_endpoint_added, events.on_endpoint_removed)
            await events.start()
            started.append(events.stop)
            if events.central_endpoint is not None:
                log.info("KV events: pods publish to %s", events.central_endpoint)
        await scraper.start()
        started.append(scraper.stop)
        if shared is not None:
            shared.start()
            started.append(shared.close)
        if relay is not None:
            relay.start()
            started.append(relay.close)
        await server.start(
            options.grpc_port,
            options.health_port,
            options.metrics_port,
            host=options.host,
            tls=credentials,
            ready=events is None,
        )
        serving = True
        if events is not None:
            redis_index = index if isinstance(index, RedisBlockIndex) else None
            catch_up = CatchUp(
                events,
                lambda: [pod.address for pod in datastore.pods()],
                (lambda: redis_index.store_synced) if redis_index is not None else None,
            )
            background.spawn(
                ready_when_caught_up(server, catch_up, options.catch_up_timeout_s, stop)
            )
        log.info(
            "epp serving ext_proc (%s) on %s:%d (health :%d, metrics :%d) with %d endpoints; "
            "KV events %s, %s index, %s shared state",
            "plaintext" if credentials is None else "TLS",
            options.host,
            server.grpc_port,
            server.health_port,
            server.metrics_port,
            len(datastore),
            options.kv_events_mode,
            options.kv_index,
            options.shared_state,
        )
        if on_started is not None:
            on_started(server)
        await stop.wait()
    finally:
        # The pool, its signals and the index stay live while the drain still decides.
        if serving:
            await drain(server, options.drain_timeout_s, options.drain_notice_s)
        if tracing is not None:  # after the drain, so the drained requests' spans go too
            await asyncio.to_thread(tracing.close)
        await background.close()
        for stop_part in reversed(started):
            try:
                await stop_part()
            except Exception:
                log.exception("shutdown step failed")
        await scheduler.aclose()
        if recorder is not None:
            recorder.close()
        if isinstance(index, RedisBlockIndex):
            await index.close()


# --------------------------------------------------------------------------- CLI


def _address(value: str) -> str:
    try:
        return parse_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _config(value: str) -> Path | str:
    path = Path(value)
    if path.is_file():
        return path
    if value in BUILTIN_CONFIGS:
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is neither a file nor a built-in config ({', '.join(BUILTIN_CONFIGS)})"
    )


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(value: str) -> int | float:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
        if number <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {value}")
        return number

    return parse


def _add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    serving = parser.add_argument_group("serving")
    serving.add_argument(
        "--host",
        default="0.0.0.0",
        help="bind address of the ext_proc, health and metrics ports (default %(default)s)",
    )
    add_secure_serving(
        serving,
        "serve ext_proc over TLS (default true): with --tls-cert/--tls-key, or a "
        "self-signed certificate generated at start. The health port stays plaintext "
        "for kubelet's gRPC probe.",
    )
    serving.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        metavar="FILE",
        help="PEM certificate (chain) of the ext_proc port, re-read when it changes",
    )
    serving.add_argument(
        "--tls-key", type=Path, default=None, metavar="FILE", help="PEM key of --tls-cert"
    )
    serving.add_argument(
        "--drain-timeout",
        type=_positive(float),
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM, health turns NOT_SERVING and open streams get this long to finish "
        "(default %(default)s; keep terminationGracePeriodSeconds above it)",
    )


def _tls_from_args(args: argparse.Namespace) -> TlsOptions | None:
    if not args.secure_serving:
        if args.tls_cert is not None or args.tls_key is not None:
            raise ValueError("--tls-cert/--tls-key need --secure-serving=true")
        return None
    tls = TlsOptions(args.tls_cert, args.tls_key)
    for path in (tls.cert_file, tls.key_file):
        if path is not None and not path.is_file():
            raise ValueError(f"TLS file {path} does not exist")
    return tls


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the endpoint picker (Envoy ext_proc gRPC server)",
        description="Envoy external processor that picks the pod for every OpenAI request.",
        epilog="Models: every pod's /v1/models is polled; a request is only sent to pods that "
        "serve its model or LoRA adapter. A model no pod serves is answered 404 (as vLLM "
        "answers it); a served model with none of its pods available, 503. "
        "KV events: list each pod's kv_events and kv_replay in --endpoints-file; pods "
        "without them are dialled at <pod ip>:--kv-events-port / --kv-replay-port, which "
        "only fits pods with their own IP. A pod whose /metrics reports a new "
        "process_start_time_seconds restarted: its index entries are dropped and its "
        "events replayed from 0.",
    )
    parser.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port")
    _add_serving_arguments(parser)
    parser.add_argument("--health-port", type=int, default=9003, help="gRPC health port")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="Prometheus port: gateway, scheduler, scrape, KV-index and model-catalog series",
    )
    parser.add_argument(
        "--config",
        type=_config,
        default=None,
        metavar="FILE|NAME",
        help="EndpointPickerConfig YAML file, or a built-in config "
        f"({', '.join(BUILTIN_CONFIGS)}); default: the built-in predicted-TTFT `default`",
    )
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument(
        "--endpoint",
        action="append",
        type=_address,
        default=[],
        metavar="HOST:PORT",
        help="a model server of the pool (repeat for each)",
    )
    pool.add_argument(
        "--endpoints-file", type=Path, default=None, help="YAML endpoints file, reloaded on change"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are answered 413",
    )
    parser.add_argument(
        "--allowed-path",
        action="append",
        default=None,
        metavar="PATH",
        help="a path forwarded to the pods (repeat; replaces the default list of the OpenAI "
        "paths vLLM serves: " + ", ".join(DEFAULT_ALLOWED_PATHS) + "); any other is "
        "answered 404, so engine admin endpoints are never reachable through the gateway",
    )
    parser.add_argument(
        "--fallbacks",
        type=int,
        default=DEFAULT_FALLBACKS,
        help="endpoints listed after the primary in the destination, best-scored first: "
        "Envoy retries on them when the primary refuses the connection "
        f"(default {DEFAULT_FALLBACKS}; 0 sends the primary alone)",
    )
    parser.add_argument(
        "--pool-name",
        default=None,
        help="the InferencePool's name: the label of the pool's metrics (default: default) "
        "and, for Kubernetes discovery, the pool whose pods are followed",
    )
    k8s = parser.add_argument_group(
        "Kubernetes discovery",
        "The pool is the InferencePool --pool-name's Running, Ready pods on its target "
        "port(s), followed over the Kubernetes API. On when --k8s-api is given, or inside a "
        "cluster (KUBERNETES_SERVICE_HOST set) when --pool-name is given without --endpoint "
        "or --endpoints-file. Pod annotations smart-epp.io/kv-events-port and "
        "smart-epp.io/kv-replay-port override --kv-events-port / --kv-replay-port per pod.",
    )
    pool.add_argument(
        "--k8s-api",
        default=None,
        metavar="URL",
        help="Kubernetes API server for out-of-cluster use (default in a cluster: the "
        "service-account's https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)",
    )
    k8s.add_argument(
        "--pool-namespace",
        default=None,
        metavar="NS",
        help="the InferencePool's namespace (default: this pod's namespace, else default)",
    )
    k8s.add_argument(
        "--k8s-token-file",
        type=Path,
        default=None,
        help="bearer token file (default in a cluster: the service-account token)",
    )
    k8s.add_argument(
        "--k8s-ca-file",
        type=Path,
        default=None,
        help="CA bundle of an https API server (default in a cluster: the service-account "
        "CA; else the system's)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="base model that scopes KV-block keys when no KV-event topic or endpoint label "
        "`model` names one (default: the base model each pod lists on /v1/models)",
    )
    kv = parser.add_argument_group("KV-cache events and block index")
    kv.add_argument(
        "--kv-events-mode",
        choices=("dial", "central", "off"),
        default="dial",
        help="dial (default): subscribe to each endpoint's kv_events publisher; central: bind one "
        "socket (--kv-events-bind) that pods publish to with topic kv@<ip:port>@<model>; "
        "off: no subscriptions (e.g. a replica reading a shared Redis index)",
    )
    kv.add_argument(
        "--kv-events-bind",
        default="tcp://*:5557",
        metavar="ZMQ_ENDPOINT",
        help="where the central-mode SUB socket binds (default %(default)s)",
    )
    kv.add_argument(
        "--kv-events-curve-key",
        type=Path,
        metavar="FILE",
        help="central mode: require ZMQ CURVE. The picker's certificate (with its secret key, "
        "e.g. epp.key_secret from zmq.auth.create_certificates); needs "
        "--kv-events-curve-clients",
    )
    kv.add_argument(
        "--kv-events-curve-clients",
        type=Path,
        metavar="DIR",
        help="central mode with CURVE: the directory of the public certificates (*.key) of "
        "the publishers allowed to connect; any other is refused at the handshake",
    )
    kv.add_argument(
        "--kv-events-port",
        type=int,
        default=5557,
        help="dial mode: the pod's publisher port when its endpoint names no kv_events "
        "(default %(default)s)",
    )
    kv.add_argument(
        "--kv-replay-port",
        type=int,
        default=5558,
        help="the pod's replay port when its endpoint names no kv_replay (default %(default)s)",
    )
    kv.add_argument(
        "--kv-index",
        choices=("memory", "redis"),
        default="memory",
        help="block index backend (default memory); redis shares one index between gateway "
        "replicas and falls back to local state while Redis is unreachable",
    )
    kv.add_argument(
        "--kv-index-capacity",
        type=_positive(int),
        default=DEFAULT_CAPACITY,
        help="most blocks the index holds, least recently used dropped beyond "
        "(default %(default)s)",
    )
    kv.add_argument(
        "--catch-up-timeout",
        type=_positive(float),
        default=DEFAULT_CATCH_UP_TIMEOUT_S,
        metavar="SECONDS",
        help="at start, readiness stays NOT_SERVING until every pod's index has caught up "
        "(its replay socket's buffer applied, or the shared Redis index reachable; a pod "
        "whose replay socket does not answer is not waited for), at most this long "
        "(default %(default)s)",
    )
    kv.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="Redis server of --kv-index redis and --shared-state redis (default %(default)s)",
    )
    shared = parser.add_argument_group("shared pool state (several pickers, one pool)")
    shared.add_argument(
        "--shared-state",
        choices=("local", "redis"),
        default="local",
        help="local (default): this picker's own in-flight counts and routed prefixes; "
        "redis: shared through the Redis server of --redis-url with every picker of the "
        "pool (replicas, workers), so each sees the others' load and routed prefixes; "
        "routing goes on with local state while the server is unreachable",
    )
    shared.add_argument(
        "--shared-state-url",
        default=None,
        metavar="URL",
        help="Redis server of --shared-state redis when it is not --redis-url's",
    )
    shared.add_argument(
        "--workers",
        type=_positive(int),
        default=1,
        metavar="N",
        help="run N picker processes on the one ext_proc port (SO_REUSEPORT), each with "
        "its own KV-event subscriptions and scrape, sharing in-flight load and routed "
        "prefixes through --shared-state redis or, without it, a private Valkey this "
        "process starts; health and metrics stay one port each (default 1)",
    )
    for hidden in ("--reuse-port", "--hand-on-records"):  # set by the supervisor
        shared.add_argument(hidden, action="store_true", help=argparse.SUPPRESS)
    shared.add_argument(
        "--shared-state-max-staleness",
        type=_positive(float),
        default=None,
        metavar="SECONDS",
        help="make each decision read the store first (one round trip, shared by the "
        "decisions waiting at that moment, waiting at most 1 ms) unless an exchange "
        "started this recently; default off: decisions use what the background sync "
        "brought in (peers' changes at most --shared-state-notice-gap old plus round "
        "trips, or --shared-state-sync-interval without notices)",
    )
    shared.add_argument(
        "--shared-state-sync-interval",
        type=_positive(float),
        default=DEFAULT_SHARED_SYNC_S,
        metavar="SECONDS",
        help="exchange with the store at least this often (besides after each decision "
        "and each peer's change notice): the heartbeat, and how stale peers' state may "
        "get when notices are off or their connection is down (default %(default)s)",
    )
    shared.add_argument(
        "--shared-state-notices",
        type=boolean,
        nargs="?",
        const=True,
        default=True,
        metavar="true|false",
        help="an exchange that changes this picker's loads or routed prefixes notifies "
        "the other pickers (store pub/sub), which read it at once instead of at their "
        "next heartbeat (default true)",
    )
    shared.add_argument(
        "--shared-state-notice-gap",
        type=_positive(float),
        default=DEFAULT_SHARED_NOTICE_GAP_S,
        metavar="SECONDS",
        help="send at most one change notice, and read the store for peers' notices at "
        "most once, per this interval: how old a busy pool's peer decisions may be when "
        "a decision reads them, against one exchange per interval (default %(default)s)",
    )
    signals = parser.add_argument_group("pod signals")
    signals.add_argument(
        "--scrape-interval",
        type=_positive(float),
        default=0.05,
        metavar="SECONDS",
        help="how often every pod's /metrics is scraped (default %(default)s)",
    )
    signals.add_argument(
        "--models-poll-interval",
        type=_positive(float),
        default=2.0,
        metavar="SECONDS",
        help="how often every pod's /v1/models (base model, LoRA adapters) is polled "
        "(default %(default)s)",
    )
    tokens = parser.add_argument_group("tokenization (for the precise prefix scorers)")
    tokens.add_argument(
        "--tokenizer-discovery",
        type=boolean,
        nargs="?",
        const=True,
        default=True,
        metavar="true|false",
        help="for a model no local-tokenizer plugin names, look for its tokenizer in "
        "--tokenizers-dir folders and the Hugging Face hub cache, check it against the "
        "pods' /tokenize on a few requests, then tokenize in-process (default true)",
    )
    tokens.add_argument(
        "--tokenizers-dir",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="a folder holding <model name>/tokenizer.json (and its chat template), as a "
        "Hugging Face download lays it out; repeatable",
    )
    record = parser.add_argument_group("traffic recording (for epp replay --format recorded)")
    record.add_argument(
        "--record-traffic",
        type=Path,
        metavar="FILE",
        help="append one JSONL row per finished request: arrival time, model, API, token "
        "counts (off by default)",
    )
    record.add_argument(
        "--record-prompts",
        action="store_true",
        help="also record each prompt (token ids, messages or text): prompts are user data, "
        "but without them a replay cannot reproduce prefix sharing",
    )
    parser.add_argument(
        "--objectives-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="InferenceObjective objects as YAML (a list or multi-document), reloaded on "
        "change: a request names one with the x-gateway-inference-objective header; "
        "spec.priority orders flow control (higher first) and a negative priority makes "
        "the objective's requests sheddable (429 while the pool is saturated)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="export one trace per request over OTLP/gRPC to this collector, e.g. "
        "http://otel-collector:4317 (default: OTEL_EXPORTER_OTLP_ENDPOINT, else off)",
    )
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="default info; debug logs one line per decision with every candidate's "
        "score components",
    )
    parser.set_defaults(func=run)


def _curve_config(args: argparse.Namespace) -> CurveServerConfig | None:
    key, clients = args.kv_events_curve_key, args.kv_events_curve_clients
    if key is None and clients is None:
        return None
    if key is None or clients is None:
        raise ValueError("--kv-events-curve-key and --kv-events-curve-clients go together")
    if args.kv_events_mode != "central":
        raise ValueError("CURVE authentication needs --kv-events-mode central")
    return CurveServerConfig(key, clients)


def _configure_logging(level_name: str) -> None:
    """`--log-level` sets smart-epp's own loggers. Libraries stay at info or above: at debug,
    grpc logs a line per event-loop tick and per cancelled stream, burying the decisions."""
    level = logging.getLevelName(level_name.upper())
    logging.basicConfig(
        level=max(level, logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger(__package__.rpartition(".")[0] or __package__).setLevel(level)


def run(args: argparse.Namespace) -> int:
    _configure_logging(args.log_level)
    if args.endpoints_file is not None and not args.endpoints_file.is_file():
        log.error("endpoints file %s does not exist", args.endpoints_file)
        return 2
    if args.objectives_file is not None:
        try:
            parse_objectives(args.objectives_file.read_text(), str(args.objectives_file))
        except (OSError, ObjectivesError) as exc:
            log.error("%s", exc)
            return 2
    try:
        load_config(args.config)
        tls = _tls_from_args(args)
        k8s = kubernetes_discovery_options(
            pool_name=args.pool_name,
            namespace=args.pool_namespace,
            api_url=args.k8s_api,
            token_file=args.k8s_token_file,
            ca_file=args.k8s_ca_file,
            static_pool=bool(args.endpoint or args.endpoints_file),
            kv_events_port=args.kv_events_port,
            kv_replay_port=args.kv_replay_port,
        )
        curve = _curve_config(args)
    except (ConfigError, OSError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    options = ServeOptions(
        grpc_port=args.grpc_port,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        host=args.host,
        tls=tls,
        drain_timeout_s=args.drain_timeout,
        config=args.config,
        endpoints=args.endpoint,
        endpoints_file=args.endpoints_file,
        k8s=k8s,
        max_body_bytes=args.max_body_bytes,
        allowed_paths=tuple(args.allowed_path or DEFAULT_ALLOWED_PATHS),
        fallbacks=max(0, args.fallbacks),
        pool_name=args.pool_name or "default",
        model=args.model,
        kv_events_mode=args.kv_events_mode,
        kv_events_bind=args.kv_events_bind,
        kv_events_curve=curve,
        kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port,
        kv_index=args.kv_index,
        kv_index_capacity=args.kv_index_capacity,
        redis_url=args.redis_url,
        catch_up_timeout_s=args.catch_up_timeout,
        scrape_interval_s=args.scrape_interval,
        models_poll_s=args.models_poll_interval,
        record_traffic=args.record_traffic,
        record_prompts=args.record_prompts,
        objectives_file=args.objectives_file,
        otlp_endpoint=args.otlp_endpoint,
        shared_state=args.shared_state,
        shared_state_url=args.shared_state_url,
        shared_state_sync_s=args.shared_state_sync_interval,
        shared_state_max_staleness_s=args.shared_state_max_staleness
        if args.shared_state_max_staleness is not None
        else DEFAULT_SHARED_MAX_STALENESS_S,
        shared_state_notices=args.shared_state_notices,
        shared_state_notice_gap_s=args.shared_state_notice_gap,
        reuse_port=args.reuse_port,
        hand_on_records=args.hand_on_records,
        tokenizer_discovery=args.tokenizer_discovery,
        tokenizers_dirs=tuple(args.tokenizers_dir),
    )
    if args.workers > 1:
        from .workers import run_workers

        if args.kv_events_mode == "central":
            log.error(
                "--workers needs --kv-events-mode dial or off: one central socket "
                "cannot be bound by several processes"
            )
            return 2
        return run_workers(
            args.workers,
            host=args.host,
            health_port=args.health_port,
            metrics_port=args.metrics_port,
            drain_timeout_s=args.drain_timeout,
            store_url=(args.shared_state_url or args.redis_url)
            if args.shared_state == "redis"
            else None,
        )
    run_event_loop(serve(options))
    return 0


def run_event_loop(main: object) -> None:
    """Runs a coroutine on uvloop when it is installed (measurably faster for gRPC)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)  # type: ignore[arg-type]
    else:
        uvloop.run(main)  # type: ignore[arg-type]

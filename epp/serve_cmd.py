"""`epp serve`: the endpoint picker as a process. `serve()` is the one place where the
datastore, discovery, scheduler and server are put together."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.discovery import EndpointsFileWatcher, endpoints_from_addresses, parse_address
from smart_epp.epp.request_parser import no_adapters
from smart_epp.epp.round_robin import RoundRobinScheduler
from smart_epp.epp.server import DEFAULT_MAX_BODY_BYTES, EppServer, ServerOptions, build_server

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    grpc_port: int = 9002
    health_port: int = 9003
    metrics_port: int = 9090
    host: str = "0.0.0.0"
    # EndpointPickerConfig YAML; None means the built-in default.
    config: Path | None = None
    endpoints: list[str] = field(default_factory=list)
    endpoints_file: Path | None = None
    endpoints_poll_s: float = 0.5
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    pool_name: str = "default"


async def serve(
    options: ServeOptions,
    *,
    stop: asyncio.Event | None = None,
    on_started: Callable[[EppServer], None] | None = None,
) -> None:
    """Runs the picker until `stop` is set (or SIGINT/SIGTERM when no event is given)."""
    datastore = Datastore()
    background: list[asyncio.Task[None]] = []

    scheduler = RoundRobinScheduler()
    server = build_server(
        scheduler,
        datastore,
        adapter_resolver=no_adapters,
        options=ServerOptions(max_body_bytes=options.max_body_bytes, pool_name=options.pool_name),
    )

    if options.endpoints:
        datastore.set_endpoints(endpoints_from_addresses(options.endpoints))
    if options.endpoints_file is not None:
        watcher = EndpointsFileWatcher(
            options.endpoints_file,
            datastore,
            options.endpoints_poll_s,
            on_error=lambda _exc: server.metrics.discovery_errors.inc(),
        )
        watcher.poll()  # the first pool is in place before the first request
        background.append(asyncio.create_task(watcher.run(), name="endpoints-file-watcher"))

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    await server.start(
        options.grpc_port, options.health_port, options.metrics_port, host=options.host
    )
    log.info(
        "epp serving ext_proc on :%d (health :%d, metrics :%d) with %d endpoints",
        server.grpc_port,
        server.health_port,
        server.metrics_port,
        len(datastore),
    )
    if on_started is not None:
        on_started(server)
    try:
        await stop.wait()
    finally:
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.stop(grace=2.0)


def _address(value: str) -> str:
    try:
        return parse_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the endpoint picker (Envoy ext_proc gRPC server)",
        description="Envoy external processor that picks the pod for every OpenAI request.",
    )
    parser.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port")
    parser.add_argument("--health-port", type=int, default=9003, help="gRPC health port")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port")
    parser.add_argument("--config", type=Path, default=None, help="EndpointPickerConfig YAML")
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
    parser.add_argument("--pool-name", default="default", help="label of the pool's metrics")
    parser.add_argument("--log-level", default="info")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.config is not None and not args.config.is_file():
        log.error("config file %s does not exist", args.config)
        return 2
    if args.endpoints_file is not None and not args.endpoints_file.is_file():
        log.error("endpoints file %s does not exist", args.endpoints_file)
        return 2
    options = ServeOptions(
        grpc_port=args.grpc_port,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        config=args.config,
        endpoints=args.endpoint,
        endpoints_file=args.endpoints_file,
        max_body_bytes=args.max_body_bytes,
        pool_name=args.pool_name,
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

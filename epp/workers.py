"""`epp serve --workers N`: N picker processes on one ext_proc port.

Python decides on one core per process, so one `epp serve` runs N full pickers: each
its own process with its own event loop, KV-event subscriptions to every pod, metrics
scrape and block index, all binding the ext_proc port with SO_REUSEPORT (the kernel
spreads Envoy's connections over them). What one decides and the others must see —
in-flight load, routed prefixes — goes through the shared pool state
(`--shared-state redis --redis-url URL` when given, else a private Valkey on a unix
socket that this process starts). Envoy access-log records that reach a worker which
did not route the request are handed to the others over the same store.

This process is the supervisor: it serves the one health port (SERVING while every
worker is) and the one metrics port (every worker's series, labelled `worker`), restarts
a worker that dies, and on SIGTERM turns NOT_SERVING and sends SIGTERM to every worker,
each of which drains its own streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import aiohttp
import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from .ports import free_port
from .server import HEALTH_SERVICES
from .shared_state.private_store import PrivateStore

log = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5
WILDCARDS = ("0.0.0.0", "::", "")
RESTART_DELAY_S = 1.0


@dataclass
class Worker:
    index: int
    command: list[str]
    health_port: int
    metrics_port: int
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    def start(self) -> None:
        self.process = subprocess.Popen(self.command)
        log.info("worker %d started (pid %d)", self.index, self.process.pid)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def _serve_arguments(argv: Sequence[str]) -> list[str]:
    """The `epp serve` arguments this process was started with."""
    argv = list(argv)
    return argv[argv.index("serve") + 1 :] if "serve" in argv else argv[1:]


def worker_command(
    serve_args: Sequence[str], index: int, store_url: str, health_port: int, metrics_port: int
) -> list[str]:
    # Later flags win in argparse: these override whatever the user gave for the ports,
    # the worker count and the shared state.
    return [
        sys.executable, "-c", "from smart_epp.epp.cli import main; main()", "serve",
        *serve_args,
        "--workers", "1",
        "--reuse-port",
        "--shared-state", "redis",
        "--shared-state-url", store_url,
        "--hand-on-records",
        "--health-port", str(health_port),
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip


# --------------------------------------------------------------------------- metrics


def merge_pages(pages: Sequence[tuple[int, str]]) -> str:
    """Every worker's exposition as one page: each sample gets a `worker` label, families
    of the same name are merged (one HELP/TYPE each)."""
    families: dict[str, object] = {}
    order: list[str] = []
    for index, page in pages:
        for family in text_string_to_metric_families(page):
            labelled = [
                Sample(s.name, {**s.labels, "worker": str(index)}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            ]
            known = families.get(family.name)
            if known is None:
                family.samples = labelled
                families[family.name] = family
                order.append(family.name)
            else:
                known.samples.extend(labelled)  # type: ignore[attr-defined]
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    class _Merged:
        def collect(self) -> Iterator[object]:
            for name in order:
                yield families[name]

    registry = CollectorRegistry()
    registry.register(_Merged())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


class Supervisor:
    def __init__(
        self,
        workers: list[Worker],
        *,
        host: str,
        health_port: int,
        metrics_port: int,
        drain_timeout_s: float,
    ) -> None:
        self.workers = workers
        self.host = host
        self.health_port = health_port
        self.metrics_port = metrics_port
        self.drain_timeout_s = drain_timeout_s
        self.stopping = False
        # Workers bind their own health and metrics ports on --host as well.
        self._local = "127.0.0.1" if host in WILDCARDS else host
        self._health = health.aio.HealthServicer()
        self._serving: bool | None = None

    async def _set_serving(self, serving: bool) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in HEALTH_SERVICES:
            await self._health.set(service, status)
        log.info("workers %s", "all serving" if serving else "not all serving")

    async def _worker_serving(self, worker: Worker) -> bool:
        if not worker.alive:
            return False
        try:
            target = f"{self._local}:{worker.health_port}"
            async with grpc.aio.insecure_channel(target) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0
                )
        except grpc.aio.AioRpcError:
            return False
        # The generated health messages are untyped: the comparison is a plain bool.
        serving: bool = reply.status == health_pb2.HealthCheckResponse.SERVING
        return serving

    async def _watch(self) -> None:
        while not self.stopping:
            for worker in self.workers:
                if not worker.alive and not self.stopping:
                    code = worker.process.returncode if worker.process is not None else None
                    log.error("worker %d exited (%s); restarting it", worker.index, code)
                    await asyncio.sleep(RESTART_DELAY_S)
                    if self.stopping:
                        return
                    worker.restarts += 1
                    worker.start()
            states = await asyncio.gather(*(self._worker_serving(w) for w in self.workers))
            if not self.stopping:
                await self._set_serving(all(states))
            await asyncio.sleep(HEALTH_POLL_S)

    async def _metrics(self, _request: web.Request) -> web.Response:
        async def page(worker: Worker) -> tuple[int, str] | None:
            try:
                url = f"http://{self._local}:{worker.metrics_port}/metrics"
                async with self._http.get(url) as resp:
                    return (worker.index, await resp.text())
            except (aiohttp.ClientError, TimeoutError):
                return None

        pages = [p for p in await asyncio.gather(*(page(w) for w in self.workers)) if p]
        text = await asyncio.to_thread(merge_pages, pages)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def run(self, stop: asyncio.Event) -> int:
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, health_server)
        bind = f"[{self.host}]" if ":" in self.host else self.host
        health_server.add_insecure_port(f"{bind}:{self.health_port}")
        await health_server.start()
        await self._set_serving(False)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.metrics_port).start()
        for worker in self.workers:
            worker.start()
        watch = asyncio.create_task(self._watch())
        try:
            await stop.wait()
        finally:
            self.stopping = True
            await self._set_serving(False)
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            for worker in self.workers:
                if worker.alive:
                    worker.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            codes = await asyncio.gather(*(asyncio.to_thread(self._wait, w) for w in self.workers))
            await self._http.close()
            await runner.cleanup()
            await health_server.stop(0)
        log.info("all %d workers stopped (exit codes %s)", len(self.workers), codes)
        return 0 if all(code == 0 for code in codes) else 1

    def _wait(self, worker: Worker) -> int | None:
        if worker.process is None:
            return None
        try:
            return worker.process.wait(timeout=self.drain_timeout_s + 10)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            return worker.process.wait()


def run_workers(
    count: int,
    *,
    host: str,
    health_port: int,
    metrics_port: int,
    drain_timeout_s: float,
    store_url: str | None,
    argv: Sequence[str] = sys.argv,
) -> int:
    private: PrivateStore | None = None
    if store_url is None:
        private = PrivateStore().start()
        store_url = private.url
        log.info("workers share pool state through a private store at %s", store_url)
    serve_args = _serve_arguments(argv)
    workers = []
    for i in range(count):
        hp, mp = free_port(), free_port()
        workers.append(Worker(i, worker_command(serve_args, i, store_url, hp, mp), hp, mp))
    supervisor = Supervisor(
        workers,
        host=host,
        health_port=health_port,
        metrics_port=metrics_port,
        drain_timeout_s=drain_timeout_s,
    )

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await supervisor.run(stop)

    log.info("epp serve: %d workers (pid %d supervising)", count, os.getpid())
    try:
        return asyncio.run(main())
    finally:
        if private is not None:
            private.stop()


__all__ = ["Supervisor", "Worker", "merge_pages", "run_workers", "worker_command"]

"""ext_proc overhead: the latency epp adds to a request, measured through one real Envoy.

One Envoy, one echo backend, one epp ext_proc server, all real processes. The same listener
has a route that skips ext_proc (header `x-epp-bypass`) and the normal route through epp,
and the two are measured alternately in the same run, so the difference is what epp costs:
sequentially (one connection), closed-loop at 32 concurrent connections (which saturates
the slowest process, so its latency is mostly queueing), and open-loop at a fixed rate over
32 connections (latency below saturation), for each body mode.

On a machine with two or more cores the processor under test is pinned to a core of its
own and Envoy, backend and load generator to the others, so epp's CPU per request and its
latency are not mixed up with theirs. By default the processor is epp's server with the
round-robin scheduler (`--processor data-path`: the ext_proc path alone); `--processor
serve` runs the `epp serve` command with its default scheduler instead.

Also reported: decisions per second of epp CPU (its process's CPU time over the requests
it decided: what one core sustains), a do-nothing processor on the same gRPC stack as the
floor, and a breakdown of epp's own work per request (protobuf, parsing, scheduling,
response building, measured in-process on the messages Envoy really sends).

    .venv/bin/python -m smart_epp.benchmarks.extproc_overhead [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

from smart_epp.benchmarks.process_cpu import cpu_seconds, tree_cpu_seconds
from smart_epp.epp.ports import free_port, port_open
from smart_epp.epp.processes import stop_process

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "extproc_overhead.json"
BACKEND_SCRIPT = REPO / "tests" / "support" / "backends.py"
GOALS = {"added_median_ms": 1.0, "added_p99_ms": 3.0, "decisions_per_s": 1500}

PROMPT = "Explain the trade-offs of prefix caching in LLM serving. " * 8
BODY = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 16}).encode()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


@contextmanager
def process(
    command: list[str], log: Path, cpus: set[int] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A child process; `cpus` pins it (and every thread it starts) to those cores."""

    def pin() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin)
    try:
        yield proc
    finally:
        stop_process(proc, 10)


# ------------------------------------------------------------------ a light HTTP/1.1 client


class Connection:
    """One keep-alive HTTP/1.1 connection, lighter than a full client library so the
    load generator itself stays cheap next to what it measures."""

    def __init__(self, port: int, bypass: bool) -> None:
        self.port = port
        extra = b"x-epp-bypass: 1\r\n" if bypass else b""
        self.request = (
            b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            + extra
            + f"content-length: {len(BODY)}\r\n\r\n".encode()
            + BODY
        )
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def call(self) -> float:
        assert self.reader is not None and self.writer is not None
        started = time.perf_counter()
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = head[9:12]
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readline()).strip(), 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            start = lower.index(b"content-length:") + 15
            length = int(lower[start : lower.index(b"\r\n", start)])
            await self.reader.readexactly(length)
        elapsed = time.perf_counter() - started
        if status != b"200":
            raise RuntimeError(f"unexpected status {status!r}: {head!r}")
        return elapsed

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def run_sequential(port: int, pairs: int) -> tuple[list[float], list[float]]:
    direct, epp = Connection(port, bypass=True), Connection(port, bypass=False)
    await direct.open()
    await epp.open()
    direct_times, epp_times = [], []
    for _ in range(pairs):  # alternate, so drift in the machine's load hits both alike
        direct_times.append(await direct.call())
        epp_times.append(await epp.call())
    await direct.close()
    await epp.close()
    return direct_times, epp_times


async def run_concurrent(
    port: int, bypass: bool, total: int, concurrency: int
) -> tuple[list[float], float]:
    connections = [Connection(port, bypass) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in connections))
    remaining = total
    times: list[float] = []

    async def worker(connection: Connection) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            times.append(await connection.call())

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    wall = time.perf_counter() - started
    await asyncio.gather(*(c.close() for c in connections))
    return times, wall


async def run_paced(
    port: int, bypass: bool, total: int, concurrency: int, rate: float
) -> tuple[list[float], float]:
    """Open-loop load: `rate` requests per second spread over `concurrency` connections;
    returns the latencies and how far behind schedule the most delayed request was sent.

    A closed loop of 32 connections always saturates whichever process is slowest, so its
    latency mostly measures queueing. At a fixed rate below saturation the latency is the
    processor's own service time plus the little queueing that rate causes. Latency counts
    from the send: on a shared machine a stall elsewhere would otherwise be charged to
    whichever route happened to be running; the schedule slip is reported instead.
    """
    connections = [Connection(port, bypass) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in connections))
    interval = 1.0 / rate
    times: list[float] = []
    behind = 0.0
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def worker(index: int, connection: Connection) -> None:
        nonlocal behind
        for due_index in range(index, total, concurrency):
            delay = started + due_index * interval - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                behind = max(behind, -delay)
            times.append(await connection.call())

    await asyncio.gather(*(worker(i, c) for i, c in enumerate(connections)))
    await asyncio.gather(*(c.close() for c in connections))
    return times, behind


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(times: list[float]) -> dict[str, float]:
    return {
        "count": len(times),
        "median_ms": round(statistics.median(times) * 1000, 3),
        "p99_ms": round(percentile(times, 0.99) * 1000, 3),
        "mean_ms": round(statistics.fmean(times) * 1000, 3),
    }


def compare(direct: list[float], epp: list[float]) -> dict[str, object]:
    d, e = summary(direct), summary(epp)
    return {
        "direct": d,
        "through_epp": e,
        "added_median_ms": round(e["median_ms"] - d["median_ms"], 3),
        "added_p99_ms": round(e["p99_ms"] - d["p99_ms"], 3),
        "median_ratio": round(e["median_ms"] / d["median_ms"], 3),
    }


# ------------------------------------------------------------------ in-process breakdown


def breakdown(iterations: int) -> dict[str, float]:
    """Microseconds per request for each piece of epp's own work, without gRPC."""
    from envoy.config.core.v3 import base_pb2 as core
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from google.protobuf import struct_pb2

    from smart_epp.epp.datastore import Datastore
    from smart_epp.epp.flow import RequestFlow
    from smart_epp.epp.request_parser import parse_request
    from smart_epp.epp.round_robin import RoundRobinScheduler
    from smart_epp.epp.server import EppServer, Exchange, Phase
    from smart_epp.framework.types import Endpoint
    from smart_epp.proto import extproc as px

    headers = {
        ":method": "POST", ":path": "/v1/completions", ":authority": "bench",
        ":scheme": "http", "content-type": "application/json", "user-agent": "bench",
        "x-forwarded-proto": "http", "x-request-id": "0b4c1c52-9a55-4b1e-8d1a-7a8f3f0a3a11",
        "content-length": str(len(BODY)),
    }  # fmt: skip
    header_bytes = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=core.HeaderMap(
                headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
            )
        ),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=4, response_body_mode=1),
    ).SerializeToString()
    # What Envoy sends for one request with the shipped config (counted at a processor):
    # the body's bytes and its end come as two messages in each direction, and the response
    # headers are skipped, their facts riding as attributes on the first response message.
    body_bytes = ep.ProcessingRequest(request_body=ep.HttpBody(body=BODY)).SerializeToString()
    body_end = ep.ProcessingRequest(
        request_body=ep.HttpBody(end_of_stream=True)
    ).SerializeToString()
    answer = json.dumps({"id": "x", "usage": {"prompt_tokens": 100, "completion_tokens": 16}})
    attributes = struct_pb2.Struct()
    attributes.update({"upstream.address": "10.0.0.1:8000", "response.code": 200})
    response_body = ep.ProcessingRequest(
        response_body=ep.HttpBody(body=answer.encode()),
        attributes={px.EXT_PROC_FILTER_NAME: attributes},
    ).SerializeToString()
    response_end = ep.ProcessingRequest(
        response_body=ep.HttpBody(end_of_stream=True)
    ).SerializeToString()
    wire = [header_bytes, body_bytes, body_end, response_body, response_end]

    def per_call_us(fn: Callable[[], object]) -> float:
        for _ in range(200):
            fn()
        started = time.perf_counter()
        for _ in range(iterations):
            fn()
        return round((time.perf_counter() - started) / iterations * 1e6, 2)

    message = ep.ProcessingRequest.FromString(header_bytes)
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("10.0.0.1:8000"), Endpoint("10.0.0.2:8000")])
    scheduler = RoundRobinScheduler()
    server = EppServer(RequestFlow(scheduler, datastore))
    candidates = datastore.ready_pods()

    def schedule() -> None:
        coroutine = scheduler.schedule(request, candidates)
        with suppress(StopIteration):
            coroutine.send(None)

    request = parse_request("/v1/completions", px.headers_of(message.request_headers), BODY, "r")

    async def exchanges(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            exchange = Exchange(server)
            for raw in wire:
                message = ep.ProcessingRequest.FromString(raw)
                if exchange.request_mode is None:
                    exchange.set_modes(px.body_modes(message))
                event = px.read_event(message, response_started=exchange.phase is not Phase.ROUTED)
                replies = await exchange.handle(event)
                for reply in replies:
                    if not isinstance(reply, bytes):
                        reply.SerializeToString()
                exchange.after_replies()
            exchange.close()
        return (time.perf_counter() - started) / n * 1e6

    asyncio.run(exchanges(200))
    whole = asyncio.run(exchanges(iterations))
    return {
        "deserialize_5_messages_us": per_call_us(
            lambda: [ep.ProcessingRequest.FromString(w) for w in wire]
        ),
        "read_headers_us": per_call_us(lambda: px.headers_of(message.request_headers)),
        "parse_openai_body_us": per_call_us(
            lambda: parse_request("/v1/completions", headers, BODY, "r")
        ),
        "schedule_round_robin_us": per_call_us(schedule),
        "build_decision_replies_us": per_call_us(
            lambda: (
                px.route_in_headers_phase("10.0.0.1:8000"),
                px.streamed_request_body(BODY),
            )
        ),
        "whole_exchange_without_grpc_us": round(whole, 2),
    }


# ------------------------------------------------------------------ the transport's floor


def serve_floor(port: int, destination: str) -> None:
    """A do-nothing processor on the same gRPC stack: routes every request to one
    destination with prebuilt replies, parses nothing, counts nothing. Its CPU per
    request is what grpc.aio and the event loop cost before any of epp's own work."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from smart_epp.epp.datastore import Datastore
    from smart_epp.epp.discovery import endpoints_from_addresses
    from smart_epp.proto import extproc as px
    from smart_epp.proto.eds import add_pool_eds

    route = px.route_in_headers_phase(destination)

    async def process(requests: object, context: grpc.aio.ServicerContext) -> None:
        parts: list[bytes] = []
        async for message in requests:  # type: ignore[attr-defined]
            kind = message.WhichOneof("request")
            if kind == "request_body":
                parts.append(message.request_body.body)
                if message.request_body.end_of_stream:
                    await context.write(route)
                    for reply in px.streamed_request_body(b"".join(parts)):
                        await context.write(reply)
            elif kind == "response_body":
                await context.write(px.CONTINUE_RESPONSE_BODY)
            elif kind == "response_headers":
                await context.write(px.CONTINUE_RESPONSE_HEADERS)

    async def main() -> None:
        server = grpc.aio.server()
        px.add_ext_proc_service(server, process)
        # Envoy learns the pool's members over EDS from the picker's port (one update at
        # start, nothing per request): without it the pool cluster is empty and every
        # request is a 503.
        datastore = Datastore()
        datastore.set_endpoints(endpoints_from_addresses([destination]))
        add_pool_eds(server, datastore)
        checks = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await checks.set(px.SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await server.wait_for_termination()

    from smart_epp.epp.serve_cmd import run_event_loop

    run_event_loop(main())


def serve_data_path(port: int, backend: str) -> None:
    """epp's ext_proc server exactly as `epp serve` builds it, with the round-robin
    scheduler: the gateway's data path alone, without the scheduler's own costs (those
    have their own benchmark), so changes to either are measured apart."""
    from smart_epp.epp.datastore import Datastore
    from smart_epp.epp.discovery import endpoints_from_addresses
    from smart_epp.epp.flow import RequestFlow
    from smart_epp.epp.round_robin import RoundRobinScheduler
    from smart_epp.epp.serve_cmd import run_event_loop
    from smart_epp.epp.server import EppServer

    async def main() -> None:
        datastore = Datastore()
        datastore.set_endpoints(endpoints_from_addresses([backend]))
        server = EppServer(RequestFlow(RoundRobinScheduler(), datastore))
        await server.start(port, None, None, host="127.0.0.1")
        await server.wait_for_termination()

    run_event_loop(main())


# ------------------------------------------------------------------ the run


def measure_mode(
    body_mode: str,
    epp_port: int,
    epp_pid: int,
    backend: str,
    args: argparse.Namespace,
    workdir: Path,
) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    from smart_epp.epp.envoy_cmd import EnvoyOptions, envoy_command, render_envoy_config

    listen, admin = free_port(), free_port()
    options = EnvoyOptions(
        listen_port=listen,
        admin_port=admin,
        epp_port=epp_port,
        body_mode=body_mode,  # type: ignore[arg-type]
        listen_address="127.0.0.1",
        bypass_backend=backend,
        # Plaintext to the picker, as the measurements before TLS became the default.
        secure_serving=False,
        # Workers share one port and receive connections, not streams.
        epp_streams_per_connection=8 if args.workers > 1 else None,
    )
    config = workdir / f"envoy-{body_mode}.yaml"
    config.write_text(render_envoy_config(options))
    command = envoy_command(config, concurrency=args.envoy_concurrency)
    with process(command, workdir / f"envoy-{body_mode}.log") as envoy:

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as r:
                    status: int = r.status
                    return status == 200
            except OSError:
                return False

        wait_for(ready, 20, "Envoy ready")

        async def run() -> dict[str, Any]:
            # Warm both routes (connections, caches) before measuring.
            await run_concurrent(listen, True, args.warmup, 8)
            await run_concurrent(listen, False, args.warmup, 8)
            direct_seq, epp_seq = await run_sequential(listen, args.sequential)
            direct_conc: list[float] = []
            epp_conc: list[float] = []
            direct_wall = epp_wall = epp_cpu = envoy_cpu_epp = envoy_cpu_direct = 0.0
            for _ in range(args.rounds):  # alternate phases, pooled
                before = cpu_seconds(envoy.pid)
                times, wall = await run_concurrent(listen, True, args.concurrent, args.concurrency)
                envoy_cpu_direct += cpu_seconds(envoy.pid) - before
                direct_conc += times
                direct_wall += wall
                before_epp, before_envoy = tree_cpu_seconds(epp_pid), cpu_seconds(envoy.pid)
                times, wall = await run_concurrent(listen, False, args.concurrent, args.concurrency)
                epp_cpu += tree_cpu_seconds(epp_pid) - before_epp
                envoy_cpu_epp += cpu_seconds(envoy.pid) - before_envoy
                epp_conc += times
                epp_wall += wall
            decided = len(epp_conc)
            direct_paced: list[float] = []
            epp_paced: list[float] = []
            slip = 0.0
            for _ in range(args.rounds):
                for bypass, pooled in ((True, direct_paced), (False, epp_paced)):
                    times, behind = await run_paced(
                        listen, bypass, args.paced, args.concurrency, args.paced_rate
                    )
                    pooled += times
                    slip = max(slip, behind)
            return {
                "sequential": compare(direct_seq, epp_seq),
                f"concurrent_{args.concurrency}": {
                    **compare(direct_conc, epp_conc),
                    "direct_requests_per_s": round(len(direct_conc) / direct_wall, 1),
                    "through_epp_requests_per_s": round(decided / epp_wall, 1),
                },
                f"paced_{args.paced_rate:g}_per_s_over_{args.concurrency}_connections": {
                    **compare(direct_paced, epp_paced),
                    "max_schedule_slip_ms": round(slip * 1000, 3),
                },
                "epp_cpu_us_per_request": round(epp_cpu / decided * 1e6, 1),
                "decisions_per_epp_cpu_second": round(decided / epp_cpu, 1),
                "envoy_cpu_us_per_request_direct": round(envoy_cpu_direct / decided * 1e6, 1),
                "envoy_cpu_us_per_request_through_epp": round(envoy_cpu_epp / decided * 1e6, 1),
            }

        try:
            import uvloop

            return uvloop.run(run())
        except ImportError:
            return asyncio.run(run())


def pinning(enabled: bool) -> set[int] | None:
    """Gives the processor under test a core of its own, so its latency and CPU per request
    are not mixed with the load generator's, Envoy's and the backend's on a small machine.
    This process (and so Envoy and the backend, started from it) keeps the other cores."""
    available = sorted(os.sched_getaffinity(0))
    if not enabled or len(available) < 2:
        return None
    processor = {available[-1]}
    os.sched_setaffinity(0, set(available[:-1]))
    return processor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequential", type=int, default=1000, help="request pairs, one at a time")
    parser.add_argument("--concurrent", type=int, default=3000, help="requests per route per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--paced", type=int, default=3000, help="requests per route per round")
    parser.add_argument(
        "--paced-rate", type=float, default=1000.0, help="offered requests/s of the paced load"
    )
    parser.add_argument("--envoy-concurrency", type=int, default=1, help="Envoy worker threads")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="`epp serve --workers N` (with --processor serve); Envoy then opens a new "
        "connection every 8 streams so that every worker receives some",
    )
    parser.add_argument("--body-modes", default="full-duplex,buffered")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a short run, for a smoke check")
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let processes float over all cores (by default the processor under test gets "
        "the last core to itself and Envoy, backend and load generator share the others)",
    )
    parser.add_argument(
        "--processor",
        choices=("data-path", "serve"),
        default="data-path",
        help="data-path: epp's server with the round-robin scheduler (the ext_proc path "
        "alone); serve: the `epp serve` command with its default scheduler",
    )
    hidden = {"nargs": 2, "metavar": ("PORT", "DEST"), "help": argparse.SUPPRESS}
    parser.add_argument("--serve-floor", **hidden)  # type: ignore[arg-type]
    parser.add_argument("--serve-data-path", **hidden)  # type: ignore[arg-type]
    args = parser.parse_args(argv)
    if args.serve_floor:
        serve_floor(int(args.serve_floor[0]), args.serve_floor[1])
        return 0
    if args.serve_data_path:
        serve_data_path(int(args.serve_data_path[0]), args.serve_data_path[1])
        return 0
    if args.quick:
        args.sequential, args.concurrent, args.rounds, args.warmup = 100, 300, 1, 50
        args.paced = 300
    processor_cpus = pinning(args.pin)

    results: dict[str, object] = {
        "benchmark": "extproc_overhead",
        "what": "latency epp adds through one real Envoy: a route skipping ext_proc vs one "
        "through epp, alternated in the same run",
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(),
            "python": platform.python_version(),
        },
        "request_body_bytes": len(BODY),
        "goals": GOALS,
        "settings": {
            "sequential_pairs": args.sequential,
            "concurrent_requests_per_route": args.concurrent * args.rounds,
            "concurrency": args.concurrency,
            "paced_requests_per_route": args.paced * args.rounds,
            "paced_rate_per_s": args.paced_rate,
            "envoy_worker_threads": args.envoy_concurrency,
            "processor": args.processor,
            "workers": args.workers,
            "processor_cpus": sorted(processor_cpus) if processor_cpus else "unpinned",
            "other_cpus": sorted(os.sched_getaffinity(0)) if processor_cpus else "unpinned",
        },
    }
    backend_port, grpc_port, health_port, metrics_port = (free_port() for _ in range(4))
    backend = f"127.0.0.1:{backend_port}"
    with tempfile.TemporaryDirectory(prefix="extproc-bench-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        stack.enter_context(
            process(
                [sys.executable, str(BACKEND_SCRIPT), "--port", str(backend_port)],
                workdir / "backend.log",
            )
        )
        if args.processor == "serve":
            serve = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()", "serve",
                     "--endpoint", backend, "--grpc-port", str(grpc_port),
                     "--health-port", str(health_port), "--metrics-port", str(metrics_port),
                     "--log-level", "warning", "--secure-serving=false",
                     "--workers", str(args.workers)]  # fmt: skip
        else:
            serve = [sys.executable, str(Path(__file__).resolve()),
                     "--serve-data-path", str(grpc_port), backend]  # fmt: skip
        epp = stack.enter_context(process(serve, workdir / "epp.log", processor_cpus))
        wait_for(lambda: port_open(backend_port) and port_open(grpc_port), 30, "backend and epp")
        modes: dict[str, dict[str, Any]] = {}
        for body_mode in args.body_modes.split(","):
            print(f"measuring {body_mode} ...", file=sys.stderr)
            modes[body_mode] = measure_mode(body_mode, grpc_port, epp.pid, backend, args, workdir)
        results["body_modes"] = modes
        print("measuring the do-nothing processor ...", file=sys.stderr)
        floor_port = free_port()
        floor = stack.enter_context(
            process(
                [sys.executable, str(Path(__file__).resolve()),
                 "--serve-floor", str(floor_port), backend],
                workdir / "floor.log",
                processor_cpus,
            )
        )  # fmt: skip
        wait_for(lambda: port_open(floor_port), 30, "do-nothing processor")
        floor_mode = measure_mode("full-duplex", floor_port, floor.pid, backend, args, workdir)
        results["do_nothing_processor_full_duplex"] = floor_mode

    print("in-process breakdown ...", file=sys.stderr)
    parts = breakdown(2000 if args.quick else 20000)
    results["epp_work_breakdown_us_per_request"] = parts
    reference = modes.get("full-duplex") or next(iter(modes.values()))
    cpu_per_request = float(reference["epp_cpu_us_per_request"])
    own_work = parts["whole_exchange_without_grpc_us"]
    floor_cpu = floor_mode["epp_cpu_us_per_request"]
    results["where_the_time_goes"] = {
        "epp_cpu_us_per_request": cpu_per_request,
        "epp_own_work_us_in_process": own_work,
        "grpc_and_event_loop_us": round(cpu_per_request - own_work, 1),
        "do_nothing_processor_cpu_us_per_request": floor_cpu,
        "note": "CPU per request of epp vs a processor that does nothing on the same gRPC "
        "stack (grpc.aio on uvloop); epp's own work is the in-process exchange without gRPC",
    }
    concurrent = reference[f"concurrent_{args.concurrency}"]
    paced_key = f"paced_{args.paced_rate:g}_per_s_over_{args.concurrency}_connections"
    paced = reference[paced_key]
    results["verdict"] = {
        "latency_goal_measured_on": paced_key,
        "added_median_ms_paced": paced["added_median_ms"],
        "added_p99_ms_paced": paced["added_p99_ms"],
        "added_median_ms_closed_loop_saturated": concurrent["added_median_ms"],
        "added_p99_ms_closed_loop_saturated": concurrent["added_p99_ms"],
        "decisions_per_epp_cpu_second": reference["decisions_per_epp_cpu_second"],
        "meets_median_goal": paced["added_median_ms"] <= GOALS["added_median_ms"],
        "meets_p99_goal": paced["added_p99_ms"] <= GOALS["added_p99_ms"],
        "meets_throughput_goal": reference["decisions_per_epp_cpu_second"]
        >= GOALS["decisions_per_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

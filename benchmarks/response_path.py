"""Response-path mechanisms: epp CPU per request for short and long streams.

Real Envoy in front of one `epp sim` pod, real epp ext_proc server (round-robin scheduler,
so the routing cost is the same small constant everywhere), a streaming client. For each
way the picker can learn how a response went, the same requests are sent with 1 and with
256 output tokens (`stream: true`, one SSE chunk per token, as vLLM sends them), and epp's
CPU time is read from /proc before and after:

- `ext-proc-per-chunk`: every response chunk crosses ext_proc (`--response-path ext-proc`);
- `headers-and-trailers`: response headers SEND, body NONE, trailers SEND;
- `grpc-access-log`: no response processing; Envoy's gRPC access-log service
  (`envoy.access_loggers.http_grpc`, one structured entry per request, streamed);
- `otel-access-log`: no response processing; Envoy's OpenTelemetry access log with one
  formatted record per request (`--response-path access-log`, the default);
- `request-only`: no response observation at all, the floor.

The ratio that matters is CPU per 256-token stream over CPU per 1-token stream within
one mechanism, and each mechanism against per-chunk in the same run. epp is pinned to a
core of its own when the machine has two or more.

    .venv/bin/python benchmarks/response_path.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import yaml

from smart_epp.benchmarks.extproc_overhead import pinning, process, wait_for
from smart_epp.epp.ports import free_port, port_open

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "response_path.json"
MECHANISMS = (
    "ext-proc-per-chunk",
    "headers-and-trailers",
    "grpc-access-log",
    "otel-access-log",
    "request-only",
)
GOAL_RATIO = 1.5  # 256-token stream CPU / 1-token stream CPU


def cpu_seconds(pid: int) -> float:
    """On-CPU time of every live thread of a process, in nanosecond resolution
    (/proc/PID/task/*/schedstat): clock ticks (10 ms) are too coarse per request."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
    return total / 1e9


# ------------------------------------------------------------------ the processor


class _Duration(Protocol):
    """What is read of a google.protobuf.Duration."""

    seconds: int
    nanos: int

    def ByteSize(self) -> int: ...


def serve_processor(port: int, backend: str) -> None:
    """epp's ext_proc server with the round-robin scheduler, plus a receiver for Envoy's
    gRPC access-log service (only the `grpc-access-log` mechanism sends to it)."""
    import grpc
    from envoy.service.accesslog.v3 import als_pb2

    from smart_epp.epp.datastore import Datastore
    from smart_epp.epp.discovery import endpoints_from_addresses
    from smart_epp.epp.flow import RequestFlow
    from smart_epp.epp.round_robin import RoundRobinScheduler
    from smart_epp.epp.serve_cmd import run_event_loop
    from smart_epp.epp.server import EppServer
    from smart_epp.proto import extproc as px
    from smart_epp.proto.access_log import ResponseRecord

    def seconds(duration: _Duration) -> float | None:
        if not duration.ByteSize():
            return None
        return duration.seconds + duration.nanos / 1e9

    async def main() -> None:
        datastore = Datastore()
        datastore.set_endpoints(endpoints_from_addresses([backend]))
        server = EppServer(RequestFlow(RoundRobinScheduler(), datastore))
        log = server.response_log

        async def stream_access_logs(
            messages: object, context: grpc.aio.ServicerContext
        ) -> als_pb2.StreamAccessLogsResponse:
            async for message in messages:  # type: ignore[attr-defined]
                records = []
                for entry in message.http_logs.log_entry:
                    common = entry.common_properties
                    socket = common.upstream_remote_address.socket_address
                    records.append(
                        ResponseRecord(
                            request_id=entry.request.request_id,
                            status=entry.response.response_code.value,
                            upstream=f"{socket.address}:{socket.port_value}"
                            if socket.address
                            else None,
                            # Headers count as the first byte here: no body timing exists.
                            first_body_byte_s=seconds(common.time_to_first_upstream_rx_byte),
                            upstream_done_s=seconds(common.time_to_last_upstream_rx_byte),
                            flags="",
                        )
                    )
                log.on_records(records)
            return als_pb2.StreamAccessLogsResponse()

        handlers = {
            "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                stream_access_logs,
                request_deserializer=als_pb2.StreamAccessLogsMessage.FromString,
                response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString,
            )
        }
        generic = grpc.method_handlers_generic_handler(
            "envoy.service.accesslog.v3.AccessLogService", handlers
        )
        register = px.add_ext_proc_service

        def add_both(
            server: grpc.aio.Server, process: Callable[[Any, grpc.aio.ServicerContext], Any]
        ) -> None:
            register(server, process)
            server.add_generic_rpc_handlers((generic,))

        # The server registers its services when it starts; add the receiver beside them.
        px.add_ext_proc_service = add_both
        await server.start(port, None, None, host="127.0.0.1")
        await server.wait_for_termination()

    run_event_loop(main())


# ------------------------------------------------------------------ Envoy configs


def envoy_config(mechanism: str, listen: int, admin: int, epp_port: int) -> str:
    from smart_epp.epp.envoy_cmd import EnvoyOptions, render_envoy_config

    path = (
        "ext-proc"
        if mechanism in ("ext-proc-per-chunk", "headers-and-trailers")
        else ("access-log")
    )
    options = EnvoyOptions(
        listen_port=listen,
        admin_port=admin,
        epp_port=epp_port,
        listen_address="127.0.0.1",
        response_path=path,  # type: ignore[arg-type]
    )
    config = yaml.safe_load(render_envoy_config(options))
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm = manager["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")[
        "typed_config"
    ]
    if mechanism == "headers-and-trailers":
        ext_proc["processing_mode"].update(
            response_header_mode="SEND", response_body_mode="NONE", response_trailer_mode="SEND"
        )
    elif mechanism == "grpc-access-log":
        hcm["access_log"] = [
            {
                "name": "envoy.access_loggers.http_grpc",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3."
                    "HttpGrpcAccessLogConfig",
                    "common_config": {
                        "log_name": "smart-epp",
                        "transport_api_version": "V3",
                        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
                        "buffer_flush_interval": "0.02s",
                    },
                },
            }
        ]
    elif mechanism == "request-only":
        hcm.pop("access_log", None)
    return json.dumps(config)


# ------------------------------------------------------------------ load


async def send_streams(url: str, tokens: int, total: int, concurrency: int) -> int:
    """`total` streaming completions of exactly `tokens` tokens; returns SSE events read."""
    body = {"model": "tiny", "prompt": "Tell me a long story. " * 8, "max_tokens": tokens,
            "stream": True}  # fmt: skip
    remaining = total
    events = 0

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal remaining, events
        while remaining > 0:
            remaining -= 1
            async with http.post(url, json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"status {response.status}: {await response.text()}")
                body_read = await response.read()
            events += body_read.count(b"data: ")

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return events


def settled_cpu(pid: int, quiet_s: float = 0.3, idle_cpu_s: float = 0.002) -> float:
    """epp's CPU time once it stopped working (late access-log batches included): when a
    quiet period costs no more than idling does (health checks, gRPC pollers)."""
    last = cpu_seconds(pid)
    while True:
        time.sleep(quiet_s)
        now = cpu_seconds(pid)
        if now - last <= idle_cpu_s:
            return now
        last = now


def idle_cpu_rate(pid: int, seconds: float = 3.0) -> float:
    """epp's CPU seconds per wall second while no request flows."""
    before, started = settled_cpu(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.perf_counter() - started)


def measure(
    mechanism: str,
    epp_port: int,
    epp_pid: int,
    args: argparse.Namespace,
    workdir: Path,
) -> dict[str, object]:
    from smart_epp.epp.envoy_cmd import envoy_command

    listen, admin = free_port(), free_port()
    config = workdir / f"envoy-{mechanism}.yaml"
    config.write_text(envoy_config(mechanism, listen, admin, epp_port))
    with process(envoy_command(config), workdir / f"envoy-{mechanism}.log") as envoy:
        wait_for(lambda: port_open(listen), 20, "Envoy listening")
        url = f"http://127.0.0.1:{listen}/v1/completions"
        asyncio.run(send_streams(url, 1, args.warmup, args.concurrency))
        # Idling with Envoy attached (its health checks) is measured, then subtracted.
        idle_rate = idle_cpu_rate(epp_pid)
        result: dict[str, object] = {"epp_idle_cpu_us_per_s": round(idle_rate * 1e6, 1)}
        for tokens in (1, 256):
            before = settled_cpu(epp_pid)
            envoy_before = cpu_seconds(envoy.pid)
            started = time.perf_counter()
            events = asyncio.run(send_streams(url, tokens, args.requests, args.concurrency))
            used = settled_cpu(epp_pid) - before
            # What epp would have spent idling meanwhile (health checks, pollers) is not
            # the requests' cost: longer streams would otherwise look dearer by wall time.
            idle = idle_rate * (time.perf_counter() - started)
            result[f"{tokens}_token"] = {
                "epp_cpu_us_per_request": round((used - idle) / args.requests * 1e6, 1),
                "epp_cpu_us_per_request_with_idle": round(used / args.requests * 1e6, 1),
                "envoy_cpu_us_per_request": round(
                    (cpu_seconds(envoy.pid) - envoy_before) / args.requests * 1e6, 1
                ),
                "sse_events_per_request": round(events / args.requests, 1),
            }
        short = result["1_token"]["epp_cpu_us_per_request"]  # type: ignore[index]
        long = result["256_token"]["epp_cpu_us_per_request"]  # type: ignore[index]
        result["ratio_256_over_1"] = round(long / short, 2)
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="streams per length")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--mechanisms", default=",".join(MECHANISMS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a short run, for a smoke check")
    parser.add_argument("--serve-processor", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_processor:
        serve_processor(int(args.serve_processor[0]), args.serve_processor[1])
        return 0
    if args.quick:
        args.requests, args.warmup = 40, 10
    processor_cpus = pinning(True)
    results: dict[str, object] = {
        "benchmark": "response_path",
        "what": "epp CPU per streaming request, 1 vs 256 output tokens, per response-path "
        "mechanism; real Envoy, one `epp sim` pod, epp's server with round-robin",
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(),
            "python": platform.python_version(),
        },
        "settings": {
            "streams_per_length": args.requests,
            "concurrency": args.concurrency,
            "processor_cpus": sorted(processor_cpus) if processor_cpus else "unpinned",
        },
        "goal_ratio_256_over_1": GOAL_RATIO,
    }
    sim_port, grpc_port = free_port(), free_port()
    backend = f"127.0.0.1:{sim_port}"
    mechanisms: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="response-path-") as tmp:
        workdir = Path(tmp)
        sim = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()", "sim",
               "--port", str(sim_port), "--model", "tiny", "--no-kv-events",
               "--time-scale", "0.0005"]  # fmt: skip
        epp = [sys.executable, str(Path(__file__).resolve()), "--serve-processor",
               str(grpc_port), backend]  # fmt: skip
        with (
            process(sim, workdir / "sim.log"),
            process(epp, workdir / "epp.log", processor_cpus) as epp_proc,
        ):
            wait_for(lambda: port_open(sim_port) and port_open(grpc_port), 30, "sim and epp")
            for mechanism in args.mechanisms.split(","):
                print(f"measuring {mechanism} ...", file=sys.stderr)
                mechanisms[mechanism] = measure(mechanism, grpc_port, epp_proc.pid, args, workdir)
    results["mechanisms"] = mechanisms
    baseline = mechanisms.get("ext-proc-per-chunk")
    if isinstance(baseline, dict):
        base_long = baseline["256_token"]["epp_cpu_us_per_request"]
        results["vs_per_chunk_256_token"] = {
            name: round(m["256_token"]["epp_cpu_us_per_request"] / base_long, 3)  # type: ignore[index]
            for name, m in mechanisms.items()
        }
    chosen = mechanisms.get("otel-access-log")
    if isinstance(chosen, dict):
        results["meets_goal"] = chosen["ratio_256_over_1"] <= GOAL_RATIO
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

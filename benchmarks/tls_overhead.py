"""What TLS between Envoy and epp costs: the same request through two gateways that differ
only in `--secure-serving` (one epp serving ext_proc over TLS with its self-signed
certificate and an Envoy speaking TLS to it; one epp and Envoy in plaintext), measured
alternately in the same run.

Reported per side: sequential latency (one connection, the two gateways alternated request
by request), and CPU time per request of epp and of Envoy over closed-loop bursts
(alternated plaintext, TLS, plaintext, ...). The ratios TLS / plaintext are the result.

    .venv/bin/python benchmarks/tls_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import tempfile
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from smart_epp.benchmarks.extproc_overhead import (
    BACKEND_SCRIPT,
    Connection,
    process,
    run_concurrent,
    summary,
    wait_for,
)
from smart_epp.benchmarks.process_cpu import cpu_seconds
from smart_epp.epp.envoy_cmd import EnvoyOptions, envoy_command, render_envoy_config
from smart_epp.epp.ports import free_port, port_open

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "tls_overhead.json"
EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]
SIDES = ("plaintext", "tls")


def envoy_ready(admin_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1) as r:
            status: int = r.status
            return status == 200
    except OSError:
        return False


async def answers(port: int) -> bool:
    connection = Connection(port, bypass=False)
    try:
        await connection.open()
        await connection.call()
    except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError):
        return False
    finally:
        await connection.close()
    return True


async def sequential(ports: dict[str, int], pairs: int) -> dict[str, list[float]]:
    connections = {side: Connection(port, bypass=False) for side, port in ports.items()}
    for connection in connections.values():
        await connection.open()
    times: dict[str, list[float]] = {side: [] for side in ports}
    for _ in range(pairs):  # alternate, so drift in the machine's load hits both alike
        for side, connection in connections.items():
            times[side].append(await connection.call())
    for connection in connections.values():
        await connection.close()
    return times


async def burst(port: int, total: int, concurrency: int) -> int:
    """Closed-loop load of `total` requests; returns how many were not answered 200 (a
    failed request is counted, its connection reopened, and the load goes on)."""
    remaining, failed = total, 0

    async def worker() -> None:
        nonlocal remaining, failed
        connection = Connection(port, bypass=False)
        await connection.open()
        while remaining > 0:
            remaining -= 1
            try:
                await connection.call()
            except (RuntimeError, OSError, asyncio.IncompleteReadError):
                failed += 1
                await connection.close()
                connection = Connection(port, bypass=False)
                await connection.open()
        await connection.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequential", type=int, default=1000, help="request pairs")
    parser.add_argument("--burst", type=int, default=2000, help="requests per burst")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per side")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a short run, for a smoke check")
    args = parser.parse_args(argv)
    if args.quick:
        args.sequential, args.burst, args.rounds = 200, 400, 2

    backend_port = free_port()
    backend = f"127.0.0.1:{backend_port}"
    with tempfile.TemporaryDirectory(prefix="tls-bench-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        stack.enter_context(
            process(
                [sys.executable, str(BACKEND_SCRIPT), "--port", str(backend_port)],
                workdir / "backend.log",
            )
        )
        epp_pids: dict[str, int] = {}
        envoy_pids: dict[str, int] = {}
        listen_ports: dict[str, int] = {}
        for side in SIDES:
            grpc_port, admin_port, listen_port = free_port(), free_port(), free_port()
            serve = [*EPP, "serve", "--endpoint", backend, "--host", "127.0.0.1",
                     "--grpc-port", str(grpc_port), "--health-port", str(free_port()),
                     "--metrics-port", str(free_port()), "--kv-events-mode", "off",
                     "--log-level", "warning", f"--secure-serving={side == 'tls'}"]  # fmt: skip
            epp = stack.enter_context(process(serve, workdir / f"epp-{side}.log"))
            wait_for(functools.partial(port_open, grpc_port), 60, f"epp ({side})")
            options = EnvoyOptions(
                listen_port=listen_port,
                admin_port=admin_port,
                epp_port=grpc_port,
                listen_address="127.0.0.1",
                secure_serving=side == "tls",
            )
            config = workdir / f"envoy-{side}.yaml"
            config.write_text(render_envoy_config(options))
            envoy = stack.enter_context(
                process(envoy_command(config, concurrency=1), workdir / f"envoy-{side}.log")
            )
            wait_for(functools.partial(envoy_ready, admin_port), 30, f"Envoy ({side})")
            epp_pids[side], envoy_pids[side], listen_ports[side] = epp.pid, envoy.pid, listen_port

        async def run() -> dict[str, object]:
            for side, port in listen_ports.items():
                for _ in range(600):  # until Envoy's health check has seen the picker
                    if await answers(port):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise TimeoutError(f"the {side} gateway never answered")
                await run_concurrent(port, False, 200, 8)  # warm up
            latencies = await sequential(listen_ports, args.sequential)
            epp_cpu = dict.fromkeys(SIDES, 0.0)
            envoy_cpu = dict.fromkeys(SIDES, 0.0)
            failed = dict.fromkeys(SIDES, 0)
            for _ in range(args.rounds):
                for side in SIDES:
                    epp_before = cpu_seconds(epp_pids[side])
                    envoy_before = cpu_seconds(envoy_pids[side])
                    failed[side] += await burst(listen_ports[side], args.burst, args.concurrency)
                    epp_cpu[side] += cpu_seconds(epp_pids[side]) - epp_before
                    envoy_cpu[side] += cpu_seconds(envoy_pids[side]) - envoy_before
            requests = args.burst * args.rounds
            sides = {
                side: {
                    "sequential_latency": summary(latencies[side]),
                    "epp_cpu_us_per_request": round(epp_cpu[side] / requests * 1e6, 1),
                    "envoy_cpu_us_per_request": round(envoy_cpu[side] / requests * 1e6, 1),
                    "burst_requests_not_200": failed[side],
                }
                for side in SIDES
            }
            plain, tls = sides["plaintext"], sides["tls"]

            def ratio(key: str, inner: str | None = None) -> float:
                a = plain[key] if inner is None else plain[key][inner]
                b = tls[key] if inner is None else tls[key][inner]
                return round(float(b) / float(a), 3)

            return {
                "sides": sides,
                "tls_over_plaintext": {
                    "sequential_median_latency": ratio("sequential_latency", "median_ms"),
                    "sequential_p99_latency": ratio("sequential_latency", "p99_ms"),
                    "epp_cpu_per_request": ratio("epp_cpu_us_per_request"),
                    "envoy_cpu_per_request": ratio("envoy_cpu_us_per_request"),
                },
            }

        measured = asyncio.run(run())

    results = {
        "benchmark": "tls_overhead",
        "what": "the same request through two gateways, epp + Envoy with TLS on the ext_proc "
        "hop vs in plaintext, alternated in the same run (full-duplex body mode, default "
        "scheduler, one echo backend)",
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
        "settings": {
            "sequential_pairs": args.sequential,
            "burst_requests": args.burst,
            "rounds_per_side": args.rounds,
            "concurrency": args.concurrency,
        },
        **measured,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["tls_over_plaintext"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

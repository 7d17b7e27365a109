"""The overload scenario live: `epp sim` pods and `epp serve` (with flow control and an
objectives file) as subprocesses, real Envoy in front.

While the pool is saturated, sheddable requests are answered 429 at once; the others
wait in the picker, a client that gives up leaves the queue, and once the load drops
every non-sheddable request completes: nothing lost, nothing hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from support.envoy import async_running_envoy
from support.net import async_wait_until, free_port, free_port_run, port_open

pytestmark = pytest.mark.envoy

MODEL = "tiny"
CLI = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]
PODS = 2
# Two requests in flight per pod fill it: saturation from the gateway's own count, so
# the scenario does not depend on scrape timing.
CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: ["flowControl"]
plugins:
  - type: queue-scorer
  - type: max-score-picker
  - type: concurrency-detector
    parameters: {maxConcurrency: 2}
flowControl:
  defaultRequestTTL: 20s
  saturationDetector: {pluginRef: concurrency-detector}
"""
OBJECTIVES = """
- apiVersion: inference.networking.x-k8s.io/v1alpha2
  kind: InferenceObjective
  metadata: {name: critical}
  spec: {priority: 2}
- kind: InferenceObjective
  metadata: {name: standard}
  spec: {priority: 0}
---
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1}
"""


def sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        if all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


@contextlib.contextmanager
def process(log: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen([*CLI, *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def epp_serve_args(tmp: Path, sim_base: int, grpc_port: int, metrics_port: int) -> list[str]:
    config, objectives = tmp / "epp.yaml", tmp / "objectives.yaml"
    config.write_text(CONFIG)
    objectives.write_text(OBJECTIVES)
    endpoints = [a for i in range(PODS) for a in ("--endpoint", f"127.0.0.1:{sim_base + i}")]
    return ["serve", "--grpc-port", str(grpc_port), "--health-port", str(free_port()),
            "--metrics-port", str(metrics_port), "--config", str(config),
            "--objectives-file", str(objectives), "--kv-events-mode", "off",
            *endpoints]  # fmt: skip


async def test_overload_sheds_sheddable_fast_queues_the_rest_and_loses_nothing(
    tmp_path: Path,
) -> None:
    sim_base, grpc_port, metrics_port = free_port_run(PODS), free_port(), free_port()
    sim_args = ["sim", "--pods", str(PODS), "--base-port", str(sim_base), "--no-kv-events",
                "--model", MODEL]  # fmt: skip
    serve_args = epp_serve_args(tmp_path, sim_base, grpc_port, metrics_port)
    with (
        process(tmp_path / "sim.log", *sim_args) as sim,
        process(tmp_path / "epp.log", *serve_args) as epp,
    ):
        await async_wait_until(
            lambda: sim.poll() is None and all(port_open(sim_base + i) for i in range(PODS)),
            30,
            "epp sim",
        )
        await async_wait_until(
            lambda: epp.poll() is None and port_open(metrics_port), 30, "epp serve"
        )
        if True:
            async with (
                async_running_envoy(epp_port=grpc_port) as envoy,
                aiohttp.ClientSession() as http,
            ):

                async def metrics() -> str:
                    async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                        return await resp.text()

                async def send(
                    objective: str, max_tokens: int, give_up_s: float | None = None
                ) -> tuple[int, float, bytes]:
                    body = {"model": MODEL, "prompt": f"{objective} request", "stream": False,
                            "max_tokens": max_tokens}  # fmt: skip
                    headers = {"x-gateway-inference-objective": objective}
                    started = time.perf_counter()
                    async with http.post(
                        f"{envoy.url}/v1/completions",
                        json=body,
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(total=give_up_s),
                    ) as resp:
                        payload = await resp.read()
                        return resp.status, time.perf_counter() - started, payload

                # Warm-up: the pool answers, and nothing is queued while it has room.
                status, _, _ = await send("standard", 1)
                assert status == 200

                # Saturate: 4 long requests fill both pods; 6 more wait in the picker.
                long = [asyncio.create_task(send("standard", 400)) for _ in range(4)]

                async def pool_busy() -> bool:
                    running = 0.0
                    for i in range(PODS):
                        url = f"http://127.0.0.1:{sim_base + i}/metrics"
                        async with http.get(url) as resp:
                            running += sample(await resp.text(), "vllm:num_requests_running")
                    return running >= 4

                await async_wait_until(pool_busy, 10, "the pool busy")
                waiting = [asyncio.create_task(send("critical", 20)) for _ in range(3)]
                waiting += [asyncio.create_task(send("standard", 20)) for _ in range(3)]

                async def queued() -> bool:
                    return sample(await metrics(), "smart_epp_flow_control_queue_requests") == 6

                await async_wait_until(queued, 10, "six requests queued in the picker")
                page = await metrics()
                assert sample(page, "smart_epp_pool_saturated") == 1.0
                assert sample(page, "smart_epp_flow_control_queue_requests", priority="2") == 3, [
                    line
                    for line in page.splitlines()
                    if not line.startswith("#")
                    and ("flow_control" in line or "objective_unknown" in line)
                ]

                # Sheddable requests: 429 at once, with an OpenAI-shaped error saying why.
                shed_latencies = []
                for _ in range(10):
                    status, elapsed, payload = await send("batch", 5)
                    assert status == 429, payload
                    error = json.loads(payload)["error"]
                    assert error["type"] == "rate_limit_exceeded" and error["code"] == 429
                    assert "saturated" in error["message"] and "sheddable" in error["message"]
                    shed_latencies.append(elapsed)
                # Answered without waiting for the pool (the queued requests wait seconds).
                # The 50 ms goal is measured by benchmarks/flow_control_bench.py; here the
                # bound leaves room for a shared, busy test machine.
                assert statistics.median(shed_latencies) < 0.25, shed_latencies
                assert max(shed_latencies) < 1.0, shed_latencies

                # A client that gives up while queued leaves the queue at once.
                with pytest.raises(asyncio.TimeoutError):
                    await send("standard", 5, give_up_s=0.3)

                async def left() -> bool:
                    page = await metrics()
                    return (
                        sample(page, "smart_epp_flow_control_rejected_total",
                               reason="disconnected") == 1
                        and sample(page, "smart_epp_flow_control_queue_requests") == 6
                    )  # fmt: skip

                await async_wait_until(left, 10, "the disconnected request leaving the queue")

                # Load drops: every non-sheddable request completes, none lost or hung.
                results = await asyncio.wait_for(asyncio.gather(*long, *waiting), 60)
                assert [r[0] for r in results] == [200] * len(results)
                page = await metrics()
                assert sample(page, "smart_epp_flow_control_queue_requests") == 0
                dispatched = sample(page, "smart_epp_flow_control_dispatched_total")
                assert dispatched >= 6
                assert (
                    sample(page, "smart_epp_flow_control_rejected_total", reason="saturated") == 10
                )
                assert sample(page, "smart_epp_flow_control_queue_wait_seconds_count") == dispatched
                # Critical requests left the queue before the standard ones queued with them.
                crit_done = max(r[1] for r in results[4:7])
                std_done = max(r[1] for r in results[7:])
                assert crit_done <= std_done
        log = (tmp_path / "epp.log").read_text()
        assert "Traceback" not in log, log

"""Flow control's costs, each against a baseline measured in the same run.

1. Added cost per request while the pool is not saturated: one request's whole life
   through `RequestFlow` (admission, scheduling with a trivial first-candidate scheduler,
   booking, routed, first byte, finish), with admission and without it, alternated in
   blocks over a pool of 8 pods with fresh metrics. Measured for the shipped
   `default-flow-control` config (prefill-backlog-detector) and for a config with the
   utilization-detector.
2. Shed latency live: `epp sim` pods, `epp serve` with flow control and objectives, and
   Envoy (`epp envoy`), all real processes. With the pool saturated by long requests, a
   sheddable request's time to its 429 through Envoy, against a 1-token request served
   through the same Envoy while the pool is idle.

    .venv/bin/python benchmarks/flow_control_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import aiohttp

from smart_epp.epp.config import load_config
from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.flowcontrol.build import build_admission
from smart_epp.epp.flowcontrol.objectives import Objective, ObjectiveTable
from smart_epp.epp.ports import free_port
from smart_epp.framework.types import Api, Decision, Endpoint, LLMRequest, Outcome, PodState

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "flow_control.json"
CLI = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]
GOALS = {"added_us_per_request": 50.0, "shed_p50_ms": 50.0}


class FirstCandidate:
    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        return Decision(endpoints=list(candidates))

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        pass

    def on_outcome(self, request: LLMRequest, decision: Decision, outcome: Outcome) -> None:
        pass


def _pool() -> Datastore:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint(f"10.0.0.{i + 1}:8000") for i in range(8)])
    return datastore


async def _lifecycles(flow: RequestFlow, requests: list[LLMRequest]) -> float:
    datastore = flow.datastore
    pods = datastore.pods()
    started = time.perf_counter()
    for request in requests:
        now = time.monotonic()
        for pod in pods:  # a scrape just happened: fresh, unsaturated metrics
            pod.metrics.scraped_at = now
        tracked = flow.start(request)
        await flow.route(tracked)
        flow.routed(tracked)
        flow.first_byte(tracked)
        flow.finish(tracked, ok=True, status=200)
    return (time.perf_counter() - started) / len(requests)


def admission_overhead(config: str, blocks: int, per_block: int) -> dict[str, float]:
    loaded = load_config(config)
    objectives = ObjectiveTable({"standard": Objective("standard", 0)})
    requests = [
        LLMRequest(f"r{i}", "/v1/completions", Api.COMPLETIONS, "tiny", prompt="hello " * 50,
                   headers={"x-gateway-inference-objective": "standard"}, body=b"x" * 300)
        for i in range(per_block)
    ]  # fmt: skip
    plain_pool, admitted_pool = _pool(), _pool()
    clock = time.monotonic
    plain = RequestFlow(FirstCandidate(), plain_pool)
    admission = build_admission(
        loaded, admitted_pool.ready_pods, clock=clock, objectives=objectives
    )
    with_admission = RequestFlow(FirstCandidate(), admitted_pool, admission=admission)

    async def run() -> tuple[list[float], list[float]]:
        base: list[float] = []
        added: list[float] = []
        for _ in range(blocks):
            base.append(await _lifecycles(plain, requests))
            added.append(await _lifecycles(with_admission, requests))
        return base, added

    base, added = asyncio.run(run())
    assert admission.waiting() == 0, "the pool was never saturated: nothing may queue"
    diffs = [a - b for a, b in zip(added, base, strict=True)]
    return {
        "baseline_us_per_request": round(statistics.median(base) * 1e6, 2),
        "with_admission_us_per_request": round(statistics.median(added) * 1e6, 2),
        "added_us_per_request": round(statistics.median(diffs) * 1e6, 2),
    }


# --------------------------------------------------------------------------- live


SHED_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: ["flowControl"]
plugins:
  - type: queue-scorer
  - type: max-score-picker
  - type: concurrency-detector
    parameters: {maxConcurrency: 1}
flowControl:
  defaultRequestTTL: 25s
  saturationDetector: {pluginRef: concurrency-detector}
"""
SHED_OBJECTIVES = """
- kind: InferenceObjective
  metadata: {name: batch}
  spec: {priority: -1}
"""


@contextlib.contextmanager
def _process(log: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
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


async def _wait_http(http: aiohttp.ClientSession, url: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url) as resp:
                if resp.status < 500:
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer")
        await asyncio.sleep(0.1)


async def _timed(
    http: aiohttp.ClientSession, url: str, objective: str, tokens: int
) -> tuple[int, float]:
    body = {"model": "tiny", "prompt": "how long until the answer", "max_tokens": tokens}
    started = time.perf_counter()
    async with http.post(
        url, json=body, headers={"x-gateway-inference-objective": objective}
    ) as resp:
        await resp.read()
        return resp.status, time.perf_counter() - started


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


async def _shed_scenario(tmp: Path, requests: int) -> dict[str, float]:
    (tmp / "epp.yaml").write_text(SHED_CONFIG)
    (tmp / "objectives.yaml").write_text(SHED_OBJECTIVES)
    sim_port, grpc, metrics, listen, admin = (free_port() for _ in range(5))
    with (
        _process(tmp / "sim.log", "sim", "--port", str(sim_port), "--no-kv-events",
                 "--model", "tiny"),
        _process(tmp / "serve.log", "serve", "--endpoint", f"127.0.0.1:{sim_port}",
                 "--grpc-port", str(grpc), "--health-port", str(free_port()),
                 "--metrics-port", str(metrics), "--config", str(tmp / "epp.yaml"),
                 "--objectives-file", str(tmp / "objectives.yaml"), "--kv-events-mode", "off",
                 "--log-level", "warning"),
        _process(tmp / "envoy.log", "envoy", "--listen-port", str(listen), "--epp-port",
                 str(grpc), "--admin-port", str(admin), "--log-level", "error"),
        contextlib.nullcontext(),
    ):  # fmt: skip
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{listen}/v1/completions"
            await _wait_http(http, f"http://127.0.0.1:{sim_port}/metrics", 90)
            await _wait_http(http, f"http://127.0.0.1:{metrics}/metrics", 90)
            deadline = time.monotonic() + 30
            while True:  # Envoy up, and its health check sees the picker
                with contextlib.suppress(aiohttp.ClientError):
                    if (await _timed(http, url, "standard", 1))[0] == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError("no request got through Envoy")
                await asyncio.sleep(0.2)
            served = []
            for _ in range(requests):
                status, elapsed = await _timed(http, url, "standard", 1)
                assert status == 200, status
                served.append(elapsed)
            # One long request fills the pool (maxConcurrency 1 per pod, one pod).
            long = asyncio.create_task(_timed(http, url, "standard", 4000))
            await asyncio.sleep(0.5)
            shed = []
            for _ in range(requests):
                status, elapsed = await _timed(http, url, "batch", 1)
                assert status == 429, status
                shed.append(elapsed)
            assert not long.done(), "the pool stopped being saturated during the measurement"
            long.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await long
    return {
        "served_1_token_p50_ms": _ms(served, 0.5),
        "served_1_token_p99_ms": _ms(served, 0.99),
        "shed_p50_ms": _ms(shed, 0.5),
        "shed_p99_ms": _ms(shed, 0.99),
        "requests": requests,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args(argv)
    blocks, per_block, live = (5, 500, 50) if args.quick else (15, 2000, 200)
    with tempfile.TemporaryDirectory() as tmp:
        # The shipped config with the utilization-detector instead, for comparison.
        utilization = Path(tmp) / "utilization.yaml"
        utilization.write_text(
            (REPO / "epp/configs/default-flow-control.yaml")
            .read_text()
            .replace("prefill-backlog-detector", "utilization-detector")
            .replace("prefillTokensPerSecond: 10000", "queueDepthThreshold: 5")
            .replace("maxPrefillSeconds: 1.0", "kvCacheUtilThreshold: 0.8")
        )
        result: dict[str, object] = {
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "goals": GOALS,
            "not_saturated": {
                "default-flow-control (prefill-backlog-detector)": admission_overhead(
                    "default-flow-control", blocks, per_block
                ),
                "utilization-detector": admission_overhead(str(utilization), blocks, per_block),
            },
        }
        result["shed_live"] = asyncio.run(_shed_scenario(Path(tmp), live))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

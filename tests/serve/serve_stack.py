"""A whole deployment for `epp serve` tests: simulated vLLM pods on this event loop,
`epp serve` as a real subprocess (its real CLI), and the real Envoy in front of it.

Between the gateway and pod 3 sit two real relays the tests control: one for the pod's
/metrics (can stop answering) and one for its KV-event stream (can lose batches).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import yaml
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.envoy import EnvoyProcess, async_running_envoy
from support.net import async_wait_until, free_port, free_port_run, port_open

from smart_epp.benchmarks.sim.pool import PodHandle, SimPool, pool_configs
from smart_epp.benchmarks.sim.tokenizer import load_tokenizer

MODEL = "tiny"
# Adapters served by only some pods: lora-a on pod 2, lora-b on pod 0.
ADAPTERS = {2: {"lora-a": "/models/tiny-lora-a"}, 0: {"lora-b": "/models/tiny-lora-b"}}
EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()", "serve"]
WORDS = ["route", "prefix", "cache", "token", "pod", "queue", "batch", "gateway", "model",
         "stream", "latency", "shard"]  # fmt: skip


def text(seed: int, words: int) -> str:
    return " ".join(
        WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] + str(i % 13) for i in range(words)
    )


# --------------------------------------------------------------------------- relays


class KVEventRelay:
    """Forwards one pod's KV-event frames (SUB -> PUB over real ZMQ sockets); while
    `losing` is set, every frame is dropped, as a network or a slow reconnect loses them.
    The SUB reconnects by itself when the pod restarts on the same port."""

    def __init__(self, upstream: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.losing = False
        self.forwarded = 0
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            if self.losing:
                self.dropped += 1
                continue
            await self._pub.send_multipart(frames)
            self.forwarded += 1

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sub.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.term()


# --------------------------------------------------------------------------- pods


@contextlib.asynccontextmanager
async def sim_pods(n: int = 4, publish_to: str | None = None) -> AsyncIterator[SimPool]:
    """n simulated vLLM pods; the adapters of ADAPTERS only on the pods named there.
    With `publish_to`, every pod's KV-event PUB connects there (central mode)."""
    extra = {"kv_events_endpoint": publish_to} if publish_to else {}
    configs = pool_configs(
        n, model=MODEL, block_size=16, kv_base_port=free_port_run(2 * n), **extra
    )
    for i, loras in ADAPTERS.items():
        if i < n:
            configs[i].engine = dataclasses.replace(configs[i].engine, loras=dict(loras))
    pool = SimPool(configs, load_tokenizer(None, configs[0].engine.vocab_size))
    try:
        await pool.start()
        yield pool
    finally:
        await pool.stop()


def served_counts(pool: SimPool) -> list[int]:
    return [sum(h.pod.engine.stats.request_success.values()) for h in pool.pods]


def write_endpoints(path: Path, entries: list[dict]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump({"endpoints": entries}))
    os.replace(temporary, path)


def endpoint_entry(pod: PodHandle, **overrides: str) -> dict:
    entry = {
        "address": pod.http_address,
        "kv_events": pod.kv_events_endpoint,
        "kv_replay": pod.replay_endpoint,
    }
    entry.update(overrides)
    return entry


# --------------------------------------------------------------------------- epp serve


@dataclass
class EppProcess:
    process: subprocess.Popen[bytes]
    grpc_port: int
    health_port: int
    metrics_port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def metrics(self, http: aiohttp.ClientSession) -> str:
        async with http.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


@contextlib.contextmanager
def epp_process(log_path: Path, *args: str) -> Iterator[EppProcess]:
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    # Scraping at 10/s instead of 20/s keeps the simulated pods, which share the test's
    # event loop, responsive when several gateways watch them on a busy machine.
    command = [*EPP, "--grpc-port", str(grpc_port), "--health-port", str(health_port),
               "--metrics-port", str(metrics_port), "--scrape-interval", "0.1",
               *args]  # fmt: skip
    with log_path.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield EppProcess(proc, grpc_port, health_port, metrics_port, log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def wait_started(epp: EppProcess) -> None:
    def up() -> bool:
        if epp.process.poll() is not None:
            raise RuntimeError(f"epp serve exited with {epp.process.returncode}:\n{epp.log()}")
        return port_open(epp.metrics_port)

    await async_wait_until(up, 30, "epp serve up")


async def wait_ready(epp: EppProcess) -> None:
    """Until epp's health service reports it ready (its KV index caught up, at most one
    catch-up timeout after start): Envoy, started after that, finds it healthy at its first
    check instead of spending its own start-up budget on the catch-up."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="readiness")

        async def ready() -> bool:
            try:
                response = await stub.Check(request, timeout=2.0)
            except grpc.aio.AioRpcError:
                return False
            return response.status == health_pb2.HealthCheckResponse.SERVING

        await async_wait_until(ready, 30, "epp serve ready")


def sample(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    for match in pattern.finditer(metrics_text):
        label_text = match.group(1) or ""
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(match.group(2))
    return total


@dataclass
class Gateway:
    pool: SimPool
    epp: EppProcess
    envoy: EnvoyProcess
    http: aiohttp.ClientSession

    async def direct(self, i: int, body: dict) -> dict:
        async with self.http.post(f"{self.pool.pods[i].url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def via_gateway(self, body: dict) -> tuple[int, dict]:
        """Sends through Envoy; returns which pod served it and the response."""
        before = served_counts(self.pool)
        async with self.http.post(f"{self.envoy.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        after = served_counts(self.pool)
        [pod] = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]
        return pod, answer

    async def status_via_gateway(self, body: dict) -> int:
        async with self.http.post(f"{self.envoy.url}/v1/completions", json=body) as resp:
            await resp.read()
            return resp.status

    async def metrics(self) -> str:
        return await self.epp.metrics(self.http)

    async def all_ready(self) -> bool:
        """Whether the gateway counts every pod as a candidate."""
        ready = sample(await self.metrics(), "inference_pool_ready_pods")
        return ready == len(self.pool.pods)

    async def stored_blocks(self, i: int) -> float:
        address = self.pool.pods[i].http_address
        text_ = await self.metrics()
        return sample(text_, "smart_epp_kv_block_hashes_total", pod=address, action="stored")

    async def until_streams_live(self) -> None:
        """Sends small requests to every pod until the gateway has heard each pod's events.

        A publisher that connects to the gateway (central mode) drops what it publishes
        before its connection is up; only its next batch (whose gap the gateway then
        fills by replay) tells the gateway about it.
        """
        for i, pod in enumerate(self.pool.pods):
            for attempt in range(10):

                async def heard(address: str = pod.http_address) -> bool:
                    page = await self.metrics()
                    return sample(page, "smart_epp_kv_events_total", pod=address) > 0

                body = {"model": MODEL, "prompt": text(900 + 10 * i + attempt, 40)}
                await self.direct(i, {**body, "max_tokens": 1})
                try:
                    await async_wait_until(heard, 1.0, f"pod {i}'s first batch")
                    break
                except TimeoutError:
                    continue
            else:
                raise TimeoutError(f"the gateway never heard pod {i}'s KV events")

    async def warm(self, i: int, prefix: str) -> None:
        """Sends `prefix` straight to pod i, then waits until the gateway has ingested, from
        the pod's KV events, at least as many blocks as the prompt fills."""
        before = await self.stored_blocks(i)
        answer = await self.direct(i, {"model": MODEL, "prompt": prefix, "max_tokens": 1})
        blocks = answer["usage"]["prompt_tokens"] // 16

        async def ingested() -> bool:
            return await self.stored_blocks(i) >= before + blocks

        await async_wait_until(ingested, 10, f"gateway ingesting pod {i}'s KV events")


@contextlib.asynccontextmanager
async def gateway(epp: EppProcess, pool: SimPool) -> AsyncIterator[Gateway]:
    await wait_started(epp)
    async with (
        async_running_envoy(epp_port=epp.grpc_port) as envoy,
        aiohttp.ClientSession() as http,
    ):
        yield Gateway(pool, epp, envoy, http)

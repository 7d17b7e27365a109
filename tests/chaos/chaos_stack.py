"""A deployment to break on purpose: `epp sim` pods as separate processes (so they can be
SIGKILLed), `epp serve` as a process, the real Envoy in front, and optionally a real
Redis-protocol server for the shared index. Every scenario prints its figures.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from support.envoy import EnvoyProcess, async_running_envoy
from support.net import async_wait_until, free_port_run, port_open

from smart_epp.epp.processes import stop_process

CLI = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]
MODEL = "tiny"


@dataclass
class SimPod:
    """One `epp sim` process: HTTP, /metrics, KV events and replay on fixed ports."""

    port: int
    kv_port: int
    replay_port: int
    log_path: Path
    time_scale: float
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> SimPod:
        command = [*CLI, "sim", "--port", str(self.port), "--model", MODEL,
                   "--kv-events-port", str(self.kv_port), "--replay-port", str(self.replay_port),
                   "--time-scale", str(self.time_scale)]  # fmt: skip
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        return self

    async def wait_up(self) -> None:
        await async_wait_until(lambda: port_open(self.port), 30, f"sim pod {self.address}")

    def kill(self) -> None:
        """SIGKILL: no goodbye, connections refused from now on."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 10)

    def entry(self) -> dict[str, str]:
        return {
            "address": self.address,
            "kv_events": f"tcp://127.0.0.1:{self.kv_port}",
            "kv_replay": f"tcp://127.0.0.1:{self.replay_port}",
        }


@dataclass
class Stack:
    pods: list[SimPod]
    epp: subprocess.Popen[bytes]
    metrics_port: int
    envoy: EnvoyProcess
    http: aiohttp.ClientSession
    workdir: Path
    figures: dict[str, object] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.envoy.url

    async def metrics(self) -> str:
        async with self.http.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as resp:
            return await resp.text()

    async def pod_metric(self, pod: SimPod, name: str) -> float:
        async with self.http.get(f"http://{pod.address}/metrics") as resp:
            page = await resp.text()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )

    async def request(
        self, prompt: str, max_tokens: int = 8, stream: bool = False, timeout_s: float = 60
    ) -> tuple[int, str]:
        """(status, body) of one completion through Envoy; status 0 = transport error or a
        stream that ended without [DONE]."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
        try:
            async with self.http.post(
                f"{self.url}/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                text = (await resp.read()).decode(errors="replace")
                if resp.status == 200 and stream and "[DONE]" not in text:
                    return 0, text  # cut off mid-stream
                return resp.status, text
        except (TimeoutError, aiohttp.ClientError) as exc:
            return 0, repr(exc)

    def say(self, scenario: str, **figures: object) -> None:
        self.figures.update(figures)
        line = ", ".join(f"{k}={v}" for k, v in figures.items())
        print(f"\n[chaos] {scenario}: {line}")


def write_pool(path: Path, pods: list[SimPod]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump({"endpoints": [p.entry() for p in pods]}))
    os.replace(temporary, path)


@contextlib.contextmanager
def _process(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        stop_process(proc, 15)


@contextlib.asynccontextmanager
async def chaos_stack(
    workdir: Path,
    pods: int = 3,
    *,
    time_scale: float = 1.0,
    serve_args: tuple[str, ...] = (),
    **envoy_overrides: object,
) -> AsyncIterator[Stack]:
    # Every port of the stack from one run of distinct free ports: ports picked one at a
    # time can repeat (each is free again once picked), and a restarted pod binds its
    # ports again, so they stay below the ephemeral range (support/net.py).
    base = free_port_run(3 * pods + 3)
    sims = []
    for i in range(pods):
        http, kv, replay = range(base + 3 * i, base + 3 * i + 3)
        sims.append(SimPod(http, kv, replay, workdir / f"pod{i}.log", time_scale))
    pool = workdir / "pool.yaml"
    write_pool(pool, sims)
    grpc_port, health_port, metrics_port = range(base + 3 * pods, base + 3 * pods + 3)
    serve = [*CLI, "serve", "--grpc-port", str(grpc_port), "--health-port", str(health_port),
             "--metrics-port", str(metrics_port), "--endpoints-file", str(pool),
             "--model", MODEL, "--scrape-interval", "0.1", *serve_args]  # fmt: skip
    try:
        for sim in sims:
            sim.start()
        for sim in sims:
            await sim.wait_up()
        with _process(serve, workdir / "epp.log") as epp:

            def epp_up() -> bool:
                if epp.poll() is not None:
                    log = (workdir / "epp.log").read_text(errors="replace")
                    raise RuntimeError(f"epp serve exited:\n{log}")
                return port_open(metrics_port)

            await async_wait_until(epp_up, 60, "epp serve up")
            async with (
                async_running_envoy(epp_port=grpc_port, **envoy_overrides) as envoy,
                aiohttp.ClientSession() as http,
            ):
                stack = Stack(sims, epp, metrics_port, envoy, http, workdir)
                await async_wait_until(
                    lambda: ready_pods(stack, len(sims)), 30, "every pod a candidate"
                )
                yield stack
    finally:
        for sim in sims:
            sim.stop()


async def ready_pods(stack: Stack, count: int) -> bool:
    page = await stack.metrics()
    for line in page.splitlines():
        if line.startswith("inference_pool_ready_pods"):
            return float(line.rsplit(" ", 1)[1]) == count
    return False


def sample(page: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in page.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


class Clock:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def ms(self) -> int:
        return round((time.perf_counter() - self.start) * 1000)

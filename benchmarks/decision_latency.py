"""Scheduling decision latency: p50/p99 per decision for 8, 64 and 256 pods.

Each point runs the full `Scheduler.schedule` path (prepare + filters + scorers + picker)
on 8k-token prompts against an in-memory KV index holding ~1M (block, pod) entries, for
smart-epp's default (predicted TTFT), llm-d's precise prefix config and the Inference
Extension's default; a round-robin scheduler measured in the same run is the baseline
for the ratios. "tokenize" points start from prompt text (a unique suffix per request,
so the LRU never answers) and tokenize it in-process with the fixtures' model.

    python -m smart_epp.benchmarks.decision_latency [--iterations N] [--pods 8,64,256]
        [--in-flight-per-pod K]

By default each request is answered before the next is decided, so every queue is empty.
`--in-flight-per-pod K` keeps about K requests per pod unanswered instead (each answered
K x pods decisions later) with every pod's KV events flowing, a few milliseconds late, as
`epp serve` runs them: the default policy then prices each pod's queue from its events.

Writes benchmarks/results/decision_latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

from smart_epp.epp.round_robin import RoundRobinScheduler
from smart_epp.epp.scheduler import build_scheduler
from smart_epp.epp.tokenization import LocalTokenizer
from smart_epp.framework.types import Api, Endpoint, LLMRequest, Outcome, PodMetrics, PodState
from smart_epp.kv_index.ingest import IngestState
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.memory import MemoryBlockIndex

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "decision_latency.json"
TINY_MODEL = REPO / "tests" / "fixtures" / "vllm" / "model" / "tiny-model"
MODEL = "tiny"
BLOCK_SIZE = 16
PROMPT_TOKENS = 8192
CONTEXT_LIMIT = 32768  # each pod's max_model_len: every prompt here fits
INDEX_ENTRIES = 1_000_000
CONFIGS = ("default", "llmd-precise", "gie-default")
GOALS_P99_MS = {64: 1.0, 256: 3.0}  # without tokenization
# How late the pods' KV events arrive with --in-flight-per-pod: a healthy pool's few ms.
EVENT_LAG_S = 0.005

_request_ids = count()


def make_pods(n: int, rng: random.Random) -> list[PodState]:
    return [
        PodState(
            endpoint=Endpoint(address=f"10.0.{i // 250}.{i % 250}:8000"),
            metrics=PodMetrics(
                waiting=rng.randrange(0, 8),
                running=rng.randrange(0, 64),
                kv_usage=rng.random() * 0.9,
                block_size=BLOCK_SIZE,
                num_gpu_blocks=100_000,
                scraped_at=0.0,
            ),
        )
        for i in range(n)
    ]


def fill_index(pods: list[PodState], prompt: list[int], rng: random.Random) -> MemoryBlockIndex:
    """~1M entries: the prompt's prefix at varied depths on a quarter of the pods, plus
    unrelated random blocks spread over every pod."""
    index = MemoryBlockIndex(capacity=4_000_000)
    keys = block_keys(prompt, BLOCK_SIZE, KeyScope(MODEL))
    entries = 0
    for i, pod in enumerate(pods[: max(1, len(pods) // 4)]):
        depth = len(keys) * (i % 8 + 1) // 8
        index.add_sync(pod.address, keys[:depth])
        entries += depth
    per_pod = (INDEX_ENTRIES - entries) // len(pods)
    for pod in pods:
        index.add_sync(pod.address, [rng.getrandbits(64) for _ in range(per_pod)])
        entries += per_pod
    return index


def token_request(prompt: list[int], rng: random.Random) -> LLMRequest:
    # Shared 7k-token prefix, unique tail: the index sees a realistic partial match.
    tokens = prompt[: PROMPT_TOKENS - 1024] + [rng.randrange(0, 700) for _ in range(1024)]
    return LLMRequest(
        request_id=f"bench-{next(_request_ids)}",
        path="/v1/completions",
        api=Api.COMPLETIONS,
        model=MODEL,
        prompt_token_ids=tokens,
    )


def text_request(base_text: str, rng: random.Random) -> LLMRequest:
    return LLMRequest(
        request_id=f"bench-{next(_request_ids)}",
        path="/v1/completions",
        api=Api.COMPLETIONS,
        model=MODEL,
        prompt=base_text + f" unique tail {rng.getrandbits(48)}",
    )


def long_text(tokenizer: LocalTokenizer, target_tokens: int, rng: random.Random) -> str:
    words = [
        "route",
        "prefix",
        "cache",
        "token",
        "pod",
        "queue",
        "batch",
        "gateway",
        "model",
        "stream",
        "latency",
    ]
    text = " ".join(rng.choice(words) for _ in range(target_tokens))
    while len(tokenizer.encode(text, add_special_tokens=True)) > target_tokens:
        text = text[: int(len(text) * 0.95)]
    return text


def summarize(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return {
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "mean_ms": statistics.fmean(ms),
        "n": len(ms),
    }


async def measure(
    scheduler: object,
    pods: list[PodState],
    make_request: Callable[[], LLMRequest],
    n: int,
    in_flight: int = 0,
) -> dict[str, float]:
    """`in_flight`: requests left unanswered, the oldest answered as each new one is sent."""
    samples: list[float] = []
    unanswered: deque[tuple[LLMRequest, Any]] = deque()
    for i in range(n + n // 10):
        req = make_request()
        start = time.perf_counter()
        decision = await scheduler.schedule(req, pods)  # type: ignore[attr-defined]
        elapsed = time.perf_counter() - start
        scheduler.on_routed(req, decision)  # type: ignore[attr-defined]
        unanswered.append((req, decision))
        while len(unanswered) > in_flight:
            answer(scheduler, *unanswered.popleft())
        if i >= n // 10:  # the first tenth warms caches and allocators
            samples.append(elapsed)
    for old, old_decision in unanswered:
        answer(scheduler, old, old_decision)
    return summarize(samples)


def answer(scheduler: object, req: LLMRequest, decision: Any) -> None:
    """The request's answer, from the pod it was sent to."""
    outcome = Outcome(decision.endpoints[0].address, ok=True, status=200)
    scheduler.on_outcome(req, decision, outcome)  # type: ignore[attr-defined]


def ingest_with_events_flowing(pods: list[PodState]) -> IngestState:
    """Ingest state whose progress view has seen every pod's events, 5 ms late."""
    ingest = IngestState()
    progress = ingest.progress
    for pod in pods:
        progress.watch(f"events-{pod.address}", pod.address, [0], BLOCK_SIZE)
        progress.stored(pod.address, [0])
        progress.forget(f"events-{pod.address}")
        progress.heard(pod.address, EVENT_LAG_S)
    return ingest


async def run(
    pod_counts: list[int], iterations: int, seed: int, in_flight_per_pod: int = 0
) -> dict[str, Any]:
    rng = random.Random(seed)
    tokenizer = LocalTokenizer.from_model_dir(TINY_MODEL)
    prompt = [rng.randrange(0, 700) for _ in range(PROMPT_TOKENS)]
    base_text = long_text(tokenizer, PROMPT_TOKENS - 16, rng)
    results: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
        "prompt_tokens": PROMPT_TOKENS,
        "block_size": BLOCK_SIZE,
        "index_entries_target": INDEX_ENTRIES,
        "iterations": iterations,
        "in_flight_per_pod": in_flight_per_pod,
        "kv_event_lag_s": EVENT_LAG_S if in_flight_per_pod else None,
        "goals_p99_ms_without_tokenization": {str(k): v for k, v in GOALS_P99_MS.items()},
        "points": [],
    }
    for n_pods in pod_counts:
        pods = make_pods(n_pods, rng)
        context_limits = {p.address: CONTEXT_LIMIT for p in pods}
        index = fill_index(pods, prompt, rng)
        gc.collect()
        in_flight = in_flight_per_pod * n_pods
        baseline = await measure(
            RoundRobinScheduler(), pods, lambda: token_request(prompt, rng), iterations, in_flight
        )
        point: dict[str, Any] = {
            "pods": n_pods,
            "index_entries": index.entries,
            "baseline_round_robin": baseline,
            "configs": {},
        }
        for name in CONFIGS:
            # With the KV-event ingest state, as `epp serve` builds it: every routed request's
            # uncached blocks are watched for its prefill progress; and with every pod's
            # context length known, as its /v1/models gives it, so that each decision checks
            # the prompt against them (epp/context_limit.py).
            scheduler = build_scheduler(
                name,
                index=index,
                tokenizer=tokenizer,
                seed=seed,
                ingest_state=ingest_with_events_flowing(pods) if in_flight else IngestState(),
                context_limit_of=context_limits.get,
            )
            plain = await measure(
                scheduler, pods, lambda: token_request(prompt, rng), iterations, in_flight
            )
            tokenized = await measure(
                scheduler, pods, lambda: text_request(base_text, rng), iterations, in_flight
            )
            entry = {
                "without_tokenization": plain,
                "with_tokenization": tokenized,
                "p50_ratio_vs_round_robin": plain["p50_ms"] / baseline["p50_ms"],
            }
            goal = GOALS_P99_MS.get(n_pods)
            if goal is not None:
                entry["goal_p99_ms"] = goal
                entry["meets_goal"] = plain["p99_ms"] <= goal
            point["configs"][name] = entry
            print(
                f"pods={n_pods:4d} {name:13s} p50={plain['p50_ms']:.3f}ms "
                f"p99={plain['p99_ms']:.3f}ms | tokenize p50={tokenized['p50_ms']:.3f}ms "
                f"p99={tokenized['p99_ms']:.3f}ms | round-robin p50={baseline['p50_ms']:.4f}ms",
                flush=True,
            )
        results["points"].append(point)
        del index
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--pods", default="8,64,256")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--in-flight-per-pod",
        type=int,
        default=0,
        help="requests per pod left unanswered while deciding (0: every queue empty)",
    )
    args = parser.parse_args(argv)
    if args.in_flight_per_pod < 0:
        parser.error("--in-flight-per-pod must be 0 or more")
    pod_counts = [int(x) for x in args.pods.split(",")]
    results = asyncio.run(run(pod_counts, args.iterations, args.seed, args.in_flight_per_pod))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

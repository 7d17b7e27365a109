"""Prompt tokenization: a pod's `/tokenize` over HTTP vs a local tokenizer, in the picker.

One `epp sim` pod serving the fixture model's tokenizer (a real Hugging Face
tokenizer.json and chat template), and in this process the two tokenizers the scheduler
can use: `PodTokenizer` (POST /tokenize, used when the picker has no tokenizer files) and
`LocalTokenizer` (the same tokenizer.json through the `tokenizers` library). Each is
asked for the same prompts, completions and chat: every prompt new (a cache miss: the
cost a new prefix pays), then every prompt again (a cache hit), then new prompts sharing
one long system text (the local tokenizer reuses the shared text's cached chunks; a
pod's /tokenize answers each whole). Reported per call: wall-clock latency p50/p99 and
this process's CPU time (what the picker itself spends), and whether both gave the same
ids.

    .venv/bin/python benchmarks/tokenize_paths.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import aiohttp

from smart_epp.benchmarks.extproc_overhead import process, wait_for
from smart_epp.epp.ports import free_port, port_open
from smart_epp.epp.tokenization import LocalTokenizer, PodTokenizer, decode_tokenize_answer
from smart_epp.framework.types import Api, Endpoint, LLMRequest, PodState

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "tokenize_paths.json"
MODEL_DIR = REPO / "tests" / "fixtures" / "vllm" / "model" / "tiny-model"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "prefix", "caches", "warm", "up"]  # fmt: skip


def prompt_text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str(seed) for i in range(words))


def requests(count: int, words: int) -> list[LLMRequest]:
    out = []
    for i in range(count):
        text = prompt_text(i, words)
        if i % 2:
            out.append(
                LLMRequest(
                    f"r{i}",
                    "/v1/chat/completions",
                    Api.CHAT,
                    "tiny",
                    messages=[
                        {"role": "system", "content": "You are terse."},
                        {"role": "user", "content": text},
                    ],
                )
            )
        else:
            out.append(LLMRequest(f"r{i}", "/v1/completions", Api.COMPLETIONS, "tiny", prompt=text))
    return out


def shared_prefix_requests(count: int, words: int) -> list[LLMRequest]:
    """New prompts that share one long system text (a system prompt, a document) and
    differ in a question a fifteenth as long: what a shared-prefix workload asks."""
    shared = prompt_text(10_000, words)
    out = []
    for i in range(count):
        question = prompt_text(20_000 + i, max(1, words // 15))
        if i % 2:
            messages = [
                {"role": "system", "content": shared},
                {"role": "user", "content": question},
            ]
            out.append(
                LLMRequest(f"s{i}", "/v1/chat/completions", Api.CHAT, "tiny", messages=messages)
            )
        else:
            prompt = f"{shared} {question}"
            out.append(
                LLMRequest(f"s{i}", "/v1/completions", Api.COMPLETIONS, "tiny", prompt=prompt)
            )
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_tokenizer(
    tokenizer: LocalTokenizer | PodTokenizer, batch: list[LLMRequest], pods: list[PodState]
) -> tuple[dict[str, float], list[list[int] | None]]:
    latencies = []
    ids: list[list[int] | None] = []
    cpu_before = time.process_time()
    for request in batch:
        started = time.perf_counter()
        result = await tokenizer.tokenize(request, pods)
        latencies.append(time.perf_counter() - started)
        ids.append(list(result) if result is not None else None)
    cpu = time.process_time() - cpu_before
    return {
        "p50_us": round(statistics.median(latencies) * 1e6, 1),
        "p99_us": round(percentile(latencies, 0.99) * 1e6, 1),
        "picker_cpu_us_per_call": round(cpu / len(batch) * 1e6, 1),
    }, ids


async def measure(address: str, count: int, words: int) -> dict[str, object]:
    pods = [PodState(Endpoint(address))]
    batch = requests(count, words)
    pod = PodTokenizer()
    local = LocalTokenizer.from_model_dir(MODEL_DIR)
    warm = requests(5, 8)
    for request in warm:  # connections, template compilation
        await pod.tokenize(request, pods)
        await local.tokenize(request, pods)
    out: dict[str, object] = {}
    pod_miss, pod_ids = await run_tokenizer(pod, batch, pods)
    local_miss, local_ids = await run_tokenizer(local, batch, pods)
    pod_hit, _ = await run_tokenizer(pod, batch, pods)
    local_hit, _ = await run_tokenizer(local, batch, pods)
    shared = shared_prefix_requests(count, words)
    pod_shared, pod_shared_ids = await run_tokenizer(pod, shared, pods)
    local_shared, local_shared_ids = await run_tokenizer(local, shared, pods)
    await pod.aclose()
    out["pod_tokenize_http"] = {
        "new_prompt": pod_miss,
        "repeated_prompt": pod_hit,
        "new_prompt_shared_prefix": pod_shared,
    }
    out["local_tokenizer"] = {
        "new_prompt": local_miss,
        "repeated_prompt": local_hit,
        "new_prompt_shared_prefix": local_shared,
    }
    shared_agree = sum(
        a == b and a is not None for a, b in zip(pod_shared_ids, local_shared_ids, strict=True)
    )
    out["same_ids_shared_prefix"] = f"{shared_agree}/{len(shared)}"
    out["picker_cpu_pod_over_local_shared_prefix"] = round(
        pod_shared["picker_cpu_us_per_call"] / max(local_shared["picker_cpu_us_per_call"], 1e-9),
        2,
    )
    out["latency_p50_pod_over_local_shared_prefix"] = round(
        pod_shared["p50_us"] / max(local_shared["p50_us"], 1e-9), 2
    )
    agree = sum(a == b and a is not None for a, b in zip(pod_ids, local_ids, strict=True))
    out["same_ids"] = f"{agree}/{len(batch)}"
    lengths = [len(i) for i in local_ids if i is not None]
    out["prompt_tokens_median"] = statistics.median(lengths) if lengths else 0
    miss_ratio = pod_miss["picker_cpu_us_per_call"] / max(
        local_miss["picker_cpu_us_per_call"], 1e-9
    )
    out["picker_cpu_pod_over_local_new_prompt"] = round(miss_ratio, 2)
    out["latency_p50_pod_over_local_new_prompt"] = round(
        pod_miss["p50_us"] / max(local_miss["p50_us"], 1e-9), 2
    )
    return out


def json_and_python_check(raw: bytes) -> list[int]:
    """How the /tokenize answer used to be read: json, then a Python loop over the ids."""
    payload = json.loads(raw)
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ValueError("no token list")
    return tokens


async def answer_decoding(address: str, words: int, repeat: int = 200) -> dict[str, object]:
    """Reading one real /tokenize answer: the previous json + Python check vs msgspec."""
    body = {"model": "tiny", "prompt": prompt_text(10_000, words)}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://{address}/tokenize", json=body) as response,
    ):
        raw = await response.read()
    assert json_and_python_check(raw) == decode_tokenize_answer(raw).tokens
    before = min(timeit.repeat(lambda: json_and_python_check(raw), number=repeat, repeat=5))
    after = min(timeit.repeat(lambda: decode_tokenize_answer(raw), number=repeat, repeat=5))
    return {
        "answer_bytes": len(raw),
        "json_and_python_check_us": round(before / repeat * 1e6, 1),
        "msgspec_us": round(after / repeat * 1e6, 1),
        "msgspec_over_json": round(after / before, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--words", type=int, default=1500, help="words per prompt")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts = 60
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tokenize-bench-") as tmp:
        sim = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()", "sim",
               "--port", str(port), "--model", "tiny", "--no-kv-events",
               "--tokenizer", str(MODEL_DIR)]  # fmt: skip
        with process(sim, Path(tmp) / "sim.log"):
            wait_for(lambda: port_open(port), 30, "sim pod")
            address = f"127.0.0.1:{port}"
            measured = asyncio.run(measure(address, args.prompts, args.words))
            measured["tokenize_answer_decoding"] = asyncio.run(answer_decoding(address, args.words))
    results = {
        "benchmark": "tokenize_paths",
        "what": "tokenizing prompts in the picker: a pod's /tokenize over HTTP (loopback, "
        "one `epp sim` pod) vs the same tokenizer.json in-process; calls one at a time",
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(),
            "python": platform.python_version(),
        },
        "settings": {
            "prompts": args.prompts,
            "words_per_prompt": args.words,
            "model": str(MODEL_DIR.relative_to(REPO)),
        },
        **measured,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

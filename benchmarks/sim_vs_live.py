"""How faithful is the simulator: one trace replayed live and in `epp replay --mode sim`.

The trace (shared system prompts, two arrival rates) is written as recorded traffic with
the prompt text and the model tokenizer's ids for it, so the live run sends text, as a
client does, and the simulator sees the very token ids the pods will compute. For each
policy (`default` and `round-robin`):

- live: a fresh `epp serve` with that policy and real Envoy in front of the pods; every
  pod's prefix cache is reset first (vLLM's `/reset_prefix_cache`, served when the pod runs
  with `VLLM_SERVER_DEV_MODE=1`) and the pods idle, then the replay's live mode (what
  `epp replay --mode live` runs) sends the trace through Envoy;
- sim: the replay's simulation (what `epp replay --mode sim` runs) with as many pods, the
  given (calibrated) profile, the pods' block size, and as routing latency what the
  gateway was measured to add in front of a pod in the same run (see `gateway_latency`).

The table (TTFT p50/p90 per policy and mode, the sim's p50 error against live, and whether
both modes rank the policies alike) goes to `benchmarks/results/sim_vs_live.json`.

    .venv/bin/python benchmarks/sim_vs_live.py --pod 127.0.0.1:8001,tcp://127.0.0.1:5557,\
tcp://127.0.0.1:5558 --pod ... --profile calibrated.yaml --tokenizer DIR/tokenizer.json \
--model tiny --block-size 32

Calibrate the pods as they will run: with the gateway in front of them (`live_gateway`),
which on a small host takes CPU from them. The real-vLLM test tier runs it against two
vLLM CPU pods with the tiny test model, prefilling in 32-token chunks
(tests/real_vllm/measure_sim_vs_live.py, run by path).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from smart_epp.benchmarks.calibrate.probe import Probe, Prompts
from smart_epp.benchmarks.replay.arrivals import scaled_arrivals
from smart_epp.benchmarks.replay.cli import Workload, simulate_policy
from smart_epp.benchmarks.replay.live import LiveOptions, read_stream, run_live
from smart_epp.benchmarks.replay.report import RequestResult, summarize
from smart_epp.benchmarks.replay.sim import SimConfig
from smart_epp.benchmarks.replay.traces import load_trace
from smart_epp.benchmarks.sim.profiles import LatencyProfile, load_profile_file
from smart_epp.epp.demo import ProcessGroup, epp_argv, http_ok, post_ok, wait_for
from smart_epp.epp.envoy_cmd import EnvoyOptions, envoy_command, render_envoy_config
from smart_epp.epp.ports import free_port
from smart_epp.epp.traffic_recorder import recorded_line

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "sim_vs_live.json"
POLICY_CONFIGS: dict[str, str | None] = {
    "default": None,  # epp serve's built-in default
    "round-robin": str(HERE / "replay" / "configs" / "round-robin.yaml"),
}
P50_TOLERANCE = 0.35

_WORDS = (
    "route", "prefix", "cache", "block", "token", "event", "pod", "model", "gateway",
    "queue", "shard", "replica", "score", "prompt", "stream", "latency", "batch", "index",
    "memory", "value", "answer", "question", "server", "client",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Groups of requests sharing a system prompt, sent in two phases of Poisson arrivals.

    With the test pods' 4,096-token KV caches, 12 system prompts of ~500 tokens do not fit
    in one pod but half of them do: a policy that keeps each group on one pod keeps its
    prefix cached, one that spreads every group over both pods evicts it.
    """

    groups: int = 12
    per_group: int = 6
    system_words: int = 240
    question_words: int = 16
    output_tokens: int = 8
    rates: tuple[float, float] = (1.0, 3.0)  # requests/s in the first and second half
    seed: int = 0

    @property
    def requests(self) -> int:
        return self.groups * self.per_group


def write_trace(spec: TraceSpec, tokenizer_json: Path, model: str, out: Path) -> int:
    """Writes the trace as recorded traffic; returns the number of requests."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    rng = random.Random(spec.seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    systems = [f"system {g}: {words(spec.system_words)}" for g in range(spec.groups)]
    order = [g for g in range(spec.groups) for _ in range(spec.per_group)]
    rng.shuffle(order)
    now = 0.0
    lines = []
    for i, g in enumerate(order):
        rate = spec.rates[0] if i < len(order) // 2 else spec.rates[1]
        now += rng.expovariate(rate)
        prompt = f"{systems[g]} question {i}: {words(spec.question_words)}"
        ids = tokenizer.encode(prompt, add_special_tokens=True).ids
        row = json.loads(
            recorded_line(now, model, len(ids), spec.output_tokens, prompt_token_ids=ids)
        )
        # Both: the simulator replays the ids, the live run sends the text.
        row["prompt"] = prompt
        lines.append(json.dumps(row, separators=(",", ":")) + "\n")
    out.write_text("".join(lines))
    return len(lines)


@dataclass(frozen=True, slots=True)
class PodSpec:
    address: str  # ip:port
    kv_events: str | None = None
    kv_replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> PodSpec:
        parts = text.split(",")
        if not 1 <= len(parts) <= 3:
            raise argparse.ArgumentTypeError(f"{text!r}: ADDRESS[,KV_EVENTS[,KV_REPLAY]]")
        return cls(*parts)

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@contextlib.contextmanager
def live_gateway(
    pods: Sequence[PodSpec], config: str | None, model: str, log_level: str = "warning"
) -> Iterator[str]:
    """`epp serve` (with `config`) and Envoy in front of the pods; yields Envoy's URL.
    At `log_level` "debug" epp logs every decision with each pod's scores."""
    # Kept afterwards: epp's and Envoy's logs there explain a run that went wrong.
    workdir = Path(tempfile.mkdtemp(prefix="sim-vs-live-"))
    group = ProcessGroup(workdir)
    try:
        entries = []
        for pod in pods:
            entry: dict[str, Any] = {"address": pod.address, "labels": {"model": model}}
            if pod.kv_events:
                entry["kv_events"] = pod.kv_events
            if pod.kv_replay:
                entry["kv_replay"] = pod.kv_replay
            entries.append(entry)
        endpoints = workdir / "endpoints.yaml"
        endpoints.write_text(yaml.safe_dump({"endpoints": entries}))
        grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
        serve = ["serve", "--grpc-port", str(grpc_port), "--health-port", str(health_port),
                 "--metrics-port", str(metrics_port), "--endpoints-file", str(endpoints),
                 "--log-level", log_level]  # fmt: skip
        if config:
            serve += ["--config", config]
        epp = group.start("epp", epp_argv(*serve))
        wait_for("epp", lambda: http_ok(f"http://127.0.0.1:{metrics_port}/metrics"), epp)
        options = EnvoyOptions(
            listen_port=free_port(),
            epp_port=grpc_port,
            admin_port=free_port(),
            listen_address="127.0.0.1",
        )
        config_path = workdir / "envoy.yaml"
        config_path.write_text(render_envoy_config(options))
        envoy = group.start("envoy", envoy_command(config_path, concurrency=1))
        wait_for("Envoy", lambda: http_ok(f"http://127.0.0.1:{options.admin_port}/ready"), envoy)
        url = f"http://127.0.0.1:{options.listen_port}"
        probe = json.dumps({"model": model, "prompt": "hello", "max_tokens": 1}).encode()
        wait_for("a request through Envoy", lambda: post_ok(f"{url}/v1/completions", probe), envoy)
        yield url
    finally:
        group.stop_all()


async def reset_prefix_caches(pods: Sequence[PodSpec]) -> None:
    async with aiohttp.ClientSession() as session:
        for pod in pods:
            async with session.post(f"{pod.url}/reset_prefix_cache") as resp:
                if resp.status != 200:
                    raise RuntimeError(
                        f"{pod.address}: POST /reset_prefix_cache answered {resp.status}; start "
                        "the pod with VLLM_SERVER_DEV_MODE=1 so each run starts cold"
                    )


async def _ttft(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    sent = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        timing = await read_stream(resp, sent, every_choice=True)
    if timing.ttft_s is None:
        raise RuntimeError(f"{url}: a stream without a token")
    return timing.ttft_s


async def gateway_latency(
    gateway_url: str, pods: Sequence[PodSpec], model: str, spec: TraceSpec, n: int = 25
) -> float:
    """What a request pays before the pod's engine sees it, as the simulator's routing
    latency: the gateway's added time to first token plus the client's HTTP round trip to
    a pod, which calibration takes out of the engine's step costs.

    Each probe is a fresh prompt of the trace's size, first sent straight to every pod (so
    it is cached wherever the gateway sends it), then through the gateway (which has to
    tokenize it, as it does each trace request) and straight to a pod, in alternating
    order; the added time is the median of the `n` pairs' differences, which a drift in
    the host's speed during the probes moves less than a difference of medians.
    """
    rng = random.Random(f"gateway-latency-{spec.seed}")
    size = spec.system_words + spec.question_words
    added = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            prompt = f"probe {i}: " + " ".join(rng.choice(_WORDS) for _ in range(size))
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
            for pod in pods:
                await _ttft(session, pod.url, body)
            direct_url = pods[i % len(pods)].url
            if i % 2:
                direct = await _ttft(session, direct_url, body)
                via = await _ttft(session, gateway_url, body)
            else:
                via = await _ttft(session, gateway_url, body)
                direct = await _ttft(session, direct_url, body)
            added.append(via - direct)
        floor = await Probe(session, pods[0].url, model).round_trip_floor()
    return max(0.0, statistics.median(added)) + floor


async def pod_slowdown(
    pods: Sequence[PodSpec], profile: LatencyProfile, model: str, tokens: int, seed: int
) -> float:
    """How much slower the pods answer a cold prompt of `tokens` now than the profile
    predicts (1.0 = as calibrated): the median over the pods of the median of 3 fresh
    prompts each, less the HTTP round trip, as `epp calibrate` measures. On a machine
    shared with other work it says how far the pods' speed drifted since calibration."""
    predicted = profile.idle_ttft_seconds(tokens)
    prompts = Prompts(seed=seed)
    ratios = []
    async with aiohttp.ClientSession() as session:
        for pod in pods:
            probe = Probe(session, pod.url, model)
            floor = await probe.round_trip_floor()
            times = []
            for _ in range(3):
                timing = await probe.stream(prompts.make(tokens), 1)
                assert timing.ttft_s is not None
                times.append(timing.ttft_s - floor)
            ratios.append(statistics.median(times) / predicted)
    return statistics.median(ratios)


async def wait_idle(pods: Sequence[PodSpec], timeout_s: float = 120.0) -> None:
    """Until no request runs or waits on any pod (vLLM's gauges), so a run starts alike."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            busy = 0.0
            for pod in pods:
                async with session.get(f"{pod.url}/metrics") as resp:
                    page = await resp.text()
                for family in text_string_to_metric_families(page):
                    if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                        busy += sum(sample.value for sample in family.samples)
            if busy == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"pods still busy after {timeout_s:.0f}s")
            await asyncio.sleep(0.1)


def summaries(results: Sequence[RequestResult], spec: TraceSpec) -> dict[str, Any]:
    """The whole trace's summary, and one per arrival rate."""
    keep = ("ttft_p50_s", "ttft_p90_s", "completed", "failed", "prefix_hit_rate")
    half = spec.requests // 2
    parts = {
        "all": results,
        f"{spec.rates[0]:g}/s": [r for r in results if r.index < half],
        f"{spec.rates[1]:g}/s": [r for r in results if r.index >= half],
    }
    pods = sorted({r.pod for r in results if r.pod})
    out = {}
    for name, part in parts.items():
        doc = summarize(part, pods).as_json()
        out[name] = {k: doc[k] for k in keep}
        # Why requests failed: an HTTP status or the client's error name, with counts.
        out[name]["failures"] = dict(Counter(str(r.status) for r in part if not r.ok))
    return out


def run_policy(
    policy: str,
    workload: Workload,
    pods: Sequence[PodSpec],
    profile: Path,
    model: str,
    block_size: int,
    spec: TraceSpec,
) -> dict[str, Any]:
    """Live, then sim (what `epp replay --mode sim` runs) for one policy: summaries of both
    and the routing latency the sim charged."""
    calibrated = load_profile_file(profile)
    size = int(statistics.median(r.input_tokens for r in workload.requests))
    conditions: dict[str, Any] = {"load_average_1m_before": round(os.getloadavg()[0], 2)}
    with live_gateway(pods, POLICY_CONFIGS[policy], model) as url:
        routing_s = asyncio.run(gateway_latency(url, pods, model, spec))
        conditions["pod_slowdown_before"] = round(
            asyncio.run(pod_slowdown(pods, calibrated, model, size, seed=1)), 3
        )
        asyncio.run(reset_prefix_caches(pods))
        asyncio.run(wait_idle(pods))
        options = LiveOptions(target=url, concurrency=64)
        live = asyncio.run(run_live(workload.requests, workload.arrivals, options))
        asyncio.run(wait_idle(pods))
        conditions["pod_slowdown_after"] = round(
            asyncio.run(pod_slowdown(pods, calibrated, model, size, seed=2)), 3
        )
    conditions["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    config = SimConfig(
        pods=len(pods),
        profile=str(profile),
        block_size=block_size,
        model=model,
        routing_latency_s=routing_s,
    )
    sim = simulate_policy(policy, workload, config, spec.seed)
    return {
        "routing_latency_s": round(routing_s, 6),
        "conditions": conditions,
        "live": summaries(live, spec),
        "sim": summaries(sim, spec),
    }


def ranking(rows: dict[str, dict[str, Any]], mode: str, key: str) -> list[str]:
    """Policies best first by `key` over the whole trace."""
    return sorted(rows, key=lambda p: rows[p][mode]["all"][key])


def compare(
    pods: Sequence[PodSpec],
    profile: Path,
    tokenizer_json: Path,
    model: str,
    block_size: int,
    workdir: Path,
    spec: TraceSpec = TraceSpec(),
) -> dict[str, Any]:
    trace = workdir / "sim_vs_live_trace.jsonl"
    write_trace(spec, tokenizer_json, model, trace)
    requests = load_trace(trace)
    workload = Workload(requests, scaled_arrivals(requests))
    rows = {
        policy: run_policy(policy, workload, pods, profile, model, block_size, spec)
        for policy in POLICY_CONFIGS
    }
    for row in rows.values():
        row["sim_p50_error"] = {
            part: round((row["sim"][part]["ttft_p50_s"] / live["ttft_p50_s"]) - 1, 4)
            for part, live in row["live"].items()
        }
    rank = {
        f"{mode}_{key}": ranking(rows, mode, key)
        for mode in ("live", "sim")
        for key in ("ttft_p50_s", "ttft_p90_s")
    }
    return {
        "what": "TTFT of one trace replayed live (Envoy + epp serve + real vLLM pods) and in "
        "epp replay --mode sim with a profile calibrated against the same pods",
        "trace": {
            "requests": spec.requests,
            "groups": spec.groups,
            "rates_per_s": list(spec.rates),
            "output_tokens": spec.output_tokens,
            "prompt_tokens_median": _median_prompt(trace),
        },
        "pods": len(pods),
        "cpus": os.cpu_count(),
        "profile": yaml.safe_load(profile.read_text()),
        "policies": rows,
        "ranking": rank,
        "ranking_agrees": rank["live_ttft_p50_s"] == rank["sim_ttft_p50_s"],
        "p50_tolerance": P50_TOLERANCE,
    }


def _median_prompt(trace: Path) -> int:
    sizes = [json.loads(line)["prompt_tokens"] for line in trace.read_text().splitlines()]
    return int(statistics.median(sizes))


def render(table: dict[str, Any]) -> str:
    lines = ["policy        arrivals mode  TTFT p50 ms  TTFT p90 ms  hit rate  sim p50 error"]
    for policy, row in table["policies"].items():
        for part in row["live"]:
            for mode in ("live", "sim"):
                s = row[mode][part]
                error = f"{row['sim_p50_error'][part]:+.1%}" if mode == "sim" else ""
                lines.append(
                    f"{policy:13} {part:8} {mode:5} {s['ttft_p50_s'] * 1000:11.1f} "
                    f"{s['ttft_p90_s'] * 1000:12.1f} {s['prefix_hit_rate']:9.2f}  {error}"
                )
        c = row["conditions"]
        lines.append(f"{policy:13} routing latency charged in the sim: "
                     f"{row['routing_latency_s'] * 1000:.1f} ms; pods' cold-prompt time vs "
                     f"profile {c['pod_slowdown_before']:.2f}x before, "
                     f"{c['pod_slowdown_after']:.2f}x after; load average "
                     f"{c['load_average_1m_before']:.1f} -> {c['load_average_1m_after']:.1f} "
                     f"on {os.cpu_count()} CPUs")  # fmt: skip
    lines.append(f"ranking agrees: {table['ranking_agrees']} {table['ranking']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pod", type=PodSpec.parse, action="append", required=True,
                   metavar="ADDRESS[,KV_EVENTS[,KV_REPLAY]]",
                   help="a vLLM pod (repeat)")  # fmt: skip
    p.add_argument("--profile", type=Path, required=True, help="profile from epp calibrate")
    p.add_argument("--tokenizer", type=Path, required=True, help="the model's tokenizer.json")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--block-size", type=int, required=True, help="the pods' KV block size")
    p.add_argument("--out", type=Path, default=RESULTS)
    default = TraceSpec()
    p.add_argument("--groups", type=int, default=default.groups, help="system prompts")
    p.add_argument("--per-group", type=int, default=default.per_group, help="requests each")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in default.rates),
                   help="requests/s of the first half and of the second "
                   "(default %(default)s)")  # fmt: skip
    args = p.parse_args(argv)
    first, second = (float(r) for r in args.rates.split(","))
    spec = TraceSpec(groups=args.groups, per_group=args.per_group, rates=(first, second))
    with tempfile.TemporaryDirectory(prefix="sim-vs-live-") as tmp:
        table = compare(
            args.pod, args.profile, args.tokenizer, args.model, args.block_size, Path(tmp), spec
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=2) + "\n")
    print(render(table))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

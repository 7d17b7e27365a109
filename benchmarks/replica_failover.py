"""Kill one of three picker replicas (SIGKILL) while requests flow, then restart it.

Everything is a real process: `epp sim` pods (one process), three `epp serve` replicas
that each subscribe to every pod's KV events, and the real Envoy (`epp envoy`'s config,
fail-open, the replicas health-checked every second) in front. An open-loop client sends
completions at a fixed rate through Envoy; one replica is SIGKILLed, and restarted on the
same ports a little later. Measured in the same run:

- requests that failed (not 200, or a transport error), before and after the kill;
- how many Envoy sent to the pool without a decision (fail-open: the picker's stream died
  or its connection was refused);
- from the kill to Envoy marking the replica unhealthy (`/clusters` health flags, polled
  every 20 ms), and to the last stream Envoy tried on it;
- from the restart (process start) to the replica reporting ready, and to its first
  decision (its own request counter);
- latency percentiles in three windows: before the kill (the baseline), the 3 s after the
  kill, and after the restart.

    .venv/bin/python benchmarks/replica_failover.py [--rate 100] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from smart_epp.benchmarks.process_cpu import cpu_seconds
from smart_epp.epp.envoy_cmd import EnvoyOptions, envoy_command, render_envoy_config
from smart_epp.epp.ports import free_port, free_port_block, port_open
from smart_epp.epp.processes import stop_process

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "replica_failover.json"
CLI = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]
MODEL = "tiny"
WORDS = [
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
    "shard",
]
POLL_S = 0.02


def prompt(i: int, groups: int = 8, words: int = 120) -> str:
    """Shared-prefix prompts: `groups` long prefixes, a short distinct tail each."""
    group = i % groups
    prefix = " ".join(f"{WORDS[(group * 5 + k) % len(WORDS)]}{k % 17}" for k in range(words))
    return f"{prefix} question {i}"


@contextlib.contextmanager
def child(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    stop_process(proc, 15)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            status: int = response.status
            return status == 200
    except OSError:
        return False


async def wait_until(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()  # type: ignore[operator]
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(POLL_S)


def metric_sum(page: str, name: str) -> float:
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(m.group(2)) for m in pattern.finditer(page))


@dataclass
class Replica:
    """One `epp serve` on fixed ports, so a restart takes the same place in Envoy."""

    index: int
    grpc_port: int
    health_port: int
    metrics_port: int
    pool_file: Path
    workdir: Path
    extra_args: tuple[str, ...] = ()  # e.g. the shared pool-state store
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> None:
        command = [*CLI, "serve", "--host", "127.0.0.1", "--secure-serving=false",
                   "--grpc-port", str(self.grpc_port), "--health-port", str(self.health_port),
                   "--metrics-port", str(self.metrics_port), "--endpoints-file",
                   str(self.pool_file), "--model", MODEL, "--scrape-interval", "0.25",
                   "--log-level", "info", *self.extra_args]  # fmt: skip
        with (self.workdir / f"epp{self.index}.log").open("ab") as out:
            self.started_at = time.monotonic()
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    async def metrics(self, http: aiohttp.ClientSession) -> str | None:
        try:
            async with http.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as resp:
                return await resp.text()
        except aiohttp.ClientError:
            return None


@dataclass
class Stack:
    replicas: list[Replica]
    pods: list[str]
    envoy_url: str
    admin_url: str
    envoy_pid: int
    http: aiohttp.ClientSession
    workdir: Path

    async def host_stats(self) -> dict[str, dict[str, str]]:
        """Envoy's view of each replica: health flags and per-host counters."""
        async with self.http.get(f"{self.admin_url}/clusters") as resp:
            text = await resp.text()
        hosts: dict[str, dict[str, str]] = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) >= 4 and parts[0] == "epp":
                hosts.setdefault(parts[1], {})[parts[2]] = parts[3]
        return hosts

    async def envoy_stat(self, name: str) -> int:
        async with self.http.get(f"{self.admin_url}/stats?filter=^{name}$") as resp:
            text = await resp.text()
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0

    async def ready_pods(self, replica: Replica) -> float:
        page = await replica.metrics(self.http)
        return 0.0 if page is None else metric_sum(page, "inference_pool_ready_pods")


@contextlib.asynccontextmanager
async def failover_stack(
    workdir: Path,
    *,
    replicas: int = 3,
    pods: int = 3,
    time_scale: float = 0.2,
    serve_args: tuple[str, ...] = (),
) -> AsyncIterator[Stack]:
    """Sim pods, `replicas` pickers (each also given `serve_args`) and Envoy (fail-open),
    all up and healthy."""
    base = free_port_block(3 * pods)
    pod_addresses = [f"127.0.0.1:{base + i}" for i in range(pods)]
    pool_file = workdir / "pool.yaml"
    entries = [
        {
            "address": address,
            "kv_events": f"tcp://127.0.0.1:{base + pods + i}",
            "kv_replay": f"tcp://127.0.0.1:{base + 2 * pods + i}",
        }
        for i, address in enumerate(pod_addresses)
    ]
    pool_file.write_text(yaml.safe_dump({"endpoints": entries}))
    sim = [*CLI, "sim", "--pods", str(pods), "--base-port", str(base), "--model", MODEL,
           "--kv-events-port", str(base + pods), "--replay-port", str(base + 2 * pods),
           "--time-scale", str(time_scale)]  # fmt: skip
    with contextlib.ExitStack() as processes:
        processes.enter_context(child(sim, workdir / "sim.log"))
        await wait_until(
            lambda: all(http_ok(f"http://{a}/metrics") for a in pod_addresses), 60, "sim pods up"
        )
        # Only now, with the pods' ports bound: a port picked earlier could be one of the
        # pods' block, free until the simulator bound it.
        pickers = [
            Replica(i, free_port(), free_port(), free_port(), pool_file, workdir, serve_args)
            for i in range(replicas)
        ]
        options = EnvoyOptions(
            listen_port=free_port(),
            admin_port=free_port(),
            listen_address="127.0.0.1",
            failure_mode="open",
            secure_serving=False,
            epp_replicas=tuple(r.address for r in pickers),
        )
        config = workdir / "envoy.yaml"
        config.write_text(render_envoy_config(options))
        for picker in pickers:
            picker.start()
            processes.callback(picker.stop)  # whichever process it runs by then
        envoy = processes.enter_context(
            child(envoy_command(config, concurrency=1), workdir / "envoy.log")
        )
        admin = f"http://127.0.0.1:{options.admin_port}"
        connector = aiohttp.TCPConnector(limit=1000)
        async with aiohttp.ClientSession(connector=connector) as http:
            stack = Stack(
                pickers,
                pod_addresses,
                f"http://127.0.0.1:{options.listen_port}",
                admin,
                envoy.pid,
                http,
                workdir,
            )
            await wait_until(lambda: http_ok(f"{admin}/ready"), 30, "Envoy up")

            async def all_up() -> bool:
                for picker in pickers:
                    assert picker.process is not None
                    if picker.process.poll() is not None:
                        log = (workdir / f"epp{picker.index}.log").read_text(errors="replace")
                        raise RuntimeError(f"epp serve {picker.index} exited:\n{log}")
                    if await stack.ready_pods(picker) < pods:
                        return False
                hosts = await stack.host_stats()
                return all(
                    hosts.get(p.address, {}).get("health_flags") == "healthy" for p in pickers
                )

            await wait_until(all_up, 90, "every replica healthy with every pod ready")

            async def pool_known() -> bool:
                return await stack.envoy_stat("cluster.inference_pool.membership_total") == pods

            await wait_until(pool_known, 30, "Envoy knowing the pool over EDS")
            yield stack


# ------------------------------------------------------------------ the scenario


@dataclass
class Sent:
    at: float
    status: int  # 0: transport error
    latency_s: float
    error: str = ""  # what a failed request got back
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the pod's prefix-cache hit, from the response's usage


@dataclass
class Timeline:
    kill_at: float = 0.0
    unhealthy_at: float | None = None
    last_attempt_at: float | None = None
    restart_at: float = 0.0
    listening_at: float | None = None  # the restarted process has its ports open
    ready_at: float | None = None
    first_decision_at: float | None = None
    notes: list[str] = field(default_factory=list)


async def send(stack: Stack, i: int, max_tokens: int, sent: list[Sent]) -> None:
    body = {"model": MODEL, "prompt": prompt(i), "max_tokens": max_tokens}
    start = time.monotonic()
    error = ""
    try:
        async with stack.http.post(
            f"{stack.envoy_url}/v1/completions",
            json=body,
            timeout=aiohttp.ClientTimeout(total=60),
        ) as resp:
            answer = await resp.read()
            status = resp.status
            if status != 200:
                error = answer[:200].decode(errors="replace")
    except (TimeoutError, aiohttp.ClientError) as exc:
        status, error = 0, repr(exc)
    record = Sent(start, status, time.monotonic() - start, error)
    if status == 200:
        usage = json.loads(answer).get("usage") or {}
        record.prompt_tokens = usage.get("prompt_tokens") or 0
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    sent.append(record)


async def open_loop(
    stack: Stack,
    rate: float,
    duration_s: float,
    max_tokens: int,
    sent: list[Sent],
    until: asyncio.Event,
    grace_s: float,
) -> None:
    """Starts one request every 1/rate s, whatever the earlier ones are doing, for
    `duration_s` and then on until `until` is set (at most `grace_s` more)."""
    tasks: list[asyncio.Task[None]] = []
    start = time.monotonic()
    end = start + duration_s
    i = 0
    while True:
        due = start + i / rate
        if due >= end and (until.is_set() or due >= end + grace_s):
            break
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(stack, i, max_tokens, sent)))
        i += 1
    await asyncio.gather(*tasks)


async def watch_dead(
    stack: Stack,
    victim: Replica,
    timeline: Timeline,
    done: asyncio.Event,
    before: dict[str, str],
) -> None:
    """Polls Envoy's view of the killed replica: when it turns unhealthy, and the last
    time Envoy still tried a stream on it (its request or connect-failure counters grew
    since `before`, taken just before the kill)."""
    last = (before.get("rq_total", ""), before.get("cx_connect_fail", ""))
    while not done.is_set():
        host = (await stack.host_stats()).get(victim.address, {})
        now = time.monotonic()
        flags = host.get("health_flags", "")
        if timeline.unhealthy_at is None and flags and flags != "healthy":
            timeline.unhealthy_at = now
        counters = (host.get("rq_total", ""), host.get("cx_connect_fail", ""))
        if counters != last:
            timeline.last_attempt_at = now
        last = counters
        await asyncio.sleep(POLL_S)


def scrape_dropouts(stack: Stack, replicas: list[Replica]) -> int:
    """How often these replicas took a pod out of their candidate set after 3 failed
    /metrics scrapes (their logs so far): on a starved machine a slow pod looks dead."""
    total = 0
    for replica in replicas:
        log = stack.workdir / f"epp{replica.index}.log"
        total += log.read_text(errors="replace").count("out of the candidate set")
    return total


async def watch_restart(stack: Stack, replica: Replica, timeline: Timeline) -> None:
    """From the restart: when Envoy sees the replica healthy, and its first decision."""
    while timeline.first_decision_at is None:
        if timeline.listening_at is None and port_open(replica.grpc_port):
            timeline.listening_at = time.monotonic()
        host = (await stack.host_stats()).get(replica.address, {})
        if timeline.ready_at is None and host.get("health_flags") == "healthy":
            timeline.ready_at = time.monotonic()
        page = await replica.metrics(stack.http)
        if page is not None and metric_sum(page, "inference_objective_request_total") > 0:
            timeline.first_decision_at = time.monotonic()
        await asyncio.sleep(POLL_S)


def window(sent: list[Sent], start: float, end: float) -> dict[str, float]:
    latencies = sorted(s.latency_s for s in sent if start <= s.at < end and s.status == 200)
    if not latencies:
        return {"count": 0}
    return {
        "count": len(latencies),
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000, 1),
    }


async def kill_one_of_three(
    stack: Stack,
    *,
    rate: float,
    warmup_s: float,
    restart_after_s: float,
    tail_s: float,
    max_tokens: int = 4,
) -> dict[str, object]:
    """Runs the scenario on a started stack; returns what was measured."""
    victim = stack.replicas[0]
    survivors = stack.replicas[1:]
    dropouts_before = scrape_dropouts(stack, survivors)
    fail_open = "http.inference_gateway.ext_proc.failure_mode_allowed"
    fail_open_before = await stack.envoy_stat(fail_open)
    sent: list[Sent] = []
    timeline = Timeline()
    duration = warmup_s + restart_after_s + tail_s
    started = time.monotonic()
    decided = asyncio.Event()  # the load goes on until the restarted replica has decided
    grace = 30.0
    load = asyncio.create_task(open_loop(stack, rate, duration, max_tokens, sent, decided, grace))
    await asyncio.sleep(warmup_s)
    before = (await stack.host_stats()).get(victim.address, {})
    victim.kill()
    timeline.kill_at = time.monotonic()
    watching_done = asyncio.Event()
    watcher = asyncio.create_task(watch_dead(stack, victim, timeline, watching_done, before))
    await asyncio.sleep(restart_after_s)
    watching_done.set()  # from here on, streams to that address reach the new process
    await watcher
    victim.start()
    timeline.restart_at = victim.started_at
    try:
        await asyncio.wait_for(watch_restart(stack, victim, timeline), tail_s + grace)
        await asyncio.sleep(3.0)  # a few seconds of the restarted replica deciding
    except TimeoutError:
        timeline.notes.append("the restarted replica made no decision in time")
    decided.set()
    await load
    achieved = len(sent) / max(1e-9, max(s.at for s in sent) - started) if sent else 0.0
    failed = [s for s in sent if s.status != 200]
    page = await victim.metrics(stack.http) or ""

    def since(t: float | None, origin: float) -> float | None:
        return None if t is None else round(t - origin, 3)

    restarted_window_start = timeline.first_decision_at or timeline.restart_at + 5
    return {
        "rate_req_per_s": rate,
        "achieved_send_rate_req_per_s": round(achieved, 1),
        "requests": len(sent),
        "failed": len(failed),
        "failed_statuses": sorted({s.status for s in failed}),
        "failure_examples": sorted({s.error for s in failed})[:3],
        "failed_at_s_after_kill": [round(s.at - timeline.kill_at, 2) for s in failed][:20],
        "served_without_a_decision": await stack.envoy_stat(fail_open) - fail_open_before,
        "pods_dropped_by_surviving_replicas_after_3_scrape_timeouts": scrape_dropouts(
            stack, survivors
        )
        - dropouts_before,
        "kill_to_unhealthy_in_envoy_s": since(timeline.unhealthy_at, timeline.kill_at),
        "kill_to_last_stream_tried_on_dead_replica_s": since(
            timeline.last_attempt_at, timeline.kill_at
        ),
        # Process start to ports open is the interpreter starting (imports): it grows
        # with the machine's load. The rest is catch-up, health check and EDS.
        "restart_to_listening_s": since(timeline.listening_at, timeline.restart_at),
        "restart_to_healthy_in_envoy_s": since(timeline.ready_at, timeline.restart_at),
        "restart_to_first_decision_s": since(timeline.first_decision_at, timeline.restart_at),
        "listening_to_first_decision_s": since(
            timeline.first_decision_at, timeline.listening_at or timeline.restart_at
        ),
        "restarted_replica_catch_up_s": metric_sum(page, "smart_epp_kv_catch_up_seconds"),
        "restarted_replica_pods_not_caught_up": metric_sum(
            page, "smart_epp_kv_catch_up_pending_pods"
        ),
        "latency": {
            "before_kill": window(sent, started, timeline.kill_at),
            "3s_after_kill": window(sent, timeline.kill_at, timeline.kill_at + 3),
            "after_restart_decided": window(sent, restarted_window_start, float("inf")),
        },
        "notes": timeline.notes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the kill")
    parser.add_argument("--restart-after", type=float, default=5.0, help="seconds dead")
    parser.add_argument("--tail", type=float, default=10.0, help="seconds after the restart")
    parser.add_argument("--runs", type=int, default=3, help="kill/restart cycles")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the logs here")
    parser.add_argument("--quick", action="store_true", help="a short run, for a smoke check")
    args = parser.parse_args(argv)
    if args.quick:
        args.rate, args.warmup, args.restart_after, args.tail, args.runs = 30, 3, 2, 4, 1

    async def run() -> list[dict[str, object]]:
        runs = []
        with tempfile.TemporaryDirectory(prefix="failover-bench-") as tmp:
            workdir = args.workdir or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            async with failover_stack(workdir) as stack:
                for n in range(args.runs):
                    cpu_before = cpu_seconds(stack.envoy_pid)
                    measured = await kill_one_of_three(
                        stack,
                        rate=args.rate,
                        warmup_s=args.warmup,
                        restart_after_s=args.restart_after,
                        tail_s=args.tail,
                    )
                    measured["envoy_cpu_s"] = round(cpu_seconds(stack.envoy_pid) - cpu_before, 2)
                    print(f"run {n + 1}: {json.dumps(measured)}", flush=True)
                    runs.append(measured)
        return runs

    runs = asyncio.run(run())
    results = {
        "benchmark": "replica_failover",
        "what": "one of 3 `epp serve` replicas SIGKILLed while an open-loop client sends "
        "completions through the real Envoy (fail-open, buffered bodies, replicas "
        "health-checked every 1 s, outlier detection) to 3 `epp sim` pods; the replica is "
        "restarted on the same ports. Latency windows compare against the same run's "
        "pre-kill window.",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end (shared with other work)",
        "command": "python benchmarks/replica_failover.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

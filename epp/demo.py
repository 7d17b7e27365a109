"""`epp demo`: the whole gateway on one machine in about a minute.

1. starts 4 simulated vLLM pods, `epp serve` and the real Envoy, each its own process;
2. replays a short shared-prefix workload live through Envoy, with a progress bar;
3. compares smart-epp's `default` scheduling with round-robin and the Gateway API
   Inference Extension's default in the replay simulator on a slice of the Mooncake trace.

Every process it starts runs in its own session and is stopped on the way out, whether
the demo finishes, fails, or is interrupted with Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console

from .ports import free_port, free_port_block

DEMO_MODEL = "demo-model"
MOONCAKE_TRACE = (
    Path(__file__).resolve().parents[1]
    / "benchmarks"
    / "traces"
    / ("mooncake_synthetic_trace.jsonl")
)
SIM_POLICIES = ("default", "round-robin", "gie-default")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo",
        help="start sim pods + epp + Envoy, replay traffic live, then compare policies",
        description=__doc__,
    )
    p.add_argument("--pods", type=int, default=4, help="simulated pods behind Envoy")
    p.add_argument("--requests", type=int, default=48, help="live requests to replay")
    p.add_argument("--qps", type=float, default=8.0, help="live request rate")
    p.add_argument(
        "--sim-requests", type=int, default=1000, help="Mooncake requests in the comparison"
    )
    p.add_argument("--sim-speedup", type=float, default=2.5, help="Mooncake time compression")
    p.add_argument("--trace", type=Path, default=MOONCAKE_TRACE, help="trace for the comparison")
    p.add_argument("--skip-live", action="store_true", help="only the simulated comparison")
    p.add_argument("--skip-sim", action="store_true", help="only the live replay")
    p.add_argument("--out", type=Path, default=None, help="also write results here")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------ processes


class StartupError(RuntimeError):
    """A demo process did not come up; the message carries the end of its log."""


@dataclass
class ManagedProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class ProcessGroup:
    """The processes the demo started; `stop_all` ends exactly these, newest first."""

    workdir: Path
    processes: list[ManagedProcess] = field(default_factory=list)

    def start(self, name: str, argv: list[str]) -> ManagedProcess:
        log_path = self.workdir / f"{name}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own session: Ctrl-C reaches only the demo, which then stops it cleanly.
                start_new_session=True,
            )
        managed = ManagedProcess(name, proc, log_path)
        self.processes.append(managed)
        # Written down so an operator (or a test) can check that nothing outlives the demo.
        with (self.workdir / "pids.txt").open("a") as pids:
            pids.write(f"{name} {proc.pid}\n")
        return managed

    def stop_all(self, timeout_s: float = 5.0) -> None:
        for managed in reversed(self.processes):
            proc = managed.process
            if proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for managed in reversed(self.processes):
            proc = managed.process
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_for(
    what: str,
    ready: Callable[[], bool],
    watched: ManagedProcess,
    timeout_s: float = 30.0,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if not watched.alive():
            raise StartupError(
                f"{watched.name} exited with {watched.process.returncode} while starting "
                f"{what}:\n{watched.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise StartupError(f"{what} not ready after {timeout_s:.0f}s:\n{watched.log_tail()}")
        time.sleep(0.05)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            status: int = resp.status  # urlopen's result is untyped
            return status == 200
    except (urllib.error.URLError, OSError):
        return False


def post_ok(url: str, body: bytes) -> bool:
    req = urllib.request.Request(
        url, data=body, headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            resp.read()
            status: int = resp.status  # urlopen's result is untyped
            return status == 200
    except (urllib.error.URLError, OSError):
        return False


def epp_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", "from smart_epp.epp.cli import main; main()", *args]


@dataclass(frozen=True, slots=True)
class Stack:
    envoy_url: str
    pod_addresses: list[str]


@contextlib.contextmanager
def running_stack(pods: int, console: Console) -> Iterator[Stack]:
    """Sim pods, epp and Envoy, each a process; all stopped when the block ends."""
    from .envoy_cmd import EnvoyOptions, envoy_command, render_envoy_config

    workdir = Path(tempfile.mkdtemp(prefix="epp-demo-"))
    group = ProcessGroup(workdir)
    try:
        # One block for the HTTP, KV PUB and replay ports: two blocks picked one after
        # the other can overlap, since neither is held until the pods bind it.
        http_base = free_port_block(3 * pods)
        kv_base = http_base + pods  # PUB ports, then replay ports
        console.print(f"[bold]starting[/bold] {pods} simulated vLLM pods (h100-llama3-8b) ...")
        sim = group.start(
            "sim",
            epp_argv(
                "sim",
                "--pods",
                str(pods),
                "--base-port",
                str(http_base),
                "--model",
                DEMO_MODEL,
                "--kv-events-port",
                str(kv_base),
            ),
        )
        addresses = [f"127.0.0.1:{http_base + i}" for i in range(pods)]
        for address in addresses:
            wait_for(f"pod {address}", functools.partial(http_ok, f"http://{address}/health"), sim)
        grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
        console.print("[bold]starting[/bold] epp (ext_proc gRPC) ...")
        serve_args = [
            "serve",
            "--grpc-port",
            str(grpc_port),
            "--health-port",
            str(health_port),
            "--metrics-port",
            str(metrics_port),
            "--log-level",
            "warning",
        ]
        # An endpoints file names each pod's KV-event and replay sockets, which the
        # --endpoint flag cannot.
        endpoints_file = workdir / "endpoints.yaml"
        endpoints_file.write_text(
            yaml.safe_dump(
                {
                    "endpoints": [
                        {
                            "address": address,
                            "kv_events": f"tcp://127.0.0.1:{kv_base + i}",
                            "kv_replay": f"tcp://127.0.0.1:{kv_base + pods + i}",
                            "labels": {"model": DEMO_MODEL},
                        }
                        for i, address in enumerate(addresses)
                    ]
                }
            )
        )
        serve_args += ["--endpoints-file", str(endpoints_file)]
        epp = group.start("epp", epp_argv(*serve_args))
        wait_for("epp", lambda: http_ok(f"http://127.0.0.1:{metrics_port}/metrics"), epp)
        console.print("[bold]starting[/bold] Envoy ...")
        options = EnvoyOptions(
            listen_port=free_port(),
            epp_port=grpc_port,
            admin_port=free_port(),
            listen_address="127.0.0.1",
        )
        config_path = workdir / "envoy.yaml"
        config_path.write_text(render_envoy_config(options))
        envoy = group.start("envoy", envoy_command(config_path, concurrency=1))
        admin = f"http://127.0.0.1:{options.admin_port}/ready"
        wait_for("Envoy", lambda: http_ok(admin), envoy)
        url = f"http://127.0.0.1:{options.listen_port}"
        probe = b'{"model":"' + DEMO_MODEL.encode() + b'","prompt":"hello","max_tokens":1}'
        wait_for("a request through Envoy", lambda: post_ok(f"{url}/v1/completions", probe), envoy)
        console.print(f"gateway ready at {url} (logs in {workdir})\n")
        yield Stack(url, addresses)
    finally:
        group.stop_all()


# ------------------------------------------------------------------------------ stages


def live_stage(stack: Stack, args: argparse.Namespace, console: Console) -> bool:
    from ..benchmarks.replay.arrivals import poisson_arrivals
    from ..benchmarks.replay.cli import progress_bar
    from ..benchmarks.replay.live import LiveOptions, run_live, served_requests
    from ..benchmarks.replay.report import render_table, summarize
    from ..benchmarks.replay.traces import SharedPrefixSpec, generate_shared_prefix

    groups = max(1, args.requests // 6)
    spec = SharedPrefixSpec(
        num_groups=groups,
        num_prompts_per_group=6,
        system_prompt_len=1500,
        question_len=100,
        output_len=32,
    )
    requests = generate_shared_prefix(spec, seed=args.seed, model=DEMO_MODEL)[: args.requests]
    arrivals = poisson_arrivals(len(requests), args.qps, args.seed)
    console.print(
        f"[bold]live replay[/bold]: {len(requests)} requests ({groups} groups sharing "
        f"1,500-token system prompts) at {args.qps:g} req/s through Envoy -> epp -> pods"
    )
    before = asyncio.run(served_requests(stack.pod_addresses))
    with progress_bar(console) as progress:
        task = progress.add_task("live via Envoy", total=len(requests))
        results = asyncio.run(
            run_live(
                requests,
                arrivals,
                LiveOptions(target=stack.envoy_url, concurrency=32),
                on_done=lambda _: progress.advance(task),
            )
        )
    after = asyncio.run(served_requests(stack.pod_addresses))
    per_pod = {a: int(after[a] - before.get(a, 0.0)) for a in stack.pod_addresses}
    summary = summarize(results, [])
    mean = sum(per_pod.values()) / len(per_pod)
    summary.load_imbalance = max(per_pod.values()) / mean if mean else 0.0
    console.print(render_table({"epp (live)": summary}, None, "live, measured by the client"))
    console.print(
        "requests per pod (from each pod's /metrics): "
        + ", ".join(f"{a}={n}" for a, n in per_pod.items())
    )
    failed = [r for r in results if not r.ok]
    if failed:
        console.print(f"[red]{len(failed)} requests failed[/red]: {failed[0].status}")
    return not failed


def sim_stage(args: argparse.Namespace, console: Console) -> None:
    from ..benchmarks.replay.arrivals import scaled_arrivals
    from ..benchmarks.replay.cli import (
        Workload,
        progress_bar,
        simulate_policy,
    )
    from ..benchmarks.replay.report import render_table, results_json, summarize
    from ..benchmarks.replay.report import write_json as write_results
    from ..benchmarks.replay.sim import SimConfig, pod_address
    from ..benchmarks.replay.traces import infinite_cache_hit_rate, load_mooncake

    requests = load_mooncake(args.trace, limit=args.sim_requests)
    workload = Workload(requests, scaled_arrivals(requests, args.sim_speedup))
    pods = 8
    # Mooncake's prompts reach 191k tokens: a 128k-context model serves most of them, and
    # the pods refuse the rest as vLLM would (the table counts them as rejected).
    config = SimConfig(pods=pods, profile="h100-llama3.1-8b-128k")
    console.print(
        f"\n[bold]simulated comparison[/bold]: {len(requests)} Mooncake requests at "
        f"{args.sim_speedup:g}x speed on {pods} simulated H100 pods, same scheduler code"
    )
    per_policy = {}
    with progress_bar(console) as progress:
        for name in SIM_POLICIES:
            per_policy[name] = simulate_policy(name, workload, config, args.seed, progress)
    addresses = [pod_address(i) for i in range(pods)]
    summaries = {name: summarize(rs, addresses) for name, rs in per_policy.items()}
    ceiling = infinite_cache_hit_rate(requests, config.block_size)
    console.print(render_table(summaries, ceiling, f"{args.trace.name}: sim, {pods} pods"))
    if args.out is not None:
        doc = results_json(str(args.trace), pods, config.profile, summaries, ceiling=ceiling)
        write_results(doc, args.out / "demo_sim.json")


def run(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 150)
    started = time.monotonic()
    ok = True
    try:
        if not args.skip_live:
            with running_stack(args.pods, console) as stack:
                ok = live_stage(stack, args, console)
        if not args.skip_sim:
            sim_stage(args, console)
    except (StartupError, OSError) as exc:
        console.print(f"[red]demo could not start:[/red] {exc}")
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        # Only Ctrl-C cancels an asyncio.run main task here; Python 3.11's asyncio.run
        # reports a Ctrl-C that lands while it installs its SIGINT handler as the task's
        # CancelledError instead of KeyboardInterrupt.
        console.print("\ninterrupted; every demo process has been stopped")
        return 130
    console.print(f"\ndemo finished in {time.monotonic() - started:.0f}s")
    return 0 if ok else 1

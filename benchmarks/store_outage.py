"""Kill the shared pool-state store under load, bring it back, and watch the pickers.

Everything is a real process: `epp sim` pods (one process), three `epp serve` replicas
sharing pool state (`--shared-state redis`) through one Valkey on a TCP port, and the real
Envoy in front (fail-open, as `replica_failover.py` starts them). An open-loop client sends
completions of shared-prefix prompts at a fixed rate through Envoy; after `--warmup`
seconds the store is SIGKILLed, and after `--outage` seconds a fresh one starts on the same
port (empty: what a restarted store without persistence holds). Measured in the same run:

- requests that failed (not 200, or a transport error), in each phase;
- latency percentiles before, during and after the outage;
- routing quality: the share of prompt tokens the pods served from their prefix cache
  (the response's `usage.prompt_tokens_details.cached_tokens`), per second, and how long
  after the store returns it is back within 2 points of its pre-outage level;
- each replica's `smart_epp_shared_state_up` and transitions, from its /metrics.

    .venv/bin/python benchmarks/store_outage.py [--rate 50] [--outage 10] [--runs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smart_epp.benchmarks.replica_failover import (
    Sent,
    Stack,
    failover_stack,
    metric_sum,
    open_loop,
    wait_until,
    window,
)
from smart_epp.epp.ports import free_port, port_open
from smart_epp.epp.processes import stop_process
from smart_epp.epp.shared_state.private_store import server_command

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "store_outage.json"
RECOVERED_WITHIN = 0.02  # cached-token share within 2 points of the pre-outage level
BIN_S = 1.0


class Store:
    """Valkey on a fixed TCP port, so a restart is found where the pickers look."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = server_command(self.workdir, port=self.port)
        with (self.workdir / "valkey.log").open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 5)


def cached_share(sent: list[Sent], start: float, end: float) -> float | None:
    answered = [s for s in sent if start <= s.at < end and s.status == 200]
    prompt = sum(s.prompt_tokens for s in answered)
    return None if prompt == 0 else sum(s.cached_tokens for s in answered) / prompt


async def replicas_up(stack: Stack) -> list[float]:
    pages = [await r.metrics(stack.http) or "" for r in stack.replicas]
    return [metric_sum(page, "smart_epp_shared_state_up") for page in pages]


async def store_outage(
    stack: Stack, store: Store, *, rate: float, warmup_s: float, outage_s: float, tail_s: float
) -> dict[str, object]:
    sent: list[Sent] = []
    started = time.monotonic()
    finished = asyncio.Event()
    finished.set()  # the load stops at its planned end
    duration = warmup_s + outage_s + tail_s
    load = asyncio.create_task(open_loop(stack, rate, duration, 4, sent, finished, 0.0))
    await asyncio.sleep(warmup_s)
    store.kill()
    killed_at = time.monotonic()
    # Every replica notices (its sync fails) and routes on local state.
    down_seen: float | None = None
    while time.monotonic() - killed_at < outage_s:
        if down_seen is None and all(u == 0 for u in await replicas_up(stack)):
            down_seen = time.monotonic()
        await asyncio.sleep(0.1)
    store.start()
    returned_at = time.monotonic()
    await wait_until(lambda: port_open(store.port), 10, "the store back")
    up_again: float | None = None
    while time.monotonic() - returned_at < tail_s:
        if up_again is None and all(u == 1 for u in await replicas_up(stack)):
            up_again = time.monotonic()
        await asyncio.sleep(0.1)
    await load
    failed = [s for s in sent if s.status != 200]

    def phase(s: Sent) -> str:
        return "before" if s.at < killed_at else "during" if s.at < returned_at else "after"

    baseline = cached_share(sent, killed_at - 5.0, killed_at)
    bins = []
    t = returned_at
    while t < returned_at + tail_s:
        bins.append((round(t - returned_at, 1), cached_share(sent, t, t + BIN_S)))
        t += BIN_S
    recovered_after: float | None = None
    if baseline is not None:
        for i, (offset, _share) in enumerate(bins):
            rest = [b for _, b in bins[i:] if b is not None]
            if rest and all(b >= baseline - RECOVERED_WITHIN for b in rest):
                recovered_after = offset
                break
    during = [(round(t - killed_at, 1), cached_share(sent, t, t + BIN_S))
              for t in (killed_at + k * BIN_S for k in range(int(outage_s)))]  # fmt: skip

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "rate_req_per_s": rate,
        "requests": len(sent),
        "achieved_send_rate_req_per_s": round(len(sent) / max(1e-9, duration), 1),
        "failed": {
            p: sum(1 for s in failed if phase(s) == p) for p in ("before", "during", "after")
        },
        "failure_examples": sorted({s.error for s in failed})[:3],
        "kill_to_every_replica_local_s": None
        if down_seen is None
        else round(down_seen - killed_at, 2),
        "return_to_every_replica_shared_s": None
        if up_again is None
        else round(up_again - returned_at, 2),
        "cached_token_share": {
            "5s_before_kill": rounded(baseline),
            "during_outage": rounded(cached_share(sent, killed_at, returned_at)),
            "first_5s_after_return": rounded(cached_share(sent, returned_at, returned_at + 5)),
            "per_second_during_outage": [(o, rounded(b)) for o, b in during],
            "per_second_after_return": [(o, rounded(b)) for o, b in bins],
        },
        "recovered_within_2_points_s_after_return": recovered_after,
        "latency": {
            "before": window(sent, started, killed_at),
            "during": window(sent, killed_at, returned_at),
            "after": window(sent, returned_at, float("inf")),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before the kill")
    parser.add_argument("--outage", type=float, default=10.0, help="seconds without a store")
    parser.add_argument("--tail", type=float, default=15.0, help="seconds after it returns")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a short run, for a smoke check")
    args = parser.parse_args(argv)
    if args.quick:
        args.rate, args.warmup, args.outage, args.tail = 20, 6, 3, 6

    async def run() -> list[dict[str, object]]:
        runs = []
        with tempfile.TemporaryDirectory(prefix="store-outage-") as tmp:
            workdir = Path(tmp)
            store = Store(workdir)
            store.start()
            try:
                await wait_until(lambda: port_open(store.port), 10, "the store")
                shared = ("--shared-state", "redis", "--redis-url", store.url)
                async with failover_stack(workdir, serve_args=shared) as stack:
                    for n in range(args.runs):
                        measured = await store_outage(
                            stack, store, rate=args.rate, warmup_s=args.warmup,
                            outage_s=args.outage, tail_s=args.tail,
                        )  # fmt: skip
                        print(f"run {n + 1}: {json.dumps(measured)}", flush=True)
                        runs.append(measured)
            finally:
                store.stop()
        return runs

    runs = asyncio.run(run())
    results = {
        "benchmark": "store_outage",
        "what": "the shared pool-state store (Valkey) of 3 `epp serve` replicas SIGKILLed "
        "while an open-loop client sends shared-prefix completions through the real Envoy "
        "(fail-open) to 3 `epp sim` pods; a fresh, empty store starts on the same port "
        "after the outage. Quality: the pods' cached share of prompt tokens.",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end",
        "command": "python benchmarks/store_outage.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "median_failed_during": statistics.median(
            [r["failed"]["during"] for r in runs]  # type: ignore[index]
        )
        if runs
        else None,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

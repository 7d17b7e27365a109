"""`epp demo` as a user runs it: real processes (sim pods, epp, Envoy), all gone after."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.net import wait_until

from smart_epp.epp.demo import ProcessGroup

DEMO = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()", "demo"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it no longer runs anything.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _started_pids(output: str) -> list[int]:
    match = re.search(r"logs in (\S+?)\)", output)
    assert match, output
    lines = (Path(match.group(1)) / "pids.txt").read_text().split("\n")
    return [int(line.split()[1]) for line in lines if line.strip()]


def test_process_group_stops_what_it_started(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    # A child that ignores SIGTERM must still be gone after stop_all (SIGKILL follows).
    ignore_term = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    stubborn = group.start("stubborn", [sys.executable, "-c", ignore_term])
    polite = group.start("polite", [sys.executable, "-c", "import time; time.sleep(60)"])
    wait_until(lambda: "up" in stubborn.log_path.read_text(), 10, "child ready")
    group.stop_all(timeout_s=1.0)
    assert not _alive(stubborn.process.pid) and not _alive(polite.process.pid)
    assert (tmp_path / "pids.txt").read_text().count("\n") == 2


@pytest.mark.envoy
def test_demo_live_stage_runs_and_cleans_up() -> None:
    proc = subprocess.run(
        [*DEMO, "--skip-sim", "--requests", "12", "--qps", "6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "12/12" in out and "requests per pod" in out
    pids = _started_pids(out)
    assert len(pids) == 3  # sim pods, epp, Envoy
    assert not any(_alive(pid) for pid in pids)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.envoy
def test_demo_interrupted_stops_every_process() -> None:
    proc = subprocess.Popen(
        [*DEMO, "--skip-sim", "--requests", "600", "--qps", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Ctrl-C as a terminal delivers it, however the suite was started: a shell that
        # runs the suite in the background hands its children SIGINT ignored.
        preexec_fn=_sigint_default,
    )
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + 90
    while "live replay" not in seen and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    assert "live replay" in seen, seen
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    out = seen + rest
    assert proc.returncode == 130, out
    pids = _started_pids(out)
    assert len(pids) == 3
    assert not any(_alive(pid) for pid in pids)


def test_an_interrupt_reported_as_a_cancelled_task_exits_as_an_interrupt(monkeypatch) -> None:
    """Python 3.11's asyncio.run turns a Ctrl-C that lands while it installs its SIGINT
    handler into its task's CancelledError; the demo still stops and exits 130."""
    import asyncio
    import contextlib

    from smart_epp.epp import demo
    from smart_epp.epp.cli import build_parser

    stopped: list[bool] = []

    @contextlib.contextmanager
    def stack(pods, console):
        try:
            yield None
        finally:
            stopped.append(True)

    def cancelled(stack, args, console):
        raise asyncio.CancelledError

    monkeypatch.setattr(demo, "running_stack", stack)
    monkeypatch.setattr(demo, "live_stage", cancelled)
    args = build_parser().parse_args(["demo", "--skip-sim"])
    assert demo.run(args) == 130
    assert stopped == [True]

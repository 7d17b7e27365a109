"""The process handling the real-vLLM tier relies on to never leave a pod running."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.net import wait_until
from vllm_pods import (
    VllmPod,
    completion_body,
    dev_mode_pod_config,
    die_with_parent,
    group_members,
    start_pods,
    stop_process_group,
    unique_prompt,
)

pytestmark = pytest.mark.real_vllm

# A parent that ignores SIGTERM and two children, like a server that hangs on shutdown.
STUBBORN_TREE = "trap '' TERM; sleep 300 & sleep 300 & wait"


def test_stop_process_group_ends_the_whole_tree_even_when_sigterm_is_ignored() -> None:
    tree = subprocess.Popen(["bash", "-c", STUBBORN_TREE], start_new_session=True)
    wait_until(lambda: len(group_members(tree.pid)) == 3, what="the tree to start")
    stop_process_group(tree, grace_s=0.5)
    assert tree.returncode == -signal.SIGKILL
    assert group_members(tree.pid) == []


def _command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


@pytest.mark.skipif(not die_with_parent(), reason="setpriv (util-linux) is not installed")
def test_process_started_by_a_killed_parent_dies_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    parent_code = (
        "import subprocess, sys, time;"
        f"child = subprocess.Popen({[*die_with_parent(), 'sleep', '300']!r});"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid));"
        "time.sleep(300)"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", what="the child")
    child = int(pid_file.read_text())
    # setpriv asks for the signal just before it becomes `sleep`: a parent killed earlier
    # would leave a child that never asked.
    wait_until(lambda: _command_of(child) == "sleep", what="setpriv to exec the child")
    parent.kill()  # no handler, no atexit: only the parent-death signal can stop the child
    parent.wait()

    def child_gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        # A zombie waiting for init to reap it is gone too.
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
        except FileNotFoundError:
            return True
        return stat.rsplit(")", 1)[1].split()[0] == "Z"

    wait_until(child_gone, timeout=10, what="the orphaned child to exit")


@pytest.fixture(scope="module")
def quick_sleeping_pod(
    vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmPod]:
    config = dataclasses.replace(dev_mode_pod_config("quick-sleep"), worker_busy_loop_s=0.05)
    pod = VllmPod(config, vllm_python, tmp_path_factory.mktemp("vllm-quick-sleep-logs"))
    start_pods([pod])
    try:
        yield pod
    finally:
        pod.stop()


def test_a_pod_told_to_poll_50_ms_stops_using_cpu_soon_after_its_last_request(
    quick_sleeping_pod: VllmPod,
) -> None:
    # vLLM's worker polls in a loop for 1 s after each step; deploy/vllm/vllm_launcher.py
    # shortens that, so that idle pods leave a small host's cores to the gateway and the
    # other pods. With vLLM's 1 s, the second below costs about 0.8 s of CPU.
    pod = quick_sleeping_pod
    pod.post_json("/v1/completions", completion_body(unique_prompt("idle-cpu"), max_tokens=2))
    time.sleep(0.2)  # past the 50 ms poll and the response's own bookkeeping
    before = pod.cpu_seconds()
    time.sleep(1.0)  # the interval measured, not a wait for a condition
    assert pod.cpu_seconds() - before < 0.3

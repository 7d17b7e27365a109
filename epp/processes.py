"""Ending a child process: politely first, then for sure."""

from __future__ import annotations

import subprocess


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within `timeout_s`; returns
    once it is gone (a process that already exited is left as it is)."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

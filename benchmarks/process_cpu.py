"""CPU time of the processes a benchmark starts, from Linux /proc."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (raises OSError once it is gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of stat(5); the split starts at field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and of every live process below it (`epp serve --workers`:
    the supervisor, its workers and their private store)."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            total += cpu_seconds(current)
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


__all__ = ["cpu_seconds", "tree_cpu_seconds"]

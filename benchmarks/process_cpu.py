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
    the supervisor, its workers and their private store). Raises OSError, as
    `cpu_seconds` does, once the process itself is gone; a child may end meanwhile."""
    total = cpu_seconds(pid)
    pending = _children(pid)
    while pending:
        current = pending.pop()
        try:
            total += cpu_seconds(current)
            pending += _children(current)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


__all__ = ["cpu_seconds", "tree_cpu_seconds"]

"""A configuration file that is re-read whenever it changes on disk.

Changes are noticed from the file's inode, modification time and size (a ConfigMap update
swaps a symlink, which changes the inode). A version that fails to load is counted and
logged, and the last good one stays in force.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class WatchedFile:
    """Subclasses say what the file holds (`what`), which errors mean a bad version
    (`load_errors`), and apply a good one in `load`."""

    what = "file"
    load_errors: tuple[type[Exception], ...] = (ValueError,)

    def __init__(self, path: Path, on_error: Callable[[Exception], None] | None = None) -> None:
        self.path = path
        self.on_error = on_error
        self.reloads = 0
        self.errors = 0
        self._signature: tuple[int, int, int] | None = None

    def load(self, text: str) -> None:
        raise NotImplementedError

    def missing(self) -> Exception:
        """The error for a file that is gone (its last version stays in force)."""
        return FileNotFoundError(f"{self.path}: file is missing; keeping the last {self.what}")

    def _stat_signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(self) -> bool:
        """Reloads when the file changed since the last look; True when a version applied."""
        signature = self._stat_signature()
        if signature == self._signature:
            return False
        self._signature = signature
        # Named up front: type checkers do not follow a starred tuple in an `except` clause.
        errors: tuple[type[Exception], ...] = (OSError, *self.load_errors)
        try:
            if signature is None:
                raise self.missing()
            self.load(self.path.read_text())
        except errors as exc:
            self.errors += 1
            log.warning("%s not applied: %s", self.what, exc)
            if self.on_error is not None:
                self.on_error(exc)
            return False
        self.reloads += 1
        return True

    async def run(self, interval_s: float) -> None:
        while True:
            self.poll()
            await asyncio.sleep(interval_s)

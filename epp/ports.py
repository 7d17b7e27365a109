"""Picking free local TCP ports, for processes this tool starts on one machine, and
telling when one of them listens."""

from __future__ import annotations

import socket
import threading

# Ports handed out lately by this process. The kernel may give the same free port to two
# binds of port 0 in a row (it is free again as soon as the probe socket closes), and the
# callers here pick several ports before any process binds them: two of one pod's
# sockets, or two pods, then collide. A port is not handed out again while it is among
# the last RECENT_PORTS picked.
RECENT_PORTS = 4096
_recent: dict[int, None] = {}  # in the order handed out (dicts keep insertion order)
_lock = threading.Lock()


def free_port() -> int:
    """A port free now and not handed out lately by this process."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        with _lock:
            if port in _recent:
                continue
            if len(_recent) >= RECENT_PORTS:
                del _recent[next(iter(_recent))]
            _recent[port] = None
            return port
    raise OSError("no free port that was not handed out lately")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on the port (waits at most 0.2 s)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def free_port_block(count: int, attempts: int = 50) -> int:
    """First of `count` consecutive free ports, for tools that bind base+i."""
    for _ in range(attempts):
        base = free_port()
        if base + count > 65_535:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise OSError(f"no block of {count} consecutive free ports")

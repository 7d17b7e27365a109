"""Picking free local TCP ports, for processes this tool starts on one machine, and
telling when one of them listens."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

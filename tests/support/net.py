"""Small networking helpers for tests: free ports and waiting on conditions."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import Awaitable, Callable

from smart_epp.epp.ports import free_port, free_port_block, port_open

__all__ = [
    "async_wait_until",
    "free_port",
    "free_port_block",
    "free_port_run",
    "port_open",
    "wait_until",
]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Polls `predicate` until it holds; raises with `what` when it never does."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(0.02)


# A poll deadline, not a cancellation scope: the predicate is cheap and must not be cancelled
# halfway, so asyncio.timeout() does not fit here.
async def async_wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10.0,  # noqa: ASYNC109
    what: str = "",
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(0.02)


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports below the kernel's ephemeral range.

    A restarted pod binds its KV ports again while sockets keep reconnecting to them; a
    port inside the ephemeral range can meanwhile be taken as a reconnecting socket's
    own source port (a TCP self-connect), and the rebind then fails.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 32_000 - count)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports")

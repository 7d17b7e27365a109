"""Start and stop the real Envoy binary in front of an epp, for tests and benchmarks.

with running_envoy(epp_port=..., body_mode="buffered") as envoy:   # epp in another process
    ...
async with async_running_envoy(epp_port=server.grpc_port) as envoy:   # epp on this loop
    await client.post(f"{envoy.url}/v1/completions", json=...)
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from smart_epp.epp.envoy_cmd import EnvoyOptions, envoy_command, render_envoy_config
from smart_epp.epp.processes import stop_process
from support.net import free_port


@dataclass
class EnvoyProcess:
    process: subprocess.Popen[bytes]
    options: EnvoyOptions
    config_path: Path
    log_path: Path

    @property
    def listen_port(self) -> int:
        return self.options.listen_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.options.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.options.admin_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges, e.g. stats("http.inference_gateway.ext_proc")."""
        with urllib.request.urlopen(f"{self.admin_url}/stats?filter={prefix}", timeout=5) as r:
            text = r.read().decode()
        result: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                result[name] = int(value)
        return result

    def epp_healthy(self) -> bool:
        """Whether Envoy's active health check currently sees the picker as healthy."""
        with urllib.request.urlopen(f"{self.admin_url}/clusters", timeout=5) as r:
            text = r.read().decode()
        flags = [
            line
            for line in text.splitlines()
            if line.startswith("epp::") and "health_flags" in line
        ]
        return bool(flags) and all(line.endswith("::healthy") for line in flags)

    def stop(self) -> None:
        stop_process(self.process, 10)


def _ready(admin_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _launch(
    options: EnvoyOptions | None,
    concurrency: int,
    workdir: Path | None,
    overrides: dict[str, object],
) -> EnvoyProcess:
    options = replace(options or EnvoyOptions(), **overrides)  # type: ignore[arg-type]
    if "listen_port" not in overrides:
        options = replace(options, listen_port=free_port())
    if "admin_port" not in overrides:
        options = replace(options, admin_port=free_port())
    options = replace(options, listen_address="127.0.0.1")
    directory = workdir or Path(tempfile.mkdtemp(prefix="epp-envoy-"))
    config_path = directory / "envoy.yaml"
    log_path = directory / "envoy.log"
    config_path.write_text(render_envoy_config(options))
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            envoy_command(config_path, concurrency=concurrency),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return EnvoyProcess(process, options, config_path, log_path)


def _check_started(envoy: EnvoyProcess, deadline: float, timeout: float) -> None:
    if envoy.process.poll() is not None:
        raise RuntimeError(f"Envoy exited with {envoy.process.returncode}:\n{envoy.log()}")
    if time.monotonic() > deadline:
        envoy.stop()
        raise TimeoutError(f"Envoy not ready after {timeout}s:\n{envoy.log()}")


def start_envoy(
    options: EnvoyOptions | None = None,
    *,
    concurrency: int = 1,
    startup_timeout: float = 15.0,
    workdir: Path | None = None,
    **overrides: object,
) -> EnvoyProcess:
    """Starts Envoy (free listen/admin ports unless given) and waits until it is ready.

    Blocks the calling thread: an epp served from the same event loop would miss Envoy's
    first health check; use `async_running_envoy` there.
    """
    envoy = _launch(options, concurrency, workdir, overrides)
    deadline = time.monotonic() + startup_timeout
    while not _ready(envoy.options.admin_port):
        _check_started(envoy, deadline, startup_timeout)
        time.sleep(0.02)
    return envoy


@contextlib.asynccontextmanager
async def async_running_envoy(
    options: EnvoyOptions | None = None,
    *,
    concurrency: int = 1,
    startup_timeout: float = 15.0,
    wait_for_epp: bool = True,
    **overrides: object,
) -> AsyncIterator[EnvoyProcess]:
    """Envoy for an `async with` block, without blocking the event loop (an epp on the
    same loop keeps answering). With `wait_for_epp`, waits until Envoy's health check
    sees the picker, so the first request is not refused."""
    envoy = _launch(options, concurrency, None, overrides)
    try:
        deadline = time.monotonic() + startup_timeout
        while not await asyncio.to_thread(_ready, envoy.options.admin_port):
            _check_started(envoy, deadline, startup_timeout)
            await asyncio.sleep(0.02)
        while wait_for_epp and not await asyncio.to_thread(envoy.epp_healthy):
            _check_started(envoy, deadline, startup_timeout)
            await asyncio.sleep(0.02)
        yield envoy
    finally:
        await asyncio.to_thread(envoy.stop)


@contextlib.contextmanager
def running_envoy(
    options: EnvoyOptions | None = None, *, concurrency: int = 1, **overrides: object
) -> Iterator[EnvoyProcess]:
    """Envoy for the duration of a `with` block; see `start_envoy` for the arguments."""
    envoy = start_envoy(options, concurrency=concurrency, **overrides)
    try:
        yield envoy
    finally:
        envoy.stop()

"""`epp serve` and `epp envoy` as the processes tooling runs, flags as documented."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.backends import echo_backends
from support.net import async_wait_until, free_port, port_open

pytestmark = pytest.mark.envoy

EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]


@contextmanager
def process(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def write_pool(path: Path, addresses: list[str]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump({"endpoints": [{"address": a} for a in addresses]}))
    os.replace(temporary, path)


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_print_config_renders_the_flags() -> None:
    out = subprocess.run(
        [*EPP, "envoy", "--print-config", "--listen-port", "8123", "--epp-port", "9123",
         "--body-mode", "buffered", "--failure-mode", "open", "--max-body-bytes", "1000",
         "--admin-port", "9901"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    config = yaml.safe_load(out)
    listener = config["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == 8123
    assert listener["per_connection_buffer_limit_bytes"] == 1000
    assert config["admin"]["address"]["socket_address"]["port_value"] == 9901
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["typed_config"]["failure_mode_allow"] is True
    assert ext_proc["typed_config"]["processing_mode"]["request_body_mode"] == "BUFFERED"
    epp = next(c for c in config["static_resources"]["clusters"] if c["name"] == "epp")
    endpoint = epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9123}


def test_bad_flags_are_refused() -> None:
    result = subprocess.run(
        [*EPP, "serve", "--endpoint", "no-port"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "HOST:PORT" in result.stderr
    result = subprocess.run(
        [*EPP, "envoy", "--print-config", "--endpoint", "host.example:80"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2 and "IP:PORT" in result.stderr


async def test_serve_and_envoy_processes_route_and_follow_the_endpoints_file(
    tmp_path: Path,
) -> None:
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    listen_port, admin_port = free_port(), free_port()
    pool = tmp_path / "pool.yaml"
    async with echo_backends(3) as backends:
        write_pool(pool, [backends[0].address])
        serve = [*EPP, "serve", "--grpc-port", str(grpc_port), "--health-port", str(health_port),
                 "--metrics-port", str(metrics_port), "--endpoints-file", str(pool)]  # fmt: skip
        envoy = [*EPP, "envoy", "--listen-port", str(listen_port), "--epp-port", str(grpc_port),
                 "--admin-port", str(admin_port), "--concurrency", "1"]  # fmt: skip
        with process(serve, tmp_path / "epp.log"), process(envoy, tmp_path / "envoy.log"):
            # Imports alone take seconds on a loaded machine.
            await async_wait_until(lambda: port_open(health_port), 30, "epp health port")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def status(service: str) -> int:
                    request = health_pb2.HealthCheckRequest(service=service)
                    return (await stub.Check(request)).status

                serving = health_pb2.HealthCheckResponse.SERVING
                assert await status("liveness") == serving
                # Ready once the KV index has caught up: these backends have no replay
                # socket that answers, which takes one replay timeout to find out.
                await async_wait_until(lambda: _is(status("readiness"), serving), 15, "epp ready")
                assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == serving

            url = f"http://127.0.0.1:{listen_port}/v1/completions"
            body = {"model": "tiny", "prompt": "hello"}
            async with aiohttp.ClientSession() as http:

                async def answered_by() -> str | None:
                    try:
                        async with http.post(url, json=body) as response:
                            if response.status != 200:
                                return None
                            return (await response.json())["backend"]
                    except aiohttp.ClientError:
                        return None

                await async_wait_until(lambda: answered_by(), timeout=20, what="gateway answering")
                assert {await answered_by() for _ in range(4)} == {backends[0].name}

                write_pool(pool, [backends[1].address, backends[2].address])

                async def moved() -> bool:
                    return await answered_by() in {backends[1].name, backends[2].name}

                await async_wait_until(moved, what="pool reloaded")
                seen = {await answered_by() for _ in range(6)}
                # Only the new pool answers (which of its two pods is the scheduler's call;
                # both being candidates shows in inference_pool_ready_pods below).
                assert seen and seen <= {backends[1].name, backends[2].name}

                async with http.post(url, data=b"{oops") as response:
                    assert response.status == 400

            text = metrics_text(metrics_port)
            assert 'inference_pool_ready_pods{name="default"} 2.0' in text
            assert (
                'inference_objective_request_total{model_name="tiny",target_model_name="tiny"}'
                in text
            )
            assert "inference_objective_request_error_total" in text
            assert 'error_code="400"' in text
            for name in (
                "inference_objective_request_duration_seconds_bucket",
                "inference_objective_input_tokens_bucket",
                "inference_objective_output_tokens_bucket",
                "inference_extension_scheduler_e2e_duration_seconds_bucket",
            ):
                assert name in text


async def _is(value: Awaitable[int], expected: int) -> bool:
    return await value == expected

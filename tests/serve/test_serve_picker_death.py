"""A routed request does not depend on the picker any more: `epp serve` SIGKILLed while
responses stream (real Envoy, real `epp serve` process, real HTTP backend), and every
response that had been routed still completes, in fail-close as well as fail-open; during
the outage fail-open keeps serving and fail-close answers an OpenAI-shaped 503; a picker
restarted on its ports takes over again."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import aiohttp
import pytest
from serve_stack import EPP, EppProcess, epp_process, sample, wait_started
from support.backends import SSE_CHUNKS, echo_backends
from support.envoy import EnvoyProcess, async_running_envoy
from support.net import async_wait_until

pytestmark = pytest.mark.envoy

STREAMS = 8


@pytest.mark.parametrize("failure_mode", ["close", "open"])
async def test_streams_complete_after_the_picker_is_killed(
    tmp_path: Path, failure_mode: str
) -> None:
    async with echo_backends(1) as (backend,):
        with epp_process(
            tmp_path / "epp.log", "--endpoint", backend.address, "--kv-events-mode", "off"
        ) as epp:
            await wait_started(epp)
            async with (
                async_running_envoy(epp_port=epp.grpc_port, failure_mode=failure_mode) as envoy,
                aiohttp.ClientSession() as http,
            ):
                # The access log reaches `epp serve`: a finished request's record matches.
                async with http.post(
                    f"{envoy.url}/v1/completions", json={"model": "tiny", "prompt": "hi"}
                ) as response:
                    assert response.status == 200

                async def recorded() -> bool:
                    page = await epp.metrics(http)
                    name = "smart_epp_access_log_records_total"
                    return sample(page, name, result="matched") == 1

                await async_wait_until(recorded, 10, "the access-log record")
                body = {"model": "tiny", "prompt": "long answer", "stream": True}
                headers = {"x-sse-delay-ms": "250"}  # about 1.5 s per stream
                responses = [
                    await http.post(f"{envoy.url}/v1/completions", json=body, headers=headers)
                    for _ in range(STREAMS)
                ]
                heads = []
                for response in responses:
                    assert response.status == 200
                    heads.append(await response.content.readline())  # streaming
                epp.process.send_signal(signal.SIGKILL)
                epp.process.wait(timeout=10)
                rests = await asyncio.gather(*(r.read() for r in responses))
                for head, rest in zip(heads, rests, strict=True):
                    text = (head + rest).decode()
                    assert text.endswith("data: [DONE]\n\n")
                    assert text.count('"text": "t') == SSE_CHUNKS
                completions = [r for r in backend.received if r.path == "/v1/completions"]
                assert len(completions) == STREAMS + 1  # none was retried or lost
                await outage_then_restart(epp, envoy, http, failure_mode, tmp_path)


async def outage_then_restart(
    epp: EppProcess, envoy: EnvoyProcess, http: aiohttp.ClientSession, mode: str, tmp: Path
) -> None:
    """While the picker is down, fail-open serves from the pool Envoy learned and
    fail-close answers an OpenAI-shaped 503; a picker restarted on its ports serves again."""

    def picker_down() -> bool:
        return (
            envoy.stats("cluster.epp.membership_healthy").get("cluster.epp.membership_healthy", 1)
            == 0
        )

    await async_wait_until(picker_down, 15, "Envoy's health check seeing the picker gone")
    body = {"model": "tiny", "prompt": "during the outage"}
    for _ in range(5):
        async with http.post(f"{envoy.url}/v1/completions", json=body) as response:
            if mode == "open":
                assert response.status == 200
            else:
                assert response.status == 503
                error = (await response.json())["error"]
                assert error["code"] == 503 and error["message"]
    command = [*EPP, "--grpc-port", str(epp.grpc_port), "--health-port", str(epp.health_port),
               "--metrics-port", str(epp.metrics_port), "--kv-events-mode", "off",
               "--endpoint", *_endpoint_arg(epp)]  # fmt: skip
    restarted = _start(command, tmp / "epp-restarted.log")
    try:
        await async_wait_until(
            lambda: (
                envoy.stats("cluster.epp.membership_healthy").get(
                    "cluster.epp.membership_healthy", 0
                )
                == 1
            ),
            60,
            "the restarted picker healthy again",
        )

        async def served() -> bool:
            async with http.post(f"{envoy.url}/v1/completions", json=body) as response:
                return response.status == 200

        # Healthy in Envoy's eyes first; its first decisions follow within moments.
        await async_wait_until(served, 30, "the restarted picker serving")
    finally:
        _stop(restarted)


def _start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _endpoint_arg(epp: EppProcess) -> list[str]:
    """The --endpoint the first picker was started with (read back from its command)."""
    args = list(epp.process.args)  # type: ignore[arg-type]
    return [args[args.index("--endpoint") + 1]]

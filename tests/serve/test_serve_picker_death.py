"""A routed request does not depend on the picker any more: `epp serve` SIGKILLed while
responses stream (real Envoy, real `epp serve` process, real HTTP backend), and every
response that had been routed still completes, in fail-close as well as fail-open."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import pytest
from serve_stack import epp_process, sample, wait_started
from support.backends import SSE_CHUNKS, echo_backends
from support.envoy import async_running_envoy
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

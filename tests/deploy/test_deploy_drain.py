"""Graceful drain on SIGTERM: health turns NOT_SERVING at once, open streams run to the
end (up to --drain-timeout), new streams are still decided meanwhile, and epp exits 0.

The process test runs the shipped stack: `epp sim` pod, `epp serve` (TLS, its default),
real Envoy, and a client reading a ten-second streamed completion across the SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.envoy import async_running_envoy
from support.net import async_wait_until, free_port, port_open, wait_until

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.drain import drain
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.round_robin import RoundRobinScheduler
from smart_epp.epp.server import EppServer
from smart_epp.framework.types import Endpoint

EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# ---------------------------------------------------------------- helpers


async def readiness(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service="readiness")
        return (await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)).status


def headers_message() -> ep.ProcessingRequest:
    values = [
        core.HeaderValue(key=k, raw_value=v.encode())
        for k, v in {":method": "POST", ":path": "/v1/completions"}.items()
    ]
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=core.HeaderMap(headers=values)),
        protocol_config=ep.ProtocolConfiguration(
            request_body_mode=pm.ProcessingMode.BUFFERED,
            response_body_mode=pm.ProcessingMode.STREAMED,
        ),
    )


BODY = ep.ProcessingRequest(
    request_body=ep.HttpBody(body=b'{"model": "tiny", "prompt": "hi"}', end_of_stream=True)
)
RESPONSE_END = ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True))


class Stream:
    """One ext_proc stream, driven message by message as Envoy drives it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=ep.ProcessingRequest.SerializeToString,
            response_deserializer=ep.ProcessingResponse.FromString,
        )()

    async def decide(self) -> str:
        """Sends a request; returns the destination the picker chose."""
        await self.call.write(headers_message())
        await self.call.read()  # headers: continue (buffered mode)
        await self.call.write(BODY)
        reply: ep.ProcessingResponse = await self.call.read()
        mutation = reply.request_body.response.header_mutation
        return next(
            h.header.raw_value.decode()
            for h in mutation.set_headers
            if h.header.key == "x-gateway-destination-endpoint"
        )

    async def finish(self) -> None:
        """The response ends and Envoy closes the stream; the server ends it cleanly."""
        await self.call.write(RESPONSE_END)
        await self.call.read()
        await self.call.done_writing()
        assert await self.call.code() == grpc.StatusCode.OK


@contextlib.asynccontextmanager
async def picker() -> AsyncIterator[tuple[EppServer, grpc.aio.Channel]]:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("10.0.0.1:8000")])
    server = EppServer(RequestFlow(RoundRobinScheduler(), datastore))
    await server.start(0, 0, None, host="127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            yield server, channel
    finally:
        await server.stop(0)


# ---------------------------------------------------------------- in process


async def test_drain_finishes_open_streams_and_still_decides_new_ones() -> None:
    async with picker() as (server, channel):
        open_stream = Stream(channel)
        assert await open_stream.decide() == "10.0.0.1:8000"
        draining = asyncio.create_task(drain(server, timeout_s=30, notice_s=0.2))
        assert await readiness(server.health_port) == NOT_SERVING
        # Envoy has not noticed yet and sends another request: it is decided.
        late = Stream(channel)
        assert await late.decide() == "10.0.0.1:8000"
        await late.finish()
        assert not draining.done()  # the first stream is still open
        await open_stream.finish()
        assert await asyncio.wait_for(draining, 10) == 0


async def test_drain_timeout_cuts_open_streams_and_says_how_many(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="smart_epp.epp.drain")
    async with picker() as (server, channel):
        streams = [Stream(channel) for _ in range(2)]
        for stream in streams:
            await stream.decide()
        started = time.monotonic()
        assert await drain(server, timeout_s=0.5, notice_s=0.1) == 2
        assert 0.5 <= time.monotonic() - started < 5
        assert "cut 2 open ext_proc streams" in caplog.text
        for stream in streams:  # ended by the server, not completed
            assert await stream.call.code() != grpc.StatusCode.OK


# ---------------------------------------------------------------- the shipped processes


@contextlib.contextmanager
def process(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# The simulated H100 decodes a token in about 6.7 ms; five times slower, 300 tokens take
# about ten seconds.
TIME_SCALE = 5.0
TOKENS = 300


@pytest.mark.envoy
async def test_sigterm_during_a_long_stream_through_envoy(tmp_path: Path) -> None:
    pod_port, grpc_port, health_port, metrics_port = (free_port() for _ in range(4))
    sim = [*EPP, "sim", "--port", str(pod_port), "--model", "tiny", "--no-kv-events",
           "--time-scale", str(TIME_SCALE)]  # fmt: skip
    serve = [*EPP, "serve", "--endpoint", f"127.0.0.1:{pod_port}", "--host", "127.0.0.1",
             "--grpc-port", str(grpc_port), "--health-port", str(health_port),
             "--metrics-port", str(metrics_port), "--kv-events-mode", "off",
             "--drain-timeout", "30"]  # fmt: skip
    log = tmp_path / "epp.log"
    with process(sim, tmp_path / "sim.log"), process(serve, log) as epp:
        wait_until(lambda: port_open(pod_port) and port_open(grpc_port), 60, "pod and epp")
        async with (
            async_running_envoy(epp_port=grpc_port, startup_timeout=60) as envoy,
            aiohttp.ClientSession() as http,
        ):
            body = {"model": "tiny", "prompt": "a long answer", "max_tokens": TOKENS,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            async with http.post(f"{envoy.url}/v1/completions", json=body) as response:
                assert response.status == 200
                lines = [await response.content.readline()]
                epp.send_signal(signal.SIGTERM)
                signalled = time.monotonic()

                async def not_serving() -> bool:
                    return await readiness(health_port) == NOT_SERVING

                await async_wait_until(not_serving, 5, "health NOT_SERVING after SIGTERM")
                assert epp.poll() is None  # still draining, the stream is open
                async for line in response.content:
                    lines.append(line)
            streamed_for = time.monotonic() - signalled
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
        assert b"data: [DONE]\n" in lines[-3:]  # the stream ended as vLLM ends it
        assert events[-1]["usage"]["completion_tokens"] == TOKENS
        assert sum(1 for e in events if e["choices"]) == TOKENS  # every token arrived
        assert streamed_for > 2  # the drain really waited for the stream
        exit_code = await asyncio.to_thread(epp.wait, 30)
    text = log.read_text()
    assert exit_code == 0, text[-3000:]
    assert "every ext_proc stream completed" in text, text[-3000:]

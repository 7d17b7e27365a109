"""The default response path: responses bypass the picker, which learns how each went
from Envoy's access log (client -> real Envoy -> epp -> echo backend, and Envoy's
OpenTelemetry access logger -> epp)."""

from __future__ import annotations

import json
import statistics
import time

import pytest
from conftest import TARGET_HEADER, gateway
from support.net import async_wait_until

pytestmark = pytest.mark.envoy

FIRST_TOKEN_MS = 300


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_outcome_carries_endpoint_and_time_to_first_body_byte(
    body_mode: str, api: str, stream: bool
) -> None:
    async with gateway(body_mode) as gw:
        target = gw.backends[1]
        if api == "chat":
            path = "/v1/chat/completions"
            body: dict = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        else:
            path, body = "/v1/completions", {"model": "tiny", "prompt": "hi"}
        body["stream"] = stream
        headers = {TARGET_HEADER: target.address, "x-first-token-delay-ms": str(FIRST_TOKEN_MS)}
        async with gw.http.post(f"{gw.url}{path}", json=body, headers=headers) as response:
            assert response.status == 200
            text = await response.text()
        if stream:
            assert text.endswith("data: [DONE]\n\n")
        else:
            assert json.loads(text)["backend"] == target.name
        await async_wait_until(lambda: len(gw.scheduler.finished) == 1, what="outcome")
        finished = gw.scheduler.finished[0]
        assert finished.ok and finished.address == target.address
        assert finished.request.stream is stream
        assert finished.ttft_s is not None
        if stream:  # the headers came at once; the first token only after the delay
            assert FIRST_TOKEN_MS / 1000 <= finished.ttft_s < 5
        pod = gw.datastore.get(target.address)
        assert pod is not None and pod.inflight.requests == 0
        assert gw.server.flow.open_requests() == 0


async def test_outcomes_arrive_within_the_configured_flush_interval() -> None:
    # In-flight counts are released and TTFT learned when the record arrives, so a record
    # held for Envoy's default one-second flush leaves the picker routing on stale load.
    async with gateway("full-duplex") as gw:
        lags = []
        for i in range(10):
            body = {"model": "tiny", "prompt": f"lag {i}"}
            headers = {TARGET_HEADER: gw.backends[i % 2].address}
            async with gw.http.post(f"{gw.url}/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200
                await r.read()
            answered = time.monotonic()
            expected = i + 1
            await async_wait_until(
                lambda n=expected: len(gw.scheduler.finished) == n,  # type: ignore[misc]
                what="outcome",
            )
            lags.append(time.monotonic() - answered)
        # The records are flushed every 20 ms; with Envoy's default (1 s) each waits ~1 s.
        assert statistics.mean(lags) < 0.25, lags


async def test_upstream_5xx_is_reported_with_its_status() -> None:
    async with gateway("full-duplex") as gw:
        target = gw.backends[0]
        headers = {TARGET_HEADER: target.address, "x-backend-status": "503"}
        body = {"model": "tiny", "prompt": "x", "stream": True}
        async with gw.http.post(f"{gw.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status == 503
        await async_wait_until(lambda: len(gw.scheduler.finished) == 1, what="outcome")
        assert gw.scheduler.finished[0].ok is False
        outcome = gw.scheduler.finished[0]
        assert outcome.address == target.address
        pod = gw.datastore.get(target.address)
        assert pod is not None and pod.inflight.requests == 0


async def test_client_reset_mid_stream_is_not_ok_and_releases(body_mode: str) -> None:
    async with gateway(body_mode) as gw:
        target = gw.backends[0]
        pod = gw.datastore.get(target.address)
        assert pod is not None
        body = {"model": "tiny", "prompt": "b", "stream": True}
        headers = {TARGET_HEADER: target.address, "x-sse-delay-ms": "400"}
        response = await gw.http.post(f"{gw.url}/v1/completions", json=body, headers=headers)
        await response.content.readline()
        assert pod.inflight.requests == 1
        response.close()
        await async_wait_until(lambda: pod.inflight.requests == 0, what="in-flight released")
        await async_wait_until(lambda: len(gw.scheduler.finished) == 1, what="outcome")
        assert gw.scheduler.finished[0].ok is False
        assert gw.server.response_log.unmatched == 0


async def test_only_routed_requests_are_logged_to_the_picker() -> None:
    async with gateway("full-duplex") as gw:
        url = f"{gw.url}/v1/completions"
        async with gw.http.post(url, data=b"{not json") as refused:
            assert refused.status == 400
        async with gw.http.post(url, json={"model": "tiny", "prompt": "ok"}) as response:
            assert response.status == 200
        # One Envoy worker sends its records in order: the refused request's would have
        # come no later than the routed one's.
        await async_wait_until(lambda: len(gw.scheduler.finished) == 1, what="outcome")
        assert gw.server.response_log.unmatched == 0

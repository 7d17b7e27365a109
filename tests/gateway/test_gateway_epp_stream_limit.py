"""Envoy's cap on concurrent ext_proc streams to epp. When responses stream through
ext_proc, each request in flight holds one stream until its response ends, so the cap is
the gateway's concurrent-request limit; on the default access-log response path a stream
lasts only until the request is routed."""

from __future__ import annotations

import asyncio

import pytest
import yaml
from conftest import gateway
from support.net import async_wait_until

from smart_epp.epp.envoy_cmd import EnvoyOptions, render_envoy_config

pytestmark = pytest.mark.envoy

# Envoy's own default per-cluster limit, which long LLM responses would exhaust.
ENVOY_DEFAULT_MAX_REQUESTS = 1024


def thresholds_of(cluster: str, options: EnvoyOptions) -> dict[str, int]:
    config = yaml.safe_load(render_envoy_config(options))
    found = next(c for c in config["static_resources"]["clusters"] if c["name"] == cluster)
    return found["circuit_breakers"]["thresholds"][0]


def epp_thresholds(options: EnvoyOptions) -> dict[str, int]:
    return thresholds_of("epp", options)


def test_default_stream_cap_is_far_above_envoys_default() -> None:
    thresholds = epp_thresholds(EnvoyOptions())
    assert thresholds["max_requests"] >= 50 * ENVOY_DEFAULT_MAX_REQUESTS
    assert thresholds["max_pending_requests"] == thresholds["max_requests"]
    assert epp_thresholds(EnvoyOptions(epp_max_streams=7))["max_requests"] == 7


def test_the_pools_request_limit_is_not_the_pickers_stream_cap() -> None:
    # On the access-log path a stream ends once its request is routed: capping streams
    # must not cap the requests the pods may answer at once.
    pool = thresholds_of("inference_pool", EnvoyOptions(epp_max_streams=7))
    assert pool["max_requests"] == pool["max_connections"] >= 50 * ENVOY_DEFAULT_MAX_REQUESTS
    limited = thresholds_of("inference_pool", EnvoyOptions(pool_max_requests=9))
    assert limited["max_requests"] == limited["max_pending_requests"] == 9


async def test_the_stream_cap_governs_concurrent_requests() -> None:
    # Three streams: the pool's EDS subscription to the picker holds one for good.
    async with gateway(
        "full-duplex", backends=1, epp_max_streams=3, response_path="ext-proc"
    ) as gw:
        url = f"{gw.url}/v1/completions"
        slow = {"x-sse-delay-ms": "300"}
        body = {"model": "tiny", "prompt": "hold", "stream": True}

        async def held() -> int:
            async with gw.http.post(url, json=body, headers=slow) as response:
                await response.read()
                return response.status

        holders = [asyncio.create_task(held()) for _ in range(2)]
        await async_wait_until(lambda: gw.server.active_streams == 2, what="two held streams")
        async with gw.http.post(url, json={"model": "tiny", "prompt": "third"}) as response:
            assert response.status >= 500  # no stream to epp: failure mode close refuses it
        assert await asyncio.gather(*holders) == [200, 200]
        await async_wait_until(lambda: gw.server.active_streams == 0, what="streams closed")
        async with gw.http.post(url, json={"model": "tiny", "prompt": "after"}) as response:
            assert response.status == 200


async def test_responses_hold_no_stream_on_the_access_log_path() -> None:
    async with gateway("full-duplex", backends=1, epp_max_streams=2) as gw:
        url = f"{gw.url}/v1/completions"
        held = {"x-sse-hold": "1"}
        body = {"model": "tiny", "prompt": "hold", "stream": True}
        # Each answer starts while the others are held: one that cannot (a limit that
        # queues it) fails here rather than at aiohttp's five-minute timeout.
        async with asyncio.timeout(30):
            responses = [await gw.http.post(url, json=body, headers=held) for _ in range(3)]
        for response in responses:
            assert response.status == 200
            await response.content.readline()  # every response is streaming
        # Each ext_proc stream ended once its request was routed, responses still flowing.
        await async_wait_until(lambda: gw.server.active_streams == 0, what="streams closed")
        pod = gw.datastore.get(gw.backends[0].address)
        assert pod is not None and pod.inflight.requests == 3
        gw.backends[0].held_streams_go.set()
        for response in responses:
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
            response.release()
        await async_wait_until(lambda: pod.inflight.requests == 0, what="in-flight released")

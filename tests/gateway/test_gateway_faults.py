"""Faults and hostile input through real Envoy: retries on the picker's fallbacks, the path
allow-list, and Envoy's own errors in the OpenAI shape."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from conftest import TARGET_HEADER, Gateway, gateway
from support.net import async_wait_until, free_port

from smart_epp.epp.request_limits import RequestLimits
from smart_epp.epp.server import ServerOptions
from smart_epp.framework.types import Endpoint

pytestmark = pytest.mark.envoy

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


async def openai_error(response: aiohttp.ClientResponse, status: int) -> dict[str, object]:
    assert response.status == status, await response.text()
    assert response.headers["content-type"].startswith("application/json")
    error = (await response.json())["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


def with_dead_pod(gw: Gateway) -> str:
    """Adds a pool member nobody listens on (a pod that was just SIGKILLed)."""
    dead = f"127.0.0.1:{free_port()}"
    gw.datastore.set_endpoints([Endpoint(dead), *(Endpoint(b.address) for b in gw.backends)])
    return dead


async def envoy_knows(gw: Gateway, count: int) -> None:
    """Waits until Envoy's pool cluster has `count` members (EDS from the picker)."""

    async def known() -> bool:
        async with gw.http.get(f"{gw.envoy.admin_url}/clusters") as response:
            text = await response.text()
        members = {
            line.split("::")[1]
            for line in text.splitlines()
            if line.startswith("inference_pool::") and "::cx_active::" in line
        }
        return len(members) == count

    await async_wait_until(known, what=f"Envoy knowing {count} pool members")


async def test_a_refused_primary_is_retried_on_the_next_fallback(body_mode: str) -> None:
    async with gateway(body_mode, backends=2, destination_count=3) as gw:
        dead = with_dead_pod(gw)
        await envoy_knows(gw, 3)

        # At once: Envoy's default of 3 concurrent retries per cluster would fail most.
        async def one() -> str:
            async with gw.http.post(
                f"{gw.url}/v1/chat/completions", json=CHAT, headers={TARGET_HEADER: dead}
            ) as response:
                assert response.status == 200, await response.text()
                return str((await response.json())["backend"])

        served = await asyncio.gather(*(one() for _ in range(30)))
        assert set(served) <= {b.name for b in gw.backends}
        retries = gw.envoy.stats("cluster.inference_pool.upstream_rq_retry")
        assert retries.get("cluster.inference_pool.upstream_rq_retry", 0) >= 30


async def test_a_pool_that_refuses_everywhere_gets_an_openai_503() -> None:
    async with gateway("full-duplex", backends=1) as gw:
        dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        gw.datastore.set_endpoints([Endpoint(a) for a in dead])
        await envoy_knows(gw, 2)
        async with gw.http.post(
            f"{gw.url}/v1/chat/completions", json=CHAT, headers={TARGET_HEADER: dead[0]}
        ) as response:
            error = await openai_error(response, 503)
        assert "could not connect" in str(error["message"])


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/metrics"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/sleep"),
        ("GET", "/health"),
        ("GET", "/v1/../metrics"),
        ("POST", "//reset_prefix_cache"),
    ],
)
async def test_admin_paths_are_404_and_never_reach_a_pod(method: str, path: str) -> None:
    async with gateway("full-duplex") as gw:
        async with gw.http.request(
            method, f"{gw.url}{path}", data=b"{}", headers={"content-type": "application/json"}
        ) as response:
            error = await openai_error(response, 404)
        assert error["type"] == "not_found_error"
        assert all(b.received == [] for b in gw.backends)
        assert gw.scheduler.routed == []  # refused before the picker was asked


async def test_allow_list_is_configurable_end_to_end() -> None:
    options = ServerOptions(request_limits=RequestLimits.with_paths(["/generate"]))
    async with gateway("full-duplex", options=options, allowed_paths=("/generate",)) as gw:
        async with gw.http.post(f"{gw.url}/generate", json={"prompt": "x"}) as response:
            assert response.status == 200
        async with gw.http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as response:
            await openai_error(response, 404)


async def test_deep_json_is_a_clean_400(body_mode: str) -> None:
    async with gateway(body_mode) as gw:
        body = b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}"
        async with gw.http.post(
            f"{gw.url}/v1/completions", data=body, headers={"content-type": "application/json"}
        ) as response:
            error = await openai_error(response, 400)
        assert "nested" in str(error["message"])
        assert all(b.received == [] for b in gw.backends)


async def test_picker_down_in_fail_close_is_an_openai_503(body_mode: str) -> None:
    async with gateway(body_mode, failure_mode="close") as gw:
        await gw.server.stop(0)
        await async_wait_until(lambda: not gw.envoy.epp_healthy(), what="epp seen down")
        async with gw.http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as response:
            error = await openai_error(response, 503)
        assert "picker" in str(error["message"])


async def test_buffer_overflow_is_an_openai_413() -> None:
    async with gateway("buffered", max_body_bytes=2048) as gw:
        body = {"model": "tiny", "prompt": "x" * 10_000}
        async with gw.http.post(f"{gw.url}/v1/completions", json=body) as response:
            await openai_error(response, 413)


async def test_http_1_0_is_refused_with_426() -> None:
    async with gateway("full-duplex") as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.envoy.listen_port)
        writer.write(b"GET /v1/models HTTP/1.0\r\nHost: x\r\n\r\n")
        await writer.drain()
        raw = await reader.read()
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.split()[1] == b"426"
        # The mapper applies (JSON content type), but Envoy writes no body on an HTTP/1.0
        # connection it refuses: the status is what such a client gets.
        assert b"content-type: application/json" in head.lower()
        assert body == b"" or json.loads(body)["error"]["code"] == 426


async def test_envoy_follows_pool_changes_over_eds() -> None:
    async with gateway("full-duplex", backends=3) as gw:
        first, second, third = gw.backends
        gw.datastore.set_endpoints([Endpoint(first.address)])
        await envoy_knows(gw, 1)
        started = time.perf_counter()
        gw.datastore.set_endpoints([Endpoint(first.address), Endpoint(third.address)])
        await envoy_knows(gw, 2)
        propagation_ms = (time.perf_counter() - started) * 1000
        print(f"EDS: pool change seen by Envoy after {propagation_ms:.0f} ms (polled via admin)")
        async with gw.http.post(
            f"{gw.url}/v1/chat/completions", json=CHAT, headers={TARGET_HEADER: third.address}
        ) as response:
            assert (await response.json())["backend"] == third.name
        assert second.received == []

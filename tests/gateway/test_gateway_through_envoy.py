"""The gateway end to end: client -> real Envoy -> epp (ext_proc) -> chosen echo backend."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from conftest import TARGET_HEADER, gateway
from support.backends import usage_for
from support.net import async_wait_until

from smart_epp.epp.server import ServerOptions
from smart_epp.framework.types import Api

pytestmark = pytest.mark.envoy


async def test_requests_land_on_the_chosen_endpoint(body_mode: str) -> None:
    async with gateway(body_mode, backends=3) as gw:
        for target in (2, 0, 1, 2):
            backend = gw.backends[target]
            body = {"model": "tiny", "prompt": f"to {target}"}
            headers = {TARGET_HEADER: backend.address}
            async with gw.http.post(
                f"{gw.url}/v1/completions", json=body, headers=headers
            ) as response:
                assert response.status == 200
                answer = await response.json()
            assert answer["backend"] == backend.name
            # The request arrived whole, with the destination the picker set.
            assert answer["body_sha256"] == hashlib.sha256(json.dumps(body).encode()).hexdigest()
            assert backend.received[-1].destination == backend.address
        assert sum(len(b.received) for b in gw.backends) == 4
        # The scheduler hears of a routing after the reply goes to Envoy, so the last
        # one can reach it after the backend has answered.
        await async_wait_until(lambda: len(gw.scheduler.routed) >= 4, 10, "4 routings")
        routed = [request for request, _ in gw.scheduler.routed]
        assert [r.api for r in routed] == [Api.COMPLETIONS] * 4
        assert [r.prompt for r in routed] == ["to 2", "to 0", "to 1", "to 2"]


async def test_client_cannot_choose_the_destination_itself(body_mode: str) -> None:
    async with gateway(body_mode) as gw:
        chosen, other = gw.backends
        headers = {TARGET_HEADER: chosen.address, "x-gateway-destination-endpoint": other.address}
        async with gw.http.post(
            f"{gw.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            headers=headers,
        ) as response:
            assert response.status == 200
            assert (await response.json())["backend"] == chosen.name
        assert other.received == []


async def test_bodiless_request_is_decided_on_headers(body_mode: str) -> None:
    async with gateway(body_mode) as gw:
        target = gw.backends[1]
        async with gw.http.get(
            f"{gw.url}/v1/models", headers={TARGET_HEADER: target.address}
        ) as response:
            assert response.status == 200
            assert (await response.json())["backend"] == target.name
        # The routing reaches the scheduler after the reply goes to Envoy.
        await async_wait_until(lambda: len(gw.scheduler.routed) == 1, 10, "the routing")
        request, _ = gw.scheduler.routed[-1]
        assert request.api is Api.OTHER and request.body == b""


async def test_two_megabyte_body_passes_in_full_duplex() -> None:
    async with gateway("full-duplex") as gw:
        prompt = "x" * (2 * 1024 * 1024)
        payload = json.dumps({"model": "tiny", "prompt": prompt}).encode()
        async with gw.http.post(
            f"{gw.url}/v1/completions",
            data=payload,
            headers={"content-type": "application/json", TARGET_HEADER: gw.backends[1].address},
        ) as response:
            assert response.status == 200
            answer = await response.json()
        assert answer["backend"] == gw.backends[1].name
        assert answer["body_bytes"] == len(payload)
        assert answer["body_sha256"] == hashlib.sha256(payload).hexdigest()
        # The body went back to Envoy in chunks it accepts (62,000 bytes at most each).
        assert len(payload) > 62_000 * 30


async def test_body_above_the_maximum_gets_413_json() -> None:
    options = ServerOptions(max_body_bytes=256 * 1024)
    async with gateway("full-duplex", options=options) as gw:
        payload = json.dumps({"model": "tiny", "prompt": "y" * (300 * 1024)}).encode()
        async with gw.http.post(
            f"{gw.url}/v1/completions",
            data=payload,
            headers={"content-type": "application/json"},
        ) as response:
            assert response.status == 413
            assert response.headers["content-type"] == "application/json"
            error = (await response.json())["error"]
        assert "262144" in error["message"] and error["code"] == 413
        assert error["type"] == "invalid_request_error"
        assert all(b.received == [] for b in gw.backends)
        # Just under the limit still passes.
        small = json.dumps({"model": "tiny", "prompt": "y" * (200 * 1024)}).encode()
        async with gw.http.post(f"{gw.url}/v1/completions", data=small) as response:
            assert response.status == 200


# Usage is read from the body only when the response streams through ext_proc.
async def test_streaming_response_passes_intact_and_usage_is_read(body_mode: str) -> None:
    async with gateway(body_mode, response_path="ext-proc") as gw:
        target = gw.backends[0]
        body = {"model": "tiny", "prompt": "stream me", "stream": True}
        headers = {TARGET_HEADER: target.address, "x-sse-delay-ms": "5"}
        async with gw.http.post(f"{gw.url}/v1/completions", json=body, headers=headers) as response:
            assert response.status == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            text = (await response.read()).decode()
        events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["text"] for c in chunks[:-1]] == [f"t{i}" for i in range(5)]
        assert all(c["backend"] == target.name for c in chunks)

        await async_wait_until(lambda: len(gw.scheduler.finished) == 1, what="response end")
        finished = gw.scheduler.finished[0]
        expected = usage_for(len(json.dumps(body)))
        assert finished.ok and finished.address == target.address
        assert finished.usage is not None
        assert finished.usage.prompt_tokens == expected["prompt_tokens"]
        assert finished.usage.completion_tokens == expected["completion_tokens"]
        assert finished.usage.cached_tokens == 16
        assert finished.ttft_s is not None and 0 < finished.ttft_s < 5
        assert finished.request.stream is True


async def test_json_response_usage_is_read(body_mode: str) -> None:
    async with gateway(body_mode, response_path="ext-proc") as gw:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
        async with gw.http.post(f"{gw.url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
        await async_wait_until(lambda: len(gw.scheduler.finished) == 1, what="response end")
        usage = gw.scheduler.finished[0].usage
        assert usage is not None
        assert usage.prompt_tokens == usage_for(len(json.dumps(body)))["prompt_tokens"]


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b'{"model": "tiny", "prompt": ', "not valid JSON"),
        (b'{"prompt": "hello"}', "model"),
        (b'{"model": 7, "prompt": "hello"}', "'model' must be"),
        (b'{"model": "tiny", "prompt": {"a": 1}}', "'prompt' must be"),
        (b'{"model": "tiny", "prompt": "x", "stream": "yes"}', "'stream' must be"),
        (b"[1, 2]", "JSON object"),
    ],
)
async def test_bad_requests_get_400_json(body_mode: str, payload: bytes, fragment: str) -> None:
    async with gateway(body_mode, backends=1) as gw:
        async with gw.http.post(
            f"{gw.url}/v1/completions",
            data=payload,
            headers={"content-type": "application/json"},
        ) as response:
            assert response.status == 400
            error = (await response.json())["error"]
        assert fragment in error["message"]
        assert error["type"] == "invalid_request_error" and error["code"] == 400
        assert gw.backends[0].received == []
        # The server is still fine afterwards.
        async with gw.http.post(
            f"{gw.url}/v1/completions", json={"model": "tiny", "prompt": "ok"}
        ) as response:
            assert response.status == 200


async def test_no_endpoints_gives_503_json(body_mode: str) -> None:
    async with gateway(body_mode, register_backends=False) as gw:
        async with gw.http.post(
            f"{gw.url}/v1/completions", json={"model": "tiny", "prompt": "hi"}
        ) as response:
            assert response.status == 503
            error = (await response.json())["error"]
        assert "no endpoint" in error["message"] and error["code"] == 503


async def test_unready_pods_are_not_candidates() -> None:
    async with gateway("full-duplex") as gw:
        down, up = gw.datastore.pods()
        down.ready = False
        for _ in range(3):
            async with gw.http.post(
                f"{gw.url}/v1/completions",
                json={"model": "tiny", "prompt": "hi"},
                headers={TARGET_HEADER: down.address},
            ) as response:
                assert (await response.json())["backend"] in {
                    b.name for b in gw.backends if b.address == up.address
                }


@pytest.mark.parametrize("response_path", ["access-log", "ext-proc"])
async def test_hundred_concurrent_requests_all_answered(body_mode: str, response_path: str) -> None:
    async with gateway(body_mode, backends=3, response_path=response_path) as gw:

        async def one(i: int) -> tuple[str, str]:
            target = gw.backends[i % 3]
            body = {"model": "tiny", "prompt": f"request {i}", "stream": i % 2 == 0}
            async with gw.http.post(
                f"{gw.url}/v1/completions", json=body, headers={TARGET_HEADER: target.address}
            ) as response:
                assert response.status == 200
                text = await response.text()
            return target.name, text

        results = await asyncio.gather(*(one(i) for i in range(100)))
        for name, text in results:
            assert f'"backend": "{name}"' in text
        assert sum(len(b.received) for b in gw.backends) == 100
        assert len({r.request_id for b in gw.backends for r in b.received}) == 100
        await async_wait_until(
            lambda: len(gw.scheduler.finished) == 100, what="all responses accounted"
        )
        assert all(f.ok and f.ttft_s is not None for f in gw.scheduler.finished)
        if response_path == "ext-proc":
            assert all(f.usage is not None for f in gw.scheduler.finished)
        await async_wait_until(
            lambda: all(p.inflight.requests == 0 for p in gw.datastore.pods()),
            what="in-flight back to zero",
        )
        assert all(p.inflight.prompt_tokens == 0 for p in gw.datastore.pods())
        assert gw.server.flow.open_requests() == 0


async def test_inflight_counts_while_a_response_streams() -> None:
    async with gateway("full-duplex") as gw:
        target = gw.backends[0]
        pod = gw.datastore.get(target.address)
        assert pod is not None
        body = {"model": "tiny", "prompt": "a" * 400, "stream": True}
        headers = {TARGET_HEADER: target.address, "x-sse-delay-ms": "150"}
        async with gw.http.post(f"{gw.url}/v1/completions", json=body, headers=headers) as resp:
            await resp.content.readline()  # the stream has started
            assert pod.inflight.requests == 1
            assert pod.inflight.prompt_tokens == 100
            await resp.read()
        await async_wait_until(lambda: pod.inflight.requests == 0, what="in-flight released")


async def test_client_reset_releases_inflight() -> None:
    async with gateway("full-duplex") as gw:
        target = gw.backends[0]
        pod = gw.datastore.get(target.address)
        assert pod is not None
        body = {"model": "tiny", "prompt": "b", "stream": True}
        headers = {TARGET_HEADER: target.address, "x-sse-delay-ms": "500"}
        response = await gw.http.post(f"{gw.url}/v1/completions", json=body, headers=headers)
        await response.content.readline()
        assert pod.inflight.requests == 1
        response.close()  # the client goes away mid-stream
        await async_wait_until(lambda: pod.inflight.requests == 0, what="in-flight released")
        await async_wait_until(lambda: len(gw.scheduler.finished) == 1, what="reported")
        assert gw.scheduler.finished[0].ok is False


async def test_backend_error_is_reported_as_not_ok() -> None:
    async with gateway("full-duplex") as gw:
        async with gw.http.post(
            f"{gw.url}/v1/completions",
            json={"model": "tiny", "prompt": "x"},
            headers={"x-backend-status": "400"},
        ) as response:
            assert response.status == 400
        await async_wait_until(lambda: len(gw.scheduler.finished) == 1, what="reported")
        assert gw.scheduler.finished[0].ok is False


async def test_epp_down_with_fail_open_still_serves(body_mode: str) -> None:
    async with gateway(body_mode, failure_mode="open") as gw:
        chosen, _ = gw.backends
        async with gw.http.post(
            f"{gw.url}/v1/completions",
            json={"model": "tiny", "prompt": "up"},
            headers={TARGET_HEADER: chosen.address},
        ) as response:
            assert (await response.json())["backend"] == chosen.name
        await gw.server.stop(0)
        # Envoy's health check of the picker notices it is gone.
        await async_wait_until(lambda: not gw.envoy.epp_healthy(), what="epp seen down")
        served = []
        for i in range(20):
            async with gw.http.post(
                f"{gw.url}/v1/completions",
                json={"model": "tiny", "prompt": f"down {i}"},
                headers={TARGET_HEADER: chosen.address},
            ) as response:
                assert response.status == 200
                served.append((await response.json())["backend"])
        # Balanced over the pool Envoy learned from the picker before it went away.
        assert set(served) == {b.name for b in gw.backends}


async def test_epp_down_with_fail_close_answers_5xx(body_mode: str) -> None:
    async with gateway(body_mode, failure_mode="close") as gw:
        async with gw.http.post(
            f"{gw.url}/v1/completions", json={"model": "tiny", "prompt": "up"}
        ) as response:
            assert response.status == 200
        await gw.server.stop(0)
        async with gw.http.post(
            f"{gw.url}/v1/completions", json={"model": "tiny", "prompt": "down"}
        ) as response:
            assert 500 <= response.status < 600
        assert sum(len(b.received) for b in gw.backends) == 1

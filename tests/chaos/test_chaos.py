"""Chaos scenarios through the whole gateway: real Envoy, `epp serve`, `epp sim` pod
processes, a real Redis-protocol server. Each is bounded in time and prints its figures
(`pytest tests/chaos -s` shows them; the README's Reliability table quotes one run).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from chaos_stack import Clock, SimPod, Stack, chaos_stack, sample
from support.net import async_wait_until
from support.redis_server import RedisServer

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(240)]

WORDS = ["route", "prefix", "cache", "token", "pod", "queue", "batch", "gateway", "model",
         "stream", "latency", "shard"]  # fmt: skip
DEEP_LIST = b'{"model":"tiny","prompt":' + b"[" * 2000 + b"]" * 2000 + b"}"
DEEP_OBJECT = b'{"model":"tiny","messages":' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}"


def prompt(seed: int, words: int = 60) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(words))


async def in_flight(stack: Stack, pod: SimPod) -> float:
    running = await stack.pod_metric(pod, "vllm:num_requests_running")
    waiting = await stack.pod_metric(pod, "vllm:num_requests_waiting")
    return running + waiting


async def test_pod_sigkill_under_30_concurrent_requests(tmp_path: Path) -> None:
    # Scraped every 2 s, the picker keeps choosing the dead pod for seconds: the requests
    # it sends there must be saved by Envoy's retry on the fallbacks.
    async with chaos_stack(tmp_path, pods=3, serve_args=("--scrape-interval", "2")) as s:
        wave = [
            asyncio.create_task(s.request(prompt(i), max_tokens=600, stream=True))
            for i in range(30)
        ]

        async def all_running() -> bool:
            counts = [await in_flight(s, p) for p in s.pods]
            return sum(counts) >= 30

        await async_wait_until(all_running, 30, "30 streams running")
        counts = [await in_flight(s, p) for p in s.pods]
        victim = s.pods[counts.index(max(counts))]
        on_victim = int(max(counts))
        victim.kill()
        clock = Clock()
        # Routed after the kill: the picker still believes in the pod for a few scrapes.
        after = await asyncio.gather(
            *(s.request(prompt(100 + i), max_tokens=16) for i in range(30))
        )
        after_ms = clock.ms()
        before = await asyncio.gather(*wave)
        retries = s.envoy.stats("cluster.inference_pool.upstream_rq_retry").get(
            "cluster.inference_pool.upstream_rq_retry", 0
        )
        failed_before = sum(status != 200 for status, _ in before)
        failed_after = [body[:200] for status, body in after if status != 200]
        s.say(
            "pod SIGKILL",
            streams_running=30,
            on_killed_pod=on_victim,
            streams_failed=failed_before,
            routed_after_kill=len(after),
            failed_after_kill=len(failed_after),
            envoy_retries=retries,
            after_kill_wave_ms=after_ms,
        )
        assert failed_before <= on_victim  # only streams already on the killed pod
        assert failed_after == [], failed_after


async def test_redis_killed_and_restarted_empty_under_load(tmp_path: Path) -> None:
    server = RedisServer().start()
    store = aioredis.Redis.from_url(server.url)
    lru = "smart-epp:kv:lru"
    try:
        args = ("--kv-index", "redis", "--redis-url", server.url)
        async with chaos_stack(tmp_path, pods=2, serve_args=args) as s:
            for i in range(6):  # prefixes learned before the outage
                status, _ = await s.request(prompt(200 + i, 120), max_tokens=1)
                assert status == 200

            async def learned() -> bool:
                return int(await store.zcard(lru)) > 0

            await async_wait_until(learned, 15, "prefixes in Redis")
            await asyncio.sleep(0)  # let the last batches land
            known = int(await store.zcard(lru))
            results: list[int] = []
            stop = asyncio.Event()

            async def load(worker: int) -> None:
                n = 0
                while not stop.is_set():
                    status, _ = await s.request(prompt(300 + worker * 1000 + n, 80), max_tokens=4)
                    results.append(status)
                    n += 1

            workers = [asyncio.create_task(load(w)) for w in range(4)]
            await async_wait_until(lambda: len(results) >= 8, 30, "load running")
            assert server.process is not None
            server.process.kill()  # SIGKILL: the store and every connection gone
            server.process.wait()
            server.process = None
            during = len(results)
            await async_wait_until(lambda: len(results) >= during + 8, 30, "load during outage")
            server.start()  # same port, empty
            clock = Clock()

            async def refilled() -> bool:
                try:
                    return int(await store.zcard(lru)) >= known
                except (OSError, ConnectionError, aioredis.ConnectionError):
                    return False

            await async_wait_until(refilled, 15, "Redis refilled from the picker's state")
            refill_ms = clock.ms()
            await async_wait_until(lambda: len(results) >= during + 24, 30, "load after restart")
            stop.set()
            await asyncio.gather(*workers)
            page = await s.metrics()
            failed = sum(status != 200 for status in results)
            s.say(
                "Redis SIGKILL + empty restart",
                requests=len(results),
                failed=failed,
                blocks_before=known,
                refilled_ms=refill_ms,
                reseeds=sample(page, "smart_epp_kv_redis_reseeds_total"),
                redis_errors=sample(page, "smart_epp_kv_redis_errors_total"),
                divergence_blocks=sample(page, "smart_epp_kv_redis_divergence_blocks"),
            )
            assert failed == 0
            assert refill_ms < 5000
    finally:
        await store.aclose()
        server.close()


async def test_kv_publisher_restart_under_load(tmp_path: Path) -> None:
    async with chaos_stack(tmp_path, pods=2) as s:
        pod = s.pods[1]
        results: list[int] = []
        stop = asyncio.Event()

        async def load(worker: int) -> None:
            n = 0
            while not stop.is_set():
                results.append((await s.request(prompt(500 + worker * 1000 + n), 4))[0])
                n += 1

        workers = [asyncio.create_task(load(w)) for w in range(4)]
        await async_wait_until(lambda: len(results) >= 8, 30, "load running")
        page = await s.metrics()
        restarts = sample(page, "smart_epp_pod_restarts_total", pod=pod.address) + sample(
            page, "smart_epp_kv_pod_restarts_total", pod=pod.address
        )
        pod.kill()  # requests running on it die with it; every later one must succeed
        clock = Clock()
        pod.start()  # same HTTP, KV and replay ports; numbering from 0, empty cache
        await pod.wait_up()

        async def detected() -> bool:
            page = await s.metrics()
            now = sample(page, "smart_epp_pod_restarts_total", pod=pod.address) + sample(
                page, "smart_epp_kv_pod_restarts_total", pod=pod.address
            )
            return now > restarts

        await async_wait_until(detected, 30, "the restart detected")
        detect_ms = clock.ms()
        served_before = await s.pod_metric(pod, "vllm:request_success_total")
        await async_wait_until(lambda: len(results) >= 40, 60, "load through the restarted pool")
        stop.set()
        await asyncio.gather(*workers)
        served_after = await s.pod_metric(pod, "vllm:request_success_total")
        failed = [status for status in results if status != 200]
        s.say(
            "KV publisher (pod) restart",
            requests=len(results),
            failed=len(failed),
            failed_statuses=sorted(set(failed)),
            restart_detected_ms=detect_ms,
            served_by_restarted_pod=served_after - served_before,
        )
        # A 502 is a request the pod was answering when it died; a request that could
        # still go elsewhere (refused connection: 503) never fails.
        assert set(failed) <= {502} and len(failed) <= 4


async def test_hostile_input_through_envoy(tmp_path: Path) -> None:
    async with chaos_stack(tmp_path, pods=2) as s:
        served = sum([await s.pod_metric(p, "vllm:request_success_total") for p in s.pods])
        cases = [
            ("POST", "/reset_prefix_cache", b"", 404),
            ("GET", "/metrics", b"", 404),
            ("POST", "/sleep?level=1", b"", 404),
            ("GET", "/v1/../metrics", b"", 404),
            ("POST", "/v1/completions", DEEP_LIST, 400),
            ("POST", "/v1/completions", b'{"model":"tiny","prompt":[1, 4294967296]}', 400),
            ("POST", "/v1/completions", b"\xff\x00 not json", 400),
            ("POST", "/v1/chat/completions", DEEP_OBJECT, 400),
        ]  # fmt: skip
        outcomes = []
        for method, path, body, expected in cases:
            async with s.http.request(
                method, f"{s.url}{path}", data=body, headers={"content-type": "application/json"}
            ) as resp:
                payload = await resp.read()
                error = json.loads(payload)["error"]
                outcomes.append((path[:24], resp.status))
                assert resp.status == expected and error["code"] == expected, (path, payload[:200])
        after = sum([await s.pod_metric(p, "vllm:request_success_total") for p in s.pods])
        s.say(
            "hostile input",
            cases=len(cases),
            answered_as_expected=len(outcomes),
            reached_a_pod=int(after - served),
        )
        assert after == served


async def test_a_burst_of_1000_streams_is_served_and_nothing_leaks(tmp_path: Path) -> None:
    # 1,000 streams at once over 1,000 client connections: every ext_proc stream, pod
    # connection and access-log record of the gateway is exercised at that width.
    async with chaos_stack(tmp_path, pods=3, time_scale=0.2) as s:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            s.http, shared = http, s.http
            clock = Clock()
            try:
                results = await asyncio.gather(
                    *(
                        s.request(prompt(i, words=20), max_tokens=16, stream=True, timeout_s=180)
                        for i in range(1000)
                    )
                )
            finally:
                s.http = shared
        burst_ms = clock.ms()
        failed = [(status, body[:120]) for status, body in results if status != 200]

        async def drained() -> bool:
            return sample(await s.metrics(), "inference_objective_running_requests") == 0

        # Every routed request ends in the picker's books (access-log records come in
        # batches, after the responses; a starved machine takes a while to work them off).
        await async_wait_until(drained, 120, "the picker's in-flight count back to 0")
        s.say("1,000-stream burst", streams=1000, failed=len(failed), burst_ms=burst_ms)
        assert failed == [], failed[:5]

"""Two `epp serve` replicas sharing one block index on a real Redis server: what one
replica learns from the pods' KV events, the other routes by without subscribing; and
with both subscribing, killing one leaves the other keeping the shared index fresh."""

from __future__ import annotations

import signal
from pathlib import Path

import aiohttp
import pytest
from serve_stack import (
    MODEL,
    endpoint_entry,
    epp_process,
    gateway,
    sample,
    sim_pods,
    text,
    wait_started,
    write_endpoints,
)
from support.net import async_wait_until
from support.redis_server import RedisServer, redis_server_fixture

from smart_epp.kv_index.redis_backend import RedisBlockIndex

pytestmark = [pytest.mark.envoy, pytest.mark.redis]
redis_server = redis_server_fixture


async def test_a_prefix_learned_by_one_replica_routes_the_other(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with sim_pods() as pool:
        pool_file = tmp_path / "pool.yaml"
        write_endpoints(pool_file, [endpoint_entry(p) for p in pool.pods])
        shared = ["--endpoints-file", str(pool_file), "--kv-index", "redis",
                  "--redis-url", redis_server.url]  # fmt: skip
        with (
            epp_process(tmp_path / "epp1.log", *shared) as subscriber,
            epp_process(tmp_path / "epp2.log", *shared, "--kv-events-mode", "off") as reader,
        ):
            await wait_started(subscriber)
            async with gateway(reader, pool) as gw:
                prefixes = {3: text(11, 600), 1: text(12, 600)}
                for i, prefix in prefixes.items():
                    answer = await gw.direct(i, {"model": MODEL, "prompt": f"{prefix} warm",
                                                 "max_tokens": 1})  # fmt: skip
                    blocks = answer["usage"]["prompt_tokens"] // 16
                    address = pool.pods[i].http_address

                    async def learned(address: str = address, blocks: int = blocks) -> bool:
                        page = await subscriber.metrics(gw.http)
                        stored = sample(
                            page, "smart_epp_kv_block_hashes_total", pod=address, action="stored"
                        )
                        return stored >= blocks

                    await async_wait_until(learned, 10, f"replica 1 ingesting pod {i}'s events")

                # Replica 2 routes; it has no subscription, so only the shared index knows.
                for n in range(3):
                    for i, prefix in prefixes.items():
                        body = {"model": MODEL, "prompt": f"{prefix} q{n}", "max_tokens": 2}
                        pod, answer = await gw.via_gateway(body)
                        assert pod == i
                        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                page = await gw.metrics()
                assert sample(page, "smart_epp_kv_events_total") == 0  # it subscribed to nothing
                assert sample(page, "smart_epp_kv_redis_up") == 1
        for log_path in ("epp1.log", "epp2.log"):
            assert "Traceback" not in (tmp_path / log_path).read_text()


async def test_every_replica_keeps_the_shared_index_fresh_when_another_is_killed(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """No single subscriber: both replicas subscribe to every pod, so after one is
    SIGKILLed the other still writes what the pods cache into the shared index."""
    store = RedisBlockIndex.from_url(redis_server.url)
    async with sim_pods() as pool:
        pool_file = tmp_path / "pool.yaml"
        write_endpoints(pool_file, [endpoint_entry(p) for p in pool.pods])
        shared = ["--endpoints-file", str(pool_file), "--kv-index", "redis",
                  "--redis-url", redis_server.url]  # fmt: skip
        try:
            with (
                epp_process(tmp_path / "epp1.log", *shared) as doomed,
                epp_process(tmp_path / "epp2.log", *shared) as survivor,
            ):
                await wait_started(doomed)
                async with gateway(survivor, pool) as gw:
                    await gw.warm(1, text(21, 400))
                    async with aiohttp.ClientSession() as http:
                        page = await doomed.metrics(http)
                    address = pool.pods[1].http_address
                    # Both replicas heard the pod.
                    name = "smart_epp_kv_block_hashes_total"
                    assert sample(page, name, pod=address, action="stored") > 0
                    doomed.process.send_signal(signal.SIGKILL)
                    doomed.process.wait(timeout=10)
                    before = await store.entries()
                    prefix = text(22, 600)
                    await gw.warm(3, prefix)

                    async def stored() -> bool:
                        return await store.entries() >= before + 600 // 16

                    await async_wait_until(stored, 10, "the survivor's writes in the store")
                    pod, _ = await gw.via_gateway(
                        {"model": MODEL, "prompt": f"{prefix} q", "max_tokens": 2}
                    )
                    assert pod == 3
        finally:
            await store.close()

"""Two `epp serve` replicas sharing one block index on a real Redis server: what one
replica learns from the pods' KV events, the other routes by without subscribing."""

from __future__ import annotations

from pathlib import Path

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

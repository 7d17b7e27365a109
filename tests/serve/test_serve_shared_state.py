"""Two `epp serve` pickers sharing pool state through a real Redis-protocol server, each
behind its own real Envoy: a prefix routed by one is followed by the other, one's
requests in flight count on the other, and a store outage leaves both serving and
sharing again once the store returns.

The second picker subscribes to no KV events, so the shared state is the only way it
can learn where the first one sent a prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from serve_stack import (
    MODEL,
    EppProcess,
    Gateway,
    endpoint_entry,
    epp_process,
    sample,
    served_counts,
    sim_pods,
    text,
    wait_ready,
    wait_started,
    write_endpoints,
)
from support.envoy import async_running_envoy
from support.net import async_wait_until
from support.redis_server import RedisServer, redis_server_fixture

pytestmark = [pytest.mark.envoy, pytest.mark.redis]
redis_server = redis_server_fixture


@dataclass
class Pair:
    first: Gateway
    second: Gateway

    async def metric(self, gw: Gateway, name: str, **labels: str) -> float:
        return sample(await gw.metrics(), name, **labels)

    async def follows(self, seed: int) -> tuple[int, int]:
        """Routes a long prompt through the first picker, waits until the second has
        applied the routed prefix, then routes a prompt sharing it through the second;
        returns both pods."""
        applied = "smart_epp_shared_state_routed_entries_total"
        before = await self.metric(self.second, applied, direction="applied")
        prefix = text(seed, 600)
        pod, _ = await self.first.via_gateway({"model": MODEL, "prompt": f"{prefix} one",
                                               "max_tokens": 1})  # fmt: skip

        async def arrived() -> bool:
            return await self.metric(self.second, applied, direction="applied") > before

        await async_wait_until(arrived, 5, "the second picker applying the routed prefix")
        other, _ = await self.second.via_gateway({"model": MODEL, "prompt": f"{prefix} two",
                                                  "max_tokens": 1})  # fmt: skip
        return pod, other


@contextlib.asynccontextmanager
async def picker_pair(tmp_path: Path, redis_url: str) -> AsyncIterator[Pair]:
    async with sim_pods() as pool:
        pool_file = tmp_path / "pool.yaml"
        write_endpoints(pool_file, [endpoint_entry(p) for p in pool.pods])
        shared = ["--endpoints-file", str(pool_file), "--shared-state", "redis",
                  "--redis-url", redis_url]  # fmt: skip
        with (
            epp_process(tmp_path / "epp1.log", *shared) as one,
            epp_process(tmp_path / "epp2.log", *shared, "--kv-events-mode", "off") as two,
        ):
            await wait_started(one)
            await wait_started(two)
            await wait_ready(one)
            await wait_ready(two)
            async with (
                async_running_envoy(epp_port=one.grpc_port) as envoy_one,
                async_running_envoy(epp_port=two.grpc_port) as envoy_two,
                aiohttp.ClientSession() as http,
            ):
                pair = Pair(
                    Gateway(pool, one, envoy_one, http), Gateway(pool, two, envoy_two, http)
                )
                for gw in (pair.first, pair.second):
                    await async_wait_until(gw.all_ready, 20, "every pod ready")

                    async def sees_peer(gw: Gateway = gw) -> bool:
                        return await pair.metric(gw, "smart_epp_shared_state_peers") == 1

                    await async_wait_until(sees_peer, 10, "the pickers seeing each other")
                yield pair
        for name in ("epp1.log", "epp2.log"):
            assert "Traceback" not in (tmp_path / name).read_text()


def log_of(epp: EppProcess) -> str:
    return epp.log()


async def test_prefixes_and_load_routed_by_one_picker_steer_the_other(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with picker_pair(tmp_path, redis_server.url) as pair:
        # Three prefixes: with four idle pods, following by chance is (1/4)^3.
        for seed in (31, 32, 33):
            pod, other = await pair.follows(seed)
            assert other == pod
        page = await pair.second.metrics()
        assert sample(page, "smart_epp_kv_events_total") == 0  # it learned nothing from pods

        # Each picker answered three of the six requests, and learns from the other's three.
        learned = "smart_epp_shared_state_learned_samples_total"

        async def learned_from_each_other() -> bool:
            return all(
                [await pair.metric(gw, learned, direction="applied") >= 3
                 and await pair.metric(gw, learned, direction="published") >= 3
                 for gw in (pair.first, pair.second)]
            )  # fmt: skip

        await async_wait_until(learned_from_each_other, 10, "each picker learning the other's")
        for gw in (pair.first, pair.second):
            assert await pair.metric(gw, learned, direction="dropped") == 0

        # A long stream through the first picker counts on its pod at the second (once the
        # requests above have left the first picker's books, with their access log).
        async def released() -> bool:
            page = await pair.second.metrics()
            return sample(page, "smart_epp_shared_state_peer_inflight_requests") == 0

        await async_wait_until(released, 15, "the earlier requests' load leaving")
        pool = pair.first.pool
        before = served_counts(pool)
        body = {"model": MODEL, "prompt": text(40, 50), "max_tokens": 3000, "stream": True,
                "ignore_eos": True}  # fmt: skip
        async with pair.first.http.post(
            f"{pair.first.envoy.url}/v1/completions", json=body
        ) as resp:
            assert resp.status == 200
            first_chunk = await resp.content.readline()
            assert first_chunk
            address = None

            async def counted() -> bool:
                nonlocal address
                page = await pair.second.metrics()
                for p in pool.pods:
                    value = sample(page, "smart_epp_shared_state_peer_inflight_requests",
                                   pod=p.http_address)  # fmt: skip
                    if value == 1:
                        address = p.http_address
                        return True
                return False

            await async_wait_until(counted, 10, "the second picker counting the stream")
            await resp.read()
        after = served_counts(pool)
        [served] = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]
        assert address == pool.pods[served].http_address

        await async_wait_until(released, 15, "the stream's load leaving the second picker")


async def test_a_store_outage_keeps_both_pickers_serving_and_they_share_again(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with picker_pair(tmp_path, redis_server.url) as pair:
        pod, other = await pair.follows(51)
        assert other == pod
        redis_server.stop()

        async def both_down() -> bool:
            return all(
                [await pair.metric(gw, "smart_epp_shared_state_up") == 0
                 for gw in (pair.first, pair.second)]
            )  # fmt: skip

        await async_wait_until(both_down, 10, "both pickers noticing the outage")
        # Both keep routing on their own state.
        statuses = await asyncio.gather(
            *(
                gw.status_via_gateway({"model": MODEL, "prompt": text(60 + n, 30), "max_tokens": 2})
                for n in range(6)
                for gw in (pair.first, pair.second)
            )
        )
        assert statuses == [200] * 12

        redis_server.start()  # empty, on the same port

        async def both_up() -> bool:
            return all(
                [await pair.metric(gw, "smart_epp_shared_state_up") == 1
                 and await pair.metric(gw, "smart_epp_shared_state_peers") == 1
                 for gw in (pair.first, pair.second)]
            )  # fmt: skip

        await async_wait_until(both_up, 15, "both pickers sharing again")
        # Each wrote what it routed during the outage in its first exchange back (before
        # it reported up). The second picker applies the first's entries in its next
        # exchange that starts after that write: wait for two of them (one may have been
        # in flight), so those entries are not taken for the ones `follows` waits for.
        exchanges = "smart_epp_shared_state_exchanges_total"
        seen = await pair.metric(pair.second, exchanges, result="ok")

        async def caught_up() -> bool:
            return await pair.metric(pair.second, exchanges, result="ok") >= seen + 2

        await async_wait_until(caught_up, 5, "the second picker reading the reconciled state")
        for seed in (52, 53):
            pod, other = await pair.follows(seed)
            assert other == pod
        for gw in (pair.first, pair.second):
            assert await pair.metric(gw, "smart_epp_shared_state_transitions_total", to="down") == 1
            log = log_of(gw.epp)
            assert log.count("shared pool state unreachable") == 1
            assert log.count("shared pool state back; reconciled") == 1


async def test_each_pod_is_fetched_by_one_picker_and_the_survivor_takes_over(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with picker_pair(tmp_path, redis_server.url) as pair:
        pool = pair.first.pool
        fetched = "smart_epp_shared_state_fetched_pods"

        async def split() -> bool:
            counts = [await pair.metric(gw, fetched) for gw in (pair.first, pair.second)]
            return sum(counts) == len(pool.pods)

        await async_wait_until(split, 10, "each pod fetched by one picker")
        # A stream on one pod shows in both pickers' view of the pool, though only one
        # of them fetches that pod's /metrics: the other applies the shared scrape.
        body = {"model": MODEL, "prompt": text(70, 50), "max_tokens": 3000, "stream": True,
                "ignore_eos": True}  # fmt: skip
        average = "inference_pool_average_running_requests"
        async with pair.first.http.post(
            f"{pair.first.envoy.url}/v1/completions", json=body
        ) as resp:
            assert resp.status == 200
            assert await resp.content.readline()

            async def both_see_it() -> bool:
                return all(
                    [await pair.metric(gw, average) == 1 / len(pool.pods)
                     for gw in (pair.first, pair.second)]
                )  # fmt: skip

            await async_wait_until(both_see_it, 10, "both pickers seeing the running stream")
            assert await split()  # nobody fetched what another picker shares
            await resp.read()
        shared = "smart_epp_shared_state_scrapes_total"
        for direction in ("published", "applied"):
            counts = [await pair.metric(gw, shared, direction=direction)
                      for gw in (pair.first, pair.second)]  # fmt: skip
            assert sum(counts) > 0

        # The first picker dies: the second fetches every pod within two seconds, before
        # the first one's entry in the store expires, and no pod leaves its candidate set.
        pair.first.epp.process.kill()
        pair.first.epp.process.wait()

        async def took_over() -> bool:
            return await pair.metric(pair.second, fetched) == len(pool.pods)

        await async_wait_until(took_over, 2, "the survivor fetching every pod")
        assert await pair.metric(pair.second, "inference_pool_ready_pods") == len(pool.pods)
        statuses = await asyncio.gather(
            *(pair.second.status_via_gateway({"model": MODEL, "prompt": text(80 + n, 30),
                                              "max_tokens": 2}) for n in range(4))
        )  # fmt: skip
        assert statuses == [200] * 4

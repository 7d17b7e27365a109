"""The restart cross-check: a new process_start_time_seconds on a pod's /metrics resets
what the KV index holds for it, even when its event stream showed nothing."""

from __future__ import annotations

import aiohttp
from serve_stack import MODEL, sim_pods
from support.net import async_wait_until
from support.paths import VLLM_FIXTURES

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.scrape import MetricsScraper, parse_vllm_metrics
from smart_epp.framework.types import Endpoint
from smart_epp.kv_index.ingest import IngestState
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.manager import KVEventManager
from smart_epp.kv_index.memory import MemoryBlockIndex

PROMPT = list(range(100, 164))  # four full blocks of 16


def test_real_vllm_page_gives_the_process_start_time() -> None:
    before = parse_vllm_metrics((VLLM_FIXTURES / "basic" / "metrics.before.txt").read_text())
    after = parse_vllm_metrics((VLLM_FIXTURES / "basic" / "metrics.after.txt").read_text())
    assert before.process_start_time == after.process_start_time == 1.7959993531e09
    # The real restart capture: the two vLLM processes report different start times.
    restart = VLLM_FIXTURES / "restart"
    one = parse_vllm_metrics((restart / "metrics.instance1.after.txt").read_text())
    two = parse_vllm_metrics((restart / "metrics.instance2.before.txt").read_text())
    assert one.process_start_time and two.process_start_time
    assert two.process_start_time > one.process_start_time


async def test_scraper_reports_a_restart_once_and_not_the_first_scrape() -> None:
    async with sim_pods(2) as pool:
        datastore = Datastore()
        datastore.set_endpoints([h.endpoint() for h in pool.pods])
        restarted: list[str] = []
        scraper = MetricsScraper(
            datastore, interval_s=0.02, on_restart=lambda pod: restarted.append(pod.address)
        )
        await scraper.start()
        try:
            pods = datastore.pods()
            await async_wait_until(
                lambda: all(p.metrics.process_start_time for p in pods), 5, "first scrapes"
            )
            first = pods[1].metrics.process_start_time
            scrapes = pods[1].metrics.scraped_at
            await async_wait_until(lambda: pods[1].metrics.scraped_at > scrapes, 5, "rescrape")
            assert restarted == []

            await pool.restart(1)
            await async_wait_until(lambda: restarted, 5, "restart seen")
            assert pods[1].metrics.process_start_time != first
            seen = pods[1].metrics.scraped_at
            await async_wait_until(lambda: pods[1].metrics.scraped_at > seen, 5, "rescrape")
            assert restarted == [pool.pods[1].http_address]
        finally:
            await scraper.stop()


def _held(index: MemoryBlockIndex, pod: str, model: str) -> int:
    keys = block_keys(PROMPT, 16, KeyScope(model))
    hit = index.lookup_sync(keys, [pod]).get(pod)
    return 0 if hit is None else hit.blocks


async def test_reset_pod_drops_a_restarted_pods_blocks_and_replays_its_buffer() -> None:
    async with sim_pods(1) as pool:
        handle = pool.pods[0]
        index, ingest = MemoryBlockIndex(), IngestState()
        events = KVEventManager(index, ingest, default_model=MODEL)
        await events.add_endpoint(handle.endpoint())
        await events.start()
        address = handle.http_address
        try:
            await _complete(handle.url, PROMPT)
            await async_wait_until(lambda: _held(index, address, MODEL) == 4, 5, "blocks")
            # Same process: a reset replays its buffer, so nothing is lost.
            assert await events.reset_pod(address)
            assert _held(index, address, MODEL) == 4

            # A new process that has published nothing: the stream cannot tell, the reset
            # drops the stale blocks.
            await pool.restart(0)
            assert _held(index, address, MODEL) == 4
            assert await events.reset_pod(address)
            assert _held(index, address, MODEL) == 0
            assert not await events.reset_pod("10.9.9.9:1")  # not a pool member
        finally:
            await events.stop()


async def test_set_model_rekeys_a_pod_learned_late() -> None:
    async with sim_pods(1) as pool:
        handle = pool.pods[0]
        index, ingest = MemoryBlockIndex(), IngestState()
        looked_up: list[str] = []

        def model_of(endpoint: Endpoint) -> str | None:
            looked_up.append(endpoint.address)
            return None  # not known yet

        events = KVEventManager(index, ingest, model_of=model_of)
        await events.add_endpoint(handle.endpoint())
        await events.start()
        address = handle.http_address
        try:
            assert looked_up == [address]
            await _complete(handle.url, PROMPT)
            await async_wait_until(lambda: _held(index, address, "") == 4, 5, "blocks")
            assert _held(index, address, MODEL) == 0
            assert await events.set_model(address, MODEL)
            assert _held(index, address, MODEL) == 4
            assert _held(index, address, "") == 0
            assert ingest.model(address) == MODEL
            assert not await events.set_model(address, MODEL)  # nothing to change
        finally:
            await events.stop()


async def _complete(url: str, prompt: list[int]) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()

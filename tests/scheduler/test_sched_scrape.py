"""/metrics parsing on real vLLM captures, and the scraper against real HTTP servers."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from prometheus_client import REGISTRY
from support.http_server import LocalHTTPServer
from support.net import async_wait_until
from support.paths import VLLM_FIXTURES

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.scrape import MetricsParseError, MetricsScraper, parse_vllm_metrics
from smart_epp.framework.types import Endpoint


def fixture(name: str) -> str:
    return (VLLM_FIXTURES / name).read_text()


def test_parses_vllm_scheduler_signals_from_real_pages():
    during = parse_vllm_metrics(fixture("basic/metrics.during.txt"))
    assert (during.running, during.waiting) == (4, 0)
    assert (during.block_size, during.num_gpu_blocks) == (32, 65536)
    assert during.prefix_cache_queries == 1536 and during.prefix_cache_hits == 512

    eviction = parse_vllm_metrics(fixture("eviction/metrics.during.txt"))
    assert (eviction.running, eviction.waiting) == (1, 3)
    assert eviction.kv_usage == pytest.approx(12 / 23)
    assert eviction.num_gpu_blocks == 24


def test_lora_requests_info_takes_the_newest_series():
    during = parse_vllm_metrics(fixture("lora/metrics.during.txt"))
    assert during.running_adapters == frozenset({"lora-a"})
    assert during.max_loras == 1
    # After the run three series persist; the newest says nothing is loaded.
    after = parse_vllm_metrics(fixture("lora/metrics.after.txt"))
    assert after.running_adapters == frozenset() and after.waiting_adapters == frozenset()


def test_every_recorded_poll_parses_to_the_recorded_counts():
    rows = [
        json.loads(line) for line in (VLLM_FIXTURES / "lora/metrics.during.series.jsonl").open()
    ]
    assert rows
    for row in rows:
        m = parse_vllm_metrics("\n".join(row["lines"]))
        assert (m.running, m.waiting) == (row["num_requests_running"], row["num_requests_waiting"])


def test_sglang_names_and_data_parallel_engines():
    sglang = parse_vllm_metrics(
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{model_name="m"} 7\n'
        'sglang:num_running_reqs{model_name="m"} 3\n'
        'sglang:token_usage{model_name="m"} 0.42\n'
    )
    assert (sglang.waiting, sglang.running, sglang.kv_usage) == (7, 3, 0.42)
    dp = parse_vllm_metrics(
        'vllm:num_requests_waiting{engine="0"} 2.0\n'
        'vllm:num_requests_waiting{engine="1"} 5.0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.1\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.6\n'
    )
    assert (dp.waiting, dp.kv_usage) == (7, 0.6)


def test_malformed_lines_are_counted_and_dropped():
    name = "smart_epp_metrics_malformed_lines_total"
    before = REGISTRY.get_sample_value(name) or 0
    page = (
        'vllm:num_requests_waiting{engine="0"} 4\n'
        'vllm:num_requests_running{engine="0" 2\n'  # unclosed labels
        "vllm:kv_cache_usage_perc{} not-a-number\n"
        "vllm:some_other_metric{} garbage\n"  # unknown names are not our business
    )
    m = parse_vllm_metrics(page)
    assert (m.waiting, m.running, m.kv_usage) == (4, 0, 0.0)
    assert REGISTRY.get_sample_value(name) == before + 2
    with pytest.raises(MetricsParseError):
        parse_vllm_metrics("<html>502 Bad Gateway</html>")


class MetricsPod(LocalHTTPServer):
    """A real HTTP server exposing a recorded vLLM /metrics page, which can break."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.page = page
        self.mode = "ok"  # ok | error | hang | garbage
        self.hits = 0

    async def _metrics(self, _: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.mode == "error":
            return web.Response(status=500, text="engine dead")
        if self.mode == "hang":
            await asyncio.sleep(1.0)
        if self.mode == "garbage":
            return web.Response(text="<html>oops</html>")
        return web.Response(text=self.page, content_type="text/plain")

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self._metrics)


@pytest.fixture
async def pods():
    servers = [
        MetricsPod(fixture("basic/metrics.during.txt")),
        MetricsPod(fixture("eviction/metrics.during.txt")),
    ]
    for s in servers:
        await s.start()
    yield servers
    for s in servers:
        await s.stop()


async def test_scraper_fills_metrics_and_recovers_after_failures(pods):
    store = Datastore()
    store.set_endpoints(Endpoint(address=p.address) for p in pods)
    scraper = MetricsScraper(store, interval_s=0.02, timeout_s=0.3, stale_after_s=0.5)
    await scraper.start()
    try:
        first, second = (store.get(p.address) for p in pods)
        await async_wait_until(
            lambda: first.metrics.running == 4 and second.metrics.waiting == 3, 5, "first scrape"
        )
        assert not scraper.stale(first)

        pods[1].mode = "error"
        await async_wait_until(lambda: not second.ready, 5, "pod leaves after failed scrapes")
        assert first.ready  # the healthy pod is untouched
        assert [p.address for p in store.ready_pods()] == [first.address]

        pods[1].mode = "ok"
        await async_wait_until(lambda: second.ready, 5, "pod comes back")
        assert second.metrics.consecutive_failures == 0

        pods[1].mode = "hang"  # timeouts count as failures too
        await async_wait_until(lambda: not second.ready, 5, "pod leaves after timeouts")
        await async_wait_until(lambda: scraper.stale(second), 5, "metrics go stale")
        pods[1].mode = "garbage"  # answering with something else is not recovery
        hits = pods[1].hits
        await async_wait_until(lambda: pods[1].hits > hits + 2, 5, "more scrapes")
        assert not second.ready
        pods[1].mode = "ok"
        await async_wait_until(lambda: second.ready and not scraper.stale(second), 5, "back")
    finally:
        await scraper.stop()


async def test_scraper_follows_pool_changes(pods):
    store = Datastore()
    store.set_endpoints([Endpoint(address=pods[0].address)])
    scraper = MetricsScraper(store, interval_s=0.02)
    await scraper.start()
    try:
        await async_wait_until(lambda: pods[0].hits > 0, 5, "first pod scraped")
        store.set_endpoints([Endpoint(address=pods[1].address)])
        await async_wait_until(
            lambda: store.get(pods[1].address).metrics.waiting == 3, 5, "new pod scraped"
        )
        hits = pods[0].hits
        seen = pods[1].hits
        await async_wait_until(lambda: pods[1].hits > seen + 3, 5, "more scrapes")
        assert pods[0].hits <= hits + 1  # the removed pod is no longer polled
    finally:
        await scraper.stop()

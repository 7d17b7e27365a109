"""The /metrics page of real vLLM pods has every series the gateway's scraper reads."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from support.net import wait_until
from vllm_pods import BLOCK_SIZE, VllmPod, completion_body, unique_prompt

from smart_epp.epp.scrape import parse_vllm_metrics
from smart_epp.framework.types import PodMetrics

pytestmark = pytest.mark.real_vllm

GATEWAY_GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
)
GATEWAY_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def samples(pod: VllmPod) -> dict[str, list[Sample]]:
    by_name: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(pod.get_text("/metrics")):
        for sample in family.samples:
            by_name.setdefault(sample.name, []).append(sample)
    return by_name


@pytest.mark.parametrize("which", ["plain", "lora"])
def test_queue_kv_usage_and_cache_config_series_are_published(vllm_pods, which: str) -> None:
    pod: VllmPod = getattr(vllm_pods, which)
    page = samples(pod)
    for name in GATEWAY_GAUGES + GATEWAY_COUNTERS:
        assert name in page, f"{name} missing from {pod.url}/metrics"
        assert page[name][0].labels.get("model_name") == "tiny"
    usage = page["vllm:kv_cache_usage_perc"][0].value
    assert 0.0 <= usage <= 1.0
    (config,) = page["vllm:cache_config_info"]
    assert config.labels["block_size"] == str(BLOCK_SIZE)
    assert config.labels["num_gpu_blocks"] == str(pod.config.num_gpu_blocks)
    assert config.labels["enable_prefix_caching"] == "True"


def test_prefix_cache_counters_count_a_repeated_prompt(pod_a: VllmPod) -> None:
    prompt = unique_prompt("metrics", words=100)
    pod_a.post_json("/v1/completions", completion_body(prompt, max_tokens=1))
    before = samples(pod_a)
    response = pod_a.post_json("/v1/completions", completion_body(prompt, max_tokens=1))
    after = samples(pod_a)
    prompt_tokens = response["usage"]["prompt_tokens"]
    cached = response["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0

    def value(page: dict[str, list[Sample]], name: str) -> float:
        return page[name][0].value

    queries = value(after, "vllm:prefix_cache_queries_total") - value(
        before, "vllm:prefix_cache_queries_total"
    )
    hits = value(after, "vllm:prefix_cache_hits_total") - value(
        before, "vllm:prefix_cache_hits_total"
    )
    assert (queries, hits) == (prompt_tokens, cached)


def test_lora_info_names_max_loras_and_the_adapters_used(pod_b: VllmPod, pod_a: VllmPod) -> None:
    assert "vllm:lora_requests_info" not in samples(pod_a)  # no LoRA, no series
    body = completion_body(unique_prompt("lora-metrics"), max_tokens=2, model="lora-b")
    pod_b.post_json("/v1/completions", body)
    series = samples(pod_b)["vllm:lora_requests_info"]
    assert {s.labels["max_lora"] for s in series} == {"1"}
    # The value is the time the label set was last written: the newest is the current one.
    newest = max(series, key=lambda s: s.value)
    assert set(newest.labels) >= {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    seen = {name for s in series for name in s.labels["running_lora_adapters"].split(",")}
    assert "lora-b" in seen


def poll_parsed_until(
    pod: VllmPod, done: Callable[[PodMetrics], bool], give_up: Callable[[], bool] = lambda: False
) -> PodMetrics | None:
    """The first parsed page that satisfies `done`; None once `give_up` holds first."""
    seen: list[PodMetrics] = []

    def check() -> bool:
        seen.append(parse_vllm_metrics(pod.get_text("/metrics")))
        return done(seen[-1]) or give_up()

    wait_until(check, timeout=60, what=f"{pod.url}/metrics to show the load")
    return seen[-1] if done(seen[-1]) else None


def all_done(futures: list[Future[Any]]) -> bool:
    return all(f.done() for f in futures)


def page_while_running(
    pod: VllmPod, batch: Callable[[int], list[dict[str, Any]]], shows: Callable[[PodMetrics], bool]
) -> tuple[PodMetrics, int]:
    """A parsed page on which `shows` holds while a batch runs, and the prompt tokens sent.

    A page shows a request only while it runs; on a busy host a whole batch can finish
    between two scrapes, so a batch that did is followed by a fresh one (three at most).
    """
    prompt_tokens = 0
    for attempt in range(3):
        bodies = batch(attempt)
        with ThreadPoolExecutor(len(bodies)) as pool:
            sent = [pool.submit(pod.post_json, "/v1/completions", b) for b in bodies]
            finished = partial(all_done, sent)
            page = poll_parsed_until(pod, shows, give_up=finished)
            prompt_tokens += sum(f.result()["usage"]["prompt_tokens"] for f in sent)
        if page is not None:
            return page, prompt_tokens
    raise AssertionError(f"three batches finished without a page of {pod.url}/metrics showing them")


def test_gateway_parser_reads_real_load_kv_usage_and_cache_config(pod_a: VllmPod) -> None:
    idle = parse_vllm_metrics(pod_a.get_text("/metrics"))
    assert (idle.block_size, idle.num_gpu_blocks) == (BLOCK_SIZE, pod_a.config.num_gpu_blocks)
    busy, prompt_tokens = page_while_running(
        pod_a,
        lambda attempt: [
            completion_body(unique_prompt(f"load{attempt}.{i}", words=150), max_tokens=600)
            for i in range(3)
        ],
        lambda m: m.running + m.waiting >= 2 and m.kv_usage > 0,
    )
    assert busy.kv_usage <= 1.0
    after = poll_parsed_until(pod_a, lambda m: m.running + m.waiting == 0)
    assert after is not None
    assert after.prefix_cache_queries >= idle.prefix_cache_queries + prompt_tokens


def test_gateway_parser_reads_the_running_adapter(pod_b: VllmPod) -> None:
    # vLLM refreshes lora_requests_info and num_requests_running at different moments
    # (on a busy machine a page can show the adapter running and 0 requests): wait
    # for a page on which the request shows in both.
    busy, _ = page_while_running(
        pod_b,
        lambda attempt: [
            {
                **completion_body(unique_prompt(f"adapter{attempt}", words=100), max_tokens=300),
                "model": "lora-a",
            }
        ],
        lambda m: "lora-a" in m.running_adapters and m.running >= 1,
    )
    assert busy.max_loras == 1

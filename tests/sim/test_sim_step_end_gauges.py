"""Gauges change when a step ends, as vLLM's do: a reader mid-step sees the previous step."""

from __future__ import annotations

import asyncio

import aiohttp
from simnet import sample, scrape
from support.net import async_wait_until

from smart_epp.benchmarks.sim.engine import EngineConfig, SimEngine, SimRequest
from smart_epp.benchmarks.sim.pool import run_pool
from smart_epp.benchmarks.sim.profiles import get_profile


def test_engine_gauges_are_those_of_the_last_step_that_ended():
    engine = SimEngine(EngineConfig(block_size=16, num_blocks=1000, hash_seed="x"))
    engine.add_request(SimRequest("a", list(range(1, 801)), max_tokens=3), 0.0)
    first = engine.step(0.0)
    mid = first.start + first.duration / 2
    m = engine.snapshot_metrics(mid)
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage_perc) == (0, 0, 0)
    # A request that arrives during the step is not counted until a step ends after it.
    engine.add_request(SimRequest("b", list(range(900, 1700)), max_tokens=3), mid)
    assert engine.snapshot_metrics(mid).num_requests_waiting == 0
    m = engine.snapshot_metrics(first.end)
    assert (m.num_requests_running, m.num_requests_waiting) == (1, 0)
    assert m.kv_cache_usage_perc > 0
    second = engine.step(first.end)
    assert engine.snapshot_metrics(second.end - 1e-9).num_requests_running == 1
    assert engine.snapshot_metrics(second.end).num_requests_running == 2


async def test_a_scrape_during_a_long_prefill_reads_the_previous_step():
    # A 20k-token cold prompt on h100-llama3-8b in one step: about 1 s of prefill.
    profile = get_profile("h100-llama3-8b").model_copy(update={"max_num_batched_tokens": 32768})
    async with run_pool(1, profile=profile, time_scale=1.0) as pool, aiohttp.ClientSession() as s:
        pod = pool.pods[0]
        engine = pod.pod.engine
        body = {"model": "sim-model", "prompt": list(range(100, 20_100)), "max_tokens": 150}
        task = asyncio.create_task(s.post(f"{pod.url}/v1/completions", json=body))
        await async_wait_until(lambda: engine.running, what="the prefill step started")
        during = await scrape(s, pod.metrics_url)
        assert engine.running and engine.running[0].num_outputs <= 1  # still that request
        assert sample(during, "vllm:num_requests_running") == 0
        assert sample(during, "vllm:kv_cache_usage_perc") == 0

        async def shows_running() -> bool:
            return sample(await scrape(s, pod.metrics_url), "vllm:num_requests_running") == 1

        await async_wait_until(shows_running, what="the gauge after the step ended")
        async with await task as resp:
            assert resp.status == 200


async def test_context_limit_is_enforced_like_vllm_0_32():
    profile = get_profile("cpu-tiny").model_copy(update={"max_model_len": 256})
    async with run_pool(1, profile=profile, time_scale=0.01) as pool, aiohttp.ClientSession() as s:
        url = pool.pods[0].url
        long = {"model": "sim-model", "prompt": list(range(1, 261)), "max_tokens": 1}
        async with s.post(f"{url}/v1/completions", json=long) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        # The body vLLM 0.32 sends for a 260-token prompt to a 256-token model.
        assert err == {
            "message": "This model's maximum context length is 256 tokens. However, your "
            "prompt contains 260 input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt. "
            "(parameter=input_tokens, value=260)",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
        # A prompt that fits: max_tokens is clamped to the room left (250 + 10 -> 6).
        fits = {**long, "prompt": list(range(1, 251)), "max_tokens": 10}
        async with s.post(f"{url}/v1/completions", json=fits) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["completion_tokens"] == 6

"""Live mode: real HTTP streaming through real Envoy and an in-process epp to sim pods."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from support.envoy import async_running_envoy
from support.net import free_port

from smart_epp.benchmarks.replay.arrivals import poisson_arrivals
from smart_epp.benchmarks.replay.live import LiveOptions, run_live
from smart_epp.benchmarks.replay.report import summarize
from smart_epp.benchmarks.replay.traces import (
    SharedPrefixSpec,
    TraceRequest,
    generate_shared_prefix,
)
from smart_epp.benchmarks.sim.pool import run_pool
from smart_epp.epp.serve_cmd import ServeOptions, serve
from smart_epp.epp.server import EppServer

MODEL = "sim-model"


def shared_prefix_requests(
    *, groups: int, per_group: int, system_len: int, output_len: int, seed: int
) -> list[TraceRequest]:
    spec = SharedPrefixSpec(
        num_groups=groups,
        num_prompts_per_group=per_group,
        system_prompt_len=system_len,
        question_len=8,
        output_len=output_len,
    )
    return generate_shared_prefix(spec, seed=seed, model=MODEL)


@contextlib.asynccontextmanager
async def epp_in_process(endpoints: list[str]) -> AsyncIterator[EppServer]:
    stop = asyncio.Event()
    started: asyncio.Future[EppServer] = asyncio.get_running_loop().create_future()
    options = ServeOptions(
        grpc_port=free_port(),
        health_port=free_port(),
        metrics_port=free_port(),
        host="127.0.0.1",
        endpoints=endpoints,
    )
    task = asyncio.create_task(serve(options, stop=stop, on_started=started.set_result))
    try:
        yield await asyncio.wait_for(started, 20)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


@pytest.mark.envoy
async def test_live_replay_through_envoy_completes_every_request() -> None:
    # Two request shapes on purpose: long unique prompts must take longer to first token
    # than short ones, measured by the client over real streaming HTTP.
    short = shared_prefix_requests(groups=2, per_group=6, system_len=40, output_len=12, seed=1)
    long = shared_prefix_requests(groups=6, per_group=1, system_len=4000, output_len=12, seed=2)
    requests = [*short, *long]
    for i, r in enumerate(requests):
        r.index = i
    arrivals = poisson_arrivals(len(requests), 20.0, seed=0)
    async with (
        run_pool(2, block_size=16, model=MODEL, time_scale=1.0) as pool,
        epp_in_process([p.http_address for p in pool.pods]) as server,
        async_running_envoy(epp_port=server.grpc_port) as envoy,
    ):
        done: list[int] = []
        results = await run_live(
            requests,
            arrivals,
            LiveOptions(target=envoy.url, concurrency=4),
            on_done=lambda r: done.append(r.index),
        )
    assert sorted(done) == list(range(len(requests)))
    assert all(r.ok and r.status == 200 for r in results), [r.status for r in results]
    for r in results:
        assert r.ttft_s is not None and r.e2e_s is not None
        assert 0 < r.ttft_s < r.e2e_s
        assert r.output_tokens == 12
    ttft_short = sorted(r.ttft_s for r in results[: len(short)] if r.ttft_s)
    ttft_long = sorted(r.ttft_s for r in results[len(short) :] if r.ttft_s)
    assert ttft_long[len(ttft_long) // 2] > ttft_short[len(ttft_short) // 2]
    # 4,000 uncached tokens at the profile's 25k tokens/s take at least 0.16 s to prefill.
    assert min(ttft_long) >= 0.15
    s = summarize(results, [])
    assert s.completed == len(requests) and s.failed == 0
    assert s.tpot_p50_s is not None and s.tpot_p50_s > 0
    # The short prompts of a group share their first blocks; the pods report hits.
    assert sum(r.cached_tokens for r in results) > 0


async def test_live_failures_are_counted_with_their_status() -> None:
    requests = shared_prefix_requests(groups=1, per_group=3, system_len=600, output_len=4, seed=0)
    arrivals = [0.0, 0.0, 0.0]
    async with run_pool(1, block_size=16, model=MODEL, time_scale=0.01, max_model_len=256) as p:
        rejected = await run_live(requests, arrivals, LiveOptions(target=p.pods[0].url))
    assert [r.status for r in rejected] == [400, 400, 400]
    assert not any(r.ok for r in rejected)
    unreachable = await run_live(
        requests, arrivals, LiveOptions(target=f"http://127.0.0.1:{free_port()}")
    )
    assert all(not r.ok and r.status == "ClientConnectorError" for r in unreachable)
    assert summarize([*rejected, *unreachable], []).failed == 6

"""Scheduling end to end: client -> real Envoy -> epp (ext_proc, default predicted-TTFT
scheduler) -> 4 simulated vLLM pods, with the pods' real KV events (ZeroMQ), /metrics
scrapes and /tokenize, wired on this event loop the way `epp serve` wires them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from support.envoy import EnvoyProcess, async_running_envoy
from support.net import async_wait_until
from support.relays import MetricsRelay

from smart_epp.benchmarks.sim.pool import PodHandle, SimPool, run_pool
from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.scheduler import PipelineScheduler, build_scheduler
from smart_epp.epp.scrape import MetricsScraper
from smart_epp.epp.server import EppServer
from smart_epp.framework.lifecycle import FlowRequest, RoutedObserver
from smart_epp.framework.types import Api, Decision, LLMRequest
from smart_epp.kv_index.ingest import IngestState
from smart_epp.kv_index.manager import KVEventManager
from smart_epp.kv_index.memory import MemoryBlockIndex

pytestmark = pytest.mark.envoy

MODEL = "tiny"
LORAS = {"lora-a": "/models/tiny-lora-a", "lora-b": "/models/tiny-lora-b"}
WORDS = [
    "route",
    "prefix",
    "cache",
    "token",
    "pod",
    "queue",
    "batch",
    "gateway",
    "model",
    "stream",
    "latency",
    "shard",
]


def text(seed: int, words: int) -> str:
    return " ".join(
        WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] + str(i % 13) for i in range(words)
    )


@dataclass
class DecisionLog(RoutedObserver):
    """Every decision the flow handed to Envoy (with each candidate's score components),
    by the request's prompt."""

    decisions: list[tuple[str | None, Decision]] = field(default_factory=list)

    def on_routed(self, flow: FlowRequest) -> None:
        if flow.decision is not None:
            self.decisions.append((flow.request.prompt, flow.decision))

    def last_for(self, prompt: str) -> Decision | None:
        return next((d for p, d in reversed(self.decisions) if p == prompt), None)


@dataclass
class Stack:
    pool: SimPool
    datastore: Datastore
    index: MemoryBlockIndex
    ingest: IngestState
    scheduler: PipelineScheduler
    envoy: EnvoyProcess
    http: aiohttp.ClientSession
    pod1_metrics: MetricsRelay
    routed: DecisionLog

    def pod(self, i: int) -> PodHandle:
        return self.pool.pods[i]

    def served(self) -> list[int]:
        return [sum(h.pod.engine.stats.request_success.values()) for h in self.pool.pods]

    async def direct(self, i: int, body: dict) -> dict:
        async with self.http.post(f"{self.pod(i).url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def via_gateway(self, body: dict) -> tuple[int, dict]:
        """Sends through Envoy; returns which pod served it and the response."""
        before = self.served()
        async with self.http.post(f"{self.envoy.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        after = self.served()
        [pod] = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]
        return pod, answer

    async def decision_for(self, prompt: str) -> Decision:
        """The decision for the last request with `prompt` (the flow logs it after the
        reply went to Envoy, so it can come after the answer)."""
        log = self.routed
        await async_wait_until(lambda: log.last_for(prompt) is not None, 10, "the decision")
        decision = log.last_for(prompt)
        assert decision is not None
        return decision


@contextlib.asynccontextmanager
async def stack(**sim_options: object) -> AsyncIterator[Stack]:
    async with run_pool(4, model=MODEL, block_size=16, loras=LORAS, **sim_options) as pool:
        relay = MetricsRelay(pool.pods[1].metrics_url)
        await relay.start()
        endpoints = [h.endpoint() for h in pool.pods]
        endpoints[1] = dataclasses.replace(endpoints[1], metrics_url=relay.url)
        datastore = Datastore()
        index = MemoryBlockIndex()
        ingest = IngestState()
        events = KVEventManager(index, ingest, default_model=MODEL)
        datastore.add_listener(events.on_endpoint_added, events.on_endpoint_removed)
        datastore.set_endpoints(endpoints)
        await events.start()
        scraper = MetricsScraper(datastore, interval_s=0.05, timeout_s=0.5, failure_threshold=3)
        await scraper.start()
        scheduler = build_scheduler(
            "default", index=index, ingest_state=ingest, base_model=MODEL, seed=3, explain=True
        )
        routed = DecisionLog()
        server = EppServer(
            RequestFlow(scheduler, datastore, hooks=[routed]),
            adapter_resolver=lambda m: m if m in LORAS else None,
        )
        await server.start(grpc_port=0, health_port=0, metrics_port=0, host="127.0.0.1")
        try:
            async with (
                async_running_envoy(epp_port=server.grpc_port, secure_serving=False) as envoy,
                aiohttp.ClientSession() as http,
            ):
                await async_wait_until(
                    lambda: all(p.metrics.scraped_at > 0 for p in datastore.pods()),
                    10,
                    "first scrape of every pod",
                )
                yield Stack(pool, datastore, index, ingest, scheduler, envoy, http, relay, routed)
        finally:
            await relay.close()
            await server.stop(0)
            await scraper.stop()
            await events.stop()
            await scheduler.aclose()


async def warm(s: Stack, i: int, prefix: str) -> None:
    """Sends `prefix` straight to pod i and waits until the index, from the pod's KV events,
    says pod i holds it."""
    await s.direct(i, {"model": MODEL, "prompt": f"{prefix} warm", "max_tokens": 1})
    await wait_held(s, i, prefix)


async def wait_held(s: Stack, i: int, prompt: str) -> None:
    """Waits until the index says pod i holds (most of) `prompt`, learnt from its events."""
    address = s.pod(i).http_address

    async def held() -> bool:
        ids = await s.scheduler.tokenizer.tokenize(_completion(prompt), [s.datastore.get(address)])
        size = s.ingest.block_size(address)
        if not ids or not size:
            return False
        hits = await s.scheduler.prefix_matcher.match(ids, _completion(prompt), {address: size})
        return address in hits and hits[address].blocks >= len(ids) // size - 1

    await async_wait_until(held, 10, f"pod {i} holding the prefix per its KV events")


def _completion(prompt: str) -> LLMRequest:
    return LLMRequest(
        request_id="probe", path="/v1/completions", api=Api.COMPLETIONS, model=MODEL, prompt=prompt
    )


async def test_a_prefix_warmed_directly_on_pod_3_draws_requests_there():
    async with stack() as s:
        prefix = text(1, 600)
        await warm(s, 3, prefix)
        for n in range(3):
            body = {"model": MODEL, "prompt": f"{prefix} question {n}", "max_tokens": 2}
            pod, answer = await s.via_gateway(body)
            assert pod == 3
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # A prompt nobody holds goes anywhere; the prefix is not what pulls everything to 3.
        others = [(await s.via_gateway({"model": MODEL, "prompt": text(50 + n, 200),
                                        "max_tokens": 2}))[0] for n in range(8)]  # fmt: skip
        assert set(others) != {3}


async def test_b_lora_request_prefers_the_pod_with_the_adapter_loaded():
    async with stack() as s:
        # A long lora-a request keeps the adapter loaded on pod 2.
        holder = asyncio.create_task(
            s.direct(2, {"model": "lora-a", "prompt": text(9, 50), "max_tokens": 400})
        )
        try:
            address = s.pod(2).http_address
            await async_wait_until(
                lambda: "lora-a" in s.datastore.get(address).metrics.running_adapters,
                10,
                "pod 2 reporting lora-a running",
            )
            for n in range(4):
                body = {"model": "lora-a", "prompt": text(20 + n, 120), "max_tokens": 2}
                pod, _ = await s.via_gateway(body)
                assert pod == 2
        finally:
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await holder


async def test_c_a_saturated_queue_sends_requests_elsewhere():
    async with stack(max_num_seqs=2, time_scale=0.5) as s:
        prefix = text(2, 400)
        await warm(s, 0, prefix)
        pod, _ = await s.via_gateway({"model": MODEL, "prompt": prefix + " a", "max_tokens": 2})
        assert pod == 0  # the warm prefix pulls the request while pod 0 is idle
        hogs = [
            asyncio.create_task(
                s.direct(0, {"model": MODEL, "prompt": text(30 + n, 80), "max_tokens": 300})
            )
            for n in range(5)  # two run, three wait
        ]
        try:
            address = s.pod(0).http_address
            await async_wait_until(
                lambda: s.datastore.get(address).metrics.waiting >= 3, 10, "pod 0 queueing"
            )
            for n in range(3):
                body = {"model": MODEL, "prompt": f"{prefix} b{n}", "max_tokens": 2}
                pod, _ = await s.via_gateway(body)
                assert pod != 0
        finally:
            for hog in hogs:
                hog.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)


async def test_d_a_pod_without_metrics_leaves_and_comes_back():
    async with stack() as s:
        prefix = text(3, 400)
        await warm(s, 1, prefix)
        pod_state = s.datastore.get(s.pod(1).http_address)
        pod, _ = await s.via_gateway({"model": MODEL, "prompt": f"{prefix} a", "max_tokens": 2})
        assert pod == 1  # its cached prefix draws the request while it is a candidate

        await s.pod1_metrics.stop()  # /metrics stops answering; the pod itself still serves
        await async_wait_until(lambda: not pod_state.ready, 10, "pod 1 out of the set")
        for n in range(3):
            pod, _ = await s.via_gateway({"model": MODEL, "prompt": f"{prefix} b{n}",
                                          "max_tokens": 2})  # fmt: skip
            assert pod != 1

        await s.pod1_metrics.start()
        await async_wait_until(lambda: pod_state.ready, 10, "pod 1 back in the set")
        # Meanwhile another pod cached that prefix too; a prefix only pod 1 holds shows it
        # is a candidate again.
        fresh = text(4, 400)
        await warm(s, 1, fresh)
        pod, _ = await s.via_gateway({"model": MODEL, "prompt": f"{fresh} c", "max_tokens": 2})
        decision = await s.decision_for(f"{fresh} c")
        explain, back = decision.explain, s.pod(1).http_address
        # Pod 1 was a candidate again, credited with the prefix it alone holds...
        assert explain[back]["hit_tokens"] > 0, explain
        assert all(row["hit_tokens"] == 0 for a, row in explain.items() if a != back), explain
        # ...and the request went where the picker sent it: normally pod 1, but a pod's
        # learned speed, which this shared machine's load moves, can outweigh the prefix.
        assert s.pod(pod).http_address == decision.endpoints[0].address, explain

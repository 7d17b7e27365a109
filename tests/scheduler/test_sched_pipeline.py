"""The scheduling pipeline end to end in-process: real KV index, keys and tokenizer."""

from __future__ import annotations

import json
import logging
import textwrap

import pytest
from prometheus_client import REGISTRY
from sched_helpers import pod, request
from support.paths import TINY_MODEL, VLLM_FIXTURES

from smart_epp.epp.config import parse_config
from smart_epp.epp.datastore import Datastore
from smart_epp.epp.errors import RequestError
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.scheduler import build_scheduler
from smart_epp.framework.types import Endpoint, Outcome, Usage
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.lookup import IndexPrefixMatcher
from smart_epp.kv_index.memory import MemoryBlockIndex


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def warm(index: MemoryBlockIndex, address: str, tokens: list[int], block_size: int = 16,
         model: str = "tiny", adapter: str | None = None) -> None:  # fmt: skip
    index.add_sync(address, block_keys(tokens, block_size, KeyScope(model, adapter)))


PROMPT = list(range(1000, 1000 + 2048))


async def test_default_routes_to_the_pod_holding_the_prefix():
    index = MemoryBlockIndex()
    pods = [pod(f"10.0.0.{i}:8000") for i in range(4)]
    warm(index, pods[3].address, PROMPT[:1536])
    scheduler = build_scheduler("default", index=index, clock=Clock(), seed=1)
    req = request(tokens=PROMPT[:1536] + [7] * 200)
    decision = await scheduler.schedule(req, pods)
    assert [p.address for p in decision.endpoints] == [pods[3].address]
    assert decision.prompt_token_ids == req.prompt_token_ids
    # Same answer without awaiting, as a replay would ask.
    sync = scheduler.schedule_sync(request(tokens=PROMPT[:1536] + [9] * 200), pods)
    assert sync.endpoints[0].address == pods[3].address


async def test_llmd_precise_and_gie_configs_decide_too():
    index = MemoryBlockIndex()
    pods = [pod(f"p{i}:80") for i in range(3)]
    warm(index, "p1:80", PROMPT[:1024])
    precise = build_scheduler("llmd-precise", index=index, seed=0)
    assert (await precise.schedule(request(tokens=PROMPT[:1100]), pods)).endpoints[
        0
    ].address == "p1:80"
    gie = build_scheduler("gie-default", seed=0)
    pods[0].metrics.waiting = 9
    pods[2].metrics.waiting = 9
    assert (await gie.schedule(request(prompt="hello " * 50), pods)).endpoints[0].address == "p1:80"


async def test_a_saturated_queue_sends_requests_elsewhere():
    index = MemoryBlockIndex()
    pods = [pod("a:1"), pod("b:1")]
    warm(index, "a:1", PROMPT[:512])
    scheduler = build_scheduler("default", index=index, seed=0)
    req = lambda: request(tokens=PROMPT[:512] + [5] * 32)  # noqa: E731
    assert (await scheduler.schedule(req(), pods)).endpoints[0].address == "a:1"
    pods[0].metrics.waiting = 40  # 40 queued prompts ahead outweigh re-prefilling 544 tokens
    pods[0].metrics.running = 16
    assert (await scheduler.schedule(req(), pods)).endpoints[0].address == "b:1"


async def test_lora_request_prefers_the_pod_with_the_adapter():
    pods = [
        pod("a:1", max_loras=1, adapters=("other",)),
        pod("b:1", max_loras=1, adapters=("sql",)),
        pod("c:1", max_loras=1),
    ]
    scheduler = build_scheduler("default", index=MemoryBlockIndex(), seed=0)
    for _ in range(5):
        decision = await scheduler.schedule(request(tokens=PROMPT[:64], adapter="sql"), pods)
        assert decision.endpoints[0].address == "b:1"
    # Without it loaded anywhere, a pod with a free slot beats one that must evict.
    pods[1].metrics.running_adapters = frozenset({"other"})
    decision = await scheduler.schedule(request(tokens=PROMPT[:64], adapter="sql"), pods)
    assert decision.endpoints[0].address == "c:1"


async def test_adapter_prefix_is_matched_in_the_adapter_scope():
    index = MemoryBlockIndex()
    pods = [pod("a:1"), pod("b:1")]
    warm(index, "a:1", PROMPT[:512], model="tiny")  # base-model blocks
    warm(index, "b:1", PROMPT[:512], model="tiny", adapter="sql")
    scheduler = build_scheduler("llmd-precise", index=index, base_model="tiny", seed=0)
    decision = await scheduler.schedule(request(tokens=PROMPT[:600], adapter="sql"), pods)
    assert decision.endpoints[0].address == "b:1"
    decision = await scheduler.schedule(request(tokens=PROMPT[:600]), pods)
    assert decision.endpoints[0].address == "a:1"


async def test_one_shared_prefix_does_not_pile_onto_one_pod():
    # A burst of requests sharing a long prefix that only p0 holds, each with 64 tokens of
    # its own. Following the prefix costs each one the queue of suffixes ahead of it on p0;
    # once that outweighs prefilling the 2,048-token prefix again elsewhere, requests go
    # to other pods, which then hold the prefix too. Each further copy is priced at the
    # queue on the median pod, so the burst (which never drains here: nothing answers)
    # spreads until the queues it would skip are about as long as a copy's prefill.
    index = MemoryBlockIndex()
    pods = [pod(f"p{i}:1") for i in range(4)]
    warm(index, "p0:1", PROMPT[:2048])
    scheduler = build_scheduler("default", index=index, clock=Clock(), seed=0)
    for i in range(64):
        req = request(tokens=PROMPT[:2048] + [i] * 64)
        decision = await scheduler.schedule(req, pods)
        scheduler.on_routed(req, decision)
        decision.endpoints[0].inflight.requests += 1  # the datastore's bookkeeping
    loads = sorted(p.inflight.requests for p in pods)
    assert loads[-1] <= 40, loads  # not all 64 on p0
    assert loads[1] >= 4, loads  # three pods take a share


async def test_learned_prefill_rate_steers_away_from_a_slow_pod():
    clock = Clock()
    pods = [pod("fast:1"), pod("slow:1")]
    index = MemoryBlockIndex(clock=clock)
    scheduler = build_scheduler("default", index=index, clock=clock, seed=0)
    scorer = scheduler.profile.scorers[0][0]
    for address, ttft in (("slow:1", 2.0), ("fast:1", 0.1)):
        target = next(p for p in pods if p.address == address)
        for _ in range(10):  # a pod's own fit is used from its 8th answer
            req = request(tokens=PROMPT[:1000])
            decision = await scheduler.schedule(req, [target])
            scheduler.on_routed(req, decision)
            clock.now += 10.0  # let the routed backlog drain
            scheduler.on_outcome(
                req, decision, Outcome(address, True, 200, Usage(1000, 100), ttft, now=clock.now)
            )
    probe = (1000, 500_000, 0)  # 1000 cold tokens
    slow, fast = (scorer.learner.predict(a, *probe) for a in ("slow:1", "fast:1"))
    assert slow > 10 * fast
    assert scorer.pods["fast:1"].decode_s_per_token == pytest.approx((10.0 - 0.1) / 100)
    decision = await scheduler.schedule(request(tokens=PROMPT[:1000]), pods)
    assert decision.endpoints[0].address == "fast:1"


async def test_unready_pods_are_never_picked_and_empty_means_503():
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("a:1"), Endpoint("b:1")])
    a, b = datastore.pods()
    a.ready = False
    flow = RequestFlow(build_scheduler("gie-default", seed=0), datastore)
    for _ in range(10):
        chosen = await flow.route(flow.start(request(prompt="x")))
        assert chosen[0].address == "b:1"
    b.ready = False
    with pytest.raises(RequestError) as refused:
        await flow.route(flow.start(request(prompt="x")))
    assert refused.value.status == 503


async def test_fallbacks_follow_the_primary_by_score():
    pods = [pod("a:1", waiting=3), pod("b:1", waiting=0), pod("c:1", waiting=9)]
    scheduler = build_scheduler("gie-default", seed=0, fallbacks=2)
    decision = await scheduler.schedule(request(prompt="x"), pods)
    assert [p.address for p in decision.endpoints] == ["b:1", "a:1", "c:1"]


async def test_explain_line_at_debug_and_duration_metrics(caplog):
    index = MemoryBlockIndex()
    pods = [pod("a:1", waiting=2), pod("b:1")]
    warm(index, "a:1", PROMPT[:256])
    scheduler = build_scheduler("default", index=index, seed=0)
    before = (
        REGISTRY.get_sample_value("inference_extension_scheduler_e2e_duration_seconds_count") or 0
    )
    with caplog.at_level(logging.DEBUG, logger="smart_epp.epp.scheduler"):
        decision = await scheduler.schedule(request(tokens=PROMPT[:300]), pods)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decision ")]
    assert len(lines) == 1
    line = lines[0]
    assert f"picked={decision.endpoints[0].address}" in line
    for component in ("predicted-ttft-scorer=", "wait_s=", "prefill_s=", "ttft_s=", "total="):
        assert line.count(component) == 2  # one per candidate
    assert decision.explain["a:1"]["hit_tokens"] == 256
    after = REGISTRY.get_sample_value("inference_extension_scheduler_e2e_duration_seconds_count")
    assert after == before + 1
    plugin_count = REGISTRY.get_sample_value(
        "inference_extension_plugin_duration_seconds_count",
        {"extension_point": "Scorer", "plugin_type": "predicted-ttft-scorer",
         "plugin_name": "predicted-ttft-scorer"},
    )  # fmt: skip
    assert plugin_count and plugin_count >= 1
    # Without debug logging nothing is collected.
    quiet = await scheduler.schedule(request(tokens=PROMPT[:300]), pods)
    assert quiet.explain == {}


async def test_index_outage_degrades_to_no_cache_information(caplog):
    class BrokenIndex(MemoryBlockIndex):
        async def lookup(self, keys, pods=None):
            raise ConnectionError("index down")

    pods = [pod("a:1"), pod("b:1", waiting=1)]
    scheduler = build_scheduler("default", index=BrokenIndex(), seed=0)
    decision = await scheduler.schedule(request(tokens=PROMPT[:300]), pods)
    assert decision.endpoints[0].address == "a:1"
    assert "prefix lookup failed" in caplog.text


async def test_pods_are_grouped_by_block_size_and_model_from_events():
    index = MemoryBlockIndex()
    pods = [pod("a:1", block_size=None), pod("b:1", block_size=None)]
    sizes = {"a:1": 32, "b:1": 16}
    models = {"a:1": "tiny", "b:1": "other"}
    index.add_sync("b:1", block_keys(PROMPT[:512], 16, KeyScope("other")))
    index.add_sync("a:1", block_keys(PROMPT[:256], 32, KeyScope("tiny")))
    matcher = IndexPrefixMatcher(index, model_of=models.get)
    hits = await matcher.match(PROMPT[:600], request(tokens=PROMPT[:600]), sizes)
    assert (hits["a:1"].blocks, hits["b:1"].blocks) == (8, 32)
    assert matcher.match_sync(PROMPT[:600], request(tokens=[1]), sizes) == hits
    scheduler = build_scheduler(
        "llmd-precise", index=index, block_size_of=sizes.get, model_of=models.get, seed=0
    )
    decision = await scheduler.schedule(request(tokens=PROMPT[:600]), pods)
    assert decision.endpoints[0].address == "b:1"  # 512 of 600 tokens vs 256


async def test_local_tokenizer_config_tokenizes_chat_exactly_like_vllm():
    rows = [json.loads(line) for line in (VLLM_FIXTURES / "basic" / "requests.jsonl").open()]
    chat = next(r for r in rows if r["name"] == "chat_1")
    vllm_ids = chat["prompt_token_ids"]
    config = parse_config(textwrap.dedent(f"""\
        apiVersion: inference.networking.x-k8s.io/v1alpha1
        kind: EndpointPickerConfig
        plugins:
        - type: local-tokenizer
          parameters:
            modelName: tiny
            path: {TINY_MODEL}
        - type: precise-prefix-cache-scorer
          parameters:
            blockSize: 32
        """))  # fmt: skip
    index = MemoryBlockIndex()
    pods = [pod("a:1", block_size=None), pod("b:1", block_size=None)]
    index.add_sync("b:1", block_keys(vllm_ids, 32, KeyScope("tiny")))
    scheduler = build_scheduler(config, index=index, seed=0)
    req = request(messages=chat["request"]["messages"])
    decision = await scheduler.schedule(req, pods)
    assert decision.prompt_token_ids == vllm_ids
    assert decision.endpoints[0].address == "b:1"
    await scheduler.aclose()


@pytest.mark.parametrize("path_line", ["", 'path: ""'])
def test_local_tokenizer_without_a_folder_is_refused_by_name(path_line: str):
    # An empty `path` is no folder either: it must get the same error as a missing one,
    # not reach the tokenizer loader with no path at all.
    config = parse_config(textwrap.dedent(f"""\
        apiVersion: inference.networking.x-k8s.io/v1alpha1
        kind: EndpointPickerConfig
        plugins:
        - name: tiny-tokenizer
          type: local-tokenizer
          parameters:
            modelName: tiny
            {path_line}
        - type: precise-prefix-cache-scorer
        """))  # fmt: skip
    with pytest.raises(ValueError, match="tiny-tokenizer: set `path` or `tokenizerFile`"):
        build_scheduler(config, index=MemoryBlockIndex(), seed=0)


async def test_metrics_can_go_to_the_gateways_own_registry():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    scheduler = build_scheduler("gie-default", registry=registry, record_e2e=False, seed=0)
    await scheduler.schedule(request(prompt="x" * 200), [pod("a:1"), pod("b:1")])
    labels = {"extension_point": "Scorer", "plugin_type": "queue-scorer",
              "plugin_name": "queue-scorer"}  # fmt: skip
    assert (
        registry.get_sample_value("inference_extension_plugin_duration_seconds_count", labels) == 1
    )
    assert (
        registry.get_sample_value("inference_extension_scheduler_e2e_duration_seconds_count")
        is None
    )
    # A second scheduler on the same registry shares the histograms.
    again = build_scheduler("gie-default", registry=registry, record_e2e=False, seed=0)
    await again.schedule(request(prompt="y" * 200), [pod("a:1")])
    assert (
        registry.get_sample_value("inference_extension_plugin_duration_seconds_count", labels) == 2
    )

"""The discrete-event replay: determinism, accounting and sanity of the policies."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from smart_epp.benchmarks.replay.arrivals import poisson_arrivals
from smart_epp.benchmarks.replay.cli import Workload, simulate_policy
from smart_epp.benchmarks.replay.policies.context import PolicyContext
from smart_epp.benchmarks.replay.policies.registry import build_policy
from smart_epp.benchmarks.replay.report import summarize
from smart_epp.benchmarks.replay.sim import (
    SimConfig,
    SimPool,
    Simulation,
    parse_slowdowns,
    pod_address,
)
from smart_epp.benchmarks.replay.traces import (
    SharedPrefixSpec,
    generate_shared_prefix,
    infinite_cache_hit_rate,
)
from smart_epp.framework.lifecycle import FlowRequest, OutcomeObserver, RoutedObserver
from smart_epp.framework.types import Outcome

PODS = 4
SPEC = SharedPrefixSpec(
    num_groups=12, num_prompts_per_group=8, system_prompt_len=512, question_len=64, output_len=8
)


def _workload(qps: float = 5.0, seed: int = 3) -> Workload:
    requests = generate_shared_prefix(SPEC, seed=seed)
    return Workload(requests, poisson_arrivals(len(requests), qps, seed))


def _config() -> SimConfig:
    return SimConfig(pods=PODS, block_size=16)


def test_same_seed_gives_identical_results() -> None:
    wl = _workload()
    for policy in ("random", "power-of-two", "full-information"):
        a = simulate_policy(policy, wl, _config(), seed=7)
        b = simulate_policy(policy, wl, _config(), seed=7)
        assert [(r.pod, r.ttft_s, r.e2e_s, r.cached_tokens) for r in a] == [
            (r.pod, r.ttft_s, r.e2e_s, r.cached_tokens) for r in b
        ]
    c = simulate_policy("random", wl, _config(), seed=8)
    assert [r.pod for r in c] != [r.pod for r in a]


def test_every_request_is_accounted_for_with_sane_latencies() -> None:
    wl = _workload(qps=40.0)
    results = simulate_policy("least-queue", wl, _config(), seed=0)
    assert len(results) == len(wl.requests)
    assert all(r.ok and r.status == 200 for r in results)
    for r in results:
        assert r.ttft_s is not None and r.e2e_s is not None
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.output_tokens == SPEC.output_len
        assert r.pod in {pod_address(i) for i in range(PODS)}
        assert r.cached_tokens % 16 == 0 and r.cached_tokens < r.prompt_tokens
    s = summarize(results, [pod_address(i) for i in range(PODS)])
    assert s.completed == len(results) and s.failed == 0
    assert s.ttft_p50_s is not None and s.ttft_p90_s is not None and s.ttft_p99_s is not None
    assert s.ttft_p50_s <= s.ttft_p90_s <= s.ttft_p99_s


def test_too_long_prompt_fails_with_400_and_others_complete() -> None:
    wl = _workload()
    config = SimConfig(pods=PODS, block_size=16, max_model_len=400)  # prompts are 576 tokens
    results = simulate_policy("round-robin", wl, config, seed=0)
    assert all(not r.ok and r.status == 400 for r in results)
    summary = summarize(results, [])
    assert summary.rejected == len(results) == summary.failed
    assert summary.rejected_reasons == {"longer than max_model_len (400 tokens)": len(results)}


def test_round_robin_hit_rate_matches_random_placement() -> None:
    wl = _workload(qps=5.0)
    results = simulate_policy("round-robin", wl, _config(), seed=0)
    # Round-robin ignores content, so for a shuffled workload a request hits its group's
    # system prompt when any earlier request of its group landed on the same pod:
    # probability 1 - (1 - 1/N)^j after j earlier group members.
    seen: dict[str | None, int] = {}
    expected_hit_tokens = 0.0
    for req in wl.requests:
        j = seen.get(req.group, 0)
        seen[req.group] = j + 1
        expected_hit_tokens += (1 - (1 - 1 / PODS) ** j) * SPEC.system_prompt_len
    predicted = expected_hit_tokens / sum(r.input_tokens for r in wl.requests)
    measured = summarize(results, []).prefix_hit_rate
    assert measured == pytest.approx(predicted, abs=0.06)
    assert measured < 0.9 * infinite_cache_hit_rate(wl.requests, 16)


def test_full_information_hit_rate_is_at_least_every_policys() -> None:
    wl = _workload(qps=5.0)
    pods = [pod_address(i) for i in range(PODS)]
    rates = {
        name: summarize(simulate_policy(name, wl, _config(), seed=0), pods).prefix_hit_rate
        for name in (
            "full-information",
            "round-robin",
            "random",
            "least-queue",
            "power-of-two",
            "sglang-cache-aware",
            "aibrix-prefix-cache",
        )
    }
    ceiling = infinite_cache_hit_rate(wl.requests, 16)
    for name, rate in rates.items():
        assert rate <= rates["full-information"] + 1e-9, (name, rates)
    assert rates["full-information"] >= 0.95 * ceiling
    assert rates["random"] < 0.8 * rates["full-information"]


def test_kv_events_reach_the_sink_through_the_wire_encoding() -> None:
    config = _config()
    pool = SimPool.build(config)
    received: list[tuple[str, int, bytes]] = []

    async def sink(pod: str, seq: int, payload: bytes) -> None:
        received.append((pod, seq, payload))

    base = build_policy("round-robin", PolicyContext(pool, lambda: 0.0, 0, "model"))
    policy = type(base)(base.name, base.scheduler, kv_events=sink)
    wl = _workload()
    asyncio.run(Simulation(config, policy, pool).run(wl.requests[:8], wl.arrivals[:8]))
    from smart_epp.kv_index.events import BlockStored, decode_batch

    assert received
    per_pod: dict[str, list[int]] = {}
    for pod, seq, payload in received:
        per_pod.setdefault(pod, []).append(seq)
        batch, skipped = decode_batch(payload)
        assert skipped == 0
        assert all(isinstance(e, BlockStored) for e in batch.events)
    for seqs in per_pod.values():
        assert seqs == list(range(len(seqs)))


def test_collector_settings_are_restored_after_a_simulation() -> None:
    import gc

    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    simulate_policy("round-robin", _workload(), _config(), seed=1)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() <= frozen


def test_the_replay_drives_the_gateways_request_flow() -> None:
    class Seen(RoutedObserver, OutcomeObserver):
        def __init__(self) -> None:
            self.routed: list[str] = []
            self.outcomes: list[tuple[str, str, bool]] = []

        def on_routed(self, flow: FlowRequest) -> None:
            self.routed.append(flow.request.request_id)

        def on_outcome(self, flow: FlowRequest, outcome: Outcome) -> None:
            self.outcomes.append((flow.request.request_id, outcome.address, outcome.ok))

    wl = _workload(qps=20.0)
    for policy in ("default", "round-robin"):
        seen = Seen()
        results = simulate_policy(policy, wl, _config(), seed=0, hooks=[seen])
        ids = [f"req-{r.index}" for r in results]
        assert sorted(seen.routed) == sorted(ids)  # every replayed request, once
        assert sorted(rid for rid, _, _ in seen.outcomes) == sorted(ids)
        by_id = {rid: (pod, ok) for rid, pod, ok in seen.outcomes}
        assert all(by_id[f"req-{r.index}"] == (r.pod, r.ok) for r in results)


def test_routing_latency_is_charged_in_virtual_time() -> None:
    wl = _workload(qps=0.5)  # requests far apart: no queueing, only the charge differs
    free = simulate_policy("round-robin", wl, SimConfig(pods=PODS, routing_latency_s=0.0), 0)
    slow = simulate_policy("round-robin", wl, SimConfig(pods=PODS, routing_latency_s=0.25), 0)
    for a, b in zip(free, slow, strict=True):
        assert a.pod == b.pod and a.arrival_s == b.arrival_s
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.25, abs=1e-9)
        assert b.e2e_s == pytest.approx(a.e2e_s + 0.25, abs=1e-9)


def test_pod_slowdowns_slow_only_the_pods_they_name() -> None:
    wl = _workload(qps=0.5)  # requests far apart: each answered by an idle pod
    even = SimConfig(pods=2, routing_latency_s=0.0)
    uneven = SimConfig(pods=2, routing_latency_s=0.0, pod_slowdowns=(2.0,))
    a = simulate_policy("round-robin", wl, even, 0)
    b = simulate_policy("round-robin", wl, uneven, 0)
    for x, y in zip(a, b, strict=True):
        assert x.pod == y.pod and x.ttft_s is not None
        factor = 2.0 if x.pod == pod_address(0) else 1.0
        assert y.ttft_s == pytest.approx(factor * x.ttft_s, rel=1e-9)


@pytest.mark.parametrize("text", ["", "1,x", "1,0", "-1", "1,inf", "nan"])
def test_bad_pod_slowdowns_are_refused_with_the_value(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="positive numbers"):
        parse_slowdowns(text)
    assert parse_slowdowns("1, 1.1,1.25") == (1.0, 1.1, 1.25)


class _CheckedPool(SimPool):
    """Records, at every scrape, what the router saw and what the engine held live."""

    seen: list[tuple[int, int]]

    def scrape(self, now: float) -> None:
        super().scrape(now)
        for address, engine in self.engines.items():
            state = self.state(address).metrics
            published = engine.snapshot_metrics(now)
            assert (state.running, state.waiting) == (
                published.num_requests_running,
                published.num_requests_waiting,
            )
            live = len(engine.running) + len(engine.waiting)
            self.seen.append((state.running + state.waiting, live))


def test_scrapes_read_gauges_published_at_step_end() -> None:
    wl = _workload(qps=200.0)  # a burst: the pod is mid-step at most scrapes
    config = SimConfig(pods=1, scrape_interval_s=0.001, routing_latency_s=0.0)
    pool = _CheckedPool.build(config)
    pool.seen = []
    policy = build_policy("round-robin", PolicyContext(pool, lambda: 0.0, 0, config.model))
    asyncio.run(Simulation(config, policy, pool).run(wl.requests, wl.arrivals))
    assert len(pool.seen) > 100
    # Mid-step, the live engine already holds what the published gauges do not show yet.
    assert any(shown != live for shown, live in pool.seen)


def test_the_default_policy_follows_chunked_prefills_through_the_pods_events() -> None:
    """Long prompts at a load that queues them: the KV events the simulated pods publish
    (real wire format, delivered after the step that scheduled each chunk) show the
    default scorer partial prefills, every pod is confirmed, and nothing stays watched
    once every request has ended."""
    spec = SharedPrefixSpec(
        num_groups=16, num_prompts_per_group=3, system_prompt_len=12000, question_len=4000,
        output_len=8,
    )  # fmt: skip
    requests = generate_shared_prefix(spec, seed=5)
    arrivals = poisson_arrivals(len(requests), 20.0, 5)
    config = _config()  # 8,192-token steps: a cold prompt's prefill takes two
    pool = SimPool.build(config)
    box: list[Simulation] = []
    clock = lambda: box[0].now if box else 0.0  # noqa: E731
    policy = build_policy("default", PolicyContext(pool, clock, 0, config.model))
    progress = policy.scheduler.prefill_progress
    partial: list[tuple[int, int]] = []

    class Watch(RoutedObserver):
        def on_routed(self, flow: FlowRequest) -> None:
            for n in range(len(requests)):
                seen = progress.computed(f"req-{n}")
                if seen is not None and 0 < seen[0] < seen[1]:
                    partial.append(seen)

    sim = Simulation(config, policy, pool, hooks=[Watch()])
    box.append(sim)
    results = asyncio.run(sim.run(requests, arrivals, Workload(requests, arrivals).stage_of()))
    assert all(r.ok for r in results)
    assert partial  # prefills seen part-way, chunk by chunk
    assert all(progress.confirmed(address) for address in pool.engines)
    assert len(progress) == 0 and progress.blocks == 0

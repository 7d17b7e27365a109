"""Several pickers of one pool in the replay (`NAME@COUNT`): replicas behind one Envoy,
handed requests in turn, each with its own view of the pods, sharing state through the
real shared-state code on the simulation's virtual clock."""

from __future__ import annotations

import asyncio

import pytest

from smart_epp.benchmarks.replay.arrivals import poisson_arrivals
from smart_epp.benchmarks.replay.cli import Workload, simulate_policy
from smart_epp.benchmarks.replay.policies.context import PolicyContext, policy_label
from smart_epp.benchmarks.replay.policies.registry import (
    UnknownPolicy,
    build_pickers,
    known_policy,
    split_pickers,
)
from smart_epp.benchmarks.replay.sim import SimConfig, SimPool, Simulation
from smart_epp.benchmarks.replay.traces import SharedPrefixSpec, generate_shared_prefix
from smart_epp.framework.lifecycle import FlowRequest, RoutedObserver
from smart_epp.scorers.predicted_ttft_scorer import PredictedTTFTScorer

SPEC = SharedPrefixSpec(
    num_groups=10, num_prompts_per_group=6, system_prompt_len=512, question_len=64, output_len=8
)
CONFIG = SimConfig(pods=4, block_size=16)


def _workload(qps: float = 20.0) -> Workload:
    requests = generate_shared_prefix(SPEC, seed=5)
    return Workload(requests, poisson_arrivals(len(requests), qps, 5))


def _outcomes(results: list) -> list[tuple]:
    return [(r.pod, r.ttft_s, r.e2e_s, r.cached_tokens) for r in results]


def test_one_picker_replays_the_policy_alone_exactly() -> None:
    wl = _workload()
    alone = simulate_policy("default", wl, CONFIG, seed=1)
    assert _outcomes(simulate_policy("default@1", wl, CONFIG, seed=1)) == _outcomes(alone)


class Routed(RoutedObserver):
    def __init__(self) -> None:
        self.ids: list[str] = []

    def on_routed(self, flow: FlowRequest) -> None:
        self.ids.append(flow.request.request_id)


def test_three_pickers_take_requests_in_turn_and_learn_from_every_answer() -> None:
    wl = _workload()
    pool = SimPool.build(CONFIG)
    box: list[Simulation] = []
    ctx = PolicyContext(pool, lambda: box[0].now if box else 0.0, 1, CONFIG.model)
    sim = Simulation(CONFIG, build_pickers("default@3", ctx), pool)
    box.append(sim)
    seen = [Routed() for _ in sim.flows]
    for flow, hook in zip(sim.flows, seen, strict=True):
        flow.add_hook(hook)
    results = asyncio.run(sim.run(wl.requests, wl.arrivals))

    assert all(r.ok for r in results)
    by_arrival = [f"req-{r.index}" for r in sorted(results, key=lambda r: r.arrival_s)]
    for i, hook in enumerate(seen):
        assert hook.ids == by_arrival[i::3]  # Envoy hands the pickers requests in turn
    # Each picker's view of the pods is its own; each ended what it booked.
    views = [pool.datastore, *pool.views]
    assert len({id(v) for v in views}) == 3
    assert all(v.own_load(p.address)[0] == 0 for v in views for p in v.pods())
    # The answers each picker learned from reached the others through the shared state:
    # each learned from far more than the third it routed.
    for picker in sim.pickers:
        scorer = next(
            p
            for p in picker.scheduler.plugins.plugins.values()  # type: ignore[attr-defined]
            if isinstance(p, PredictedTTFTScorer)
        )
        learned = sum(speed.samples for speed in scorer.learner.pods.values())
        assert learned > 0.8 * len(results)


def test_several_pickers_replay_deterministically() -> None:
    wl = _workload(qps=60.0)
    a = simulate_policy("default@3", wl, CONFIG, seed=1)
    b = simulate_policy("default@3", wl, CONFIG, seed=1)
    assert _outcomes(a) == _outcomes(b)
    assert all(r.ok for r in a)


def test_picker_counts_are_read_from_the_policy_name() -> None:
    assert split_pickers("default") == ("default", 1)
    assert split_pickers("default@3") == ("default", 3)
    assert split_pickers("configs/x.yaml@2") == ("configs/x.yaml", 2)
    assert policy_label("configs/x.yaml@2") == "x@2"
    assert known_policy("llmd-precise@2") and not known_policy("default@0")
    for bad in ("default@0", "default@x", "default@"):
        with pytest.raises(UnknownPolicy, match="number of pickers"):
            split_pickers(bad)
    with pytest.raises(UnknownPolicy, match="one router"):
        build_pickers("round-robin@2", PolicyContext(SimPool.build(CONFIG), float, 0, "m"))

"""Speculative index entries: a routed prompt counts as held by its pod until events confirm,
for as long as the policy predicts it waits."""

from __future__ import annotations

from sched_helpers import pod, request

from smart_epp.epp.scheduler import (
    MAX_SPECULATIVE_TTL_S,
    SPECULATIVE_TTFT_MARGIN,
    build_scheduler,
)
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.memory import DEFAULT_SPECULATIVE_TTL_S, MemoryBlockIndex


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


PROMPT = list(range(5000, 5000 + 1024))
KEYS = block_keys(PROMPT, 16, KeyScope("tiny"))


async def test_routing_marks_the_prompt_as_held_until_the_ttl_passes():
    clock = Clock()
    index = MemoryBlockIndex(clock=clock)
    pods = [pod(f"10.0.1.{i}:8000") for i in range(4)]
    scheduler = build_scheduler("llmd-precise", index=index, clock=clock, seed=3)
    req = request(tokens=PROMPT)
    decision = await scheduler.schedule(req, pods)
    chosen = decision.endpoints[0].address
    assert index.lookup_sync(KEYS, [p.address for p in pods]) == {}

    scheduler.on_routed(req, decision)
    hits = index.lookup_sync(KEYS, [p.address for p in pods])
    assert set(hits) == {chosen} and hits[chosen].blocks == len(KEYS)

    # A second request sharing the prefix, before any KV event, follows the first.
    follow = request(tokens=PROMPT[:800] + [1] * 300)
    assert (await scheduler.schedule(follow, pods)).endpoints[0].address == chosen

    clock.now += 2.5  # past the default 2 s TTL with no confirming event
    assert index.lookup_sync(KEYS, [p.address for p in pods]) == {}


async def test_a_confirming_event_outlives_the_ttl():
    clock = Clock()
    index = MemoryBlockIndex(clock=clock)
    pods = [pod(f"10.0.2.{i}:8000") for i in range(2)]
    scheduler = build_scheduler("llmd-precise", index=index, clock=clock, seed=3)
    req = request(tokens=PROMPT)
    decision = await scheduler.schedule(req, pods)
    scheduler.on_routed(req, decision)
    chosen = decision.endpoints[0].address
    index.add_sync(chosen, KEYS)  # what the pod's BlockStored event does
    clock.now += 10
    assert index.lookup_sync(KEYS, [chosen])[chosen].blocks == len(KEYS)


async def test_zero_ttl_disables_speculation():
    index = MemoryBlockIndex()
    pods = [pod(f"10.0.3.{i}:8000") for i in range(2)]
    scheduler = build_scheduler("llmd-precise", index=index, speculative_ttl_s=0, seed=3)
    req = request(tokens=PROMPT)
    scheduler.on_routed(req, await scheduler.schedule(req, pods))
    assert index.lookup_sync(KEYS, [p.address for p in pods]) == {}


async def _routed_by_default(waiting: int) -> tuple[Clock, MemoryBlockIndex, str, float]:
    """The default policy routes PROMPT to one of two pods each `waiting` requests deep;
    returns the clock, the index, the chosen pod and the decision's predicted TTFT."""
    clock = Clock()
    index = MemoryBlockIndex(clock=clock)
    pods = [pod(f"10.0.4.{i}:8000", waiting=waiting) for i in range(2)]
    scheduler = build_scheduler("default", index=index, clock=clock, seed=3, tokenizer=False)
    req = request(tokens=PROMPT)
    decision = await scheduler.schedule(req, pods)
    assert decision.predicted_ttft_s is not None
    scheduler.on_routed(req, decision)
    return clock, index, decision.endpoints[0].address, decision.predicted_ttft_s


async def test_a_prompt_predicted_to_wait_stays_held_until_its_prefill_is_due():
    # Queued behind 40 requests, the prompt is computed seconds from now: its blocks
    # count as held on its pod until the margin past its predicted TTFT, not for 2 s.
    clock, index, chosen, predicted = await _routed_by_default(waiting=40)
    life = SPECULATIVE_TTFT_MARGIN * predicted
    assert life > 2 * DEFAULT_SPECULATIVE_TTL_S
    clock.now += life - 0.5
    assert index.lookup_sync(KEYS, [chosen])[chosen].blocks == len(KEYS)
    clock.now += 1.0
    assert index.lookup_sync(KEYS, [chosen]) == {}


async def test_an_idle_pods_prompt_keeps_the_floor_and_a_lost_one_the_cap():
    clock, index, chosen, predicted = await _routed_by_default(waiting=0)
    assert SPECULATIVE_TTFT_MARGIN * predicted < DEFAULT_SPECULATIVE_TTL_S
    clock.now += DEFAULT_SPECULATIVE_TTL_S - 0.1
    assert index.lookup_sync(KEYS, [chosen])[chosen].blocks == len(KEYS)
    clock.now += 0.2
    assert index.lookup_sync(KEYS, [chosen]) == {}

    clock, index, chosen, predicted = await _routed_by_default(waiting=400)
    assert SPECULATIVE_TTFT_MARGIN * predicted > MAX_SPECULATIVE_TTL_S
    clock.now += MAX_SPECULATIVE_TTL_S - 0.1
    assert index.lookup_sync(KEYS, [chosen])[chosen].blocks == len(KEYS)
    clock.now += 0.2
    assert index.lookup_sync(KEYS, [chosen]) == {}

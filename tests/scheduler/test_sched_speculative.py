"""Speculative index entries: a routed prompt counts as held by its pod until events confirm."""

from __future__ import annotations

from sched_helpers import pod, request

from smart_epp.epp.scheduler import build_scheduler
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.memory import MemoryBlockIndex


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

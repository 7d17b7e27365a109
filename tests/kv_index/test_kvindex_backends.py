"""One suite, two backends: the in-memory index and the index on a real Redis server."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from support.redis_server import (
    RedisServer,
    redis_server_fixture,  # noqa: F401 - the redis_server fixture
)

from smart_epp.kv_index import metrics
from smart_epp.kv_index.api import BlockIndex, PrefixHit
from smart_epp.kv_index.memory import MemoryBlockIndex
from smart_epp.kv_index.redis_backend import RedisBlockIndex


class FakeClock:
    """Virtual time, so speculative expiry is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    index: BlockIndex
    clock: FakeClock
    server: RedisServer | None = None

    async def blocks(self) -> int:
        if isinstance(self.index, RedisBlockIndex):
            return await self.index.entries()
        assert isinstance(self.index, MemoryBlockIndex)
        return self.index.blocks


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


CAPACITY = 64


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    clock = FakeClock()
    if request.param == "memory":
        yield Backend(MemoryBlockIndex(capacity=CAPACITY, clock=clock, evict_chunk=4), clock)
        return
    server: RedisServer = request.getfixturevalue("shared_redis")
    client = aioredis.Redis.from_url(server.url)
    index = RedisBlockIndex(
        client, namespace=f"t-{uuid.uuid4().hex}", capacity=CAPACITY, clock=clock
    )
    try:
        yield Backend(index, clock, server)
    finally:
        await client.aclose()


async def test_longest_consecutive_prefix_per_pod(backend: Backend) -> None:
    idx = backend.index
    await idx.add("a", [1, 2, 3, 4])
    await idx.add("b", [1, 2])
    await idx.add("c", [2, 3, 4])  # holds later blocks but not the first: no prefix
    hits = await idx.lookup([1, 2, 3, 4, 5])
    assert hits == {"a": PrefixHit(4), "b": PrefixHit(2)}
    assert await idx.lookup([9, 1, 2]) == {}


async def test_a_hole_ends_the_run(backend: Backend) -> None:
    await backend.index.add("a", [1, 2, 4, 5])
    assert await backend.index.lookup([1, 2, 3, 4, 5]) == {"a": PrefixHit(2)}


async def test_candidate_filter(backend: Backend) -> None:
    idx = backend.index
    await idx.add("a", [1, 2, 3])
    await idx.add("b", [1, 2, 3])
    assert await idx.lookup([1, 2, 3], pods=["b", "zz"]) == {"b": PrefixHit(3)}
    assert await idx.lookup([1, 2, 3], pods=[]) == {}


async def test_tier_is_the_slowest_along_the_run_and_gpu_wins_per_block(backend: Backend) -> None:
    idx = backend.index
    await idx.add("a", [1, 2], "GPU")
    await idx.add("a", [3], "CPU")
    await idx.add("b", [1, 2, 3], "GPU")
    await idx.add("b", [2], "CPU")  # a CPU copy of a GPU block is still GPU
    hits = await idx.lookup([1, 2, 3])
    assert hits == {"a": PrefixHit(3, "CPU"), "b": PrefixHit(3, "GPU")}
    assert await idx.lookup([1, 2]) == {"a": PrefixHit(2, "GPU"), "b": PrefixHit(2, "GPU")}


async def test_remove_is_per_tier_and_idempotent(backend: Backend) -> None:
    idx = backend.index
    await idx.add("a", [1, 2, 3])
    await idx.add("a", [2], "CPU")
    await idx.remove("a", [2], "GPU")
    assert await idx.lookup([1, 2, 3]) == {"a": PrefixHit(3, "CPU")}
    await idx.remove("a", [2], "CPU")
    await idx.remove("a", [2], "CPU")
    await idx.remove("nobody", [1])
    assert await idx.lookup([1, 2, 3]) == {"a": PrefixHit(1)}


async def test_clear_pod_leaves_other_pods(backend: Backend) -> None:
    idx = backend.index
    await idx.add("a", [1, 2, 3])
    await idx.add("b", [1, 2])
    await idx.add_speculative("a", [7], ttl_s=5)
    await idx.clear_pod("a")
    assert await idx.lookup([1, 2, 3]) == {"b": PrefixHit(2)}
    assert await idx.lookup([7]) == {}
    await idx.add("a", [1])
    assert await idx.lookup([1, 2]) == {"a": PrefixHit(1), "b": PrefixHit(2)}


async def test_speculative_entries_expire_unless_confirmed(backend: Backend) -> None:
    idx = backend.index
    await idx.add("a", [1])
    await idx.add_speculative("a", [1, 2, 3], ttl_s=2.0)
    await idx.add_speculative("b", [1, 2], ttl_s=2.0)
    assert await idx.lookup([1, 2, 3]) == {"a": PrefixHit(3), "b": PrefixHit(2)}
    await idx.add("a", [2])  # an event confirms block 2 on pod a
    backend.clock.now += 2.5
    assert await idx.lookup([1, 2, 3]) == {"a": PrefixHit(2)}
    await idx.add_speculative("b", [5], ttl_s=2.0)  # also purges the expired ones
    assert await idx.lookup([1, 2]) == {"a": PrefixHit(2)}


async def test_a_shorter_speculative_life_never_cuts_a_longer_one(backend: Backend) -> None:
    # A prompt predicted to wait in the queue is held for longer than the default life;
    # a later prompt with the same prefix, routed with a shorter one, must not cut it.
    idx = backend.index
    await idx.add_speculative("a", [1, 2, 3], ttl_s=10.0)
    await idx.add_speculative("a", [1, 2], ttl_s=2.0)
    backend.clock.now += 5.0
    assert await idx.lookup([1, 2, 3]) == {"a": PrefixHit(3)}
    await idx.add_speculative("a", [1], ttl_s=8.0)  # a longer one extends it
    backend.clock.now += 6.0
    assert await idx.lookup([1, 2, 3]) == {"a": PrefixHit(1)}
    backend.clock.now += 3.0
    assert await idx.lookup([1, 2, 3]) == {}


async def test_a_prompt_routed_to_its_holder_stays_held_there_when_the_pod_evicts_it(
    backend: Backend,
) -> None:
    # A waiting request pins no blocks in vLLM: the pod may evict the prefix it was routed
    # for before running it, and then computes it again. Either way the pod holds the
    # prefix once the request has run, so the prompts that follow should go there too.
    idx = backend.index
    await idx.add("a", [1, 2, 3])
    await idx.add_speculative("a", [1, 2, 3, 4], ttl_s=2.0)
    await idx.remove("a", [2, 3])
    assert await idx.lookup([1, 2, 3, 4]) == {"a": PrefixHit(4)}
    backend.clock.now += 2.5  # the routing is no longer news: only events count
    assert await idx.lookup([1, 2, 3, 4]) == {"a": PrefixHit(1)}
    await idx.add_speculative("a", [1], ttl_s=2.0)
    backend.clock.now += 2.5
    await idx.remove("a", [1])  # evicted after that routing stopped being news
    assert await idx.lookup([1, 2, 3, 4]) == {}


async def test_duplicate_stores_are_idempotent(backend: Backend) -> None:
    idx = backend.index
    for _ in range(3):
        await idx.add("a", [1, 2])
    assert await idx.lookup([1, 2]) == {"a": PrefixHit(2)}
    assert await backend.blocks() == 2


async def test_capacity_bound_holds_under_a_flood_of_unique_prefixes(backend: Backend) -> None:
    idx = backend.index
    counter = itertools.count(1_000)
    for round_ in range(40):
        pod = f"pod-{round_ % 3}"
        await idx.add(pod, [next(counter) for _ in range(16)])
        assert await backend.blocks() <= CAPACITY
    # The most recently stored prefix survives; the oldest are gone.
    last = list(range(next(counter) - 16, next(counter) - 1))
    assert (await idx.lookup(last)) == {"pod-0": PrefixHit(len(last))}
    assert await idx.lookup([1_000, 1_001]) == {}


async def test_held_blocks_count_each_pods_gpu_blocks(backend: Backend) -> None:
    idx = backend.index
    held = idx.held_blocks_sync  # type: ignore[attr-defined]
    await idx.add("a", [1, 2, 3])
    await idx.add("a", [3, 4])  # 3 again: stored once
    await idx.add("b", [1, 2])
    await idx.add("a", [5], "CPU")  # offloaded blocks are not in the GPU cache
    assert (held("a"), held("b"), held("nobody")) == (4, 2, 0)
    await idx.add("a", [5])
    await idx.add_speculative("a", [10, 11], ttl_s=5.0)  # routed, not stored yet
    assert held("a") == 5
    await idx.remove("a", [1, 9])  # 9 was never held
    await idx.remove("a", [5], "CPU")  # its GPU copy stays
    assert held("a") == 4
    await idx.clear_pod("b")
    assert (held("a"), held("b")) == (4, 0)
    # Blocks the index drops for its own capacity leave their pods' counts too. (The Redis
    # backend counts from its local mirror, which takes every event the store does.)
    counted = idx.local if isinstance(idx, RedisBlockIndex) else idx
    assert isinstance(counted, MemoryBlockIndex)
    for start in range(1_000, 1_160, 16):
        await idx.add("c", list(range(start, start + 16)))
    kept = [k for k in [1, 2, 3, 4, *range(1_000, 1_160)] if counted.lookup_sync([k])]
    assert 0 < held("c") <= CAPACITY
    assert held("a") + held("c") == len(kept)


async def test_routing_to_a_held_prefix_keeps_it_from_eviction(backend: Backend) -> None:
    idx = backend.index
    hot = [1, 2, 3, 4]
    await idx.add("a", hot)
    counter = itertools.count(1_000)
    for _ in range(10):
        await idx.add("b", [next(counter) for _ in range(16)])
        await idx.add_speculative("a", hot, ttl_s=0.5)  # routed there again
    backend.clock.now += 10  # no speculative entry is left; only confirmed ones count
    assert await idx.lookup(hot) == {"a": PrefixHit(4)}
    assert await backend.blocks() <= CAPACITY


async def test_keys_beyond_int64_keep_their_identity(backend: Backend) -> None:
    big = [2**64 - 1, 2**63 + 12345, 2**53 + 1]
    await backend.index.add("a", big)
    assert await backend.index.lookup(big) == {"a": PrefixHit(3)}
    assert await backend.index.lookup([2**64 - 1, 2**53]) == {"a": PrefixHit(1)}


@pytest.mark.redis
async def test_redis_outage_keeps_routing_on_local_state(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_server
    client = aioredis.Redis.from_url(server.url, socket_connect_timeout=0.2, socket_timeout=0.2)
    index = RedisBlockIndex(client, namespace="outage", retry_after_s=0.0)
    try:
        await index.add("a", [1, 2, 3])
        assert metrics.REDIS_UP._value.get() == 1
        errors_before = metrics.REDIS_ERRORS.labels("lookup")._value.get()
        server.stop()
        assert await index.lookup([1, 2, 3]) == {"a": PrefixHit(3)}
        assert metrics.REDIS_UP._value.get() == 0
        assert metrics.REDIS_ERRORS.labels("lookup")._value.get() == errors_before + 1
        assert "Redis unreachable" in caplog.text
        await index.add("b", [1])  # written locally while Redis is down
        assert await index.lookup([1, 2]) == {"a": PrefixHit(2), "b": PrefixHit(1)}
        server.start()  # same port, empty server
        await index.add("c", [1])
        assert metrics.REDIS_UP._value.get() == 1
        assert await index.lookup([1]) == {"c": PrefixHit(1)}
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_two_gateway_replicas_share_one_redis_index(shared_redis: RedisServer) -> None:
    ns = f"shared-{uuid.uuid4().hex}"
    c1 = aioredis.Redis.from_url(shared_redis.url)
    c2 = aioredis.Redis.from_url(shared_redis.url)
    try:
        writer = RedisBlockIndex(c1, namespace=ns)
        reader = RedisBlockIndex(c2, namespace=ns)
        await writer.add("10.0.0.1:8000", [11, 12])
        assert await reader.lookup([11, 12, 13]) == {"10.0.0.1:8000": PrefixHit(2)}
        assert reader.local.lookup_sync([11]) == {}  # the answer came from Redis
    finally:
        await c1.aclose()
        await c2.aclose()

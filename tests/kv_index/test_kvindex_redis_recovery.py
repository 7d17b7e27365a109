"""A shared Redis index that restarts empty is refilled, and reconnects do not flap."""

from __future__ import annotations

import asyncio

import pytest
from support.redis_server import (
    RedisServer,
    redis_server_fixture,  # noqa: F401 - the redis_server fixture
)

from smart_epp.framework.types import PrefixHit
from smart_epp.kv_index import metrics
from smart_epp.kv_index.redis_backend import RedisBlockIndex

pytestmark = pytest.mark.redis


async def test_an_empty_restart_is_reseeded_from_local_state(redis_server: RedisServer) -> None:
    writer = RedisBlockIndex.from_url(redis_server.url, namespace="reseed")
    reader = RedisBlockIndex.from_url(redis_server.url, namespace="reseed")
    try:
        assert await writer.check()  # the first generation
        await writer.add("10.0.0.1:8000", [1, 2, 3])
        await writer.add("10.0.0.2:8000", [1, 2], "CPU")
        assert await reader.lookup([1, 2, 3]) == {
            "10.0.0.1:8000": PrefixHit(3),
            "10.0.0.2:8000": PrefixHit(2, "CPU"),
        }
        redis_server.stop()
        redis_server.start()  # same port, nothing in it
        assert await reader.lookup([1, 2, 3]) == {}  # what a replica sees before the reseed
        reseeds = metrics.REDIS_RESEEDS._value.get()
        assert await writer.check()
        assert metrics.REDIS_RESEEDS._value.get() == reseeds + 1
        assert await reader.lookup([1, 2, 3]) == {
            "10.0.0.1:8000": PrefixHit(3),
            "10.0.0.2:8000": PrefixHit(2, "CPU"),
        }
        assert reader.local.lookup_sync([1]) == {}  # the answer came from Redis
        assert metrics.REDIS_DIVERGENCE._value.get() == 0
        assert not await writer.check()  # nothing changed since: no second write-back
    finally:
        await writer.close()
        await reader.close()


async def test_writes_lost_in_an_outage_are_reconciled(redis_server: RedisServer) -> None:
    index = RedisBlockIndex.from_url(redis_server.url, namespace="outage", retry_after_s=0.0)
    try:
        await index.check()
        await index.add("a", [1, 2, 3])
        redis_server.stop()
        await index.remove("a", [3])  # only the mirror sees these two
        await index.add("b", [1])
        assert not index.up
        redis_server.start()
        await index.client.set("reseed:unrelated", b"1")  # the store is not empty this time
        await index.client.set("outage:epoch", b"someone-else")
        assert await index.check()
        assert await index.lookup([1, 2, 3]) == {"a": PrefixHit(2), "b": PrefixHit(1)}
        assert index.local.lookup_sync([1, 2, 3]) == await index.lookup([1, 2, 3])
    finally:
        await index.close()


async def test_a_restart_does_not_flap_the_connection_state(redis_server: RedisServer) -> None:
    index = RedisBlockIndex.from_url(redis_server.url, namespace="flap")
    try:
        await index.add("a", [1, 2])
        # Several pooled connections, all of which the restart leaves stale.
        await asyncio.gather(*(index.lookup([1, 2]) for _ in range(8)))
        assert len(index.client.connection_pool._available_connections) > 1
        redis_server.stop()
        redis_server.start()
        errors = sum(m._value.get() for m in metrics.REDIS_ERRORS._metrics.values())
        for _ in range(20):
            await asyncio.gather(*(index.lookup([1]) for _ in range(4)))
        after = sum(m._value.get() for m in metrics.REDIS_ERRORS._metrics.values())
        assert (after - errors, index.up) == (0, True)  # stale connections retried, not failed
    finally:
        await index.close()

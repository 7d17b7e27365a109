"""A starting replica's catch-up, over real ZMQ sockets against publishers that speak
vLLM's protocol: readiness waits for every pod's replay, and not forever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio
from kvindex_publisher import VllmKvPublisher
from support.net import async_wait_until, free_port
from support.redis_server import RedisServer, redis_server_fixture
from support.replay_sockets import EndlessReplaySocket
from test_kvindex_subscriber import Pod, held_blocks, publish_until_seen, stored_batch

from smart_epp.framework.types import Endpoint
from smart_epp.kv_index.catch_up import CatchUp, PodCatchUp
from smart_epp.kv_index.manager import KVEventManager
from smart_epp.kv_index.memory import MemoryBlockIndex
from smart_epp.kv_index.redis_backend import RedisBlockIndex

redis_server = redis_server_fixture


class HeldReplayPublisher(VllmKvPublisher):
    """Answers replay requests only once `release` is set: a slow replay socket."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.release = asyncio.Event()

    async def _serve_replay(self) -> None:
        await self.release.wait()
        await super()._serve_replay()


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


def silent(pod: Pod) -> Endpoint:
    """The pod's endpoint with a replay socket nobody answers on."""
    return Endpoint(
        address=pod.address,
        kv_events=pod.events,
        kv_replay=f"tcp://127.0.0.1:{free_port()}",
        labels=(("model", "m"),),
    )


async def test_ready_only_once_every_pods_buffer_is_applied(ctx) -> None:
    fast, slow = Pod(), Pod()
    quick = await VllmKvPublisher(f"kv@{fast.address}@m", fast.events, fast.replay).start()
    held = await HeldReplayPublisher(f"kv@{slow.address}@m", slow.events, slow.replay).start()
    index = MemoryBlockIndex()
    manager = KVEventManager(index, context=ctx, replay_timeout_s=5.0)
    try:
        # Both pods cached blocks before this replica started.
        await quick.publish(stored_batch([1, 2, 3, 4], [101]))
        await held.publish(stored_batch([5, 6, 7, 8], [201]))
        await held.publish(stored_batch([9, 10, 11, 12], [202], parent=201))
        await manager.start()
        for pod in (fast, slow):
            await manager.add_endpoint(pod.endpoint)
        catch_up = CatchUp(manager, lambda: [fast.address, slow.address])
        waiting = asyncio.create_task(catch_up.wait(timeout_s=30))
        # The fast pod catches up; the replica stays unready while the slow one replays.
        await async_wait_until(
            lambda: catch_up.pending() == [slow.address], what="the fast pod caught up"
        )
        assert held_blocks(index, fast.address, fast.keys([1, 2, 3, 4])) == 1
        assert not waiting.done()
        held.release.set()
        result = await waiting
        assert result.complete
        assert held_blocks(index, slow.address, slow.keys(list(range(5, 13)))) == 2
    finally:
        await manager.stop()
        await quick.close()
        await held.close()


async def test_a_pod_whose_replay_socket_never_answers_is_not_waited_for(ctx) -> None:
    pod, other = Pod(), Pod()
    live = await VllmKvPublisher(f"kv@{other.address}@m", other.events, other.replay).start()
    manager = KVEventManager(MemoryBlockIndex(), context=ctx, replay_timeout_s=0.3)
    try:
        await manager.start()
        await manager.add_endpoint(silent(pod))
        await manager.add_endpoint(other.endpoint)
        catch_up = CatchUp(manager, lambda: [pod.address, other.address])
        result = await catch_up.wait(30)
        # Down or starting: waiting would not help; its events come live once it publishes.
        assert result.pending == (pod.address,)
        assert result.waited_s < 10
        assert catch_up.states() == {
            pod.address: PodCatchUp.UNREACHABLE,
            other.address: PodCatchUp.CAUGHT_UP,
        }
    finally:
        await manager.stop()
        await live.close()


async def test_a_replay_that_never_ends_delays_readiness_only_so_long(ctx) -> None:
    pod = Pod()
    replay = EndlessReplaySocket(ctx)
    manager = KVEventManager(MemoryBlockIndex(), context=ctx, replay_timeout_s=1.0)
    try:
        await manager.start()
        await manager.add_endpoint(
            Endpoint(
                address=pod.address,
                kv_events=pod.events,
                kv_replay=replay.endpoint,
                labels=(("model", "m"),),
            )
        )
        catch_up = CatchUp(manager, lambda: [pod.address])
        result = await catch_up.wait(1.5)
        assert result.pending == (pod.address,)
        assert result.waited_s >= 1.5
        assert catch_up.states()[pod.address] is PodCatchUp.WAITING
    finally:
        await manager.stop()
        await replay.close()


async def test_a_pod_without_replay_socket_is_not_waited_for(ctx) -> None:
    pod = Pod()
    manager = KVEventManager(
        MemoryBlockIndex(), context=ctx, default_replay_port=None, replay_timeout_s=5.0
    )
    try:
        await manager.start()
        await manager.add_endpoint(
            Endpoint(address=pod.address, kv_events=pod.events, labels=(("model", "m"),))
        )
        result = await CatchUp(manager, lambda: [pod.address]).wait(10)
        assert result.complete and result.waited_s < 5
    finally:
        await manager.stop()


async def test_a_pod_the_replica_has_not_subscribed_to_is_pending(ctx) -> None:
    manager = KVEventManager(MemoryBlockIndex(), context=ctx)
    catch_up = CatchUp(manager, lambda: ["10.0.0.9:8000"])
    assert catch_up.pending() == ["10.0.0.9:8000"]


@pytest.mark.redis
async def test_with_a_shared_store_the_store_stands_in_for_a_silent_replay(
    ctx, redis_server: RedisServer
) -> None:
    pod = Pod()
    index = RedisBlockIndex.from_url(redis_server.url)
    manager = KVEventManager(index, context=ctx, replay_timeout_s=0.3)
    try:
        await manager.start()
        await manager.add_endpoint(silent(pod))
        catch_up = CatchUp(manager, lambda: [pod.address], lambda: index.store_synced)
        stream = manager.stream(pod.address)
        assert stream is not None
        await asyncio.wait_for(stream.sync_attempted.wait(), 10)
        # Until the replica has joined the store's generation, the store does not count.
        assert catch_up.pending() == [pod.address]
        await index.check()
        result = await catch_up.wait(10)
        assert result.complete
        redis_server.stop()
        await index.lookup([1])  # the failed call marks the store down
        assert not index.store_synced
        assert catch_up.pending() == [pod.address]
    finally:
        await manager.stop()
        await index.close()


async def test_a_pod_that_comes_up_after_the_replica_is_caught_up_from_its_batch_0(
    ctx,
) -> None:
    pod = Pod()
    index = MemoryBlockIndex()
    manager = KVEventManager(index, context=ctx, replay_timeout_s=0.3)
    publisher = VllmKvPublisher(f"kv@{pod.address}@m", pod.events, pod.replay)
    try:
        await manager.start()
        await manager.add_endpoint(pod.endpoint)  # nothing listens on its sockets yet
        catch_up = CatchUp(manager, lambda: [pod.address])
        await catch_up.wait(10)
        assert catch_up.states()[pod.address] is PodCatchUp.UNREACHABLE
        await publisher.start()
        await publish_until_seen(publisher, index, pod, [1, 2, 3, 4], 101)
        # Its stream from batch 0 on: nothing it cached can have been missed.
        assert catch_up.states()[pod.address] is PodCatchUp.CAUGHT_UP
    finally:
        await manager.stop()
        await publisher.close()

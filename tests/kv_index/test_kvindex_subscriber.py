"""Subscribers over real ZMQ sockets against a publisher speaking vLLM's protocol."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio
from kvindex_captures import CAPTURE_BLOCK_SIZE, frames, requests
from kvindex_publisher import VllmKvPublisher
from support.net import async_wait_until, free_port

from smart_epp.framework.types import Endpoint
from smart_epp.kv_index import metrics
from smart_epp.kv_index.events import BlockStored, EventBatch, encode_batch
from smart_epp.kv_index.keys import KeyScope, block_keys
from smart_epp.kv_index.manager import KVEventManager
from smart_epp.kv_index.memory import MemoryBlockIndex

BS = 4


def stored_batch(
    tokens: list[int], hashes: list[int], parent: int | None = None, age_s: float = 0.0
) -> bytes:
    """A batch the pod published `age_s` ago."""
    event = BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS
    )
    return encode_batch(EventBatch(ts=time.time() - age_s, events=[event]))


def held_blocks(index: MemoryBlockIndex, pod: str, keys: list[int]) -> int:
    """How many leading blocks of `keys` the index says `pod` holds."""
    hit = index.lookup_sync(keys).get(pod)
    return 0 if hit is None else hit.blocks


def counter(metric: object, *labels: str) -> float:
    return metric.labels(*labels)._value.get()  # type: ignore[attr-defined]


class Pod:
    def __init__(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.endpoint = Endpoint(
            address=self.address,
            kv_events=self.events,
            kv_replay=self.replay,
            labels=(("model", "m"),),
        )

    def keys(self, tokens: list[int]) -> list[int]:
        return block_keys(tokens, BS, KeyScope("m"))


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


@pytest.fixture
async def dial() -> AsyncIterator[tuple[KVEventManager, MemoryBlockIndex, Pod, VllmKvPublisher]]:
    context = zmq.asyncio.Context()
    pod = Pod()
    index = MemoryBlockIndex()
    manager = KVEventManager(index, context=context, replay_timeout_s=1.0)
    publisher = await VllmKvPublisher(f"kv@{pod.address}@m", pod.events, pod.replay).start()
    await manager.start()
    await manager.add_endpoint(pod.endpoint)
    try:
        yield manager, index, pod, publisher
    finally:
        await manager.stop()
        await publisher.close()
        context.term()


async def publish_until_seen(
    publisher: VllmKvPublisher, index: MemoryBlockIndex, pod: Pod, tokens: list[int], h: int
) -> None:
    """The first batches race ZMQ's subscription handshake; keep publishing the same
    (idempotent) batch until the subscriber has it, like a live pod would keep going."""

    async def seen() -> bool:
        if index.lookup_sync(pod.keys(tokens)):
            return True
        await publisher.publish(stored_batch(tokens, [h]))
        return False

    await async_wait_until(seen, timeout=10, what="first batch through the SUB socket")


async def test_dial_mode_applies_batches_and_recovers_a_dropped_one(dial) -> None:
    manager, index, pod, publisher = dial
    await publish_until_seen(publisher, index, pod, [1, 2, 3, 4], 101)
    gaps = counter(metrics.SEQUENCE_GAPS, pod.address)
    dropped = await publisher.publish(stored_batch([5, 6, 7, 8], [102], parent=101), drop=True)
    await publisher.publish(stored_batch([9, 10, 11, 12], [103], parent=102))
    chain = pod.keys(list(range(1, 13)))
    await async_wait_until(
        lambda: held_blocks(index, pod.address, chain) == 3,
        what="the dropped batch recovered through replay",
    )
    # The first request is the resync on connect; a later one fetched the dropped batch.
    assert any(start <= dropped for start in publisher.replay_requests[1:])
    assert counter(metrics.SEQUENCE_GAPS, pod.address) == gaps  # nothing lost for good
    assert manager.ingest.block_size(pod.address) == BS


async def test_publisher_restart_resets_the_pod(dial) -> None:
    _, index, pod, publisher = dial
    await publish_until_seen(publisher, index, pod, [1, 2, 3, 4], 101)
    await publisher.publish(stored_batch([5, 6, 7, 8], [102], parent=101))
    old = pod.keys(list(range(1, 9)))
    await async_wait_until(lambda: held_blocks(index, pod.address, old) == 2)
    restarts = counter(metrics.RESTARTS, pod.address)
    await publisher.restart()
    new_tokens = [50, 51, 52, 53]
    await publish_until_seen(publisher, index, pod, new_tokens, 201)
    assert counter(metrics.RESTARTS, pod.address) == restarts + 1
    assert index.lookup_sync(old) == {}  # nothing the old process published survives
    assert index.lookup_sync(pod.keys(new_tokens))[pod.address].blocks == 1


async def test_malformed_frames_are_counted_and_ingestion_continues(dial) -> None:
    _, index, pod, publisher = dial
    await publish_until_seen(publisher, index, pod, [1, 2, 3, 4], 101)
    errors = counter(metrics.DECODE_ERRORS, pod.address)
    await publisher.publish(b"\xc1 not msgpack")
    await publisher.send_raw([b"kv@x@m", b"short"])
    await publisher.publish(stored_batch([5, 6, 7, 8], [102], parent=101))
    chain = pod.keys(list(range(1, 9)))
    await async_wait_until(lambda: held_blocks(index, pod.address, chain) == 2)
    assert counter(metrics.DECODE_ERRORS, pod.address) == errors + 2


@pytest.fixture
async def unconnected(
    ctx: zmq.asyncio.Context,
) -> AsyncIterator[tuple[KVEventManager, MemoryBlockIndex, Pod, VllmKvPublisher]]:
    """A publishing pod and a manager that has not connected to it yet."""
    pod = Pod()
    publisher = await VllmKvPublisher(f"kv@{pod.address}@m", pod.events, pod.replay).start()
    index = MemoryBlockIndex()
    manager = KVEventManager(index, context=ctx, replay_timeout_s=1.0)
    try:
        yield manager, index, pod, publisher
    finally:
        await manager.stop()
        await publisher.close()


async def test_connecting_late_replays_what_the_pod_buffered(unconnected) -> None:
    manager, index, pod, publisher = unconnected
    await publisher.publish(stored_batch([1, 2, 3, 4], [101]))  # nobody listens yet
    await publisher.publish(stored_batch([5, 6, 7, 8], [102], parent=101))
    await manager.start()
    await manager.add_endpoint(pod.endpoint)
    chain = pod.keys(list(range(1, 9)))
    await async_wait_until(lambda: held_blocks(index, pod.address, chain) == 2)
    assert publisher.replay_requests[0] == 0


async def test_the_lag_of_a_pods_events_is_read_from_live_batches_only(unconnected) -> None:
    manager, index, pod, publisher = unconnected
    # Buffered by the pod 30 s ago and replayed on connect: old by design.
    await publisher.publish(stored_batch([1, 2, 3, 4], [101], age_s=30.0))
    await manager.start()
    await manager.add_endpoint(pod.endpoint)
    await async_wait_until(lambda: held_blocks(index, pod.address, pod.keys([1, 2, 3, 4])))
    assert manager.ingest.progress.lag_s(pod.address) == 0.0
    # Live batches that left the pod 0.5 s before they were sent on.
    tokens = list(range(1, 9))

    async def heard_live() -> bool:
        if manager.ingest.progress.lag_s(pod.address) > 0:
            return True
        await publisher.publish(stored_batch(tokens[4:], [102], parent=101, age_s=0.5))
        return False

    await async_wait_until(heard_live, timeout=10, what="a live batch through the SUB socket")
    assert 0.5 <= manager.ingest.progress.lag_s(pod.address) < 5.0


async def test_removed_endpoint_is_purged_and_its_socket_closed(dial) -> None:
    manager, index, pod, publisher = dial
    await publish_until_seen(publisher, index, pod, [1, 2, 3, 4], 101)
    manager.on_endpoint_removed(pod.endpoint)
    await async_wait_until(lambda: not index.lookup_sync(pod.keys([1, 2, 3, 4])))
    assert manager.stream(pod.address) is None
    assert manager.ingest.block_size(pod.address) is None
    await publisher.publish(stored_batch([1, 2, 3, 4], [101]))
    assert index.entries == 0


async def test_central_mode_routes_by_topic_and_replays_real_capture(ctx) -> None:
    index = MemoryBlockIndex()
    manager = KVEventManager(
        index,
        mode="central",
        bind=f"tcp://127.0.0.1:{free_port()}",
        context=ctx,
        replay_timeout_s=1.0,
    )
    await manager.start()
    bound = manager.central_endpoint
    assert bound is not None
    pod = Pod()
    stranger = Pod()
    publisher = await VllmKvPublisher(
        f"kv@{pod.address}@tiny", bound, pod.replay, connect=True
    ).start()
    other = await VllmKvPublisher(f"kv@{stranger.address}@tiny", bound, None, connect=True).start()
    try:
        await manager.add_endpoint(Endpoint(address=pod.address, kv_replay=pod.replay))
        capture = [f for f in frames("basic")]
        # The first half goes out before anyone listens: it comes back through replay.
        half = len(capture) // 2
        for frame in capture[:half]:
            await publisher.publish(frame.payload, drop=True)
        unknown_before = metrics.UNKNOWN_TOPICS._value.get()

        async def all_applied() -> bool:
            stream = manager.stream(pod.address)
            assert stream is not None
            if stream.tracker(0).expected == len(capture):
                return True
            if publisher.seq < len(capture):
                await publisher.publish(capture[publisher.seq].payload)
            await other.publish(stored_batch([1, 2, 3, 4], [9]))
            return False

        await async_wait_until(all_applied, timeout=15, what="the whole capture applied")
        assert metrics.UNKNOWN_TOPICS._value.get() > unknown_before
        assert manager.ingest.model(pod.address) == "tiny"  # from the topic
        assert stranger.address not in index.pods()
        for req in requests("basic"):
            keys = block_keys(req.cached_tokens(), CAPTURE_BLOCK_SIZE, KeyScope("tiny"))
            assert index.lookup_sync(keys)[pod.address].blocks == len(keys), req.name
    finally:
        await manager.stop()
        await publisher.close()
        await other.close()


async def test_pod_without_replay_socket_keeps_streaming(ctx) -> None:
    pod = Pod()
    silent_replay = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    publisher = await VllmKvPublisher(f"kv@{pod.address}@m", pod.events, None).start()
    index = MemoryBlockIndex()
    manager = KVEventManager(index, context=ctx, replay_timeout_s=0.2)
    try:
        await manager.start()
        endpoint = Endpoint(
            address=pod.address,
            kv_events=pod.events,
            kv_replay=silent_replay,
            labels=(("model", "m"),),
        )
        await manager.add_endpoint(endpoint)
        failed = counter(metrics.REPLAYS, pod.address, "failed")
        await publish_until_seen(publisher, index, pod, [1, 2, 3, 4], 101)
        await publisher.publish(stored_batch([5, 6, 7, 8], [102], parent=101), drop=True)
        await publisher.publish(stored_batch([9, 10, 11, 12], [103], parent=102))
        await publisher.publish(stored_batch([20, 21, 22, 23], [104]))
        await async_wait_until(
            lambda: bool(index.lookup_sync(pod.keys([20, 21, 22, 23]))),
            what="live batches after an unrecoverable gap",
        )
        assert counter(metrics.REPLAYS, pod.address, "failed") >= failed + 1
        assert counter(metrics.SEQUENCE_GAPS, pod.address) >= 1
        assert counter(metrics.ORPHAN_BLOCKS, pod.address) == 1  # 103's parent was lost
    finally:
        await manager.stop()
        await publisher.close()

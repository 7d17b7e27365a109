"""Faulty and hostile event streams over real ZMQ: failures are counted, never trusted."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio
from kvindex_publisher import VllmKvPublisher
from support.net import async_wait_until
from test_kvindex_subscriber import BS, Pod, counter, held_blocks, publish_until_seen, stored_batch

from smart_epp.framework.types import Medium
from smart_epp.kv_index import metrics
from smart_epp.kv_index.events import BlockStored, EventBatch, encode_batch
from smart_epp.kv_index.ingest import IngestState
from smart_epp.kv_index.manager import KVEventManager
from smart_epp.kv_index.memory import MemoryBlockIndex


class FailingIndex(MemoryBlockIndex):
    """A block index whose writes fail on demand, as a backend outage would."""

    failing = False

    async def add(self, pod: str, keys: list[int], medium: Medium = "GPU") -> None:
        if self.failing:
            raise ConnectionError("index backend unavailable")
        await super().add(pod, keys, medium)


@pytest.fixture
async def stream() -> AsyncIterator[tuple[KVEventManager, FailingIndex, Pod, VllmKvPublisher]]:
    context = zmq.asyncio.Context()
    pod = Pod()
    index = FailingIndex()
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


async def test_failed_batches_are_counted_and_their_sequence_advances(stream) -> None:
    _, index, pod, publisher = stream
    await publish_until_seen(publisher, index, pod, [1, 2, 3, 4], 101)
    gaps = counter(metrics.SEQUENCE_GAPS, pod.address)
    failures = counter(metrics.APPLY_FAILURES, pod.address)
    replays = len(publisher.replay_requests)
    index.failing = True
    for i in range(10):
        await publisher.publish(stored_batch([10 + i] * BS, [500 + i]))
    await async_wait_until(
        lambda: counter(metrics.APPLY_FAILURES, pod.address) == failures + 10,
        what="ten failed batches counted",
    )
    index.failing = False
    await publisher.publish(stored_batch([5, 6, 7, 8], [102], parent=101))
    chain = pod.keys(list(range(1, 9)))
    await async_wait_until(lambda: held_blocks(index, pod.address, chain) == 2)
    # No phantom gap and no replay: every failed batch consumed its number.
    assert counter(metrics.SEQUENCE_GAPS, pod.address) == gaps
    assert len(publisher.replay_requests) == replays


@pytest.mark.parametrize("seq", [2**64 - 2, 2**40])
async def test_implausible_sequence_jump_is_dropped_and_counters_stay_sane(stream, seq) -> None:
    _, index, pod, publisher = stream
    await publish_until_seen(publisher, index, pod, [1, 2, 3, 4], 101)
    gaps = counter(metrics.SEQUENCE_GAPS, pod.address)
    restarts = counter(metrics.RESTARTS, pod.address)
    suspects = counter(metrics.SUSPECT_FRAMES, pod.address)
    forged = stored_batch([9, 9, 9, 9], [999])
    await publisher.send_raw([publisher.topic, seq.to_bytes(8, "big"), forged])
    await async_wait_until(
        lambda: counter(metrics.SUSPECT_FRAMES, pod.address) == suspects + 1,
        what="the forged frame dropped",
    )
    await publisher.publish(stored_batch([5, 6, 7, 8], [102], parent=101))
    chain = pod.keys(list(range(1, 9)))
    await async_wait_until(lambda: held_blocks(index, pod.address, chain) == 2)
    assert counter(metrics.SEQUENCE_GAPS, pod.address) == gaps
    assert counter(metrics.RESTARTS, pod.address) == restarts
    assert index.lookup_sync(pod.keys([9, 9, 9, 9])) == {}


async def test_forged_restart_is_checked_against_the_replay_buffer(stream) -> None:
    _, index, pod, publisher = stream
    await publish_until_seen(publisher, index, pod, [1, 2, 3, 4], 101)
    await publisher.publish(stored_batch([5, 6, 7, 8], [102], parent=101))
    chain = pod.keys(list(range(1, 9)))
    await async_wait_until(lambda: held_blocks(index, pod.address, chain) == 2)
    restarts = counter(metrics.RESTARTS, pod.address)
    suspects = counter(metrics.SUSPECT_FRAMES, pod.address)
    # Sequence 0 with a newer engine time is what a restart looks like on the wire; the
    # pod's replay buffer still holds our last batch with its timestamp, so it is not one.
    forged = encode_batch(EventBatch(ts=time.time() + 60, events=[]))
    await publisher.send_raw([publisher.topic, (0).to_bytes(8, "big"), forged])
    await async_wait_until(
        lambda: counter(metrics.SUSPECT_FRAMES, pod.address) == suspects + 1,
        what="the forged restart dropped",
    )
    assert held_blocks(index, pod.address, chain) == 2
    assert counter(metrics.RESTARTS, pod.address) == restarts


def test_hash_map_is_bounded_per_tier() -> None:
    state = IngestState(max_hashes_per_tier=32)
    evicted = 0
    for i in range(100):
        event = BlockStored(block_hashes=[i], token_ids=[i] * BS, block_size=BS)
        evicted += state.apply("p", EventBatch(ts=float(i), events=[event]), "m").evicted_hashes
    held = state.pod("p").hashes_known()  # type: ignore[union-attr]
    assert held <= 32 and evicted == 100 - held
    newest = state.pod("p").maps[(0, "GPU")]  # type: ignore[union-attr]
    assert 99 in newest and 0 not in newest  # the oldest stored go first
    with pytest.raises(ValueError):
        IngestState(max_hashes_per_tier=0)

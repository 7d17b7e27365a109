"""ZMQ shells around the pure ingest logic: one pod's stream, replay, and the sockets.

`PodEventStream` applies one pod's messages in order (sequence tracking, replay on
connect and on gaps, restarts, AllBlocksCleared); `ReplayClient` speaks vLLM's replay
protocol; `dial_loop` reads a SUB socket connected to one pod and `central_loop` reads
one bound SUB socket that every pod connects to, routing by topic `kv@<ip:port>@<model>`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing, suppress
from typing import Any

import zmq
import zmq.asyncio

from . import metrics
from .api import BlockIndex
from .events import DecodeError, EventBatch, decode_batch
from .ingest import ApplyResult, IngestState
from .log_throttle import LogThrottle
from .sequence import SequenceTracker, Verdict

log = logging.getLogger(__name__)

END_OF_REPLAY = 0xFFFFFFFFFFFFFFFF
_EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
TOPIC_PREFIX = "kv@"


def parse_topic(topic: bytes) -> tuple[str, str] | None:
    """`kv@<ip:port>@<model>` -> (pod address, model); None for any other topic."""
    try:
        text = topic.decode()
    except UnicodeDecodeError:
        return None
    if not text.startswith(TOPIC_PREFIX):
        return None
    address, sep, model = text[len(TOPIC_PREFIX) :].partition("@")
    if not sep or ":" not in address:
        return None
    return address, model


class ReplayClient:
    """Asks a pod's replay ROUTER for every buffered batch from a sequence number."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, timeout_s: float = 2.0) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.timeout_s = timeout_s

    async def fetch(self, start: int) -> AsyncGenerator[tuple[bytes, int, bytes], None]:
        """Yields (topic, seq, payload) in order; raises TimeoutError if the pod goes quiet.

        A fresh DEALER per request, so a late answer to an abandoned request can never
        be mistaken for this one's.
        """
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(self.timeout_s * 1000):  # POLLIN, the default
                    raise TimeoutError(f"replay from {self.endpoint} went quiet")
                frames = await sock.recv_multipart()
                if len(frames) < 3:
                    continue
                topic, seq_bytes, payload = frames[-3:]
                seq = int.from_bytes(seq_bytes, "big")
                if seq == END_OF_REPLAY:
                    return
                yield topic, seq, payload
        finally:
            sock.close(linger=0)


class PodEventStream:
    """Applies one pod's batches to the index, exactly once and in order."""

    def __init__(
        self,
        pod: str,
        model: str,
        ingest: IngestState,
        index: BlockIndex,
        replay: Callable[[int], ReplayClient] | None = None,
        wall_clock: Callable[[], float] = time.time,
        model_from_topic: bool = False,
        replay_backoff_s: float = 10.0,
        warn_interval_s: float = 60.0,
    ) -> None:
        self.pod = pod
        self.model = model
        self.model_from_topic = model_from_topic
        self.ingest = ingest
        self.index = index
        self._replay_for_rank = replay
        self._wall_clock = wall_clock
        self._trackers: dict[int, SequenceTracker] = {}
        self._lock = asyncio.Lock()
        self._counters: dict[str, Any] | None = None
        # After a failed replay (no replay socket, pod down) the stream keeps going on
        # live batches for a while instead of stalling on every gap.
        self.replay_backoff_s = replay_backoff_s
        self._replay_blocked_until = 0.0
        self._last_topic = b""
        # Catch-up on start (readiness waits for it, see kv_index/catch_up.py): whether the
        # first resync has run, and whether a replay from 0 applied the pod's buffer.
        self.sync_attempted = asyncio.Event()
        self.caught_up = asyncio.Event()
        # Warnings a broken or hostile publisher could repeat every batch: once a minute.
        self._log_throttle = LogThrottle(warn_interval_s)
        ingest.register_pod(pod, model)

    def learn_model(self, topic: bytes) -> None:
        """Central mode: the model is the one the pod names in its topic."""
        if topic == self._last_topic:
            return  # a pod sends the same topic every batch: parse it once
        self._last_topic = topic
        parsed = parse_topic(topic)
        if parsed is not None and parsed[1] and parsed[1] != self.model:
            self.model = parsed[1]
            self.ingest.register_pod(self.pod, self.model)

    def tracker(self, rank: int = 0) -> SequenceTracker:
        tracker = self._trackers.get(rank)
        if tracker is None:
            tracker = self._trackers[rank] = SequenceTracker()
        return tracker

    @property
    def replayable(self) -> bool:
        """Whether the pod has a replay socket to catch up from."""
        return self._replay_for_rank is not None

    async def resync(self, rank: int = 0) -> None:
        """Fetches whatever the pod still buffers (used right after connecting)."""
        try:
            async with self._lock:
                await self._replay(rank, 0, None)
        finally:
            self.sync_attempted.set()

    async def handle(self, seq: int, payload: bytes) -> None:
        async with self._lock:
            try:
                await self._handle(seq, payload)
            except Exception:  # one bad batch or backend hiccup must not stop the stream
                self._warn_throttled("failed to handle batch %d from %s", seq, self.pod)

    async def _handle(self, seq: int, payload: bytes) -> None:
        try:
            batch, skipped = decode_batch(payload)
        except DecodeError as exc:
            metrics.DECODE_ERRORS.labels(self.pod).inc()
            log.warning("kv events: dropped undecodable batch %d from %s: %s", seq, self.pod, exc)
            # Its rank is unreadable; rank 0 is the only one in all but DP deployments.
            # Consuming its number keeps a replay from fetching the same bad bytes.
            tracker = self.tracker(0)
            if tracker.expected == seq:
                tracker.expected = seq + 1
            return
        if skipped:
            metrics.DECODE_ERRORS.labels(self.pod).inc(skipped)
        rank = batch.data_parallel_rank or 0
        tracker = self.tracker(rank)
        verdict, start = tracker.observe(seq, batch.ts)
        if verdict is Verdict.DUPLICATE:
            return
        if verdict is Verdict.RESTART or verdict is Verdict.SUSPECT:
            # Verified against the pod's replay buffer before anything is wiped: a frame
            # that is corrupt or forged must not clear a healthy pod's index.
            same = await self._same_process(rank)
            if same or (same is None and verdict is Verdict.SUSPECT):
                metrics.SUSPECT_FRAMES.labels(self.pod).inc()
                self._warn_throttled(
                    "dropped batch %d from %s: sequence implausible after %s",
                    seq,
                    self.pod,
                    tracker.expected,
                )
                return
            metrics.RESTARTS.labels(self.pod).inc()
            log.info("kv events: %s restarted (seq %d after %s)", self.pod, seq, tracker.expected)
            await self._reset()
            if verdict is Verdict.SUSPECT:
                # The numbering of the new process is unknown: take what it buffers.
                await self._replay(rank, 0, None)
                return
            verdict, start = tracker.observe(seq, batch.ts)
        if verdict is Verdict.GAP:
            if tracker.expected is None:
                # The first live batch: the pod is up now, whatever an earlier replay
                # (before it had started) ran into.
                self._replay_blocked_until = 0.0
            missing = seq - start
            recovered = await self._replay(rank, start, seq)
            if recovered < missing:
                metrics.SEQUENCE_GAPS.labels(self.pod).inc(missing - recovered)
                log.warning(
                    "kv events: %s lost batches %d..%d (%d recovered by replay)",
                    self.pod,
                    start,
                    seq - 1,
                    recovered,
                )
        await self._apply(rank, seq, batch)
        if seq == 0:
            self.caught_up.set()  # live from the process's first batch: nothing missed

    async def _same_process(self, rank: int) -> bool | None:
        """Whether the pod still buffers our last applied batch with the same timestamp
        (the same engine process); None when that cannot be asked."""
        tracker = self.tracker(rank)
        anchor = tracker.anchor()
        if (
            anchor is None
            or self._replay_for_rank is None
            or time.monotonic() < self._replay_blocked_until
        ):
            return None
        client = self._replay_for_rank(rank)
        try:
            async with aclosing(client.fetch(anchor)) as replayed:
                async for _topic, seq, payload in replayed:
                    if seq != anchor:
                        return True  # our anchor aged out of a buffer that went on filling
                    try:
                        batch, _ = decode_batch(payload)
                    except DecodeError:
                        return None
                    return batch.ts == tracker.last_ts
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("kv events: replay from %s failed: %s", client.endpoint, exc)
            self._replay_blocked_until = time.monotonic() + self.replay_backoff_s
            return None
        return False  # nothing at or after our anchor: a younger process

    def _warn_throttled(self, message: str, *args: object) -> None:
        held = self._log_throttle.allow()
        if held is None:
            return
        suffix = f" ({held} similar messages held back)" if held else ""
        failing = sys.exc_info()[1] is not None
        log.warning("kv events: " + message + suffix, *args, exc_info=failing)

    async def rebuild(self, model: str | None = None) -> None:
        """Drops what the pod published (re-keying it under `model` when given) and
        replays its buffer from 0 on every rank seen."""
        # Under the lock, so no live batch lands between the purge and the replay.
        async with self._lock:
            await self._reset()
            if model is not None:
                self.model = model
                self.ingest.register_pod(self.pod, model)
            self._replay_blocked_until = 0.0  # a restarted pod deserves a fresh try
            for rank in sorted(self._trackers) or [0]:
                await self._replay(rank, 0, None)

    async def _reset(self) -> None:
        self.ingest.reset_pod(self.pod)
        await self.index.clear_pod(self.pod)
        for tracker in self._trackers.values():
            tracker.reset()

    async def _replay(self, rank: int, start: int, stop: int | None) -> int:
        """Applies replayed batches in [start, stop); returns how many were applied.

        When resuming an existing stream, the replay starts one batch early: if the pod
        no longer has our last batch with the same timestamp, it restarted while we were
        not listening, so its state is dropped and the replay starts over from 0.
        """
        if self._replay_for_rank is None or time.monotonic() < self._replay_blocked_until:
            return 0
        client = self._replay_for_rank(rank)
        tracker = self.tracker(rank)
        anchor = tracker.anchor() if start == tracker.expected else None
        applied = 0
        restarted = False
        try:
            async with aclosing(client.fetch(start if anchor is None else anchor)) as replayed:
                async for topic, seq, payload in replayed:
                    if stop is not None and seq >= stop:
                        break  # the live stream delivers the rest
                    if self.model_from_topic:
                        self.learn_model(topic)
                    try:
                        batch, skipped = decode_batch(payload)
                    except DecodeError:
                        if seq != anchor:  # the anchor was counted when it arrived live
                            metrics.DECODE_ERRORS.labels(self.pod).inc()
                        continue
                    if anchor is not None:
                        if seq == anchor and batch.ts != tracker.last_ts:
                            restarted = True
                            break
                        anchor = None  # verified, or too old to be buffered any more
                        if seq < start:
                            continue
                    if not tracker.wants(seq):
                        continue
                    if skipped:
                        metrics.DECODE_ERRORS.labels(self.pod).inc(skipped)
                    await self._apply(rank, seq, batch, live=False)
                    applied += 1
        except (TimeoutError, zmq.ZMQError) as exc:
            metrics.REPLAYS.labels(self.pod, "failed").inc()
            log.warning("kv events: replay from %s failed: %s", client.endpoint, exc)
            self._replay_blocked_until = time.monotonic() + self.replay_backoff_s
            return applied
        metrics.REPLAYS.labels(self.pod, "ok").inc()
        metrics.REPLAYED_BATCHES.labels(self.pod).inc(applied)
        if start == 0 and not restarted:
            self.caught_up.set()  # everything the pod still buffers is applied
        if restarted:
            metrics.RESTARTS.labels(self.pod).inc()
            log.info("kv events: %s restarted while its batches were lost", self.pod)
            await self._reset()
            return await self._replay(rank, 0, stop)
        return applied

    async def _apply(self, rank: int, seq: int, batch: EventBatch, live: bool = True) -> None:
        """`live`: heard as the pod published it (a replayed batch is old by design, so
        its age says nothing of how late the pod's events arrive)."""
        if live:
            self.ingest.progress.heard(self.pod, self._wall_clock() - batch.ts)
        try:
            result = self.ingest.apply(self.pod, batch, self.model)
            for op in result.ops:
                if op.kind == "add":
                    await self.index.add(self.pod, op.keys, op.medium)
                elif op.kind == "remove":
                    await self.index.remove(self.pod, op.keys, op.medium)
                else:
                    await self.index.clear_pod(self.pod)
        except Exception:
            # The batch is skipped but its number consumed: retrying it by replay would
            # fail the same way, and every later batch would look like a gap.
            metrics.APPLY_FAILURES.labels(self.pod).inc()
            self.tracker(rank).applied(seq, batch.ts)
            self._warn_throttled("failed to apply batch %d from %s", seq, self.pod)
            return
        self.tracker(rank).applied(seq, batch.ts)
        self._count(batch, result)

    def _count(self, batch: EventBatch, result: ApplyResult) -> None:
        counters = self._counters
        if counters is None:
            # Labelled children are looked up once per pod: the lookup costs more than
            # the increment on this hot path.
            pod = self.pod
            counters = self._counters = {
                "stored": metrics.BLOCKS.labels(pod, "stored"),
                "removed": metrics.BLOCKS.labels(pod, "removed"),
                "orphan": metrics.ORPHAN_BLOCKS.labels(pod),
                "evicted": metrics.HASH_MAP_EVICTIONS.labels(pod),
                "decode": metrics.DECODE_ERRORS.labels(pod),
                **{name: metrics.EVENTS.labels(pod, name) for name in _EVENT_TYPES},
            }
        metrics.LAG.observe(max(0.0, self._wall_clock() - batch.ts))
        events = batch.events
        if len(events) == 1:
            counters[type(events[0]).__name__].inc()
        else:
            # One increment per event type, not per event: a batch may hold hundreds.
            for event_type, count in Counter(map(type, events)).items():
                counters[event_type.__name__].inc(count)
        if result.stored_blocks:
            counters["stored"].inc(result.stored_blocks)
        if result.removed_blocks:
            counters["removed"].inc(result.removed_blocks)
        if result.orphan_blocks:
            counters["orphan"].inc(result.orphan_blocks)
        if result.evicted_hashes:
            counters["evicted"].inc(result.evicted_hashes)
        if result.malformed_events:
            counters["decode"].inc(result.malformed_events)


def split_frames(frames: list[bytes]) -> tuple[bytes, int, bytes] | None:
    """[topic, seq (8 bytes BE), payload] -> parts; None for a malformed message."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return frames[0], int.from_bytes(frames[1], "big"), frames[2]


async def dial_loop(
    ctx: zmq.asyncio.Context, endpoint: str, stream: PodEventStream, resync: bool = True
) -> None:
    """Connects a SUB to one pod's publisher and applies its batches until cancelled."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    try:
        if resync:
            await stream.resync()
        while True:
            parts = split_frames(await sock.recv_multipart())
            if parts is None:
                metrics.DECODE_ERRORS.labels(stream.pod).inc()
                continue
            _, seq, payload = parts
            await stream.handle(seq, payload)
    finally:
        sock.close(linger=0)


async def central_loop(
    sock: zmq.asyncio.Socket,
    route: Callable[[bytes, str, int, bytes], bool],
) -> None:
    """Reads the bound SUB socket; `route(topic, pod, seq, payload)` hands a batch on and
    returns False when no pool member has that address."""
    while True:
        parts = split_frames(await sock.recv_multipart())
        if parts is None:
            metrics.DECODE_ERRORS.labels("").inc()
            continue
        topic, seq, payload = parts
        parsed = parse_topic(topic)
        if parsed is None or not route(topic, parsed[0], seq, payload):
            metrics.UNKNOWN_TOPICS.inc()


async def drain_queue(
    queue: asyncio.Queue[tuple[bytes, int, bytes]], stream: PodEventStream
) -> None:
    """Per-pod worker of central mode: a slow replay for one pod never stalls another."""
    while True:
        topic, seq, payload = await queue.get()
        stream.learn_model(topic)
        await stream.handle(seq, payload)


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task

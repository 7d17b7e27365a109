"""KV-cache events on the wire, like vLLM 0.32's ZMQ publisher.

``encode_batch`` is the pure part: events -> msgpack payload bytes, either vLLM 0.32's
maps with a ``"type"`` key (fields in vLLM's order, ``session_id`` omitted when unset) or the
older positional arrays with the tag first. ``KVEventPublisher`` is the socket shell: a PUB
socket sending ``[topic, seq (8-byte big-endian), payload]`` and an optional ROUTER that
answers vLLM's replay protocol (a DEALER sends ``[b"", start_seq (8 bytes)]`` and gets
``[b"", topic, seq, payload]`` for every buffered batch with seq >= start_seq, then the end
marker ``[b"", b"", b"\\xff" * 8, b""]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

Encoding = Literal["map", "array"]
END_OF_REPLAY_SEQ = b"\xff" * 8
DEFAULT_BUFFER_STEPS = 10_000

_encoder = msgspec.msgpack.Encoder()
_STORED_FIELDS = tuple(f.name for f in fields(BlockStored))
# The positional layout of older vLLM releases (tag first, no LoRA name / group fields).
_LEGACY_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium")  # fmt: skip


def event_to_wire(event: KVEvent, encoding: Encoding = "map") -> Any:
    """The msgpack-ready form of one event."""
    if isinstance(event, BlockStored):
        if encoding == "array":
            return ["BlockStored", *(getattr(event, f) for f in _LEGACY_STORED)]
        out: dict[str, Any] = {"type": "BlockStored"}
        for name in _STORED_FIELDS:
            value = getattr(event, name)
            if name == "session_id" and value is None:
                continue
            out[name] = value
        return out
    if isinstance(event, BlockRemoved):
        if encoding == "array":
            return ["BlockRemoved", event.block_hashes, event.medium]
        return {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": event.medium,
            "group_idx": event.group_idx,
        }
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(
    events: Sequence[KVEvent], ts: float, encoding: Encoding = "map", data_parallel_rank: int = 0
) -> bytes:
    """msgpack payload of one batch: ``[ts, [event, ...], data_parallel_rank]``."""
    return _encoder.encode([float(ts), [event_to_wire(e, encoding) for e in events],
                            data_parallel_rank])  # fmt: skip


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=False)


class KVEventPublisher:
    """ZMQ PUB (+ optional replay ROUTER) for one pod's KV-event batches.

    ``endpoint`` is bound when it contains ``*`` or ``bind=True``, else connected.
    Sequence numbers start at 0 for every publisher, as after a vLLM restart.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str,
        replay_endpoint: str | None = None,
        *,
        bind: bool | None = None,
        encoding: Encoding = "map",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        ctx: zmq.asyncio.Context | None = None,
    ):
        self.endpoint = endpoint
        self.topic = topic
        self._topic = topic.encode()
        self.replay_endpoint = replay_endpoint
        self.encoding: Encoding = encoding
        self._bind = ("*" in endpoint) if bind is None else bind
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def start(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        if self._bind:
            _bind_retrying(pub, self.endpoint)
        else:
            pub.connect(self.endpoint)
        if self._bind:  # a ":*" port binds any free port: report the one taken
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub = pub
        if self.replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            # A ROUTER silently drops above its high-water mark: room for a full replay.
            router.setsockopt(zmq.SNDHWM, (self._buffer.maxlen or DEFAULT_BUFFER_STEPS) + 16)
            _bind_retrying(router, self.replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._router = router
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KVEvent], ts: float) -> int | None:
        """Sends one batch (nothing when ``events`` is empty); returns its seq."""
        if not events or self._pub is None:
            return None
        payload = encode_batch(events, ts, self.encoding)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self._topic, seq_bytes(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV event batch %d dropped: subscriber queue full", seq)
        return seq

    def replay_frames(self, start_seq: int) -> list[list[bytes]]:
        """What the replay socket answers (without the identity frame) for ``start_seq``."""
        frames = [[b"", self._topic, seq_bytes(s), p] for s, p in self._buffer if s >= start_seq]
        frames.append([b"", b"", END_OF_REPLAY_SEQ, b""])
        return frames

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            msg = await router.recv_multipart()
            identity, rest = msg[0], msg[1:]
            if len(rest) < 2 or len(rest[-1]) != 8:
                log.warning("malformed replay request dropped: %d frames", len(msg))
                continue
            start = int.from_bytes(rest[-1], "big")
            for frames in self.replay_frames(start):
                await router.send_multipart([identity, *frames])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None


REBIND_TIMEOUT_S = 2.0


def _bind_retrying(sock: zmq.Socket[Any], endpoint: str) -> None:
    """Binds, retrying briefly while the port is still held.

    A restarted pod binds the ports its previous process used; ZeroMQ releases a closed
    socket's port from its I/O thread, a moment after close() returns.
    """
    deadline = time.monotonic() + REBIND_TIMEOUT_S
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)

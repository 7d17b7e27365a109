"""A plain ZMQ SUB on one vLLM pod's KV-event publisher, and vLLM's block-hash recipe."""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from smart_epp.kv_index.events import EventBatch, decode_batch
from smart_epp.kv_index.subscriber import split_frames

# vLLM's default seed when PYTHONHASHSEED is unset (the pods here unset it).
_NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()


def vllm_block_ids(token_ids: Sequence[int], block_size: int, extra_keys: Any = None) -> list[int]:
    """The ids vLLM (sha256 prefix-caching hash) publishes for the full blocks of a prompt."""
    ids = []
    parent = _NONE_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, extra_keys), protocol=5)).digest()
        ids.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return ids


@dataclass(frozen=True)
class ReceivedBatch:
    topic: str
    seq: int
    payload: bytes
    batch: EventBatch


class KvEventSubscriber:
    """Subscribes to one pod's topic; waits for the connection before tests send requests.

    A PUB drops what it publishes before the subscriber is connected, so `__enter__`
    blocks until ZMQ reports the handshake done.
    """

    def __init__(self, endpoint: str, topic: str, connect_timeout_s: float = 10.0) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._endpoint = endpoint
        self._connect_timeout_s = connect_timeout_s

    def __enter__(self) -> KvEventSubscriber:
        monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            self._sock.connect(self._endpoint)
            if not monitor.poll(self._connect_timeout_s * 1000):
                raise TimeoutError(f"no ZMQ handshake with {self._endpoint}")
            recv_monitor_message(monitor)
        finally:
            self._sock.disable_monitor()
            monitor.close(linger=0)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def receive(self, timeout_s: float) -> ReceivedBatch | None:
        if not self._sock.poll(timeout_s * 1000, zmq.POLLIN):
            return None
        parts = split_frames(self._sock.recv_multipart())
        assert parts is not None, "a KV event message that is not [topic, seq, payload]"
        topic, seq, payload = parts
        batch, skipped = decode_batch(payload)
        assert skipped == 0, f"{skipped} events of batch {seq} could not be decoded"
        return ReceivedBatch(topic.decode(), seq, payload, batch)

    def collect_until(
        self, done: Callable[[list[ReceivedBatch]], bool], timeout_s: float = 60.0
    ) -> list[ReceivedBatch]:
        """Receives batches until `done(all received so far)` holds."""
        received: list[ReceivedBatch] = []
        deadline = time.monotonic() + timeout_s
        while not done(received):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"KV events incomplete after {timeout_s}s: {received}")
            item = self.receive(left)
            if item is not None:
                received.append(item)
        return received

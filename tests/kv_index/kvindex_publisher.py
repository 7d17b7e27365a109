"""A KV-event publisher that speaks vLLM's ZMQ protocol, for subscriber tests.

PUB frames `[topic, seq (8-byte big-endian), payload]`; a ROUTER answers
`[b"", start_seq]` with `[b"", topic, seq, payload]` for every buffered batch from
start_seq, then the end marker `[b"", b"", 0xff * 8, b""]`. It can bind (dial mode:
the subscriber connects) or connect to a bound SUB (central mode), "restart" (new
sockets, numbering from 0, empty buffer) and drop a batch from the live stream while
keeping it in the replay buffer, as a lossy network would.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

import zmq
import zmq.asyncio

END_MARKER = [b"", b"", b"\xff" * 8, b""]


class VllmKvPublisher:
    def __init__(
        self,
        topic: str,
        events_endpoint: str,
        replay_endpoint: str | None,
        connect: bool = False,
        curve: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        self.topic = topic.encode()
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self.connect = connect
        # (own public key, own secret key, the server's public key) for a CURVE client
        self.curve = curve
        self.ctx = zmq.asyncio.Context()
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> VllmKvPublisher:
        # A socket whose bind fails is closed at once: a leaked one would keep its port
        # and make the context's term() wait forever.
        pub = self.ctx.socket(zmq.PUB)
        try:
            pub.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                pub.curve_publickey, pub.curve_secretkey, pub.curve_serverkey = self.curve
            if self.connect:
                pub.connect(self.events_endpoint)
            else:
                pub.bind(self.events_endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        self._pub = pub
        if self.replay_endpoint is not None:
            router = self.ctx.socket(zmq.ROUTER)
            try:
                router.setsockopt(zmq.LINGER, 0)
                router.bind(self.replay_endpoint)
            except zmq.ZMQError:
                router.close(linger=0)
                pub.close(linger=0)
                self._pub = None
                raise
            self._router = router
            self._task = asyncio.create_task(self._serve_replay())
        return self

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            identity, _, start = await self._router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self._router.send_multipart(
                        [identity, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._router.send_multipart([identity, *END_MARKER])

    async def publish(self, payload: bytes, drop: bool = False) -> int:
        """Publishes the next batch; with `drop` it is only kept for replay."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not drop:
            assert self._pub is not None
            await self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        assert self._pub is not None
        await self._pub.send_multipart(frames)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    async def restart(self) -> None:
        """A new engine process on the same ports: numbering and buffer start afresh."""
        await self.stop()
        self.seq = 0
        self.buffer.clear()
        for _ in range(200):  # the old sockets release their ports asynchronously
            try:
                await self.start()
                return
            except zmq.ZMQError:
                await asyncio.sleep(0.05)
        await self.start()

    async def close(self) -> None:
        await self.stop()
        self.ctx.term()

"""Replay sockets (vLLM's ROUTER protocol) that misbehave on purpose, for catch-up tests:
one that answers only when released, one whose answer never ends."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import zmq
import zmq.asyncio

from smart_epp.kv_index.events import EventBatch, encode_batch

END_OF_REPLAY = [b"", b"", b"\xff" * 8, b""]


class _ReplaySocket:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.requests = 0
        self._task = asyncio.create_task(self._serve())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close(linger=0)


class HeldReplaySocket(_ReplaySocket):
    """Answers every request with an empty buffer, but only once `release` is set."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.release = asyncio.Event()
        super().__init__(ctx)

    async def _serve(self) -> None:
        while True:
            identity, *_ = await self.sock.recv_multipart()
            self.requests += 1
            await self.release.wait()
            await self.sock.send_multipart([identity, *END_OF_REPLAY])


class EndlessReplaySocket(_ReplaySocket):
    """Answers the first request with an empty batch every 50 ms, and never ends."""

    async def _serve(self) -> None:
        identity, *_ = await self.sock.recv_multipart()
        self.requests += 1
        for seq in itertools.count():
            payload = encode_batch(EventBatch(ts=time.time(), events=[]))
            await self.sock.send_multipart([identity, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await asyncio.sleep(0.05)

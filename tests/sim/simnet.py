"""Network helpers for simulator tests: ZMQ replay/SUB clients and /metrics reading."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families


async def replay(endpoint: str, start_seq: int = 0) -> list[dict[str, Any]]:
    """Asks a replay ROUTER for every batch from ``start_seq``; returns decoded batches."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), 5.0)
            _, topic, seq, payload = frames
            if seq == b"\xff" * 8:
                assert topic == b"" and payload == b""
                return out
            out.append(decode(topic, seq, payload))
    finally:
        sock.close(linger=0)


def decode(topic: bytes, seq: bytes, payload: bytes) -> dict[str, Any]:
    ts, events, rank = msgspec.msgpack.decode(payload)
    return {"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "ts": ts,
            "events": events, "rank": rank}  # fmt: skip


class Subscriber:
    """A SUB socket collecting decoded batches in the background."""

    def __init__(self, endpoint: str, topic: str):
        self.batches: list[dict[str, Any]] = []
        self._sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 20)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.connect(endpoint)
        self._task = asyncio.get_running_loop().create_task(self._recv())

    async def _recv(self) -> None:
        while True:
            topic, seq, payload = await self._sock.recv_multipart()
            self.batches.append(decode(topic, seq, payload))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._sock.close(linger=0)


@contextlib.asynccontextmanager
async def subscriber(endpoint: str, topic: str) -> AsyncIterator[Subscriber]:
    sub = Subscriber(endpoint, topic)
    try:
        yield sub
    finally:
        await sub.close()


def events_of(batches: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for b in batches for e in b["events"] if e["type"] == kind]


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics parsed by prometheus_client: {(sample name, sorted labels): value}."""
    async with session.get(url) as resp:
        assert resp.status == 200
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(metrics: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    wanted = labels.items()
    matches = [v for (n, lbl), v in metrics.items() if n == name and wanted <= dict(lbl).items()]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, float, list[dict[str, Any]]]:
    """POSTs a streaming request; returns (time to first chunk, total time, data chunks)."""
    start = time.monotonic()
    first = None
    chunks = []
    async with session.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if first is None and any(c.get("text") for c in chunk["choices"]):
                first = time.monotonic() - start
            chunks.append(chunk)
    assert first is not None
    return first, time.monotonic() - start, chunks

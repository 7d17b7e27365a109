"""Hands Envoy access-log records between the workers of one `epp serve`.

Workers share one ext_proc port, so each of Envoy's access-log streams lands on one of
them, whichever routed the requests it reports. A worker publishes the records it did
not route on a Redis channel of the pool; every other worker hears them and ends the
requests it routed (`ResponseLog.on_records(handed_on=True)`), so in-flight counts,
TTFT learning and outcomes stay exact. A record nobody routed (a restarted picker's)
is dropped by all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from ...proto.access_log import ResponseRecord

log = logging.getLogger(__name__)

Deliver = Callable[[list[ResponseRecord]], None]


def encode(records: list[ResponseRecord], sender: str) -> str:
    rows = [
        [r.request_id, r.status, r.upstream, r.first_body_byte_s, r.upstream_done_s, r.flags]
        for r in records
    ]
    return json.dumps([sender, rows])


def decode(message: bytes | str) -> tuple[str, list[ResponseRecord]]:
    sender, rows = json.loads(message)
    return sender, [ResponseRecord(*row) for row in rows]


class RecordRelay:
    def __init__(self, url: str, pool_name: str, worker: str, deliver: Deliver) -> None:
        self.client = aioredis.Redis.from_url(url, socket_connect_timeout=0.5)
        self.channel = f"smart-epp:{{{pool_name}}}:records"
        self.worker = worker
        self.deliver = deliver
        self.sent = 0
        self.received = 0
        self._pending: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None

    def hand_on(self, records: list[ResponseRecord]) -> None:
        task = asyncio.get_running_loop().create_task(self._publish(records))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self, records: list[ResponseRecord]) -> None:
        try:
            await self.client.publish(self.channel, encode(records, self.worker))
            self.sent += len(records)
        except Exception as exc:  # the record is lost; its request expires in time
            log.warning("could not hand on %d access-log records: %s", len(records), exc)

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="record-relay")

    async def _listen(self) -> None:
        while True:
            try:
                async with self.client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.channel)
                    async for message in pubsub.listen():
                        sender, records = decode(message["data"])
                        if sender == self.worker:
                            continue
                        self.received += len(records)
                        self.deliver(records)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("access-log relay: %s; resubscribing", exc)
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        await self.client.aclose()


__all__ = ["RecordRelay", "decode", "encode"]

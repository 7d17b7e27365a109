"""A starting replica reports ready once its block index has caught up with the pool.

Until then its health answers NOT_SERVING (liveness excepted), so Envoy's active health
check and kubelet's readiness probe keep traffic on the replicas that already know what
the pods cached; the wait is bounded (see kv_index/catch_up.py).
"""

from __future__ import annotations

import asyncio
import logging

from ..kv_index.catch_up import CatchUp
from .server import EppServer

log = logging.getLogger(__name__)


async def ready_when_caught_up(
    server: EppServer, catch_up: CatchUp, timeout_s: float, stop: asyncio.Event
) -> None:
    result = await catch_up.wait(timeout_s)
    if stop.is_set():
        return  # draining already: stay NOT_SERVING
    await server.set_serving(True)
    log.info(
        "ready: health SERVING after %.2fs of index catch-up (%d pods pending)",
        result.waited_s,
        len(result.pending),
    )


__all__ = ["ready_when_caught_up"]

"""Graceful drain of the ext_proc server on SIGTERM.

Health turns NOT_SERVING at once (kubelet takes the pod out of its Service, Envoy's
active health check stops choosing it), while the server keeps accepting and deciding
streams: Envoy keeps sending new ones until its next health check. Open streams (an LLM
response can stream for minutes) run to completion, up to the drain timeout; whatever is
still open then is cut, and the log says how many.
"""

from __future__ import annotations

import asyncio
import logging

from .server import EppServer

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# How long new streams are still expected after NOT_SERVING: one health-check interval of
# the shipped Envoy config (1 s). Streams that arrive meanwhile are decided as usual.
DEFAULT_DRAIN_NOTICE_S = 1.0
# How often the open-stream count is looked at while draining.
_POLL_S = 0.05


async def drain(
    server: EppServer,
    timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    notice_s: float = DEFAULT_DRAIN_NOTICE_S,
) -> int:
    """Drains and stops `server`; returns how many open streams the timeout cut."""
    await server.set_serving(False)
    loop = asyncio.get_running_loop()
    started = loop.time()
    log.info(
        "draining: health NOT_SERVING, %d open ext_proc streams, up to %.1fs",
        server.active_streams,
        timeout_s,
    )
    while True:
        elapsed = loop.time() - started
        if elapsed >= timeout_s:
            break
        if server.active_streams == 0 and elapsed >= min(notice_s, timeout_s):
            break
        await asyncio.sleep(_POLL_S)
    cut = server.active_streams
    await server.stop(grace=0)
    if cut:
        log.warning("drain timeout (%.1fs) reached: cut %d open ext_proc streams", timeout_s, cut)
    else:
        log.info("drained in %.1fs: every ext_proc stream completed", loop.time() - started)
    return cut


__all__ = ["DEFAULT_DRAIN_NOTICE_S", "DEFAULT_DRAIN_TIMEOUT_S", "drain"]

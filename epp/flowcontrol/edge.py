"""The asyncio edge of flow control: the timer that expires TTLs and retries dispatch.

Everything else is synchronous: the request flow awaits a future that admission resolves,
and requests ending or metrics scrapes call `pump()` directly.
"""

from __future__ import annotations

import asyncio
import logging

from .admission import AdmissionController
from .objectives import ObjectivesFileWatcher

log = logging.getLogger(__name__)

DISPATCH_RETRY_S = 0.02


async def run_admission_clock(
    admission: AdmissionController, interval_s: float = DISPATCH_RETRY_S
) -> None:
    """Pumps at each TTL deadline, and every `interval_s` while requests wait (a pod's
    room can also come from a scrape the gateway does not hear of, e.g. a shared index)."""
    while True:
        deadline = admission.next_deadline()
        delay = interval_s
        if deadline is not None:
            delay = min(delay, max(0.0, deadline - admission.clock()))
        await asyncio.sleep(delay)
        try:
            admission.pump()
        except Exception:
            log.exception("flow-control dispatch failed")


async def watch_objectives(watcher: ObjectivesFileWatcher, interval_s: float = 0.5) -> None:
    while True:
        await asyncio.sleep(interval_s)
        watcher.poll()

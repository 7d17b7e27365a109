"""When a starting replica's block index has caught up with the pool (its readiness).

A replica that starts late or restarts knows nothing of what the pods cached. It reports
ready only once every known pod's index is caught up, so Envoy and kubelet keep sending
to the replicas that already know. A pod counts as caught up when:
- a replay from 0 applied everything its replay socket still buffers (vLLM keeps 10,000
  batches), or
- its first resync has run and the shared store (`--kv-index redis`) is reachable: the
  other replicas keep the pod's blocks there, and lookups read them, or
- its first resync has run and it has no replay socket at all: nothing more can be
  fetched, its index fills from live events;
- the live stream delivered the engine's batch 0: nothing came before it.
A pod whose first resync failed is asked again every second while the wait lasts.
The wait is bounded: a pod whose replay socket does not answer must not keep the replica
out of service forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import metrics
from .manager import KVEventManager
from .subscriber import PodEventStream

log = logging.getLogger(__name__)

DEFAULT_CATCH_UP_TIMEOUT_S = 10.0
_POLL_S = 0.05
# A pod whose first resync failed (it came up after this replica) is asked again this often.
RETRY_S = 1.0


def stream_caught_up(stream: PodEventStream | None, store_synced: bool) -> bool:
    """Whether one pod's index is caught up (the rules in the module docstring)."""
    if stream is None:
        return False  # its subscription is not even registered yet
    if stream.caught_up.is_set():
        return True
    if not stream.sync_attempted.is_set():
        return False
    return store_synced or not stream.replayable


@dataclass(frozen=True, slots=True)
class CatchUpResult:
    waited_s: float
    pending: tuple[str, ...]  # pods still not caught up when the wait ended

    @property
    def complete(self) -> bool:
        return not self.pending


class CatchUp:
    """Waits until every pool member's index is caught up, or the timeout passes."""

    def __init__(
        self,
        manager: KVEventManager,
        pods: Callable[[], Iterable[str]],
        store_synced: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager = manager
        self.pods = pods
        self.store_synced = store_synced or (lambda: False)
        self.clock = clock

    def pending(self) -> list[str]:
        synced = self.store_synced()
        return [
            address
            for address in self.pods()
            if not stream_caught_up(self.manager.stream(address), synced)
        ]

    async def wait(self, timeout_s: float = DEFAULT_CATCH_UP_TIMEOUT_S) -> CatchUpResult:
        started = self.clock()
        retries: dict[str, tuple[float, asyncio.Task[None]]] = {}
        try:
            while True:
                pending = self.pending()
                waited = self.clock() - started
                if not pending or waited >= timeout_s:
                    break
                self._retry(pending, retries)
                await asyncio.sleep(_POLL_S)
        finally:
            for _, task in retries.values():
                task.cancel()
        result = CatchUpResult(waited, tuple(pending))
        metrics.CATCH_UP_SECONDS.set(waited)
        metrics.CATCH_UP_PENDING.set(len(pending))
        if pending:
            log.warning(
                "kv index: %d pods not caught up after %.1fs (%s); ready anyway, their "
                "entries fill from live events",
                len(pending),
                waited,
                ", ".join(sorted(pending)[:5]) + (" ..." if len(pending) > 5 else ""),
            )
        else:
            log.info("kv index: every pod caught up in %.2fs", waited)
        return result

    def _retry(
        self, pending: list[str], retries: dict[str, tuple[float, asyncio.Task[None]]]
    ) -> None:
        now = self.clock()
        for address in pending:
            stream = self.manager.stream(address)
            if stream is None or not stream.sync_attempted.is_set():
                continue  # the first resync is still running
            last = retries.get(address)
            if last is not None and (not last[1].done() or now - last[0] < RETRY_S):
                continue
            retries[address] = (now, asyncio.create_task(stream.retry_catch_up()))


__all__ = ["DEFAULT_CATCH_UP_TIMEOUT_S", "CatchUp", "CatchUpResult", "stream_caught_up"]

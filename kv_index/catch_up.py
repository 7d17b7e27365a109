"""When a starting replica's block index has caught up with the pool (its readiness).

A replica that starts late or restarts knows nothing of what the pods cached. It reports
ready only once every known pod's index has caught up, so Envoy and kubelet keep sending
to the replicas that already know. Per pod:
- caught up: a replay from 0 applied everything its replay socket still buffers (vLLM
  keeps 10,000 batches); or the live stream delivered the engine's batch 0 (nothing came
  before it); or, once its first resync has run, the shared store (`--kv-index redis`) is
  reachable and joined (the other replicas keep the pod's blocks there and lookups read
  them), or the pod has no replay socket at all (its index can only fill from live events);
- waiting: its first resync is still running (a replay can take a while on a busy pod);
- unreachable: its replay socket did not answer (the pod is down or starting; its events
  reach the index live once it publishes). Waiting for it would not help.
The wait ends when no pod is waiting, or after the timeout: a replay that never ends must
not keep the replica out of service forever. Pods not caught up are logged and counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from . import metrics
from .manager import KVEventManager
from .subscriber import PodEventStream

log = logging.getLogger(__name__)

DEFAULT_CATCH_UP_TIMEOUT_S = 10.0
_POLL_S = 0.05


class PodCatchUp(Enum):
    CAUGHT_UP = "caught up"
    WAITING = "replaying"
    UNREACHABLE = "replay socket did not answer"


def pod_catch_up(stream: PodEventStream | None, store_synced: bool) -> PodCatchUp:
    """Where one pod's index stands (the rules in the module docstring)."""
    if stream is None:
        return PodCatchUp.WAITING  # its subscription is not even registered yet
    if stream.caught_up.is_set():
        return PodCatchUp.CAUGHT_UP
    if not stream.sync_attempted.is_set():
        return PodCatchUp.WAITING
    if store_synced or not stream.replayable:
        return PodCatchUp.CAUGHT_UP
    return PodCatchUp.UNREACHABLE


@dataclass(frozen=True, slots=True)
class CatchUpResult:
    waited_s: float
    pending: tuple[str, ...]  # pods not caught up when the wait ended

    @property
    def complete(self) -> bool:
        return not self.pending


class CatchUp:
    """Waits until no pool member's index is still catching up, or the timeout passes."""

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

    def states(self) -> dict[str, PodCatchUp]:
        synced = self.store_synced()
        return {
            address: pod_catch_up(self.manager.stream(address), synced) for address in self.pods()
        }

    def pending(self) -> list[str]:
        """Pods not caught up (still replaying, or unreachable)."""
        return [a for a, state in self.states().items() if state is not PodCatchUp.CAUGHT_UP]

    async def wait(self, timeout_s: float = DEFAULT_CATCH_UP_TIMEOUT_S) -> CatchUpResult:
        started = self.clock()
        while True:
            states = self.states()
            waited = self.clock() - started
            if PodCatchUp.WAITING not in states.values() or waited >= timeout_s:
                break
            await asyncio.sleep(_POLL_S)
        behind = {a: s for a, s in states.items() if s is not PodCatchUp.CAUGHT_UP}
        metrics.CATCH_UP_SECONDS.set(waited)
        metrics.CATCH_UP_PENDING.set(len(behind))
        if behind:
            shown = sorted(behind)[:5]
            log.warning(
                "kv index: %d pods not caught up after %.1fs (%s%s); ready anyway, their "
                "entries fill from live events",
                len(behind),
                waited,
                ", ".join(f"{a}: {behind[a].value}" for a in shown),
                " ..." if len(behind) > len(shown) else "",
            )
        else:
            log.info("kv index: every pod caught up in %.2fs", waited)
        return CatchUpResult(waited, tuple(sorted(behind)))


__all__ = ["DEFAULT_CATCH_UP_TIMEOUT_S", "CatchUp", "CatchUpResult", "PodCatchUp", "pod_catch_up"]

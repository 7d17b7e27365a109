"""The pool as the gateway knows it: one PodState per endpoint address.

Single-threaded by design (one event loop per process), so no locking. Discovery calls
`set_endpoints`; the KV-event subscribers and the metrics scraper follow membership
through listeners; the request flow books requests in flight with `book`/`release`
(it remembers what it booked, so the datastore keeps no per-request table).

With shared pool state, other pickers' in-flight totals are folded into each pod's
`inflight` (`set_peer_loads`, its `peer_*` fields say how much of it is theirs), and
`on_change` tells the shared state when this picker's own load changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from ..framework.types import Endpoint, PodState

log = logging.getLogger(__name__)

EndpointListener = Callable[[Endpoint], None]
_T = TypeVar("_T")
# (requests, prompt tokens, prefilling, prefilling tokens, routed prefill seconds so far)
OwnLoad = tuple[int, int, int, int, float]
# (requests, prompt tokens, prefilling, prefilling tokens, prefill seconds routed per second)
PeerLoad = tuple[int, int, int, int, float]


class Datastore:
    def __init__(self) -> None:
        self._pods: dict[str, PodState] = {}
        self._listeners: list[tuple[EndpointListener, EndpointListener]] = []
        self._departure_listeners: list[Callable[[str], None]] = []
        # Called after this picker's own in-flight load changed, with (pod, added): added
        # when the pod got new work (`book`), not when work left it (`prefilled`, `release`).
        self.on_change: Callable[[str, bool], None] | None = None

    # ------------------------------------------------------------ membership

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Replaces the pool. Pods whose address stays keep their state (metrics, in-flight).

        A pod whose address stays but whose description changed (e.g. a new KV-event
        socket) keeps its state, and listeners see it removed then added again so they
        can reconnect.
        """
        wanted = {endpoint.address: endpoint for endpoint in endpoints}
        removed = [p.endpoint for a, p in self._pods.items() if a not in wanted]
        added: list[Endpoint] = []
        changed: list[tuple[Endpoint, Endpoint]] = []
        pods: dict[str, PodState] = {}
        for address, endpoint in wanted.items():
            pod = self._pods.get(address)
            if pod is None:
                pod = PodState(endpoint=endpoint)
                added.append(endpoint)
            elif pod.endpoint != endpoint:
                changed.append((pod.endpoint, endpoint))
                pod.endpoint = endpoint
            pods[address] = pod
        self._pods = pods
        for endpoint in removed:
            self._notify(1, endpoint)
            for departed in self._departure_listeners:
                self._call(departed, endpoint.address)
        for old, new in changed:
            self._notify(1, old)
            self._notify(0, new)
        for endpoint in added:
            self._notify(0, endpoint)
        if removed or added or changed:
            log.info(
                "pool now %d endpoints (+%d -%d ~%d)",
                len(pods),
                len(added),
                len(removed),
                len(changed),
            )

    def add_listener(self, on_added: EndpointListener, on_removed: EndpointListener) -> None:
        """Subscribes to membership; `on_added` is called at once for the current pods."""
        self._listeners.append((on_added, on_removed))
        for pod in list(self._pods.values()):
            self._call(on_added, pod.endpoint)

    def add_departure_listener(self, on_departed: Callable[[str], None]) -> None:
        """Subscribes to addresses leaving the pool. Unlike `add_listener`'s removals, a
        pod whose description changed is not one: it stays, and keeps its state."""
        self._departure_listeners.append(on_departed)

    def _notify(self, which: int, endpoint: Endpoint) -> None:
        for listener in self._listeners:
            self._call(listener[which], endpoint)

    @staticmethod
    def _call(listener: Callable[[_T], None], arg: _T) -> None:
        try:
            listener(arg)
        except Exception:
            # One faulty subscriber must not stop the others from learning the pool.
            log.exception("endpoint listener failed for %s", getattr(arg, "address", arg))

    # ------------------------------------------------------------ queries

    def pods(self) -> list[PodState]:
        return list(self._pods.values())

    def ready_pods(self) -> list[PodState]:
        return [p for p in self._pods.values() if p.ready]

    def get(self, address: str) -> PodState | None:
        return self._pods.get(address)

    def __len__(self) -> int:
        return len(self._pods)

    # ------------------------------------------------------------ in-flight accounting

    def book(
        self,
        address: str,
        prompt_tokens: int,
        adapter: str | None,
        prefilling: bool = True,
        prefill_s: float = 0.0,
    ) -> bool:
        """Counts one request in flight on `address` (still waiting for its first byte
        unless `prefilling` is false) and the prefill seconds the policy predicted for it;
        False when no such pod exists."""
        pod = self._pods.get(address)
        if pod is None:
            return False
        inflight = pod.inflight
        inflight.requests += 1
        inflight.prompt_tokens += prompt_tokens
        inflight.routed_prefill_s += prefill_s
        if prefilling:
            inflight.prefilling += 1
            inflight.prefilling_tokens += prompt_tokens
        if adapter:
            inflight.adapters[adapter] += 1
        if self.on_change is not None:
            self.on_change(address, True)
        return True

    def prefilled(self, address: str, prompt_tokens: int) -> None:
        """A booked request's first byte came back: its prefill is done."""
        pod = self._pods.get(address)
        if pod is None:
            return
        inflight = pod.inflight
        inflight.prefilling = max(0, inflight.prefilling - 1)
        inflight.prefilling_tokens = max(0, inflight.prefilling_tokens - prompt_tokens)
        if self.on_change is not None:
            self.on_change(address, False)

    def release(
        self, address: str, prompt_tokens: int, adapter: str | None, prefilling: bool = False
    ) -> None:
        """Undoes one `book` (and its prefill count when it never saw a first byte); a pod
        that left the pool meanwhile has nothing to undo."""
        pod = self._pods.get(address)
        if pod is None:
            return
        inflight = pod.inflight
        inflight.requests = max(0, inflight.requests - 1)
        inflight.prompt_tokens = max(0, inflight.prompt_tokens - prompt_tokens)
        if prefilling:
            inflight.prefilling = max(0, inflight.prefilling - 1)
            inflight.prefilling_tokens = max(0, inflight.prefilling_tokens - prompt_tokens)
        if adapter:
            remaining = inflight.adapters[adapter] - 1
            if remaining > 0:
                inflight.adapters[adapter] = remaining
            else:
                del inflight.adapters[adapter]
        if self.on_change is not None:
            self.on_change(address, False)

    # ------------------------------------------------------------ shared with peers

    def own_load(self, address: str) -> OwnLoad:
        """This picker's own (requests, prompt tokens, prefilling, prefilling tokens,
        routed prefill seconds so far) on `address`: the pod's counts minus its peers'
        share."""
        pod = self._pods.get(address)
        if pod is None:
            return (0, 0, 0, 0, 0.0)
        i = pod.inflight
        return (
            max(0, i.requests - i.peer_requests),
            max(0, i.prompt_tokens - i.peer_prompt_tokens),
            max(0, i.prefilling - i.peer_prefilling),
            max(0, i.prefilling_tokens - i.peer_prefilling_tokens),
            i.routed_prefill_s,
        )

    def set_peer_loads(self, loads: Mapping[str, PeerLoad]) -> None:
        """Replaces what other pickers have in flight per pod (absent: nothing)."""
        for address, pod in self._pods.items():
            i = pod.inflight
            requests, prompt_tokens, prefilling, prefilling_tokens, prefill_rate = loads.get(
                address, (0, 0, 0, 0, 0.0)
            )
            own = self.own_load(address)
            i.requests = own[0] + requests
            i.prompt_tokens = own[1] + prompt_tokens
            i.prefilling = own[2] + prefilling
            i.prefilling_tokens = own[3] + prefilling_tokens
            i.peer_requests = requests
            i.peer_prompt_tokens = prompt_tokens
            i.peer_prefilling = prefilling
            i.peer_prefilling_tokens = prefilling_tokens
            i.peer_prefill_rate = prefill_rate

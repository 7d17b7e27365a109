"""The pool as the gateway knows it: one PodState per endpoint address.

Single-threaded by design (one event loop per process), so no locking. Discovery calls
`set_endpoints`; the KV-event subscribers and the metrics scraper follow membership
through listeners; the server accounts requests in flight with `begin`/`end`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from smart_epp.epp.types import Endpoint, LLMRequest, PodState

log = logging.getLogger(__name__)

EndpointListener = Callable[[Endpoint], None]


class Datastore:
    def __init__(self) -> None:
        self._pods: dict[str, PodState] = {}
        self._listeners: list[tuple[EndpointListener, EndpointListener]] = []
        # (address, id(request)) -> (request, prompt tokens counted at begin). Keeping the
        # request alive pins its id; remembering the count makes `end` exact and idempotent.
        self._open: dict[tuple[str, int], tuple[LLMRequest, int]] = {}

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

    def _notify(self, which: int, endpoint: Endpoint) -> None:
        for listener in self._listeners:
            self._call(listener[which], endpoint)

    @staticmethod
    def _call(listener: EndpointListener, endpoint: Endpoint) -> None:
        try:
            listener(endpoint)
        except Exception:
            # One faulty subscriber must not stop the others from learning the pool.
            log.exception("endpoint listener failed for %s", endpoint.address)

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

    def begin(self, address: str, request: LLMRequest) -> None:
        pod = self._pods.get(address)
        key = (address, id(request))
        if pod is None or key in self._open:
            return
        tokens = request.estimated_prompt_tokens()
        self._open[key] = (request, tokens)
        inflight = pod.inflight
        inflight.requests += 1
        inflight.prompt_tokens += tokens
        if request.adapter:
            inflight.adapters[request.adapter] += 1

    def end(self, address: str, request: LLMRequest) -> None:
        """Undoes `begin`; a second call, or one for a pod that left, does nothing."""
        entry = self._open.pop((address, id(request)), None)
        if entry is None:
            return
        pod = self._pods.get(address)
        if pod is None:
            return
        inflight = pod.inflight
        inflight.requests = max(0, inflight.requests - 1)
        inflight.prompt_tokens = max(0, inflight.prompt_tokens - entry[1])
        if request.adapter:
            remaining = inflight.adapters[request.adapter] - 1
            if remaining > 0:
                inflight.adapters[request.adapter] = remaining
            else:
                del inflight.adapters[request.adapter]

    def open_requests(self) -> int:
        """Requests begun and not yet ended, over all pods (for tests and health)."""
        return len(self._open)

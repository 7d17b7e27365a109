"""RequestFlow: one request's life from parsed body to outcome, with no I/O of its own.

    start -> route ([admission: wait for room] -> candidates -> schedule -> book in-flight)
          -> routed
          -> [first_byte] -> [served_by: re-book to the endpoint that answered]
          -> finish (release, outcome hooks)

The live gateway (`epp.server.Exchange`) drives it from Envoy's messages on the real
clock; the replay benchmark drives the very same object from simulated engines on a
virtual clock, so every benchmark result goes through the production lifecycle.

The flow is the only place that filters candidates (readiness, subset hint, the hooks'
candidate filters) and the only owner of per-request state: one `FlowRequest` per open
request, in one bounded table. When the table is full, the oldest request is ended as
lost (its in-flight load released, its outcome `ok=False`) rather than leaked.

Admission (optional) runs first in `route`: saturation-aware rejection of sheddable
requests and flow control, which may hold the request until a pod has room. Its
dispatch trigger is `pump`, called here whenever a request ends; the gateway also calls
it after metrics scrapes and on a timer, the replay on its simulated events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

from ..framework.lifecycle import CandidateFilter, FlowRequest, OutcomeObserver, RoutedObserver
from ..framework.scheduling import Scheduler
from ..framework.types import Decision, LLMRequest, Outcome, PodState, Usage
from .datastore import Datastore
from .errors import RequestError

log = logging.getLogger(__name__)

MAX_OPEN_REQUESTS = 100_000

Wake = Callable[[RequestError | None], None]


class Admission(Protocol):
    """The admission step (see `epp.flowcontrol.admission.AdmissionController`)."""

    def admit(self, flow: FlowRequest, wake: Wake) -> bool: ...
    def check_decision(self, flow: FlowRequest, decision: Decision) -> None: ...
    def settled(self, flow: FlowRequest) -> None: ...
    def cancel(self, flow: FlowRequest) -> bool: ...
    def pump(self) -> int: ...


class RequestFlow:
    def __init__(
        self,
        scheduler: Scheduler,
        datastore: Datastore,
        *,
        clock: Callable[[], float] = time.perf_counter,
        destination_count: int = 1,
        hooks: Iterable[object] = (),
        max_open: int = MAX_OPEN_REQUESTS,
        admission: Admission | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.admission = admission
        self.datastore = datastore
        self.clock = clock
        self.destination_count = max(1, destination_count)
        self.max_open = max_open
        self._filters: list[CandidateFilter] = []
        self._routed: list[RoutedObserver] = []
        self._outcomes: list[OutcomeObserver] = []
        for hook in hooks:
            self.add_hook(hook)
        if isinstance(admission, CandidateFilter):  # flow control's pods-with-room filter
            self.add_hook(admission)
        # Insertion-ordered: the first entry is the oldest open request.
        self._open: dict[int, FlowRequest] = {}
        # Awaited before each decision: brings in what other pickers of the pool decided
        # (shared pool state); None for a picker alone.
        self.refresh: Callable[[], Awaitable[None]] | None = None

    def add_hook(self, hook: object) -> None:
        """Registers a hook under every lifecycle interface it implements."""
        known = False
        if isinstance(hook, CandidateFilter):
            self._filters.append(hook)
            known = True
        if isinstance(hook, RoutedObserver):
            self._routed.append(hook)
            known = True
        if isinstance(hook, OutcomeObserver):
            self._outcomes.append(hook)
            known = True
        if not known:
            raise TypeError(f"{type(hook).__name__} implements no request-lifecycle hook")

    def open_requests(self) -> int:
        return len(self._open)

    # ------------------------------------------------------------------ request path

    def start(self, request: LLMRequest) -> FlowRequest:
        return FlowRequest(request=request, received_at=self.clock())

    def candidates(self, request: LLMRequest, subset: Sequence[str] | None) -> list[PodState]:
        pods = self.datastore.ready_pods()
        if subset is not None:
            allowed = set(subset)
            pods = [p for p in pods if p.address in allowed]
        for f in self._filters:
            if not pods:
                break
            pods = f.candidates(request, pods)
        return pods

    def admit(self, flow: FlowRequest, wake: Wake) -> bool:
        """The admission step alone, for drivers that wait in their own way (the replay).

        True: route it now (with `admitted=True`). False: it waits; `wake(None)` means
        route it now, `wake(error)` that it was refused. Raises RequestError (e.g. 429)."""
        if self.admission is None:
            return True
        return self.admission.admit(flow, wake)

    def abandon(self, flow: FlowRequest) -> None:
        """The client left before the request was routed: it leaves the queue at once."""
        if self.admission is not None:
            self.admission.cancel(flow)

    def pump(self) -> None:
        """Dispatch trigger: queued requests go on if a pod has room now."""
        if self.admission is not None:
            self.admission.pump()

    async def _wait_for_admission(self, flow: FlowRequest, admission: Admission) -> None:
        waiter: asyncio.Future[RequestError | None] | None = None

        def wake(error: RequestError | None) -> None:
            if waiter is not None and not waiter.done():
                waiter.set_result(error)

        waiter = asyncio.get_running_loop().create_future()
        if admission.admit(flow, wake):
            return
        try:
            error = await waiter
        except asyncio.CancelledError:  # the client went away while queued
            admission.cancel(flow)
            raise
        if error is not None:
            raise error

    async def route(
        self, flow: FlowRequest, subset: Sequence[str] | None = None, *, admitted: bool = False
    ) -> list[PodState]:
        """Admits the request (it may wait for room), chooses the destination (primary
        first, then fallbacks) and books the primary.

        Raises `RequestError`: `no_endpoint` when no pod can take the request, `shed`
        (429) or `no_endpoint` (503) when admission refuses it.
        """
        admission = self.admission
        if admission is None:
            return await self._schedule(flow, subset)
        if not admitted:
            await self._wait_for_admission(flow, admission)
        try:
            return await self._schedule(flow, subset)
        finally:
            admission.settled(flow)

    async def _schedule(self, flow: FlowRequest, subset: Sequence[str] | None) -> list[PodState]:
        if self.refresh is not None:
            await self.refresh()
        request = flow.request
        candidates = self.candidates(request, subset)
        if not candidates:
            raise RequestError.no_endpoint(
                "no endpoint in the requested subset is available"
                if subset is not None
                else "no endpoint available to serve the request"
            )
        decision = await self.scheduler.schedule(request, candidates)
        if self.admission is not None:
            self.admission.check_decision(flow, decision)
        return self._book(flow, decision)

    def _book(self, flow: FlowRequest, decision: Decision) -> list[PodState]:
        if not decision.endpoints:
            raise RequestError.no_endpoint()
        chosen = decision.endpoints[: self.destination_count]
        flow.decision = decision
        flow.primary = chosen[0].address
        flow.routed_at = self.clock()
        self._open_request(flow)
        self._book_on(flow, flow.primary)
        return chosen

    def _open_request(self, flow: FlowRequest) -> None:
        opened = self._open
        while len(opened) >= self.max_open:
            oldest = next(iter(opened.values()))
            log.warning(
                "more than %d requests open; ending the oldest (%s) as lost",
                self.max_open,
                oldest.request.request_id,
            )
            self.finish(oldest, ok=False)
        opened[id(flow)] = flow

    def _book_on(self, flow: FlowRequest, address: str) -> None:
        tokens = flow.request.estimated_prompt_tokens()
        waiting_first_byte = flow.first_byte_at is None
        decision = flow.decision
        # The predicted prefill counts once, on the pod the policy predicted it for.
        prefill_s = (
            decision.predicted_prefill_s
            if decision is not None and decision.endpoints[0].address == address
            else 0.0
        )
        if self.datastore.book(
            address, tokens, flow.request.adapter, waiting_first_byte, prefill_s
        ):
            flow.served = address
            flow.booked_tokens = tokens
        else:  # an address outside the pool: nothing to account
            flow.served = address
            flow.booked_tokens = -1

    def _release(self, flow: FlowRequest) -> None:
        if flow.served is not None and flow.booked_tokens >= 0:
            self.datastore.release(
                flow.served,
                flow.booked_tokens,
                flow.request.adapter,
                prefilling=flow.first_byte_at is None,
            )
        flow.booked_tokens = -1

    def routed(self, flow: FlowRequest) -> None:
        """The decision is on its way to Envoy: tell the scheduler and the observers."""
        decision = flow.decision
        if decision is None or flow.finished:
            return
        for observer in self._routed:
            try:
                observer.on_routed(flow)
            except Exception:  # bookkeeping must never fail a request
                log.exception("routed hook %r failed", observer)
        try:
            self.scheduler.on_routed(flow.request, decision)
        except Exception:
            log.exception("scheduler.on_routed failed for request %s", flow.request.request_id)
        # Only the outcome hooks' small records are needed from here on.
        decision.prompt_token_ids = None

    # ------------------------------------------------------------------ response path

    def first_byte(self, flow: FlowRequest, at: float | None = None) -> None:
        """The first byte of the response body arrived (`at`: when, on the flow's clock)."""
        if flow.first_byte_at is None:
            if flow.served is not None and flow.booked_tokens >= 0:
                self.datastore.prefilled(flow.served, flow.booked_tokens)
            flow.first_byte_at = self.clock() if at is None else at
            if self.admission is not None:  # its pod's prefill queue just got shorter
                self.admission.pump()

    def served_by(self, flow: FlowRequest, address: str) -> None:
        """A fallback (or a retry) answered: move the in-flight load to it.

        `address` is what Envoy dialed; where the decision sends a pod's requests to
        another address (data-parallel ranks behind one port), it maps back to the chosen
        pod dialed there, the booked one first.
        """
        if flow.finished or not address:
            return
        decision = flow.decision
        if decision is not None and decision.forward:
            dialed_there = [
                p.address
                for p in decision.endpoints[: self.destination_count]
                if decision.destination_of(p.address) == address
            ]
            if flow.served in dialed_there:
                return
            if dialed_there:
                address = dialed_there[0]
        if address == flow.served:
            return
        self._release(flow)
        self._book_on(flow, address)

    def finish(
        self,
        flow: FlowRequest,
        *,
        ok: bool,
        status: int = 0,
        usage: Usage | None = None,
        ended_at: float | None = None,
    ) -> Outcome | None:
        """Ends the request exactly once; later calls return None.

        `ended_at`: when the response ended on the flow's clock, for observers that hear
        of it later (an access log arrives in batches); default now.
        """
        if flow.finished or flow.decision is None or flow.served is None:
            return None
        self._open.pop(id(flow), None)
        self._release(flow)
        now = self.clock() if ended_at is None else ended_at
        ttft = flow.first_byte_at - flow.routed_at if flow.first_byte_at is not None else None
        outcome = Outcome(
            address=flow.served,
            ok=ok,
            status=status,
            usage=usage,
            ttft_s=ttft,
            duration_s=now - flow.routed_at,
            now=now,
        )
        flow.outcome = outcome
        try:
            self.scheduler.on_outcome(flow.request, flow.decision, outcome)
        except Exception:
            log.exception("scheduler.on_outcome failed for request %s", flow.request.request_id)
        for observer in self._outcomes:
            try:
                observer.on_outcome(flow, outcome)
            except Exception:  # bookkeeping must never fail a request
                log.exception("outcome hook %r failed", observer)
        if self.admission is not None:  # its pod has room for a queued request now
            self.admission.pump()
        return outcome


__all__ = ["MAX_OPEN_REQUESTS", "Admission", "RequestFlow"]

"""Admission and flow control for one pool: the synchronous core of the request flow's
admission step.

`admit(flow, wake)` runs before scheduling. Not saturated (and nobody waiting): the
request goes on at once. Saturated: a sheddable request (negative priority) is refused
with 429; the others, with flow control on, wait in the `FlowQueue` until `pump()` finds
a pod with room (or their TTL passes: 503, 429 for sheddable), and without it go on as
before. A waiting request's `wake(error_or_None)` is called exactly once.

`pump()` is the dispatch trigger. The gateway calls it when a request ends, after every
metrics scrape and on a timer for TTLs; the replay calls it on its own simulated events.
Nothing here reads a clock except the injected one, so the replay runs it in virtual time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from ...framework.lifecycle import CandidateFilter, FlowRequest
from ...framework.types import SLO_TTFT_HEADER, Decision, LLMRequest, PodState
from ...scorers.saturation_detectors import Reserved, SaturationDetector
from ..errors import RequestError
from .objectives import FAIRNESS_HEADER, OBJECTIVE_HEADER, ObjectiveTable
from .queue import FlowQueue, QueuedItem, QueueFull
from .settings import QueueSettings

log = logging.getLogger(__name__)

DEFAULT_FLOW = "default-flow"
Wake = Callable[[RequestError | None], None]


class Reason(StrEnum):
    SATURATED = "saturated"  # sheddable, pool saturated
    QUEUE_FULL = "queue-full"
    EXPIRED = "ttl-expired"
    DISCONNECTED = "disconnected"
    SLO_UNREACHABLE = "slo-unreachable"  # sheddable, no pod predicted to meet its TTFT SLO


class AdmissionObserver(Protocol):
    def dispatched(self, priority: int, waited_s: float) -> None: ...
    def rejected(self, priority: int, reason: Reason) -> None: ...


class _NoObserver:
    def dispatched(self, priority: int, waited_s: float) -> None:
        pass

    def rejected(self, priority: int, reason: Reason) -> None:
        pass


class AdmissionRefused(RequestError):
    """A RequestError from admission, with the reason it was refused."""

    def __init__(self, error: RequestError, reason: Reason) -> None:
        super().__init__(error.status, error.message, error.error_type, error.param)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Classified:
    objective: str
    priority: int
    flow_id: str


def request_size(request: LLMRequest) -> int:
    """Bytes a queued request counts against the byte limits: its body as received."""
    return len(request.body) or request.estimated_prompt_tokens() * 4


class AdmissionController(CandidateFilter):
    """Admission, flow control, and (with flow control on) the candidate filter that
    keeps requests off the pods past their limit, so a request goes where the room that
    admitted it is (every pod when none has room: fail open). A detector that calls the
    pool unsaturated while one pod has room relies on it."""

    def __init__(
        self,
        detector: SaturationDetector,
        pods: Callable[[], Sequence[PodState]],
        objectives: ObjectiveTable | None = None,
        *,
        flow_control: bool = False,
        queue: QueueSettings | None = None,
        clock: Callable[[], float],
        observer: AdmissionObserver | None = None,
    ) -> None:
        self.detector = detector
        self.objectives = objectives if objectives is not None else ObjectiveTable()
        self.flow_control = flow_control
        self.clock = clock
        self.observer: AdmissionObserver = observer or _NoObserver()
        settings = queue or QueueSettings()
        self.ttl_s = settings.ttl_s
        self.queue = FlowQueue(
            settings.bands,
            settings.default_band,
            settings.default_negative_band,
            settings.max_requests,
            settings.max_bytes,
        )
        self._pods = pods
        self._waiting: dict[int, tuple[QueuedItem, Wake]] = {}
        # Requests admitted and not yet booked on a pod (being scheduled): their prompt
        # tokens by flow, and the total.
        self._reserved: dict[int, int] = {}
        self._reserved_tokens = 0

    # ------------------------------------------------------------------ state

    def classify(self, request: LLMRequest) -> Classified:
        headers = request.headers
        name = headers.get(OBJECTIVE_HEADER, "")
        priority = self.objectives.priority(name)
        return Classified(name, priority, headers.get(FAIRNESS_HEADER) or DEFAULT_FLOW)

    def _reservations(self) -> Reserved:
        return Reserved(len(self._reserved), self._reserved_tokens)

    def _reserve(self, flow: FlowRequest) -> None:
        key = id(flow)
        if key not in self._reserved:
            tokens = flow.request.estimated_prompt_tokens()
            self._reserved[key] = tokens
            self._reserved_tokens += tokens

    def saturation(self) -> float:
        pods = self._pods()
        return self.detector.saturation(pods, self.clock(), self._reservations())

    def waiting(self) -> int:
        return self.queue.requests

    def candidates(self, request: LLMRequest, pods: Sequence[PodState]) -> list[PodState]:
        if not self.flow_control:
            return list(pods)
        now = self.clock()
        over = self.detector.over_limit
        kept = [p for p in pods if not over(p, now)]
        return kept or list(pods)

    # ------------------------------------------------------------------ request path

    def check_decision(self, flow: FlowRequest, decision: Decision) -> None:
        """Refuses (429) a sheddable request whose TTFT objective (`x-slo-ttft-ms`) the
        chosen pod is not predicted to meet: with an objective, the default policy chooses
        the pod with the smallest predicted TTFT, so no other pod is predicted to either."""
        raw = flow.request.headers.get(SLO_TTFT_HEADER)
        predicted = decision.predicted_ttft_s
        if raw is None or predicted is None:
            return
        try:
            slo_s = float(raw) / 1000.0
        except ValueError:
            return
        if predicted <= slo_s:
            return
        who = self.classify(flow.request)
        if who.priority >= 0:
            return
        self.observer.rejected(who.priority, Reason.SLO_UNREACHABLE)
        raise AdmissionRefused(
            RequestError.shed(
                f"no endpoint is predicted to meet the request's time-to-first-token "
                f"objective of {raw} ms (best predicted {predicted * 1000:.0f} ms) and "
                f"objective {who.objective!r} (priority {who.priority}) is sheddable"
            ),
            Reason.SLO_UNREACHABLE,
        )

    def admit(self, flow: FlowRequest, wake: Wake) -> bool:
        """True: schedule now. False: queued; `wake` is called later. Raises RequestError."""
        pods = self._pods()
        if not pods:  # nothing to wait for: scheduling answers 503 as usual
            return True
        now = self.clock()
        saturation = self.detector.saturation(pods, now, self._reservations())
        saturated = saturation >= 1.0
        if not saturated and not self.queue.requests:
            self._reserve(flow)
            return True
        who = self.classify(flow.request)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "admission %s: pool saturation %.3f, objective %r priority %d flow %r, %d queued",
                flow.request.request_id,
                saturation,
                who.objective,
                who.priority,
                who.flow_id,
                self.queue.requests,
            )
        if saturated and who.priority < 0:
            self.observer.rejected(who.priority, Reason.SATURATED)
            raise AdmissionRefused(
                RequestError.shed(
                    f"the pool is saturated and objective {who.objective!r} (priority "
                    f"{who.priority}) is sheddable; retry later"
                ),
                Reason.SATURATED,
            )
        if not self.flow_control:
            self._reserve(flow)
            return True
        item = QueuedItem(
            payload=flow,
            priority=who.priority,
            flow_id=who.flow_id,
            size=request_size(flow.request),
            enqueued_at=now,
            deadline=now + self.ttl_s if self.ttl_s is not None else None,
        )
        try:
            self.queue.push(item)
        except QueueFull as full:
            self.observer.rejected(who.priority, Reason.QUEUE_FULL)
            raise AdmissionRefused(
                RequestError.shed(
                    f"the pool is saturated and the flow-control queue is full "
                    f"({full.reason}); retry later"
                ),
                Reason.QUEUE_FULL,
            ) from None
        self._waiting[id(flow)] = (item, wake)
        if not saturated:
            self.pump()
        return False

    def settled(self, flow: FlowRequest) -> None:
        """The request was booked on a pod (or failed to be): it no longer holds a reservation."""
        tokens = self._reserved.pop(id(flow), None)
        if tokens is not None:
            self._reserved_tokens -= tokens

    def cancel(self, flow: FlowRequest) -> bool:
        """The client left while the request waited: out of the queue at once."""
        self.settled(flow)
        waiting = self._waiting.pop(id(flow), None)
        if waiting is None:
            return False
        item, wake = waiting
        if self.queue.remove(item):
            self.observer.rejected(item.priority, Reason.DISCONNECTED)
        # Nobody should be left waiting on a request that left, whoever noticed first.
        gone = RequestError(499, "the client closed the request", "client_closed")
        self._wake(wake, AdmissionRefused(gone, Reason.DISCONNECTED))
        return True

    # ------------------------------------------------------------------ dispatch

    def next_deadline(self) -> float | None:
        return self.queue.next_deadline()

    def pump(self) -> int:
        """Expires overdue requests and dispatches while a pod has room; returns dispatches."""
        queue = self.queue
        if not queue.requests:
            return 0
        now = self.clock()
        for expired in queue.expire(now):
            self._expired(expired, now)
        dispatched = 0
        detector = self.detector
        while queue.requests:
            pods = self._pods()
            if pods and detector.saturation(pods, now, self._reservations()) >= 1.0:
                break
            item = queue.pop()
            if item is None:
                break
            flow = item.payload
            waiting = self._waiting.pop(id(flow), None)
            if waiting is None:
                continue
            self._reserve(flow)
            self.observer.dispatched(item.priority, now - item.enqueued_at)
            dispatched += 1
            self._wake(waiting[1], None)
        return dispatched

    def _expired(self, item: QueuedItem, now: float) -> None:
        waiting = self._waiting.pop(id(item.payload), None)
        if waiting is None:
            return
        self.observer.rejected(item.priority, Reason.EXPIRED)
        waited = now - item.enqueued_at
        message = (
            f"the pool stayed saturated for the request's {waited:.1f} s in the flow-control "
            "queue (its TTL); retry later"
        )
        if item.priority < 0:
            error = RequestError.shed(message)
        else:
            error = RequestError.no_endpoint(message)
        self._wake(waiting[1], AdmissionRefused(error, Reason.EXPIRED))

    @staticmethod
    def _wake(wake: Wake, error: RequestError | None) -> None:
        try:
            wake(error)
        except Exception:  # one waiter's failure must not stop the dispatch loop
            log.exception("waking a queued request failed")

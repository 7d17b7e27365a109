"""Plain-data pools, requests and a clock for the flow-control tests."""

from __future__ import annotations

from collections.abc import Sequence

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flowcontrol.objectives import (
    FAIRNESS_HEADER,
    OBJECTIVE_HEADER,
    Objective,
    ObjectiveTable,
)
from smart_epp.framework.types import Api, Decision, Endpoint, LLMRequest, Outcome, PodState

PODS = ["10.0.0.1:8000", "10.0.0.2:8000"]


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def pool(clock: Clock, waiting: int = 0, kv: float = 0.0) -> Datastore:
    """Two pods whose metrics were just scraped, with `waiting` queued requests each."""
    datastore = Datastore()
    datastore.set_endpoints([Endpoint(a) for a in PODS])
    for pod in datastore.pods():
        set_load(pod, clock, waiting=waiting, kv=kv)
    return datastore


def set_load(pod: PodState, clock: Clock, waiting: int = 0, kv: float = 0.0) -> None:
    pod.metrics.waiting = waiting
    pod.metrics.kv_usage = kv
    pod.metrics.scraped_at = clock()


def request(
    rid: str,
    objective: str | None = None,
    fairness: str | None = None,
    body: bytes = b'{"model": "tiny", "prompt": "hello"}',
) -> LLMRequest:
    headers: dict[str, str] = {}
    if objective is not None:
        headers[OBJECTIVE_HEADER] = objective
    if fairness is not None:
        headers[FAIRNESS_HEADER] = fairness
    return LLMRequest(
        rid, "/v1/completions", Api.COMPLETIONS, "tiny", prompt="hello", headers=headers, body=body
    )


def objectives() -> ObjectiveTable:
    return ObjectiveTable(
        {
            "critical": Objective("critical", 2),
            "standard": Objective("standard", 0),
            "batch": Objective("batch", -1),
        }
    )


class FirstCandidate:
    """Routes to the first candidate; a real Scheduler-protocol object, no I/O."""

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        return Decision(endpoints=list(candidates))

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        pass

    def on_outcome(self, request: LLMRequest, decision: Decision, outcome: Outcome) -> None:
        pass

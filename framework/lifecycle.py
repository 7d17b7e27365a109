"""One request's life as the request flow tracks it, and the opt-in hooks that watch it.

A hook implements only the interfaces it needs: `CandidateFilter` narrows the pods a
request may go to before scheduling (e.g. to the pods that serve its model),
`RoutedObserver` hears where it went, `OutcomeObserver` how it ended.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from .types import Decision, LLMRequest, Outcome, PodState


@dataclass(slots=True, eq=False)
class FlowRequest:
    """The one per-request state object, from parsed body to outcome."""

    request: LLMRequest
    received_at: float  # the flow's clock when the request was parsed
    decision: Decision | None = None
    primary: str | None = None  # the endpoint the picker chose first
    served: str | None = None  # the endpoint booked now (a fallback's once it answered)
    booked_tokens: int = 0  # prompt tokens counted in the served pod's in-flight load
    routed_at: float = 0.0
    first_byte_at: float | None = None
    outcome: Outcome | None = None  # set once, when the request ends
    # Named instants on the flow's clock (e.g. when parsing began), recorded only when a
    # hook needs them (tracing); None otherwise.
    marks: dict[str, float] | None = None

    @property
    def finished(self) -> bool:
        return self.outcome is not None


class CandidateFilter(ABC):
    """Narrows a request's candidate pods before the scheduler ranks them."""

    @abstractmethod
    def candidates(self, request: LLMRequest, pods: Sequence[PodState]) -> list[PodState]: ...


class RoutedObserver(ABC):
    """Hears every routed request once its decision is on its way to Envoy."""

    @abstractmethod
    def on_routed(self, flow: FlowRequest) -> None: ...


class OutcomeObserver(ABC):
    """Hears every routed request's outcome, exactly once."""

    @abstractmethod
    def on_outcome(self, flow: FlowRequest, outcome: Outcome) -> None: ...

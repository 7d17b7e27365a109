"""A trivial Scheduler: rotate through the candidates. The default until a smarter one
is configured, and a baseline for comparisons."""

from __future__ import annotations

from collections.abc import Sequence

from ..framework.types import Decision, LLMRequest, Outcome, PodState


class RoundRobinScheduler:
    def __init__(self) -> None:
        self._next = 0

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        if not candidates:
            return Decision(endpoints=[])
        start = self._next % len(candidates)
        self._next = start + 1
        # The rest, in rotation order, serve as fallbacks when more than one is asked for.
        return Decision(endpoints=[*candidates[start:], *candidates[:start]], profile="round-robin")

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        pass

    def on_outcome(self, request: LLMRequest, decision: Decision, outcome: Outcome) -> None:
        pass

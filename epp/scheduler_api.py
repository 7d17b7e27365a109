"""The contract between the ext_proc server and whatever makes the routing decision."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from smart_epp.epp.types import Decision, LLMRequest, PodState, Usage


class Scheduler(Protocol):
    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        """Ranks `candidates` (already narrowed by the subset hint and readiness).

        Returns an empty `Decision.endpoints` when no candidate can take the request; the
        server answers 503 then.
        """
        ...

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        """Called once the decision has been sent to Envoy (speculative index entries,
        routing history for approximate prefix scoring, session affinity)."""
        ...

    def on_response(
        self,
        request: LLMRequest,
        address: str,
        usage: Usage | None,
        ttft_s: float | None,
        ok: bool,
    ) -> None:
        """Called when the response ends (normally, with an error, or on client reset)."""
        ...

"""Narrows every request's candidates to the pods that serve its model.

A pod that does not serve a LoRA adapter (or a base model) answers 404 for it, so this is
a hard constraint applied before any scoring: it wraps a Scheduler and hands it only the
pods the model catalog lists for the request's adapter or model. When none of the
candidates serves it, the decision is empty and the server answers 503 (the model
exists in the pool, but no pod that serves it is available right now).
"""

from __future__ import annotations

from collections.abc import Sequence

from smart_epp.epp.model_catalog import ModelCatalog
from smart_epp.epp.scheduler_api import Scheduler
from smart_epp.epp.types import Decision, LLMRequest, PodState, Usage


class ServedModelScheduler:
    def __init__(self, inner: Scheduler, catalog: ModelCatalog) -> None:
        self.inner = inner
        self.catalog = catalog

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        wanted = request.adapter or request.model
        if wanted:
            servers = self.catalog.servers(wanted)
            if servers is not None:
                candidates = [p for p in candidates if p.address in servers]
                if not candidates:
                    return Decision(endpoints=[])
        return await self.inner.schedule(request, candidates)

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        self.inner.on_routed(request, decision)

    def on_response(
        self,
        request: LLMRequest,
        address: str,
        usage: Usage | None,
        ttft_s: float | None,
        ok: bool,
    ) -> None:
        self.inner.on_response(request, address, usage, ttft_s, ok)

    async def aclose(self) -> None:
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await close()

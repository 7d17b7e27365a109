"""Narrows every request's candidates to the pods that serve its model.

A pod that does not serve a LoRA adapter (or a base model) answers 404 for it, so this is
a hard constraint applied before any scoring: a request-flow candidate filter that keeps
only the pods the model catalog lists for the request's adapter or model. When none of
the candidates serves it, the gateway answers 503 (the model exists in the pool, but no
pod that serves it is available right now).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..framework.lifecycle import CandidateFilter
from ..framework.types import LLMRequest, PodState
from .model_catalog import ModelCatalog


class ServedModelFilter(CandidateFilter):
    def __init__(self, catalog: ModelCatalog) -> None:
        self.catalog = catalog

    def candidates(self, request: LLMRequest, pods: Sequence[PodState]) -> list[PodState]:
        wanted = request.adapter or request.model
        if wanted:
            servers = self.catalog.servers(wanted)
            if servers is not None:
                return [p for p in pods if p.address in servers]
        return list(pods)

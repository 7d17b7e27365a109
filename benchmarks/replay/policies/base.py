"""Shared plumbing for the peer policies: a Decision from a ranked list, and no-op hooks."""

from __future__ import annotations

from collections.abc import Sequence

from ....framework.types import Decision, LLMRequest, Outcome, PodState


def ranked(first: PodState, candidates: Sequence[PodState], profile: str) -> Decision:
    """`first`, then the other candidates as fallbacks in their given order."""
    rest = [c for c in candidates if c is not first]
    return Decision(endpoints=[first, *rest], profile=profile)


def gateway_load(pod: PodState) -> int:
    """Requests this gateway has sent to `pod` that have not finished: what a router knows
    without waiting for a metrics scrape (the load signal of SGLang's and AIBrix's routers)."""
    return pod.inflight.requests


class StatelessHooks:
    """Policies that learn nothing from routing or responses."""

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        return None

    def on_outcome(self, request: LLMRequest, decision: Decision, outcome: Outcome) -> None:
        return None

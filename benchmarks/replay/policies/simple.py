"""Load-only policies: round-robin, random, least-queue and power-of-two choices."""

from __future__ import annotations

import random
from collections.abc import Sequence

from ....framework.types import Decision, LLMRequest, PodState
from .base import StatelessHooks, gateway_load, ranked


class RoundRobin(StatelessHooks):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        if not candidates:
            return Decision(endpoints=[], profile=self.name)
        pick = candidates[self._next % len(candidates)]
        self._next += 1
        return ranked(pick, candidates, self.name)


class RandomChoice(StatelessHooks):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        if not candidates:
            return Decision(endpoints=[], profile=self.name)
        return ranked(self._rng.choice(candidates), candidates, self.name)


class LeastQueue(StatelessHooks):
    """Fewest requests queued at the pod: the gateway's own in-flight count, then the
    scraped waiting queue, ties broken at random so equal pods share the load."""

    name = "least-queue"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        if not candidates:
            return Decision(endpoints=[], profile=self.name)
        order = sorted(
            candidates,
            key=lambda p: (gateway_load(p), p.metrics.waiting, self._rng.random()),
        )
        return Decision(endpoints=list(order), profile=self.name)


class PowerOfTwo(StatelessHooks):
    """Two pods drawn at random; the less loaded one wins."""

    name = "power-of-two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        if not candidates:
            return Decision(endpoints=[], profile=self.name)
        if len(candidates) == 1:
            return ranked(candidates[0], candidates, self.name)
        a, b = self._rng.sample(list(candidates), 2)
        pick = a if gateway_load(a) <= gateway_load(b) else b
        return ranked(pick, candidates, self.name)

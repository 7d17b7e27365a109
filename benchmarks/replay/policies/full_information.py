"""full-information: a greedy predicted-TTFT router that reads the simulated engines.

It reads every simulated engine directly — the real prefix cache, the real queues, the
profile's true step cost — which no gateway can do, and sends each request to the pod with
the smallest predicted time to first token for that request alone. It is a reference for
what better information buys a greedy TTFT heuristic, not a bound: it ignores what a
placement does to later requests, and other policies can and do beat it. It exists only
inside the replay simulation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ....framework.types import Decision, LLMRequest, Outcome, PodState
from ...sim.engine import SimEngine
from .base import StatelessHooks


class FullInformation(StatelessHooks):
    name = "full-information"

    def __init__(self, engines: Mapping[str, SimEngine]) -> None:
        self._engines = engines
        # Block digests of every request routed and not finished: the engines compute a
        # waiting request's digests only when they first try to admit it.
        self._digests: dict[str, list[bytes]] = {}

    def _request_digests(self, engine: SimEngine, token_ids: Sequence[int]) -> list[bytes]:
        # At least one token is always computed, as in vLLM: the last full block before it.
        digests: list[bytes] = []
        engine.hasher.extend(digests, token_ids, (len(token_ids) - 1) // engine.block_size)
        return digests

    def _queued_prefill(self, engine: SimEngine) -> tuple[int, float]:
        """Prefill tokens and seconds of the work already on ``engine`` (running and queued)."""
        prof = engine.profile
        bs = engine.block_size
        tokens, seconds = 0, 0.0
        for r in engine.running:
            if r.num_computed < r.num_prompt:
                n = r.num_prompt - r.num_computed
                tokens += n
                seconds += prof.prefill_seconds(n, r.num_computed)
        for r in engine.waiting:
            digests = r.digests or self._digests.get(r.req.request_id, [])
            cached = len(engine.pool.longest_cached_prefix(digests)) * bs if digests else 0
            done = max(r.num_computed, cached)
            n = max(1, r.num_prompt - done)
            tokens += n
            seconds += prof.prefill_seconds(n, done)
        return tokens, seconds

    def predict_ttft(
        self, engine: SimEngine, uncached_tokens: int, cached_tokens: int = 0
    ) -> float:
        prof = engine.profile
        queued_tokens, queued_s = self._queued_prefill(engine)
        work_s = queued_s + prof.prefill_seconds(uncached_tokens, cached_tokens)
        work_tokens = queued_tokens + uncached_tokens
        steps = max(1, math.ceil(work_tokens / engine.max_num_batched_tokens))
        decoding = [r for r in engine.running if r.num_computed >= r.num_prompt]
        context = sum(len(r.tokens) for r in decoding)
        per_step = (
            prof.step_overhead_s
            + len(decoding) * prof.decode_s_per_seq
            + context * prof.decode_kv_read_s_per_token
        )
        return work_s + steps * per_step

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        if not candidates:
            return Decision(endpoints=[], profile=self.name)
        tokens = request.prompt_token_ids or []
        first = self._engines[candidates[0].address]
        digests = self._request_digests(first, tokens)
        self._digests[request.request_id] = digests
        scored: list[tuple[float, int, int, PodState]] = []
        for i, pod in enumerate(candidates):
            engine = self._engines[pod.address]
            cached = len(engine.pool.longest_cached_prefix(digests)) * engine.block_size
            ttft = self.predict_ttft(engine, max(1, len(tokens) - cached), cached)
            scored.append((ttft, -cached, i, pod))
        scored.sort(key=lambda s: s[:3])
        explain = {s[3].address: {"predicted_ttft_s": s[0], "cached_tokens": -s[1]} for s in scored}
        return Decision(endpoints=[s[3] for s in scored], profile=self.name, explain=explain)

    def on_outcome(self, request: LLMRequest, decision: Decision, outcome: Outcome) -> None:
        self._digests.pop(request.request_id, None)

"""What `epp calibrate` measures, in order, turned into fit samples.

- cold prefill: time to first token of unique prompts at >= 6 lengths up to the limit;
- warm prefix: the same prompt length with 0, 50 and 90% of it cached just before (the
  cache is reset between runs where the pod allows it);
- decode: the steady inter-token latency (mean gap after the first few tokens) of 1, 4 and
  8 concurrent streams, each at a short and a long context, so per-sequence and
  per-context-token costs separate.

Every time has the pod's HTTP round trip (median ``GET /health``) taken off, so what is
fitted is the engine's time, not the client's.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from .fit import Sample, decode_sample, prefill_sample
from .probe import PodInfo, Probe, Prompts, cached_tokens

# The first inter-token gaps of a decode batch can include the other streams' prefills.
_SKIPPED_GAPS = 5
_MIN_SECONDS = 1e-6


@dataclass(frozen=True, slots=True)
class Plan:
    cold_lengths: list[int]
    warm_length: int
    warm_fractions: tuple[float, ...]
    decode_batches: list[int]
    decode_contexts: list[int]
    decode_tokens: int
    repeats: int
    chunk_tokens: int

    @property
    def steps(self) -> int:
        cold = len(self.cold_lengths) * self.repeats
        warm = len(self.warm_fractions) * self.repeats
        return cold + warm + len(self.decode_batches) * len(self.decode_contexts) * self.repeats


def make_plan(
    info: PodInfo,
    max_prompt_tokens: int | None,
    max_num_seqs: int,
    chunk_tokens: int,
    repeats: int = 3,
) -> Plan:
    longest = info.max_model_len - 1  # one generated token must fit
    if max_prompt_tokens is not None:
        longest = min(longest, max_prompt_tokens)
    if longest < 64:
        raise ValueError(f"prompts up to {longest} tokens are too short to calibrate on")
    shortest = max(16, longest // 32)
    ratio = (longest / shortest) ** (1 / 6)
    cold = sorted({round(shortest * ratio**i) for i in range(7)})
    decode_tokens = 40
    batches = [b for b in (1, 4, 8) if b <= max_num_seqs]
    # The largest batch at the long context must fit the KV cache with room to spare.
    room = int(0.8 * info.kv_tokens / max(batches)) - decode_tokens
    long_context = max(32, min(longest // 2, info.max_model_len - decode_tokens - 1, room))
    contexts = sorted({min(32, long_context), long_context})
    return Plan(
        cold_lengths=cold,
        warm_length=longest,
        warm_fractions=(0.0, 0.5, 0.9),
        decode_batches=batches,
        decode_contexts=contexts,
        decode_tokens=decode_tokens,
        repeats=repeats,
        chunk_tokens=chunk_tokens,
    )


async def measure(
    probe: Probe,
    info: PodInfo,
    plan: Plan,
    seed: int = 0,
    advance: Callable[[str], None] = lambda _: None,
) -> list[Sample]:
    prompts = Prompts(seed)
    floor = await probe.round_trip_floor()
    await probe.stream(prompts.make(16), 2)  # warm-up: first-request costs are not steps
    samples: list[Sample] = []
    for n in plan.cold_lengths:
        times = []
        for _ in range(plan.repeats):
            timing = await probe.stream(prompts.make(n), 1)
            times.append((timing.ttft_s or 0.0) - floor)
            advance("cold prefill")
        samples.append(prefill_sample("cold prefill", n, 0, plan.chunk_tokens, _median(times)))
    n = plan.warm_length
    for fraction in plan.warm_fractions:
        times, cached_seen = [], []
        for _ in range(plan.repeats):
            await probe.reset_prefix_cache()
            prompt = prompts.make(n)
            primed = int(fraction * n)
            if primed:
                await probe.stream(prompt[:primed], 1)
            timing = await probe.stream(prompt, 1)
            reported = cached_tokens(timing)
            guess = primed // info.block_size * info.block_size
            cached_seen.append(reported if reported is not None else guess)
            times.append((timing.ttft_s or 0.0) - floor)
            advance("warm prefix")
        cached = int(statistics.median(cached_seen))
        samples.append(
            prefill_sample("warm prefix", n - cached, cached, plan.chunk_tokens, _median(times))
        )
    for batch in plan.decode_batches:
        for context in plan.decode_contexts:
            steps = []
            for _ in range(plan.repeats):
                await probe.reset_prefix_cache()
                streams = [
                    probe.stream(prompts.make(context), plan.decode_tokens) for _ in range(batch)
                ]
                timings = await asyncio.gather(*streams)
                # A busy server can deliver several tokens at once: the mean gap over the
                # steady part of a stream is its step time, whatever the bursts.
                steps += [
                    sum(gaps) / len(gaps) for t in timings if (gaps := t.itl_s[_SKIPPED_GAPS:])
                ]
                advance("decode")
            if steps:
                # Mean context of a sequence over the measured steps.
                mean_context = context + (_SKIPPED_GAPS + plan.decode_tokens) / 2
                samples.append(decode_sample(batch, batch * mean_context, _median(steps)))
    return samples


def _median(times: list[float]) -> float:
    """The median of repeated runs: one stall of a busy host does not move it."""
    return max(_MIN_SECONDS, statistics.median(times))

"""predicted-ttft-scorer: estimate each pod's time to first token and prefer the smallest.

For each candidate pod:

    ttft = overhead
         + backlog / prefill_rate               queued prefill work ahead of the request
         + uncached / prefill_rate              the prompt tokens the pod does not hold
         + cpu_tier_tokens / cpu_tier_rate      held tokens that must come back from CPU
         + running * step_cost                  decode batch sharing the prefill steps
         + adapter penalty                      LoRA load, or waiting for a free slot
         + KV-pressure penalty                  no free KV for the prompt: wait for one to end
         + hot-spot penalty                     load far above the pool's mean

`uncached` comes from the KV index (tokens held at the pod's block size) and, with
`routedPrefixSeconds` set, from the prompts this gateway sent the pod and has not seen
answered: a request sharing a prefix then follows it even when the first one has waited
in a queue longer than the index's speculative entries last. `backlog` is
the larger of (a) the prefill work this gateway routed to the pod, draining at the pod's
rate since, and (b) the pod's scraped waiting queue times the mean uncached prompt size.
The prefill rate is learned per pod from observed TTFTs, but only from requests that
met a short queue (the gateway's own routed work and the scraped waiting queue both
small) and needed no adapter load: a TTFT that mostly measured queueing or a LoRA load
says nothing about prefill speed, and learning it made busy pods look slow and idle pods
look impossibly fast. The estimate is the median of a window of recent samples, held
within `rateBand` x the prior (the pod's own hint, else `prefillTokensPerSecond`) until
`rateTrustSamples` samples agree to within 2x; then it follows them. Decode time per token
is a plain EWMA of (completion time - TTFT) / output tokens.

vLLM always computes the prompt's last token, so a pod reuses at most
(prompt - 1) // block_size full blocks, however much of the prompt it holds.

When the pod has no free KV cache for the prompt (or no free LoRA slot), the request
waits for running requests to finish: the wait grows with how many must finish, at
about one completion per (mean decode time / running requests).

The hot-spot term keeps one prefix shared by every request from piling all load onto the
pod that cached it first (the cache-aware routers' balance rule, made gradual): past
`hotspotRelativeThreshold` x the least-loaded candidate's load + `hotspotSlack`
requests, each extra request costs `hotspotPenaltySeconds`, so the prefix spreads to
other pods once the first one is clearly busier.

Pods are ranked by cost = ttft + `congestionWeight` x queued requests x (own prefill time
+ the KV-wait its uncached tokens cause when KV is short). With an empty queue that is the
TTFT alone; with a long one, a cache miss delays every request behind it, so the pool
keeps its prefixes where they are cached instead of trading them for a queue that is a
few percent shorter, which past saturation loses the cache and the throughput with it.

Score = min_cost / cost, so the best pod scores 1 and the plugin mixes with others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import Field

from ..framework.plugins import (
    OutcomeHook,
    PluginParams,
    RoutingHook,
    SchedulingContext,
    Scorer,
)
from ..framework.registry import register_plugin
from ..framework.types import Outcome, PodState
from .lora_affinity_scorer import adapter_active, adapter_slot_free

SCRATCH_KEY = "predicted-ttft-scorer"


class PredictedTTFTParams(PluginParams):
    prefillTokensPerSecond: float = Field(default=10_000.0, gt=0)
    decodeSecondsPerToken: float = Field(default=0.02, gt=0)
    overheadSeconds: float = Field(default=0.005, ge=0)
    runningRequestStepSeconds: float = Field(default=0.0005, ge=0)
    cpuTierTokensPerSecond: float = Field(default=100_000.0, gt=0)
    adapterLoadSeconds: float = Field(default=0.05, ge=0)
    meanPromptTokens: float = Field(default=1024.0, gt=0)
    meanOutputTokens: float = Field(default=256.0, gt=0)
    kvFullUsage: float = Field(default=0.98, gt=0, le=1)
    hotspotRelativeThreshold: float = Field(default=1.5, ge=1)
    hotspotSlack: float = Field(default=8.0, ge=0)
    hotspotPenaltySeconds: float = Field(default=0.1, ge=0)
    learningRate: float = Field(default=0.2, gt=0, le=1)
    minSampleTokens: int = Field(default=256, ge=1)
    # A TTFT sample teaches the prefill rate only when the queue ahead of the request was
    # at most this many times its own uncached tokens.
    learnMaxQueueRatio: float = Field(default=0.5, ge=0)
    rateWindow: int = Field(default=32, ge=1)
    rateBand: float = Field(default=4.0, ge=1)
    rateTrustSamples: int = Field(default=5, ge=1)
    # Weight of the delay a request's own prefill imposes on the requests queued behind
    # it, added to its predicted TTFT when ranking pods (0: rank by TTFT alone).
    congestionWeight: float = Field(default=1.0, ge=0)
    # Prompt prefixes this gateway routed count as held by that pod until answered (at
    # most this long), so requests sharing a prefix follow it even when it waits in a
    # queue longer than the KV index's own speculative entries last (0: off, the
    # default: the index's entries cover bursts, and this costs hashing every prompt).
    routedPrefixSeconds: float = Field(default=0.0, ge=0)
    routedPrefixChunkTokens: int = Field(default=256, ge=1)
    staleAfterSeconds: float = Field(default=1.0, gt=0)
    blockSize: int | None = Field(default=None, gt=0)


@dataclass(slots=True)
class PodModel:
    """What has been learned about one pod."""

    prefill_tok_per_s: float | None = None
    rate_samples: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    decode_s_per_token: float | None = None
    prior_tok_per_s: float | None = None  # the pod's hint when first seen
    backlog_tokens: float = 0.0  # routed prefill work, as of `backlog_at`
    backlog_at: float = 0.0
    # When this gateway's requests to the pod ended: a scrape taken before that still
    # counts them, so they are taken off its queue.
    finished_at: deque[float] = field(default_factory=lambda: deque(maxlen=256))

    def finished_since(self, t: float) -> int:
        n = 0
        for done in reversed(self.finished_at):
            if done <= t:
                break
            n += 1
        return n


@dataclass(slots=True)
class Routed:
    address: str
    work_tokens: float  # backlog + uncached at routing time
    routed_at: float
    step_s: float = 0.0  # decode-batch share of the predicted wait
    learnable: bool = True  # short queue ahead and no adapter load: a clean prefill sample
    chunk_keys: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Prediction:
    ttft_s: list[float]
    cost_s: list[float]  # ttft_s plus the delay imposed on requests queued behind
    uncached: list[float]
    work: list[float]
    step_s: list[float]
    learnable: list[bool]
    chunk_keys: list[int]


def chunk_keys(token_ids: Sequence[int] | None, chunk_tokens: int) -> list[int]:
    """Chained keys of the prompt's whole `chunk_tokens` chunks: equal keys mean equal
    prefixes (within one process; ints hash deterministically)."""
    if not token_ids:
        return []
    keys: list[int] = []
    key = 0
    for start in range(0, len(token_ids) - chunk_tokens + 1, chunk_tokens):
        key = hash((key, tuple(token_ids[start : start + chunk_tokens])))
        keys.append(key)
    return keys


class RoutedPrefixes:
    """Prompt prefixes this gateway sent to each pod and has not seen answered yet.

    The KV index learns a prefix only once a pod has computed it and its events arrived;
    a request sharing the prefix that comes sooner (a burst, or a queue too long to reach
    the prefill yet) would otherwise see no holder and be sent anywhere, so the group
    spreads and every pod prefills the prefix again. Once the response ends the index
    is the authority again; `ttl_s` bounds how long a lost response keeps an entry.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        # key -> address -> [requests in flight, expires at]
        self._holders: dict[int, dict[str, list[float]]] = {}
        self._expiry: deque[tuple[float, int, str]] = deque()

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, keys: Sequence[int], address: str, now: float) -> None:
        if self.ttl_s <= 0 or not keys:
            return
        self._expire(now)
        until = now + self.ttl_s
        for key in keys:
            entry = self._holders.setdefault(key, {}).get(address)
            if entry is None:
                self._holders[key][address] = [1.0, until]
            else:
                entry[0] += 1.0
                entry[1] = until
            self._expiry.append((until, key, address))

    def release(self, keys: Sequence[int], address: str) -> None:
        for key in keys:
            holders = self._holders.get(key)
            entry = holders.get(address) if holders is not None else None
            if entry is None:
                continue
            entry[0] -= 1.0
            if entry[0] <= 0:
                del holders[address]  # type: ignore[union-attr]
                if not holders:
                    del self._holders[key]

    def matched_chunks(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Per pod, how many leading chunks of `keys` it was sent and not yet answered."""
        run: dict[str, int] = {}
        holders_by_depth: list[dict[str, list[float]]] = []
        for n, key in enumerate(keys, 1):
            holders = self._holders.get(key)
            if not holders:
                break
            # Keys are chained, so holding chunk n means holding chunks 1..n as well.
            run.update(dict.fromkeys(holders, n))
            holders_by_depth.append(holders)
        for address, n in list(run.items()):
            if holders_by_depth[n - 1][address][1] <= now:
                del run[address]
        return run

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, key, address = expiry.popleft()
            holders = self._holders.get(key)
            entry = holders.get(address) if holders is not None else None
            # A later add refreshed the entry: that add's own record removes it.
            if entry is not None and entry[1] <= now:
                del holders[address]  # type: ignore[union-attr]
                if not holders:
                    del self._holders[key]


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)


def reusable_tokens(prompt_tokens: int, held_blocks: int, block_size: int) -> int:
    """Prompt tokens a pod can skip: whole held blocks, but never the last prompt token,
    which vLLM always recomputes to produce the first output token."""
    if block_size <= 0 or held_blocks <= 0 or prompt_tokens <= 1:
        return 0
    return min(held_blocks, (prompt_tokens - 1) // block_size) * block_size


def robust_rate(samples: Sequence[float], prior: float, band: float, trust_after: int) -> float:
    """The median of recent prefill-rate samples, held within `band` x `prior` until at
    least `trust_after` samples agree (interquartile ratio within 2x)."""
    ordered = sorted(samples)
    n = len(ordered)
    mid = n // 2
    median = ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
    if n >= trust_after and ordered[(3 * n) // 4 if n > 1 else 0] <= 2.0 * ordered[n // 4]:
        return median
    return min(prior * band, max(prior / band, median))


@register_plugin()
class PredictedTTFTScorer(Scorer, RoutingHook, OutcomeHook):
    type_name = "predicted-ttft-scorer"
    Params = PredictedTTFTParams
    params: PredictedTTFTParams
    needs_tokens = True
    needs_prefix_hits = True

    def __init__(self, name: str, params: PredictedTTFTParams) -> None:
        super().__init__(name, params)
        self.pods: dict[str, PodModel] = {}
        self.mean_uncached_tokens = params.meanPromptTokens
        self.mean_prompt_tokens = params.meanPromptTokens
        self.mean_output_tokens = params.meanOutputTokens
        self.routed_prefixes = RoutedPrefixes(params.routedPrefixSeconds)

    # ------------------------------------------------------------------ model

    def prior_rate(self, pod: PodState) -> float:
        """The prefill rate to assume before learning: the pod's own hint, else the
        configured rate."""
        return pod.prefill_tok_per_s or self.params.prefillTokensPerSecond

    def prefill_rate(self, pod: PodState) -> float:
        model = self.pods.get(pod.address)
        if model is not None and model.prefill_tok_per_s is not None:
            return model.prefill_tok_per_s
        return self.prior_rate(pod)

    def decode_s_per_token(self, address: str) -> float:
        model = self.pods.get(address)
        if model is not None and model.decode_s_per_token is not None:
            return model.decode_s_per_token
        return self.params.decodeSecondsPerToken

    def routed_backlog(self, address: str, rate: float, now: float) -> float:
        model = self.pods.get(address)
        if model is None or model.backlog_tokens <= 0:
            return 0.0
        return max(0.0, model.backlog_tokens - rate * (now - model.backlog_at))

    def predict(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> Prediction:
        # One tight loop per pod with parameters hoisted into locals: this runs for every
        # candidate of every request (256 pods must stay well under a millisecond).
        p = self.params
        now = ctx.now
        prompt = float(ctx.prompt_tokens)
        adapter = ctx.request.adapter
        hits = ctx.prefix_hits or {}
        block_sizes = ctx.block_sizes
        models = self.pods
        stale_after = p.staleAfterSeconds
        default_rate = p.prefillTokensPerSecond
        default_tpot = p.decodeSecondsPerToken
        step_s = p.runningRequestStepSeconds
        cpu_rate = p.cpuTierTokensPerSecond
        kv_full = p.kvFullUsage
        half_output = 0.5 * self.mean_output_tokens
        mean_output = self.mean_output_tokens
        mean_uncached = self.mean_uncached_tokens
        request_kv_tokens = self.mean_prompt_tokens + mean_output
        learn_ratio = p.learnMaxQueueRatio
        prompt_len = ctx.prompt_tokens
        explain = ctx.components if ctx.explain else None
        chunk = p.routedPrefixChunkTokens
        keys = chunk_keys(ctx.token_ids, chunk) if p.routedPrefixSeconds > 0 else []
        routed_runs = self.routed_prefixes.matched_chunks(keys, now) if keys else {}

        fresh: list[bool] = []
        loads: list[int] = []
        for pod in pods:
            m = pod.metrics
            ok = m.scraped_at == 0.0 or now - m.scraped_at <= stale_after
            fresh.append(ok)
            inflight = pod.inflight.requests
            loads.append(max(m.running + m.waiting, inflight) if ok else inflight)
        hot_limit = p.hotspotRelativeThreshold * min(loads) + p.hotspotSlack
        hot_penalty = p.hotspotPenaltySeconds

        congestion = p.congestionWeight
        ttfts: list[float] = []
        costs: list[float] = []
        uncached_list: list[float] = []
        work_list: list[float] = []
        step_list: list[float] = []
        learnable_list: list[bool] = []
        for pod, ok, load in zip(pods, fresh, loads, strict=True):
            address = pod.endpoint.address
            m = pod.metrics
            model = models.get(address)
            rate = (
                model.prefill_tok_per_s
                if model is not None and model.prefill_tok_per_s is not None
                else pod.prefill_tok_per_s or default_rate
            )
            hit_tokens = 0.0
            cpu_s = 0.0
            held = hits.get(address)
            if held is not None and held.blocks > 0:
                hit_tokens = float(
                    reusable_tokens(prompt_len, held.blocks, block_sizes.get(address, 0))
                )
                if held.medium == "CPU":
                    cpu_s = hit_tokens / cpu_rate
            routed_chunks = routed_runs.get(address)
            if routed_chunks:
                block_size = block_sizes.get(address) or 1
                routed_tokens = float(
                    reusable_tokens(prompt_len, routed_chunks * chunk // block_size, block_size)
                )
                if routed_tokens > hit_tokens:
                    hit_tokens = routed_tokens
                    cpu_s = 0.0
            uncached = prompt - hit_tokens
            backlog = 0.0
            if model is not None and model.backlog_tokens > 0:
                backlog = max(0.0, model.backlog_tokens - rate * (now - model.backlog_at))
            waiting = 0
            if ok and m.waiting:
                waiting = m.waiting
                if model is not None and m.scraped_at > 0.0:
                    waiting = max(0, waiting - model.finished_since(m.scraped_at))
                backlog = max(backlog, waiting * mean_uncached)
            # Between scrapes the gateway's own sends are the freshest count of the batch.
            running = max(m.running, pod.inflight.requests - m.waiting) if ok else load
            run_s = running * step_s
            wait_s = backlog / rate + run_s
            prefill_s = uncached / rate + cpu_s
            adapter_s = 0.0
            kv_s = 0.0
            needs_slot = adapter is not None and not adapter_active(pod, adapter)
            kv_tight = False
            kv_s_per_token = 0.0
            deficit = 0.0
            if ok:
                block_size = block_sizes.get(address)
                if m.num_gpu_blocks and block_size:
                    free_tokens = (1.0 - m.kv_usage) * m.num_gpu_blocks * block_size
                    deficit = uncached + backlog - free_tokens
                    kv_tight = deficit > 0
                else:
                    kv_tight = m.kv_usage >= kv_full
                    deficit = (waiting + 1) * request_kv_tokens if kv_tight else 0.0
            if needs_slot or kv_tight:
                tpot = (
                    model.decode_s_per_token
                    if model is not None and model.decode_s_per_token is not None
                    else default_tpot
                )
                if needs_slot:
                    adapter_s = p.adapterLoadSeconds
                    if not adapter_slot_free(pod):
                        # A slot frees when a running request ends: about half a decode.
                        adapter_s += half_output * tpot
                if kv_tight:
                    # Space frees as running requests end, about one per (mean decode
                    # time / running requests), each returning a mean request's KV.
                    finishing = max(1.0, deficit / request_kv_tokens)
                    kv_s_per_token = mean_output * tpot / (max(1, running) * request_kv_tokens)
                    kv_s = finishing * kv_s_per_token * request_kv_tokens
            hot_s = (load - hot_limit) * hot_penalty if load > hot_limit else 0.0
            ttft = p.overheadSeconds + wait_s + prefill_s + adapter_s + kv_s + hot_s
            queued = max(waiting, pod.inflight.requests - m.running) if ok else load
            # The requests behind wait for this one's prefill and, when KV is what they
            # queue for, for the KV its uncached tokens hold until it ends.
            congestion_s = (
                congestion * queued * (prefill_s + uncached * kv_s_per_token) if queued > 0 else 0.0
            )
            ttfts.append(ttft)
            costs.append(ttft + congestion_s)
            uncached_list.append(uncached)
            work_list.append(backlog + uncached)
            step_list.append(run_s)
            learnable_list.append(
                not needs_slot and not kv_tight and backlog <= learn_ratio * uncached
            )
            if explain is not None:
                explain.setdefault(address, {}).update(
                    wait_s=wait_s,
                    prefill_s=prefill_s,
                    adapter_s=adapter_s,
                    kv_s=kv_s,
                    hot_s=hot_s,
                    congestion_s=congestion_s,
                    ttft_s=ttft,
                    hit_tokens=hit_tokens,
                )
        prediction = Prediction(
            ttfts, costs, uncached_list, work_list, step_list, learnable_list, keys
        )
        ctx.scratch[SCRATCH_KEY] = (pods, prediction)
        return prediction

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        if not pods:
            return []
        costs = self.predict(ctx, pods).cost_s
        best = min(costs)
        return [best / c if c > 0 else 1.0 for c in costs]

    # ------------------------------------------------------------------ learning

    def _new_model(self, pod: PodState | None) -> PodModel:
        model = PodModel(rate_samples=deque(maxlen=self.params.rateWindow))
        if pod is not None:
            model.prior_tok_per_s = self.prior_rate(pod)
        return model

    def on_routed(self, ctx: SchedulingContext, chosen: PodState) -> None:
        stashed = ctx.scratch.get(SCRATCH_KEY)
        if stashed is None:
            return
        pods, prediction = stashed
        try:
            i = next(i for i, pod in enumerate(pods) if pod.address == chosen.address)
        except StopIteration:
            return
        address = chosen.address
        rate = self.prefill_rate(chosen)
        model = self.pods.get(address)
        if model is None:
            model = self.pods[address] = self._new_model(chosen)
        model.backlog_tokens = self.routed_backlog(address, rate, ctx.now) + prediction.uncached[i]
        model.backlog_at = ctx.now
        self.routed_prefixes.add(prediction.chunk_keys, address, ctx.now)
        alpha = self.params.learningRate
        self.mean_uncached_tokens = _ewma(
            self.mean_uncached_tokens, max(1.0, prediction.uncached[i]), alpha
        )
        self.mean_prompt_tokens = _ewma(self.mean_prompt_tokens, float(ctx.prompt_tokens), alpha)
        ctx.kept[SCRATCH_KEY] = Routed(
            address,
            prediction.work[i],
            ctx.now,
            step_s=prediction.step_s[i],
            learnable=prediction.learnable[i],
            chunk_keys=prediction.chunk_keys,
        )

    def on_outcome(self, ctx: SchedulingContext, outcome: Outcome) -> None:
        routed = ctx.kept.pop(SCRATCH_KEY, None)
        address = outcome.address
        if not isinstance(routed, Routed) or routed.address != address:
            return
        usage, ttft_s, ok, now = outcome.usage, outcome.ttft_s, outcome.ok, outcome.now
        self.routed_prefixes.release(routed.chunk_keys, address)
        p = self.params
        model = self.pods.get(address)
        if model is None:
            model = self.pods[address] = self._new_model(None)
        model.finished_at.append(now)
        if not ok:
            return
        if ttft_s is not None and routed.learnable and routed.work_tokens >= p.minSampleTokens:
            service_s = ttft_s - p.overheadSeconds - routed.step_s
            if service_s > 0:
                prior = model.prior_tok_per_s or p.prefillTokensPerSecond
                # Even a trusted estimate stays within 100x the prior: a pause or a
                # preemption must not make a pod look idle or dead.
                sample = min(prior * 100, max(prior / 100, routed.work_tokens / service_s))
                model.rate_samples.append(sample)
                model.prefill_tok_per_s = robust_rate(
                    model.rate_samples, prior, p.rateBand, p.rateTrustSamples
                )
        if usage is not None and usage.completion_tokens > 0:
            self.mean_output_tokens = _ewma(
                self.mean_output_tokens, float(usage.completion_tokens), p.learningRate
            )
            if ttft_s is not None:
                decode_s = (now - routed.routed_at) - ttft_s
                if decode_s > 0:
                    model.decode_s_per_token = _ewma(
                        model.decode_s_per_token,
                        decode_s / usage.completion_tokens,
                        p.learningRate,
                    )

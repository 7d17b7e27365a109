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

`uncached` comes from the KV index (tokens held at the pod's block size). `backlog` is
the larger of (a) the prefill work this gateway routed to the pod, draining at the pod's
rate since, and (b) the pod's scraped waiting queue times the mean uncached prompt size.
Prefill and decode rates are learned per pod from observed TTFTs and completion times
(EWMA), starting from the pod's own hint or the configured defaults.

The hot-spot term keeps one prefix shared by every request from piling all load onto the
pod that cached it first (the cache-aware routers' balance rule, made gradual): past
`hotspotRelativeThreshold` x the least-loaded candidate's load + `hotspotSlack`
requests, each extra request costs `hotspotPenaltySeconds`, so the prefix spreads to
other pods once the first one is clearly busier.

Score = min_ttft / ttft, so the fastest pod scores 1 and the plugin mixes with others.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import Field

from smart_epp.epp.config import register_plugin
from smart_epp.epp.types import PodState, Usage
from smart_epp.scorers.base import PluginParams, SchedulingContext, Scorer
from smart_epp.scorers.lora_affinity_scorer import adapter_active, adapter_slot_free

SCRATCH_KEY = "predicted-ttft-scorer"
MAX_PENDING = 200_000  # requests awaiting their response; oldest dropped beyond this


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
    minSampleTokens: int = Field(default=32, ge=1)
    staleAfterSeconds: float = Field(default=1.0, gt=0)
    blockSize: int | None = Field(default=None, gt=0)


@dataclass(slots=True)
class PodModel:
    """What has been learned about one pod."""

    prefill_tok_per_s: float | None = None
    decode_s_per_token: float | None = None
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


@dataclass(slots=True)
class Prediction:
    ttft_s: list[float]
    uncached: list[float]
    work: list[float]


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)


@register_plugin()
class PredictedTTFTScorer(Scorer):
    type_name = "predicted-ttft-scorer"
    Params = PredictedTTFTParams
    params: PredictedTTFTParams
    needs_tokens = True
    needs_prefix_hits = True

    def __init__(self, name: str, params: PredictedTTFTParams) -> None:
        super().__init__(name, params)
        self.pods: dict[str, PodModel] = {}
        self._pending: OrderedDict[str, Routed] = OrderedDict()
        self.mean_uncached_tokens = params.meanPromptTokens
        self.mean_output_tokens = params.meanOutputTokens

    # ------------------------------------------------------------------ model

    def prefill_rate(self, pod: PodState) -> float:
        model = self.pods.get(pod.address)
        if model is not None and model.prefill_tok_per_s is not None:
            return model.prefill_tok_per_s
        return pod.prefill_tok_per_s or self.params.prefillTokensPerSecond

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
        mean_uncached = self.mean_uncached_tokens
        explain = ctx.components if ctx.explain else None

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

        ttfts: list[float] = []
        uncached_list: list[float] = []
        work_list: list[float] = []
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
                hit_tokens = min(prompt, float(held.blocks * block_sizes.get(address, 0)))
                if held.medium == "CPU":
                    cpu_s = hit_tokens / cpu_rate
            uncached = prompt - hit_tokens
            backlog = 0.0
            if model is not None and model.backlog_tokens > 0:
                backlog = max(0.0, model.backlog_tokens - rate * (now - model.backlog_at))
            if ok and m.waiting:
                waiting = m.waiting
                if model is not None and m.scraped_at > 0.0:
                    waiting = max(0, waiting - model.finished_since(m.scraped_at))
                backlog = max(backlog, waiting * mean_uncached)
            # Between scrapes the gateway's own sends are the freshest count of the batch.
            running = max(m.running, pod.inflight.requests - m.waiting) if ok else load
            wait_s = backlog / rate + running * step_s
            prefill_s = uncached / rate + cpu_s
            adapter_s = 0.0
            kv_s = 0.0
            needs_slot = adapter is not None and not adapter_active(pod, adapter)
            kv_tight = False
            if ok:
                block_size = block_sizes.get(address)
                if m.num_gpu_blocks and block_size:
                    free_tokens = (1.0 - m.kv_usage) * m.num_gpu_blocks * block_size
                    kv_tight = uncached + backlog > free_tokens
                else:
                    kv_tight = m.kv_usage >= kv_full
            if needs_slot or kv_tight:
                # Waiting for a running request to finish: about half a mean decode.
                tpot = (
                    model.decode_s_per_token
                    if model is not None and model.decode_s_per_token is not None
                    else default_tpot
                )
                drain_s = half_output * tpot
                if needs_slot:
                    adapter_s = p.adapterLoadSeconds
                    if not adapter_slot_free(pod):
                        adapter_s += drain_s
                if kv_tight:
                    kv_s = drain_s
            hot_s = (load - hot_limit) * hot_penalty if load > hot_limit else 0.0
            ttft = p.overheadSeconds + wait_s + prefill_s + adapter_s + kv_s + hot_s
            ttfts.append(ttft)
            uncached_list.append(uncached)
            work_list.append(backlog + uncached)
            if explain is not None:
                explain.setdefault(address, {}).update(
                    wait_s=wait_s,
                    prefill_s=prefill_s,
                    adapter_s=adapter_s,
                    kv_s=kv_s,
                    hot_s=hot_s,
                    ttft_s=ttft,
                    hit_tokens=hit_tokens,
                )
        prediction = Prediction(ttfts, uncached_list, work_list)
        ctx.scratch[SCRATCH_KEY] = (pods, prediction)
        return prediction

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        if not pods:
            return []
        ttfts = self.predict(ctx, pods).ttft_s
        best = min(ttfts)
        return [best / t if t > 0 else 1.0 for t in ttfts]

    # ------------------------------------------------------------------ learning

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
        model = self.pods.setdefault(address, PodModel())
        model.backlog_tokens = self.routed_backlog(address, rate, ctx.now) + prediction.uncached[i]
        model.backlog_at = ctx.now
        self.mean_uncached_tokens = _ewma(
            self.mean_uncached_tokens, max(1.0, prediction.uncached[i]), self.params.learningRate
        )
        self._pending[ctx.request.request_id] = Routed(address, prediction.work[i], ctx.now)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def on_response(
        self,
        ctx: SchedulingContext,
        address: str,
        usage: Usage | None,
        ttft_s: float | None,
        ok: bool,
        now: float,
    ) -> None:
        routed = self._pending.pop(ctx.request.request_id, None)
        if routed is None or routed.address != address:
            return
        p = self.params
        model = self.pods.setdefault(address, PodModel())
        model.finished_at.append(now)
        if not ok:
            return
        if ttft_s is not None:
            service_s = ttft_s - p.overheadSeconds
            if routed.work_tokens >= p.minSampleTokens and service_s > 0:
                sample = routed.work_tokens / service_s
                # Clamp so one outlier (a pause, a preemption) cannot wreck the estimate.
                low, high = p.prefillTokensPerSecond / 100, p.prefillTokensPerSecond * 100
                sample = min(high, max(low, sample))
                model.prefill_tok_per_s = _ewma(model.prefill_tok_per_s, sample, p.learningRate)
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

"""The scheduling pipeline: prepare -> filters -> weighted scorers -> picker.

`PipelineScheduler` implements the framework's `Scheduler` protocol. Per
request, an async prepare step gathers what the plugins need exactly once — the prompt's
token ids (from the request, a local tokenizer or a pod's /tokenize) and each candidate
pod's longest cached prefix (from the KV index) — then the decision itself runs as pure,
synchronous plugin calls. `schedule_sync` runs the same decision with no I/O at all, for
replays in virtual time (requests carry token ids; the index answers synchronously).

Every decision can be logged at debug level as one line listing each candidate's score
components; time spent goes to `inference_extension_scheduler_e2e_duration_seconds` and,
per plugin, `inference_extension_plugin_duration_seconds`.
"""

from __future__ import annotations

import heapq
import inspect
import logging
import random
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Histogram

from ..framework.plugins import (
    DecisionHook,
    OutcomeHook,
    Plugin,
    PoolHook,
    RoutingHook,
    SchedulingContext,
)
from ..framework.scheduling import PrefillProgressView, PrefixMatcher, PromptTokenizer
from ..framework.types import Decision, LLMRequest, Outcome, PodState, PrefixHit
from ..kv_index.api import BlockIndex
from ..kv_index.lookup import IndexPrefixMatcher, ModelOf
from ..kv_index.memory import DEFAULT_SPECULATIVE_TTL_S
from ..scorers.local_tokenizer import (
    LocalTokenizerParams,
    PodTokenizerParams,
    TokenProducerParams,
)
from .config import LoadedConfig, PluginSet, Profile, instantiate, load_config
from .context_limit import ContextLimitOf, pods_that_hold
from .tokenization import LocalTokenizer, PodTokenizer, TokenizerRouter
from .tokenizer_discovery import TokenizerDiscovery

log = logging.getLogger(__name__)

# `SchedulingContext.kept` key: prompt tokens the KV index said the chosen pod holds.
PREDICTED_CACHED_TOKENS = "prefix.predicted_cached_tokens"

# A routed prompt's speculative index entries stand for blocks the pod has not computed
# yet, so they should last until its KV events can confirm them: past its prefill. When
# the policy predicts the request's TTFT (queue and prefill), they last this multiple of
# it, at least `speculative_ttl_s` and at most `MAX_SPECULATIVE_TTL_S`; other pickers of
# the pool receive them with the same life. The multiple covers the prediction's error
# (benchmarks/RESULTS.md, "Prefixes in flight across pickers": the measured spread of TTFT
# over predicted TTFT past saturation).
SPECULATIVE_TTFT_MARGIN = 2.0
MAX_SPECULATIVE_TTL_S = 60.0

_BUCKETS = (
    0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005,
    0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip
E2E_NAME = "inference_extension_scheduler_e2e_duration_seconds"
PLUGIN_NAME = "inference_extension_plugin_duration_seconds"


@dataclass(slots=True)
class SchedulerMetrics:
    """The scheduler's histograms in one registry (created once per registry)."""

    plugin: Histogram
    e2e: Histogram | None = None


_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, SchedulerMetrics] = (
    weakref.WeakKeyDictionary()
)


def scheduler_metrics(
    registry: CollectorRegistry = REGISTRY, *, record_e2e: bool = True
) -> SchedulerMetrics:
    """Histograms for `registry`. Pass `record_e2e=False` when the registry already has an
    e2e histogram of its own (the gateway server times the whole scheduling call)."""
    found = _METRICS.get(registry)
    if found is None:
        found = SchedulerMetrics(
            plugin=Histogram(
                PLUGIN_NAME,
                "Time spent in one scheduling plugin (or prepare stage) per request",
                ["extension_point", "plugin_type", "plugin_name"],
                buckets=_BUCKETS,
                registry=registry,
            )
        )
        _METRICS[registry] = found
    if record_e2e and found.e2e is None:
        found.e2e = Histogram(
            E2E_NAME,
            "Time to make one scheduling decision, prepare step included",
            buckets=_BUCKETS,
            registry=registry,
        )
    return found


DEFAULT_BLOCK_SIZE = 16  # vLLM's GPU default; pods that report theirs override it

BlockSizeOf = Callable[[str], int | None]  # pod address -> block size (e.g. IngestState)


# --------------------------------------------------------------------------- the scheduler


class PipelineScheduler:
    """One scheduling profile run as prepare -> filters -> scorers -> picker."""

    def __init__(
        self,
        plugins: PluginSet,
        *,
        profile: str | None = None,
        prefix_matcher: PrefixMatcher | None = None,
        tokenizer: PromptTokenizer | None = None,
        block_size_of: BlockSizeOf | None = None,
        default_block_size: int = DEFAULT_BLOCK_SIZE,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        explain: bool | None = None,
        fallbacks: int = 0,
        metrics: SchedulerMetrics | None = None,
        speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
        prefill_progress: PrefillProgressView | None = None,
        context_limit_of: ContextLimitOf | None = None,
    ) -> None:
        self.plugins = plugins
        self.prefill_progress = prefill_progress
        # Each pod's longest accepted request, for the candidates that can hold a prompt
        # whose token count is known (epp/context_limit.py).
        self.context_limit_of = context_limit_of
        self.fallbacks = fallbacks
        self.speculative_ttl_s = speculative_ttl_s
        self.profile = self._choose_profile(plugins.profiles, profile)
        self.prefix_matcher = prefix_matcher
        self.tokenizer = tokenizer
        self.block_size_of = block_size_of
        self.default_block_size = default_block_size
        self.clock = clock
        self.rng = random.Random(seed)
        self._explain = explain
        active: list[Plugin] = [*self.profile.filters, *(s for s, _ in self.profile.scorers)]
        active.append(self.profile.picker)
        self.active_plugins = active
        self.needs_tokens = any(p.needs_tokens for p in active)
        self.needs_prefix_hits = any(p.needs_prefix_hits for p in active)
        self._routing_hooks = [p for p in active if isinstance(p, RoutingHook)]
        self._outcome_hooks = [p for p in active if isinstance(p, OutcomeHook)]
        self._decision_hooks = [p for p in active if isinstance(p, DecisionHook)]
        self._pool_hooks = [p for p in active if isinstance(p, PoolHook)]
        if isinstance(plugins.handler, DecisionHook):
            self._decision_hooks.append(plugins.handler)
        metrics = metrics or scheduler_metrics()
        plugin_timer = metrics.plugin
        self._e2e = metrics.e2e
        self._timers = {
            id(p): plugin_timer.labels(p.kind.capitalize(), p.type_name, p.name) for p in active
        }
        # Per-request stage timings in the context, for tracing (off: nothing recorded).
        self.record_timings = False
        self._tokenize_timer = plugin_timer.labels("Prepare", "tokenize", "tokenize")
        self._match_timer = plugin_timer.labels("Prepare", "prefix-match", "prefix-match")

    @staticmethod
    def _choose_profile(profiles: Sequence[Profile], name: str | None) -> Profile:
        if name is None:
            return profiles[0]
        for profile in profiles:
            if profile.name == name:
                return profile
        raise ValueError(f"no scheduling profile named {name!r}")

    # ------------------------------------------------------------------ prepare

    def _explaining(self) -> bool:
        return self._explain if self._explain is not None else log.isEnabledFor(logging.DEBUG)

    def _context(self, request: LLMRequest, candidates: Sequence[PodState]) -> SchedulingContext:
        ctx = SchedulingContext(
            request=request,
            now=self.clock(),
            prompt_tokens=0,
            token_ids=request.prompt_token_ids,
            rng=self.rng,
            explain=self._explaining(),
            timings=[] if self.record_timings else None,
        )
        if self.needs_prefix_hits:
            ctx.block_sizes = {p.address: self._block_size(p) for p in candidates}
            ctx.prefill_progress = self.prefill_progress
        return ctx

    def _block_size(self, pod: PodState) -> int:
        if self.block_size_of is not None:
            size = self.block_size_of(pod.address)
            if size:
                return size
        return pod.metrics.block_size or self.default_block_size

    @staticmethod
    def _count_prompt(ctx: SchedulingContext) -> None:
        ctx.prompt_tokens = (
            len(ctx.token_ids)
            if ctx.token_ids is not None
            else ctx.request.estimated_prompt_tokens()
        )

    async def prepare(
        self, request: LLMRequest, candidates: Sequence[PodState]
    ) -> SchedulingContext:
        ctx = self._context(request, candidates)
        if self.needs_tokens and ctx.token_ids is None and self.tokenizer is not None:
            start = time.perf_counter()
            try:
                ctx.token_ids = await self.tokenizer.tokenize(request, candidates)
            except Exception:  # no token ids means no cache information, never a 5xx
                log.exception("tokenization failed; scheduling without cache information")
            end = time.perf_counter()
            self._tokenize_timer.observe(end - start)
            if ctx.timings is not None:
                ctx.timings.append(("Prepare", "tokenize", "tokenize", start, end))
        self._count_prompt(ctx)
        if self.needs_prefix_hits and ctx.token_ids and self.prefix_matcher is not None:
            start = time.perf_counter()
            try:
                keys: dict[str, Sequence[int]] = {}
                ctx.prefix_hits = await self.prefix_matcher.match(
                    ctx.token_ids, request, ctx.block_sizes, keys
                )
                ctx.prompt_keys = keys
                ctx.held_blocks = self.prefix_matcher.held_blocks(ctx.block_sizes)
            except Exception:  # an index outage degrades to "nothing cached", never a 5xx
                log.exception("prefix lookup failed; scheduling without cache information")
            end = time.perf_counter()
            self._match_timer.observe(end - start)
            if ctx.timings is not None:
                ctx.timings.append(("Prepare", "prefix-match", "index lookup", start, end))
        return ctx

    def prepare_sync(
        self,
        request: LLMRequest,
        candidates: Sequence[PodState],
        prefix_hits: Mapping[str, PrefixHit] | None = None,
    ) -> SchedulingContext:
        ctx = self._context(request, candidates)
        self._count_prompt(ctx)
        if prefix_hits is not None:
            ctx.prefix_hits = prefix_hits
        elif self.needs_prefix_hits and ctx.token_ids and self.prefix_matcher is not None:
            start = time.perf_counter()
            keys: dict[str, Sequence[int]] = {}
            ctx.prefix_hits = self.prefix_matcher.match_sync(
                ctx.token_ids, request, ctx.block_sizes, keys
            )
            ctx.prompt_keys = keys
            ctx.held_blocks = self.prefix_matcher.held_blocks(ctx.block_sizes)
            self._match_timer.observe(time.perf_counter() - start)
        return ctx

    # ------------------------------------------------------------------ decide

    def _that_hold(
        self, ctx: SchedulingContext, candidates: Sequence[PodState]
    ) -> Sequence[PodState]:
        """The candidates whose context holds the request; raises vLLM's 400 when none
        does. Only with the prompt's token ids: a count estimated from characters could
        refuse a prompt the pods would take."""
        if self.context_limit_of is None or ctx.token_ids is None:
            return candidates
        return pods_that_hold(
            candidates, ctx.prompt_tokens, ctx.request.max_tokens, self.context_limit_of
        )

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        start = time.perf_counter()
        ctx = await self.prepare(request, candidates)
        candidates = self._that_hold(ctx, candidates)
        decision = self.decide(ctx, candidates)
        if self._e2e is not None:
            self._e2e.observe(time.perf_counter() - start)
        return decision

    def schedule_sync(
        self,
        request: LLMRequest,
        candidates: Sequence[PodState],
        prefix_hits: Mapping[str, PrefixHit] | None = None,
    ) -> Decision:
        """The whole decision without I/O; `prefix_hits` overrides the index lookup."""
        start = time.perf_counter()
        ctx = self.prepare_sync(request, candidates, prefix_hits)
        candidates = self._that_hold(ctx, candidates)
        decision = self.decide(ctx, candidates)
        if self._e2e is not None:
            self._e2e.observe(time.perf_counter() - start)
        return decision

    def decide(self, ctx: SchedulingContext, candidates: Sequence[PodState]) -> Decision:
        profile = self.profile
        timers = self._timers
        perf = time.perf_counter
        pods = list(candidates)
        timings = ctx.timings
        for f in profile.filters:
            if not pods:
                break
            t = perf()
            pods = f.filter(ctx, pods)
            end = perf()
            timers[id(f)].observe(end - t)
            if timings is not None:
                timings.append(("Filter", f.type_name, f.name, t, end))

        per_scorer: list[tuple[str, list[float]]] = []
        totals: list[float] = [0.0] * len(pods)
        if pods:
            first = True
            for scorer, weight in profile.scorers:
                t = perf()
                scores = scorer.score(ctx, pods)
                end = perf()
                timers[id(scorer)].observe(end - t)
                if timings is not None:
                    timings.append(("Scorer", scorer.type_name, scorer.name, t, end))
                if first:
                    totals = scores if weight == 1.0 else [weight * s for s in scores]
                    first = False
                elif weight:
                    totals = [a + weight * s for a, s in zip(totals, scores, strict=True)]
                if ctx.explain:
                    per_scorer.append((scorer.name, scores))
            t = perf()
            picked = profile.picker.pick(ctx, pods, totals)
            end = perf()
            timers[id(profile.picker)].observe(end - t)
            if timings is not None:
                picker = profile.picker
                timings.append(("Picker", picker.type_name, picker.name, t, end))
            if self.fallbacks and len(picked) < len(pods):
                picked = picked + self._fallbacks(pods, totals, picked)
        else:
            picked = []

        decision = Decision(
            endpoints=picked, profile=profile.name, prompt_token_ids=ctx.token_ids, context=ctx
        )
        if picked:
            for hook in self._decision_hooks:
                hook.on_decided(ctx, decision)
        if ctx.explain:
            decision.explain = self._explanation(ctx, pods, per_scorer, totals)
            log.debug(self._explain_line(ctx, decision))
        return decision

    def _fallbacks(
        self, pods: Sequence[PodState], totals: Sequence[float], picked: Sequence[PodState]
    ) -> list[PodState]:
        taken = {p.address for p in picked}
        rest = [i for i, p in enumerate(pods) if p.address not in taken]
        best = heapq.nlargest(self.fallbacks, rest, key=totals.__getitem__)
        return [pods[i] for i in best]

    # ------------------------------------------------------------------ explain

    @staticmethod
    def _explanation(
        ctx: SchedulingContext,
        pods: Sequence[PodState],
        per_scorer: Sequence[tuple[str, list[float]]],
        totals: Sequence[float],
    ) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for i, pod in enumerate(pods):
            row = {name: scores[i] for name, scores in per_scorer}
            row.update(ctx.components.get(pod.address, {}))
            row["total"] = totals[i]
            out[pod.address] = row
        return out

    @staticmethod
    def _explain_line(ctx: SchedulingContext, decision: Decision) -> str:
        picked = ",".join(p.address for p in decision.endpoints) or "-"
        parts = []
        for address, row in sorted(decision.explain.items(), key=lambda kv: -kv[1]["total"]):
            fields = " ".join(f"{k}={v:.4g}" for k, v in row.items())
            parts.append(f"{address}[{fields}]")
        return (
            f"decision request={ctx.request.request_id} model={ctx.request.model} "
            f"profile={decision.profile} prompt_tokens={ctx.prompt_tokens} picked={picked} | "
            + " ".join(parts)
        )

    # ------------------------------------------------------------------ outcomes

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        ctx = decision.context
        if not isinstance(ctx, SchedulingContext) or not decision.endpoints:
            return
        ctx.now = self.clock()
        chosen = decision.endpoints[0]
        if ctx.prefix_hits is not None and ctx.token_ids is not None:
            ctx.kept[PREDICTED_CACHED_TOKENS] = self._predicted_cached(ctx, chosen)
        for plugin in self._routing_hooks:
            plugin.on_routed(ctx, chosen)
        self._speculate(ctx, chosen, decision.predicted_ttft_s)
        # Only what the outcome hooks kept is needed until the response: drop the token
        # ids, index matches, block keys and per-pod scratch so thousands of requests in
        # flight stay cheap.
        ctx.token_ids = None
        ctx.prefix_hits = None
        ctx.prompt_keys = None
        ctx.scratch.clear()
        ctx.components.clear()

    def _predicted_cached(self, ctx: SchedulingContext, chosen: PodState) -> int:
        """The cached tokens the pod should report for this request, per the index: its
        matched blocks, capped because vLLM always computes the prompt's last token."""
        hits = ctx.prefix_hits or {}
        hit = hits.get(chosen.address)
        block = ctx.block_sizes.get(chosen.address) or self._block_size(chosen)
        if hit is None or block <= 0 or ctx.prompt_tokens <= 0:
            return 0
        cacheable = (ctx.prompt_tokens - 1) // block * block
        return min(hit.blocks * block, cacheable)

    def _speculate(
        self, ctx: SchedulingContext, chosen: PodState, predicted_ttft_s: float | None
    ) -> None:
        speculate = getattr(self.prefix_matcher, "speculate", None)
        if (
            speculate is None
            or self.speculative_ttl_s <= 0
            or not ctx.token_ids
            or not ctx.block_sizes
        ):
            return
        block_size = ctx.block_sizes.get(chosen.address) or self._block_size(chosen)
        # The prefix lookup already cut the prompt into the pod's keys (when it knew the
        # pod's block size): they are the keys to mark.
        keys = ctx.prompt_keys.get(chosen.address) if ctx.prompt_keys is not None else None
        ttl_s = self.speculative_ttl_s
        if predicted_ttft_s is not None and predicted_ttft_s > 0:
            due_s = SPECULATIVE_TTFT_MARGIN * predicted_ttft_s
            ttl_s = max(ttl_s, min(MAX_SPECULATIVE_TTL_S, due_s))
        try:
            speculate(ctx.token_ids, ctx.request, chosen.address, block_size, ttl_s, keys)
        except Exception:  # a hint that could not be recorded must never fail the request
            log.exception("speculative index entry failed")

    def on_outcome(self, request: LLMRequest, decision: Decision, outcome: Outcome) -> None:
        ctx = decision.context
        if not isinstance(ctx, SchedulingContext):
            return
        for plugin in self._outcome_hooks:
            plugin.on_outcome(ctx, outcome)

    def on_pod_removed(self, address: str) -> None:
        """The pod left the pool: the plugins drop what they kept of it."""
        for plugin in self._pool_hooks:
            try:
                plugin.on_pod_removed(address)
            except Exception:  # one plugin's bookkeeping must not keep the others' state
                log.exception("%s failed to forget pod %s", plugin.name, address)

    async def aclose(self) -> None:
        close = getattr(self.tokenizer, "aclose", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                await result


# --------------------------------------------------------------------------- construction


def tokenizer_from_config(
    plugins: PluginSet,
    base_model: str | None = None,
    discovery: TokenizerDiscovery | None = None,
) -> TokenizerRouter:
    """Local tokenizers from `local-tokenizer` plugins; for the rest, one found on disk
    (`discovery`, once it agrees with the pods) or /tokenize via a pod."""
    local: dict[str, LocalTokenizer] = {}
    # Each type name is registered once, so its plugins were built with its Params.
    for plugin in plugins.of_type("local-tokenizer"):
        p = plugin.params
        assert isinstance(p, LocalTokenizerParams)
        # An empty `path` counts as unset, as it always has when choosing the folder.
        if p.path:
            model_dir = Path(p.path)
        elif p.tokenizerFile is not None:
            model_dir = Path(p.tokenizerFile).parent
        else:
            raise ValueError(f"{plugin.name}: set `path` or `tokenizerFile`")
        local[p.modelName] = LocalTokenizer.from_model_dir(
            model_dir,
            tokenizer_file=p.tokenizerFile,
            chat_template_file=p.chatTemplateFile,
            cache_bytes=p.cacheBytes,
        )
    pod_settings = plugins.of_type("pod-tokenizer")
    producers = plugins.of_type("token-producer")
    if producers:
        t = producers[0].params
        assert isinstance(t, TokenProducerParams)
        fallback = PodTokenizer(
            cache_bytes=t.cacheBytes,
            timeout_s=t.timeout_seconds(),
            server_url=t.vllm.url if t.vllm is not None else None,
            server_model=t.modelName,
        )
    elif pod_settings:
        p = pod_settings[0].params
        assert isinstance(p, PodTokenizerParams)
        fallback = PodTokenizer(cache_bytes=p.cacheBytes, timeout_s=p.timeoutSeconds)
    else:
        fallback = PodTokenizer()
    return TokenizerRouter(local, fallback, base_model, discovery)


def _configured_block_size(plugins: PluginSet) -> int | None:
    for plugin in plugins.plugins.values():
        size = getattr(plugin.params, "blockSize", None)
        if plugin.needs_prefix_hits and isinstance(size, int):
            return size
    return None


def build_scheduler(
    config: str | Path | LoadedConfig | None = None,
    *,
    index: BlockIndex | None = None,
    prefix_matcher: PrefixMatcher | None = None,
    tokenizer: PromptTokenizer | bool | None = None,
    ingest_state: Any = None,
    block_size_of: BlockSizeOf | None = None,
    model_of: ModelOf | None = None,
    base_model: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    seed: int | None = None,
    profile: str | None = None,
    explain: bool | None = None,
    fallbacks: int = 0,
    registry: CollectorRegistry = REGISTRY,
    record_e2e: bool = True,
    speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
    tokenizer_discovery: TokenizerDiscovery | None = None,
    context_limit_of: ContextLimitOf | None = None,
) -> PipelineScheduler:
    """Builds the scheduler for a config (a built-in name, a YAML path, or loaded config).

    - `index`: the KV block index the precise scorers match prompts against (wrapped in an
      `IndexPrefixMatcher`), or any `prefix_matcher`.
    - `ingest_state`: the KV index's `IngestState`; supplies each pod's block size and base
      model as learned from its events (`block_size_of` / `model_of` override it), and
      the prefill progress its events show for the requests in flight.
      `base_model` names the base model for adapter requests when pods' events do not.
    - `tokenizer`: None = from the config (local-tokenizer plugins, else a pod's /tokenize),
      only when a plugin needs token ids; False = never tokenize (replays whose requests
      carry token ids); or any `PromptTokenizer`. `tokenizer_discovery` (with None) lets
      a model with no local-tokenizer plugin use its tokenizer found on disk once that
      agrees with the pods.
    - Block sizes: from the pod's events, else its /metrics cache_config_info, else the
      config's `blockSize`, else 16.
    - `clock`: monotonic seconds, or a virtual clock in a replay.
    - `fallbacks`: extra endpoints, best-scored first, appended after the picker's choice.
    - `speculative_ttl_s`: how long a routed prompt's blocks count as held by the chosen
      pod before its KV events confirm them (0 disables; needs an index); longer for a
      prompt the policy predicts to wait (`SPECULATIVE_TTFT_MARGIN`).
    - `registry` / `record_e2e`: where the duration histograms go; `record_e2e=False` when
      the caller already times the scheduling call under the same e2e metric name.
    - `context_limit_of`: each pod's `max_model_len` (the model catalog's), so that a
      prompt goes only to pods that can hold it and one no pod can is refused (400).
    """
    plugins = instantiate(load_config(config))
    if ingest_state is not None:
        block_size_of = block_size_of or ingest_state.block_size
        model_of = model_of or ingest_state.model
    if prefix_matcher is None and index is not None:
        prefix_matcher = IndexPrefixMatcher(index, model_of=model_of, base_model=base_model)
    scheduler = PipelineScheduler(
        plugins,
        profile=profile,
        prefix_matcher=prefix_matcher,
        block_size_of=block_size_of,
        default_block_size=_configured_block_size(plugins) or DEFAULT_BLOCK_SIZE,
        clock=clock,
        seed=seed,
        explain=explain,
        fallbacks=fallbacks,
        metrics=scheduler_metrics(registry, record_e2e=record_e2e),
        speculative_ttl_s=speculative_ttl_s,
        prefill_progress=getattr(ingest_state, "progress", None),
        context_limit_of=context_limit_of,
    )
    if tokenizer is None or tokenizer is True:
        if scheduler.needs_tokens:
            scheduler.tokenizer = tokenizer_from_config(plugins, base_model, tokenizer_discovery)
    elif tokenizer is not False:
        scheduler.tokenizer = tokenizer
    return scheduler


__all__ = [
    "PipelineScheduler",
    "SchedulerMetrics",
    "build_scheduler",
    "scheduler_metrics",
]

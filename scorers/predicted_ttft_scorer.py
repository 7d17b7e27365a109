"""predicted-ttft-scorer: predict each pod's time to first token from what it has learned,
and pick the pod where a request costs the pool least.

Per candidate pod:

    ttft = learned(tokens ahead + own uncached tokens,      scorers/ttft_model.py: k_pod x
                   attention pairs of that work,             (c0 + c1 tokens + c2 pairs
                   running requests)                         + c3 running), fitted online
         + cpu_tier_tokens / cpuTierTokensPerSecond          held tokens back from CPU
         + adapter load, or the wait for a free LoRA slot
         + KV wait                                           no free KV for the prompt

`own uncached tokens` = prompt - tokens the pod holds (the KV index at the pod's block size,
or prompts this gateway sent it and has not seen answered); its attention pairs are
u * (held + u / 2), so a long uncached prompt costs more than linearly once the model has
seen that it does. `tokens ahead` is the prefill this gateway has sent the pod and not
seen done: as far as the pod's KV events show each request's prefill (vLLM stores a
prompt's blocks as it schedules them, chunk by chunk; kv_index/progress.py), else each
request draining over its own predicted prefill; plus the pod's scraped waiting requests
that this gateway did not send, at the mean request size. The queue wait is therefore
the same learned cost applied to the work ahead, not a separate constant.

Learning: each answered request teaches its pod's model (and the pool-wide model that new
pods start from) its measured TTFT against the features recorded when it was sent; its
cached tokens come from the response's `usage.prompt_tokens_details.cached_tokens` when
present, else from the index's prediction. Requests that waited for an adapter load or
for KV space are not learned from: those waits are separate terms.

Ranking: cost = ttft + `congestionWeight` x (queued requests x own prefill time
                                           + rho / (1 - rho) x duplicated prefill time)
                    + `decodeStallWeight` x running requests x own prefill time
                    + `decodeCrowdingWeight` x running requests x decode slope
                                             x mean output tokens.
The first term is the prefill time this placement adds to the pod, valued at the requests
it delays: those that will queue behind it there, about as many as are queued now. On an
idle pod it is nothing and the request goes wherever it is answered first (its cached
prefix, unless that pod is busy); on a busy pod a cache miss costs every request behind
it, so a busy pool keeps misses off its busy pods instead of trading cache hits for a
queue that is a little shorter (the spread -> fewer hits -> more work loop that a
TTFT-only ranking falls into). The second term charges a pod for the prompt tokens
another candidate already holds (or is computing) and it would compute again, at the
pool's cost shape: work the pool would not otherwise do, which at prefill utilisation
rho delays the requests after it by about rho / (1 - rho) times its length (an M/M/1
queue's wait per unit of work). rho is the predicted prefill of what this gateway (and,
with shared pool state, the other pickers) routed in the last second, per candidate pod,
capped at 0.95; rho / (1 - rho) is also read from the queues, as the median candidate's
work ahead in mean requests (an M/M/1 queue's wait in services), and the larger of the
two counts, since decode steps can fill the pods' time while routed prefill looks light.
An idle pool pays nothing for it; a saturated one follows its prefixes. A copy also
serves the prefix's later followers, so the price is divided by 1 + n (1 - rho): n the
requests that reused the prefix in the last second (scorers/prefix_reuse.py), 1 - rho the
share of them that would find the copy's pod free. A system prompt every request carries
is cheap to copy to a pod holding none of it; a prefix nobody reused lately pays in full,
and so does a copy on a pod whose prefix cache is full (it would push out prefixes that
are reused too).
The third term is the decode stall: vLLM schedules prefill chunks in the same steps as
the running requests' decodes, so each of those waits the placement's prefill time for
its next token. Weighted at a tenth of a second of TTFT per stalled second (a chosen rate
of exchange, measured both ways in benchmarks/RESULTS.md), it sends prompts that nothing
holds to pods decoding fewer requests, so decode batches stay even, while a cached prefix
(little prefill, little stall) still wins. The fourth term, off unless configured, is the
decode crowding: once its prefill is done the placement decodes in the same steps as the
pod's running requests, and each step takes longer by the learned slope
(scorers/decode_model.py: seconds per output token per running request, from the
answers' time per output token with the prefill's share of the steps divided out), for
about the mean output length. It keeps a popular prefix's followers from piling into one
decode batch once that batch costs its requests more than the prefix saves: more output
tokens/s, at the price of computing some prefixes again. Other terms were measured and
rejected (benchmarks/RESULTS.md, "Routing policies").

vLLM always computes the prompt's last token, so a pod reuses at most
(prompt - 1) // block_size full blocks, however much of the prompt it holds.

Score = min_cost / cost, so the best pod scores 1 and the plugin mixes with others.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pydantic import Field

from ..framework.plugins import (
    DecisionHook,
    LearnedSample,
    OutcomeHook,
    PluginParams,
    PoolHook,
    RoutingHook,
    SchedulingContext,
    Scorer,
    SharedLearning,
)
from ..framework.registry import register_plugin
from ..framework.types import SLO_TTFT_HEADER, Decision, Outcome, PodState
from .decode_model import DecodeSlope
from .lora_affinity_scorer import adapter_active, adapter_slot_free
from .prefix_reuse import RecentReuse
from .routed_prefixes import unit_chunk_keys
from .ttft_model import (
    PAIR_UNIT,
    TOKEN_UNIT,
    Inflight,
    PodQueue,
    Prior,
    Snapshot,
    TTFTLearner,
    attention_pairs,
)

SCRATCH_KEY = "predicted-ttft-scorer"
MAX_PENDING = 200_000  # requests awaiting their response; oldest dropped beyond this
# Past this prefill utilisation the pool is saturated and rho / (1 - rho) (here 19) says
# nothing more: the duplicated work is then always worth avoiding.
MAX_UTILISATION = 0.95
# rho / (1 - rho) at that utilisation: the most mean services a second of duplicated
# prefill is priced as delaying, however long the queues (a cap on the price, not a bound
# on the wait).
MAX_DELAYED_PER_WORK = MAX_UTILISATION / (1.0 - MAX_UTILISATION)
# Utilisation is the predicted prefill routed over this window: long enough to average a
# few requests' arrivals, short enough to follow a load change within a second.
UTILISATION_WINDOW_S = 1.0
# Answers kept for other pickers (shared pool state) between two exchanges with them; each
# answer ends a request, whose release wakes an exchange, so they go long before this
# many arrive.
MAX_SHARED_SAMPLES = 4096
# A shared sample: TTFT, prompt tokens, cached tokens, and what was ahead on the pod
# (tokens, attention pairs, running requests).
SAMPLE_FIELDS = 6
# A shared record about a request (`LearnedSample.ref` is its id) starts with its kind:
# routed (then its uncached tokens, attention pairs, predicted prefill seconds, predicted
# TTFT and its age when handed on), or answered. Other pickers queue the requests a picker
# routed on their own model of the pod's queue, as it does, and take them off when it
# hears the answer.
REQUEST_ROUTED, REQUEST_ANSWERED = 1.0, 0.0
ROUTED_FIELDS = 6
# A peer's request whose answer never reaches this picker (the peer died) leaves the
# queue model this long after its predicted first token; by then it adds nothing ahead.
PEER_REQUEST_GRACE_S = 10.0
# Far below any difference predictions resolve (a million tokens: a microsecond), so it
# only orders pods whose prices are otherwise equal.
TIE_BREAK_S_PER_TOKEN = 1e-12
# Likewise per second of prefill routed to a pod lately: orders pods whose prices, held
# tokens included, are exactly equal.
TIE_BREAK_S_PER_ROUTED_S = 1e-12


class PredictedTTFTParams(PluginParams):
    # Priors of the learned model, used until a pod has answered (then it follows its
    # answers): 10k tokens/s is a mid-range GPU's prefill for an 8B model; set it to your
    # model's measured throughput. Attention cost starts unknown (0) and is learned.
    prefillTokensPerSecond: float = Field(default=10_000.0, gt=0)
    prefillAttentionSecondsPerTokenPair: float = Field(default=0.0, ge=0)
    overheadSeconds: float = Field(default=0.005, ge=0)
    runningRequestStepSeconds: float = Field(default=0.0005, ge=0)
    # Weight of the previous fit per new sample: 0.97 remembers about the last 30 answers.
    forgetting: float = Field(default=0.97, gt=0.5, le=1)
    decodeSecondsPerToken: float = Field(default=0.02, gt=0)
    cpuTierTokensPerSecond: float = Field(default=100_000.0, gt=0)
    adapterLoadSeconds: float = Field(default=0.05, ge=0)
    meanPromptTokens: float = Field(default=1024.0, gt=0)
    meanOutputTokens: float = Field(default=256.0, gt=0)
    kvFullUsage: float = Field(default=0.98, gt=0, le=1)
    learningRate: float = Field(default=0.2, gt=0, le=1)
    # Weight of the prefill time a placement adds to the pool, per request queued in it
    # (0: rank by the request's own TTFT alone).
    congestionWeight: float = Field(default=1.0, ge=0)
    # Weight of the decode steps a placement's prefill stalls, per request decoding on the
    # pod: vLLM runs prefill chunks in the same steps as the batch's decodes, so each of
    # them waits the prefill's time for its next token. A rate of exchange between a
    # second of that stall and a second of TTFT, not a measured constant: 0 ranks for
    # TTFT alone (big decode batches pile up where prefixes are), 1 for the sum of
    # end-to-end latencies (measured to cost TTFT p90). 0.1 was chosen on the seed-0
    # policy grids from {0, 0.05, 0.1, 0.15, 0.25, 1} and checked on held-out seeds
    # (benchmarks/RESULTS.md, "Routing policies").
    decodeStallWeight: float = Field(default=0.1, ge=0)
    # Weight of the decode steps a placement slows while it decodes, per request decoding
    # on the pod: each running request waits the learned per-request step cost
    # (scorers/decode_model.py) for about the mean output length. The same kind of delay
    # as the stall; at the stall's rate (0.1) it evens decode batches for output tokens/s
    # at some cost in TTFT p90, measured in benchmarks/RESULTS.md ("Decode crowding"), so
    # it is off (0) by default: a choice for pools that value throughput over TTFT tails.
    decodeCrowdingWeight: float = Field(default=0.0, ge=0)
    # Prompt prefixes this gateway routed count as held by that pod until answered, at
    # most this long. A queued request has computed nothing yet, so neither the pod's KV
    # events nor the index's speculative entries (2 s) show its prefix; past saturation,
    # where queues last longer than that, a new prefix's followers would each see it
    # nowhere and compute it again on another pod. A running request keeps its blocks
    # until it ends, so "held until answered" is what the pod does; the cap only bounds
    # an answer that never comes (60 s: longer than a queue any pool serves from; 60 and
    # 300 gave identical grids, benchmarks/RESULTS.md, "Prefixes in flight"). 0 turns it off.
    routedPrefixSeconds: float = Field(default=60.0, ge=0)
    # Share the price of computing again a prefix another pod holds with the prefix's
    # recent followers that would find the copy's pod free (benchmarks/RESULTS.md, "A copy
    # of a prefix serves its later followers too"); false charges the whole price to the one
    # request.
    shareDuplicationPrice: bool = True
    routedPrefixChunkTokens: int = Field(default=256, ge=1)
    # With shared pool state, hand each routed request and its answer to the other
    # pickers, and put theirs on this picker's queue model. Off by default: in the replay
    # it brings three pickers to one picker's TTFT, but live past saturation it placed
    # the groups of a shared-prefix workload worse than without it (benchmarks/RESULTS.md,
    # "Several pickers, one queue").
    sharedQueue: bool = False
    # A pod's scraped queue is trusted until this long past the scrape after it was due
    # (PodMetrics.scrape_interval_s): a pod whose scrapes fail stops counting by its old
    # queue, while a pool scraped every few seconds is read between its scrapes instead of
    # being taken for one that stopped answering.
    staleAfterSeconds: float = Field(default=1.0, gt=0)
    blockSize: int | None = Field(default=None, gt=0)


@dataclass(slots=True)
class PodModel:
    """What the scorer tracks per pod besides the learned TTFT model."""

    queue: PodQueue = field(default_factory=PodQueue)
    decode_s_per_token: float | None = None
    # When this gateway's requests to the pod ended: a scrape taken before that still
    # counts them, so they are taken off its queue.
    finished_at: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    # (routed at, predicted prefill seconds) this gateway sent the pod in the last
    # UTILISATION_WINDOW_S, and their sum.
    recent_prefill: deque[tuple[float, float]] = field(default_factory=deque)
    recent_prefill_s: float = 0.0
    # Requests running on the pod as the last decision priced it (scrape and sends).
    last_running: float = 0.0
    # Of `queue.items`, the requests other pickers routed (shared pool state).
    peer_requests: int = 0

    def routed_prefill_s(self, now: float) -> float:
        """Predicted prefill seconds this gateway routed to the pod in the last window."""
        recent = self.recent_prefill
        while recent and recent[0][0] <= now - UTILISATION_WINDOW_S:
            self.recent_prefill_s -= recent.popleft()[1]
        if not recent:
            self.recent_prefill_s = 0.0
        return self.recent_prefill_s

    def finished_since(self, t: float) -> int:
        finished = self.finished_at
        if not finished or finished[-1] <= t:
            return 0
        n = 0
        for done in reversed(finished):
            if done <= t:
                break
            n += 1
        return n


@dataclass(slots=True)
class Routed:
    address: str
    ahead: Snapshot  # the learner's features at dispatch
    hit_tokens: float  # cached tokens the index predicted
    routed_at: float
    learnable: bool = True  # no adapter load or KV wait: the model explains its TTFT
    chunk_keys: Sequence[int] = ()  # the prompt's routed-prefix keys for this pod
    prefill_share: float = 0.0  # the pod's share of time in routed prefill, at dispatch


@dataclass(slots=True)
class Prediction:
    ttft_s: list[float]
    cost_s: list[float]
    hit_tokens: list[float]
    # Per pod, as plain tuples (objects are built for the chosen pod only): the request's
    # own prefill (tokens, pairs, prefill_s) and what is ahead (tokens, pairs, running).
    own: list[tuple[float, float, float]]
    ahead: list[tuple[float, float, float]]
    learnable: list[bool]
    # Per pod: the prompt's routed-prefix keys there (pods sharing a block size share one
    # list), and the prompt tokens each key covers.
    chunk_keys: list[Sequence[int]]
    chunk_tokens: list[int]


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

    def drop_pod(self, address: str) -> None:
        """Forgets every prefix sent to `address` (its expiry records find nothing)."""
        for key in [k for k, holders in self._holders.items() if address in holders]:
            holders = self._holders[key]
            del holders[address]
            if not holders:
                del self._holders[key]

    def matched_chunks(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Per pod, how many leading chunks of `keys` it was sent and not yet answered.

        Keys are chained (holding chunk n means holding chunks 1..n), and every prompt
        adds, refreshes and releases all its chunks at once, so the pods holding chunk n
        are among those holding chunk n - 1: walking from the deepest chunk up, a level
        no larger than the pods already placed adds none, and each pod is visited about
        once however many chunks it shares (a system prompt sent to every pod)."""
        levels: list[dict[str, list[float]]] = []
        holders_of = self._holders
        for key in keys:
            holders = holders_of.get(key)
            if not holders:
                break
            levels.append(holders)
        deepest: dict[str, int] = {}  # 0: its deepest entry had expired
        for n in range(len(levels), 0, -1):
            holders = levels[n - 1]
            if len(holders) <= len(deepest):
                continue
            for address, entry in holders.items():
                if address not in deepest:
                    deepest[address] = n if entry[1] > now else 0
        return {address: n for address, n in deepest.items() if n}

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


@register_plugin()
class PredictedTTFTScorer(Scorer, RoutingHook, OutcomeHook, DecisionHook, SharedLearning, PoolHook):
    type_name = "predicted-ttft-scorer"
    Params = PredictedTTFTParams
    params: PredictedTTFTParams
    needs_tokens = True
    needs_prefix_hits = True

    def __init__(self, name: str, params: PredictedTTFTParams) -> None:
        super().__init__(name, params)
        self.pods: dict[str, PodModel] = {}
        self.learner = TTFTLearner(
            Prior.from_rates(
                params.overheadSeconds,
                params.prefillTokensPerSecond,
                params.prefillAttentionSecondsPerTokenPair,
                params.runningRequestStepSeconds,
            ),
            params.forgetting,
        )
        self._pending: OrderedDict[str, Routed] = OrderedDict()
        # Other pickers' requests on this scorer's queue models, a heap of (leave at, pod,
        # id): the soonest to leave first.
        self._peer_requests: list[tuple[float, str, str]] = []
        self.mean_uncached_tokens = params.meanPromptTokens
        self.mean_uncached_pairs = 0.5 * params.meanPromptTokens**2
        self.mean_prompt_tokens = params.meanPromptTokens
        self.mean_output_tokens = params.meanOutputTokens
        # Share of prompt tokens the pool's answers found cached, as a running mean: how
        # much of what the pods hold gets used again (0 until answers show any).
        self.reuse_rate = 0.0
        self.decode_slope = DecodeSlope()
        self.routed_prefixes = RoutedPrefixes(params.routedPrefixSeconds)
        # Per routed-prefix key, the requests that reused it in the last window: how many
        # followers a prefix draws (the duplicated-work price is shared among them).
        self.recent_reuse = RecentReuse(UTILISATION_WINDOW_S)
        # (routed at, predicted prefill seconds) of the last UTILISATION_WINDOW_S.
        self._recent_prefill: deque[tuple[float, float]] = deque()
        self._recent_prefill_s = 0.0
        # Answers learned from, for the other pickers of the pool (take_learned).
        self._to_share: deque[LearnedSample] = deque(maxlen=MAX_SHARED_SAMPLES)
        self.rejected_samples = 0

    def utilisation(self, now: float, pods: Sequence[PodState]) -> float:
        """Predicted prefill seconds routed to the candidates in the last window, per
        second and per candidate: the share of the pods' time that prefill work takes.
        With shared pool state, what the other pickers routed counts too (each picker
        decides only its share of the requests)."""
        recent = self._recent_prefill
        while recent and recent[0][0] <= now - UTILISATION_WINDOW_S:
            self._recent_prefill_s -= recent.popleft()[1]
        if not recent:
            self._recent_prefill_s = 0.0
        if not pods:
            return 0.0
        routed_s = self._recent_prefill_s
        for pod in pods:
            routed_s += pod.inflight.peer_prefill_rate * UTILISATION_WINDOW_S
        busy = routed_s / (UTILISATION_WINDOW_S * len(pods))
        return min(MAX_UTILISATION, max(0.0, busy))

    def learned_cold_ttft(self, prompt_tokens: int) -> dict[str, float]:
        """Per pod that has answered: the TTFT the learned model predicts for a prompt of
        `prompt_tokens` that nothing holds, on an idle pod (what operators compare
        across pods and across replicas, which learn independently)."""
        pairs = attention_pairs(float(prompt_tokens), 0.0)
        return {
            address: self.learner.predict(address, float(prompt_tokens), pairs, 0.0)
            for address in self.learner.pods
        }

    def decode_s_per_token(self, address: str) -> float:
        model = self.pods.get(address)
        if model is not None and model.decode_s_per_token is not None:
            return model.decode_s_per_token
        return self.params.decodeSecondsPerToken

    def _routed_prefix_lookup(
        self, ctx: SchedulingContext, pods: Sequence[PodState], now: float
    ) -> tuple[list[Sequence[int]], list[int], dict[str, float]]:
        """Per pod (in `pods`' order), the prompt's routed-prefix keys and the prompt tokens
        each covers, and per pod sent a prefix of it and not yet answered, the prompt tokens
        it can reuse from that.

        The keys are the block index's own chained block keys for the pod (already cut
        for the prefix lookup, scoped by model, adapter and salt), every `chunk`-th one:
        a chunk of the prompt costs no hashing. Pods without block keys (no KV events)
        use chained keys of the token ids in `routedPrefixChunkTokens` chunks."""
        chunk = self.params.routedPrefixChunkTokens
        prompt_len = ctx.prompt_tokens
        prompt_keys = ctx.prompt_keys or {}
        block_sizes = ctx.block_sizes
        routed = self.routed_prefixes
        # id(block keys list), or 0 -> (chunk keys, prompt tokens per chunk key, matched runs)
        by_list: dict[int, tuple[Sequence[int], int, dict[str, int]]] = {}
        per_pod: list[Sequence[int]] = []
        per_pod_tokens: list[int] = []
        tokens_of: dict[str, float] = {}
        for pod in pods:
            address = pod.endpoint.address
            block_keys = prompt_keys.get(address)
            size = block_sizes.get(address) or 0
            indexed = block_keys is not None and size > 0
            list_id = id(block_keys) if indexed else 0  # 0: the token-id fallback
            found = by_list.get(list_id)
            if found is None:
                if indexed:
                    assert block_keys is not None  # indexed: it has block keys
                    stride = max(1, chunk // size)
                    keys: Sequence[int] = block_keys[stride - 1 :: stride]
                    tokens_per_key = stride * size
                else:
                    keys = unit_chunk_keys(ctx.token_ids or (), chunk)
                    tokens_per_key = chunk
                runs = routed.matched_chunks(keys, now) if keys and len(routed) else {}
                found = by_list[list_id] = (keys, tokens_per_key, runs)
            keys, tokens_per_key, runs = found
            per_pod.append(keys)
            per_pod_tokens.append(tokens_per_key)
            run = runs.get(address)
            if run:
                size = size or 1
                # Whole blocks of the pod's size within the chunks it was sent.
                tokens_of[address] = float(
                    reusable_tokens(prompt_len, run * tokens_per_key // size, size)
                )
        return per_pod, per_pod_tokens, tokens_of

    def predict(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> Prediction:
        # One tight loop per pod with parameters hoisted into locals: this runs for every
        # candidate of every request (256 pods must stay well under a millisecond).
        p = self.params
        now = ctx.now
        if self._peer_requests and self._peer_requests[0][0] <= now:
            self._expire_peer_requests(now)  # also while the shared state is away
        prompt = float(ctx.prompt_tokens)
        prompt_len = ctx.prompt_tokens
        adapter = ctx.request.adapter
        hits = ctx.prefix_hits or {}
        block_sizes = ctx.block_sizes
        models = self.pods
        learner = self.learner
        stale_after = p.staleAfterSeconds
        default_tpot = p.decodeSecondsPerToken
        cpu_rate = p.cpuTierTokensPerSecond
        kv_full = p.kvFullUsage
        half_output = 0.5 * self.mean_output_tokens
        mean_output = self.mean_output_tokens
        mean_tokens = self.mean_uncached_tokens
        mean_pairs = self.mean_uncached_pairs
        request_kv_tokens = self.mean_prompt_tokens + mean_output
        explain = ctx.components if ctx.explain else None
        # Per pod: the prompt's routed-prefix keys and the tokens it was sent and has not
        # seen answered (a prefix the pod's queue holds but no KV event shows yet).
        chunk_keys, chunk_tokens, routed_tokens_of = (
            self._routed_prefix_lookup(ctx, pods, now)
            if p.routedPrefixSeconds > 0
            else ([], [], {})
        )
        progress = ctx.prefill_progress

        ttfts: list[float] = []
        own_s: list[float] = []
        queued_list: list[float] = []
        hit_list: list[float] = []
        own_list: list[tuple[float, float, float]] = []
        ahead_list: list[tuple[float, float, float]] = []
        speeds = learner.pods
        pool_c0, pool_c1, pool_c2, pool_c3 = learner.pool.c
        typical = learner.typical_scale()
        center = learner.center_log_scale
        learnable_list: list[bool] = []
        speed_list: list[float] = []
        for pod in pods:
            address = pod.endpoint.address
            m = pod.metrics
            ok = m.scraped_at == 0.0 or now - m.scraped_at <= stale_after + m.scrape_interval_s
            model = models.get(address)
            speed = speeds.get(address)
            k = math.exp(speed.credible_log_scale(center)) if speed is not None else typical
            c0, c1, c2, c3 = k * pool_c0, k * pool_c1, k * pool_c2, k * pool_c3
            speed_list.append(k)
            hit_tokens = 0.0
            cpu_s = 0.0
            held = hits.get(address)
            if held is not None and held.blocks > 0:
                hit_tokens = float(
                    reusable_tokens(prompt_len, held.blocks, block_sizes.get(address, 0))
                )
                if held.medium == "CPU":
                    cpu_s = hit_tokens / cpu_rate
            routed_tokens = routed_tokens_of.get(address)
            if routed_tokens is not None and routed_tokens > hit_tokens:
                hit_tokens = routed_tokens
                cpu_s = 0.0
            uncached = prompt - hit_tokens
            pairs = uncached * (hit_tokens + 0.5 * uncached)
            waiting = 0
            if ok and m.waiting:
                waiting = m.waiting
                if model is not None and m.scraped_at > 0.0:
                    # Requests that ended after the scrape had left the queue by then.
                    waiting = max(0, waiting - model.finished_since(m.scraped_at))
            if model is not None and model.queue.items:
                # The pod's events, once they have shown a prefill, and how late they come.
                events = progress if progress is not None and progress.confirmed(address) else None
                tokens_ahead, pairs_ahead, queued, others = model.queue.ahead(
                    now,
                    waiting if ok and m.scraped_at > 0.0 else None,
                    m.scraped_at,
                    events,
                    events.lag_s(address) if events is not None else 0.0,
                )
            else:
                tokens_ahead = pairs_ahead = 0.0
                queued = 0
                others = waiting
            peer_prefilling = pod.inflight.peer_prefilling
            if model is not None and model.peer_requests:
                # Those on the queue model are placed there already.
                peer_prefilling = max(0, peer_prefilling - model.peer_requests)
            if others > 0 and peer_prefilling > 0:
                # Of the scraped waiting requests this gateway did not send, other pickers'
                # (shared pool state) are of known size. Only as many as the pod reports
                # waiting: a peer hears of a first token late (with its access log), so
                # its prefilling count alone would hold requests long answered.
                peer_waiting = min(others, peer_prefilling)
                peer_mean = pod.inflight.peer_prefilling_tokens / pod.inflight.peer_prefilling
                tokens_ahead += peer_waiting * peer_mean
                pairs_ahead += peer_waiting * 0.5 * peer_mean * peer_mean
                queued += peer_waiting
                others -= peer_waiting
            if others > 0:
                # Waiting requests this gateway did not send: at the mean request's size.
                tokens_ahead += others * mean_tokens
                pairs_ahead += others * mean_pairs
                queued += others
            # Between scrapes the gateway's own sends are the freshest count of the batch.
            inflight = pod.inflight.requests
            running = float(max(m.running, inflight - m.waiting) if ok else inflight)
            if model is not None:
                model.last_running = running
            prefill_s = c1 * uncached / TOKEN_UNIT + c2 * pairs / PAIR_UNIT
            wait_s = (
                c0 + c1 * tokens_ahead / TOKEN_UNIT + c2 * pairs_ahead / PAIR_UNIT + c3 * running
            )
            adapter_s = 0.0
            kv_s = 0.0
            needs_slot = adapter is not None and not adapter_active(pod, adapter)
            kv_tight = False
            deficit = 0.0
            if ok:
                block_size = block_sizes.get(address)
                if m.num_gpu_blocks and block_size:
                    free_tokens = (1.0 - m.kv_usage) * m.num_gpu_blocks * block_size
                    deficit = uncached + tokens_ahead - free_tokens
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
                    kv_s = finishing * mean_output * tpot / max(1.0, running)
            ttft = wait_s + prefill_s + cpu_s + adapter_s + kv_s
            ttfts.append(ttft)
            own_s.append(prefill_s + cpu_s)
            queued_list.append(float(queued))
            hit_list.append(hit_tokens)
            own_list.append((uncached, pairs, prefill_s))
            ahead_list.append((tokens_ahead, pairs_ahead, running))
            learnable_list.append(not needs_slot and not kv_tight)
            if explain is not None:
                explain.setdefault(address, {}).update(
                    wait_s=wait_s,
                    prefill_s=prefill_s,
                    cpu_s=cpu_s,
                    adapter_s=adapter_s,
                    kv_s=kv_s,
                    ttft_s=ttft,
                    hit_tokens=hit_tokens,
                    queued=float(queued),
                )
        # The prefill a placement adds delays the requests that queue behind it there:
        # about as many as are queued now (Little's law at a steady arrival rate); and it
        # stalls the decode steps of the requests running there, whose next tokens wait
        # for each of its chunks (its computed tokens only: a CPU-tier load is a copy).
        weight = p.congestionWeight
        stall_weight = p.decodeStallWeight
        # a[2]: the pod's running requests; o[2]: the placement's own prefill seconds.
        stalls = [stall_weight * a[2] * o[2] for a, o in zip(ahead_list, own_list, strict=True)]
        crowding: list[float] | None = None  # per pod, only when priced
        crowding_weight = p.decodeCrowdingWeight
        if crowding_weight > 0:
            # While it decodes, the placement adds the learned per-request step cost to
            # each of the pod's steps (at the pod's speed relative to the pool's), about
            # mean-output times.
            per_running = crowding_weight * self.decode_slope.slope * self.mean_output_tokens
            per_running /= typical
            crowding = [per_running * k * a[2] for a, k in zip(ahead_list, speed_list, strict=True)]
            for i, crowded in enumerate(crowding):
                stalls[i] += crowded
        costs = [
            t + weight * q * o + st
            for t, o, q, st in zip(ttfts, own_s, queued_list, stalls, strict=True)
        ]
        # Prompt tokens another candidate holds are work this pod would do again: valued
        # at the pool's cost shape (not the pod's speed factor, so that pods that merely
        # look faster are not favoured for it) and at the pool's utilisation.
        rho = self.utilisation(now, pods)
        shape_c1, shape_c2 = typical * pool_c1, typical * pool_c2

        def at_pool_shape(tokens: float, pairs: float) -> float:
            """Seconds of prefill for `tokens` and their attention `pairs`, at the pool's
            cost shape."""
            return shape_c1 * tokens / TOKEN_UNIT + shape_c2 * pairs / PAIR_UNIT

        def cold_prefill_s(tokens: float) -> float:
            """`tokens` computed from scratch, at the pool's cost shape."""
            return at_pool_shape(tokens, attention_pairs(tokens, 0.0))

        duplicated: list[float] = [0.0] * len(pods)
        # Per pod, the held blocks the placement's new blocks would push out of a full
        # prefix cache (0: room for them, or the cache unknown); read only where priced.
        evicted: list[int] | None = None
        # rho / (1 - rho) is also an M/M/1 queue's mean wait in mean services, so the
        # queues give a second estimate of it: the work ahead on the median candidate,
        # in units of the mean request's prefill. It sees a saturation the routed prefill
        # misses (decode steps taking much of the pods' time: every pod has work waiting
        # at a prefill utilisation of a half); the median, so that one pod's hot prefix
        # does not make an otherwise idle pool look saturated. The larger estimate counts.
        # Read only when some candidate would compute again what another holds.
        queue_ratio = 0.0
        best_hit = max(hit_list) if hit_list else 0.0
        if best_hit > min(hit_list, default=best_hit):
            mean_work = at_pool_shape(mean_tokens, mean_pairs)
            if mean_work > 0:
                work_ahead = sorted(at_pool_shape(a[0], a[1]) for a in ahead_list)
                queue_ratio = work_ahead[(len(work_ahead) - 1) // 2] / mean_work
            delayed_per_work = min(MAX_DELAYED_PER_WORK, max(rho / (1.0 - rho), queue_ratio))
            if delayed_per_work > 0:
                per_work = weight * delayed_per_work
                # A second copy of the prefix serves its later followers too, for as long
                # as it stays cached: the price is shared with those that will find the
                # copy's pod free, counted as the requests that reused the prefix in the
                # last window (a prefix reused n times a window draws about n in the next)
                # times the pool's idle share 1 - rho (past saturation they would queue
                # there as well, and the copy is only more work). A system prompt every
                # request carries is then cheap to copy to a pod that holds none of it,
                # while a prefix nobody reused lately pays in full. Not on a pod whose
                # cache is full: there the copy pushes out other reused prefixes (the
                # displaced price below) and may itself be gone before the followers come.
                holder = hit_list.index(best_hit)
                followers = (
                    self._followers(
                        chunk_keys[holder] if chunk_keys else (),
                        chunk_tokens[holder] if chunk_tokens else 0,
                        best_hit,
                        now,
                    )
                    if p.shareDuplicationPrice
                    else 0
                )
                free_share = 1.0 / (1.0 + delayed_per_work)  # 1 - rho
                if followers:
                    evicted = self._evicted_blocks(ctx, pods, own_list)
                # Candidates holding the same share (most often none of it) repeat the
                # same price: computed once per distinct share.
                price_of: dict[float, float] = {}
                for i, held_tokens in enumerate(hit_list):
                    extra = best_hit - held_tokens
                    if extra > 0:
                        price = price_of.get(extra)
                        if price is None:
                            price = price_of[extra] = cold_prefill_s(extra)
                        duplicated[i] = price
                        if evicted is not None and evicted[i] <= 0:
                            duplicated[i] = price / (1.0 + followers * free_share)
                        costs[i] += per_work * duplicated[i]
        # A prompt's new blocks on a pod whose prefix cache is full push as many held
        # blocks out (vLLM evicts the least recently used), which the requests that would
        # have reused them compute again; on a pod with room they push out nothing. Priced
        # at the pool's cost shape and at the share of prompt tokens answers lately found
        # cached: an estimate of how much of what a pod holds is used again. Without it,
        # every new prefix goes to whichever idle pod is priced a little faster, until its
        # cache holds more prefixes than fit and they evict each other.
        displaced = [0.0] * len(pods)
        reuse = self.reuse_rate
        if reuse > 0 and ctx.held_blocks:
            if evicted is None:
                evicted = self._evicted_blocks(ctx, pods, own_list)
            for i, gone_blocks in enumerate(evicted):
                if gone_blocks > 0:
                    size = block_sizes.get(pods[i].endpoint.address) or 0
                    displaced[i] = reuse * cold_prefill_s(float(gone_blocks * size))
                    costs[i] += displaced[i]
        if explain is not None:
            for i, (pod, t, cost, dup, gone, st) in enumerate(
                zip(pods, ttfts, costs, duplicated, displaced, stalls, strict=True)
            ):
                crowded = crowding[i] if crowding is not None else 0.0
                row = explain[pod.endpoint.address]
                row["congestion_s"] = cost - t - gone - st
                row["decode_stall_s"] = st - crowded
                row["decode_crowding_s"] = crowded
                row["duplicated_s"] = dup
                row["displaced_s"] = gone
                row["utilisation"] = rho
                row["queue_ratio"] = queue_ratio
        if hit_list:
            # Pods priced alike go to the one holding most of the prompt: the fit can find
            # prefill too cheap to tell them apart (answers dominated by fixed cost), and the
            # pod that computes least is the one such a price would have missed.
            for i, held_tokens in enumerate(hit_list):
                costs[i] += TIE_BREAK_S_PER_TOKEN * (best_hit - held_tokens)
            self._break_ties_by_load(costs, pods, now)
        prediction = Prediction(
            ttfts, costs, hit_list, own_list, ahead_list, learnable_list, chunk_keys, chunk_tokens
        )
        ctx.scratch[SCRATCH_KEY] = (pods, prediction)
        return prediction

    def _break_ties_by_load(self, costs: list[float], pods: Sequence[PodState], now: float) -> None:
        """Pods still priced exactly alike (idle, alike in speed, holding the same) go to the
        one sent the least prefill in the last second, by this picker and the others: a
        prompt nothing holds starts a prefix its followers will come back to, and spreading
        those starts is what keeps the pods' shares of the traffic even. Only exact ties,
        so no difference the model prices is overridden."""
        best = min(costs)
        tied = [i for i, cost in enumerate(costs) if cost == best]
        if len(tied) < 2:
            return
        for i in tied:
            pod = pods[i]
            model = self.pods.get(pod.endpoint.address)
            routed_s = model.routed_prefill_s(now) if model is not None else 0.0
            routed_s += pod.inflight.peer_prefill_rate * UTILISATION_WINDOW_S
            costs[i] += TIE_BREAK_S_PER_ROUTED_S * routed_s

    @staticmethod
    def _evicted_blocks(
        ctx: SchedulingContext,
        pods: Sequence[PodState],
        own: Sequence[tuple[float, float, float]],
    ) -> list[int]:
        """Per pod, the held blocks that the placement's new blocks (its uncached tokens,
        whole blocks) would push out of the pod's prefix cache: 0 where they fit, or
        where the index does not know what the pod holds or how much it can."""
        held_blocks = ctx.held_blocks
        out = [0] * len(pods)
        if not held_blocks:
            return out
        held_of = held_blocks.get
        size_of = ctx.block_sizes.get
        for i, (pod, mine) in enumerate(zip(pods, own, strict=True)):
            address = pod.endpoint.address
            held_now = held_of(address)
            block_size = size_of(address)
            if held_now is None or not block_size:
                continue
            capacity = pod.metrics.num_gpu_blocks
            new_blocks = int(mine[0]) // block_size
            if capacity and held_now + new_blocks > capacity:
                out[i] = min(new_blocks, held_now + new_blocks - capacity)
        return out

    def _followers(
        self, keys: Sequence[int], tokens_per_key: int, held_tokens: float, now: float
    ) -> int:
        """Requests that reused the first `held_tokens` of the prompt in the last window
        (the prefix's chunk key at that depth)."""
        if tokens_per_key <= 0:
            return 0
        depth = min(len(keys), int(held_tokens) // tokens_per_key)
        return self.recent_reuse.count(keys[depth - 1], now) if depth > 0 else 0

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        if not pods:
            return []
        prediction = self.predict(ctx, pods)
        # A request with a TTFT SLO goes where it has the most predicted headroom (the
        # smallest predicted TTFT); others by cost, which also weighs the queue behind.
        costs = prediction.ttft_s if SLO_TTFT_HEADER in ctx.request.headers else prediction.cost_s
        best = min(costs)
        return [best / c if c > 0 else 1.0 for c in costs]

    def on_decided(self, ctx: SchedulingContext, decision: Decision) -> None:
        stashed = ctx.scratch.get(SCRATCH_KEY)
        if stashed is None or not decision.endpoints:
            return
        pods, prediction = stashed
        chosen = decision.endpoints[0].address
        for i, pod in enumerate(pods):
            if pod.address == chosen:
                decision.predicted_ttft_s = prediction.ttft_s[i]
                decision.predicted_prefill_s = prediction.own[i][2]
                return

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
        model = self.pods.get(address)
        if model is None:
            model = self.pods[address] = PodModel()
        request_id = ctx.request.request_id
        tokens, pairs, prefill_s = prediction.own[i]
        now = ctx.now
        model.queue.items[request_id] = Inflight(
            tokens, pairs, now, max(prefill_s, 1e-6), now + prediction.ttft_s[i]
        )
        if self.params.sharedQueue:
            # The last value is when it was routed, handed on as its age (`take_learned`).
            routed = (
                REQUEST_ROUTED,
                tokens,
                pairs,
                max(prefill_s, 1e-6),
                prediction.ttft_s[i],
                now,
            )
            self._to_share.append(LearnedSample(self.name, address, routed, request_id))
        keys = prediction.chunk_keys[i] if prediction.chunk_keys else ()
        self.routed_prefixes.add(keys, address, ctx.now)
        per_key = prediction.chunk_tokens[i] if prediction.chunk_tokens else 0
        if self.params.shareDuplicationPrice and 0 < per_key <= prediction.hit_tokens[i]:
            # The chunks the chosen pod holds: this request reuses that prefix.
            self.recent_reuse.add(keys[: int(prediction.hit_tokens[i]) // per_key], now)
        self._watch_prefill(ctx, address)
        self._recent_prefill.append((now, prefill_s))
        self._recent_prefill_s += prefill_s
        model.routed_prefill_s(now)  # drops what left the window: the deque stays short
        model.recent_prefill.append((now, prefill_s))
        model.recent_prefill_s += prefill_s
        alpha = self.params.learningRate
        self.mean_uncached_tokens = _ewma(self.mean_uncached_tokens, max(1.0, tokens), alpha)
        self.mean_uncached_pairs = _ewma(self.mean_uncached_pairs, pairs, alpha)
        self.mean_prompt_tokens = _ewma(self.mean_prompt_tokens, float(ctx.prompt_tokens), alpha)
        self._pending[request_id] = Routed(
            address,
            Snapshot(*prediction.ahead[i]),
            prediction.hit_tokens[i],
            ctx.now,
            learnable=prediction.learnable[i],
            chunk_keys=keys,
            prefill_share=self._prefill_share(model, now),
        )
        while len(self._pending) > MAX_PENDING:
            old_id, old = self._pending.popitem(last=False)
            old_model = self.pods.get(old.address)
            if old_model is not None:
                old_model.queue.remove(old_id)
            if ctx.prefill_progress is not None:
                ctx.prefill_progress.forget(old_id)

    @staticmethod
    def _prefill_share(model: PodModel, now: float) -> float:
        """Share of the pod's time its routed prefill takes (prefill chunks share the
        decode steps), capped as the utilisation is."""
        return min(MAX_UTILISATION, model.routed_prefill_s(now) / UTILISATION_WINDOW_S)

    def _watch_prefill(self, ctx: SchedulingContext, address: str) -> None:
        """Follows this request's prefill in the pod's KV events: the prompt's blocks past
        those the index says the pod holds."""
        progress = ctx.prefill_progress
        keys = ctx.prompt_keys.get(address) if ctx.prompt_keys is not None else None
        block_size = ctx.block_sizes.get(address)
        if progress is None or not keys or not block_size:
            return
        held = ctx.prefix_hits.get(address) if ctx.prefix_hits is not None else None
        uncached = keys[held.blocks :] if held is not None else keys
        progress.watch(ctx.request.request_id, address, uncached, block_size)

    def on_outcome(self, ctx: SchedulingContext, outcome: Outcome) -> None:
        address, usage, ttft_s, ok, now = (
            outcome.address, outcome.usage, outcome.ttft_s, outcome.ok, outcome.now
        )  # fmt: skip
        routed = self._pending.pop(ctx.request.request_id, None)
        if ctx.prefill_progress is not None:
            ctx.prefill_progress.forget(ctx.request.request_id)
        if routed is None or routed.address != address:
            return
        self.routed_prefixes.release(routed.chunk_keys, address)
        model = self.pods.get(address)
        if model is None:
            model = self.pods[address] = PodModel()
        # Its prefill was over at its first token (the outcome comes at the response's end).
        first_token_at = routed.routed_at + ttft_s if ok and ttft_s is not None else None
        model.queue.remove(ctx.request.request_id, first_token_at)
        model.finished_at.append(now)
        if self.params.sharedQueue:
            self._to_share.append(
                LearnedSample(self.name, address, (REQUEST_ANSWERED,), ctx.request.request_id)
            )
        if not ok:
            return
        prompt_tokens = usage.prompt_tokens if usage is not None and usage.prompt_tokens else 0
        cached = (
            usage.cached_tokens
            if usage is not None and usage.cached_tokens is not None
            else int(routed.hit_tokens)
        )
        if prompt_tokens or ctx.prompt_tokens:
            share = min(1.0, cached / (prompt_tokens or ctx.prompt_tokens))
            self.reuse_rate = _ewma(self.reuse_rate, share, self.params.learningRate)
        if ttft_s is not None and routed.learnable:
            self.observe(address, ttft_s, prompt_tokens or ctx.prompt_tokens, cached, routed.ahead)
        if usage is not None and usage.completion_tokens > 0:
            alpha = self.params.learningRate
            self.mean_output_tokens = _ewma(
                self.mean_output_tokens, float(usage.completion_tokens), alpha
            )
            if ttft_s is not None:
                decode_s = (now - routed.routed_at) - ttft_s
                if decode_s > 0 and usage.completion_tokens > 1:
                    self._learn_decode_slope(model, routed, decode_s, usage.completion_tokens, now)
                if decode_s > 0:
                    model.decode_s_per_token = _ewma(
                        model.decode_s_per_token, decode_s / usage.completion_tokens, alpha
                    )

    def _learn_decode_slope(
        self, model: PodModel, routed: Routed, decode_s: float, tokens: int, now: float
    ) -> None:
        """One answer's time per output token against the requests running alongside it,
        both averaged over its dispatch and its end, with the prefill chunks' share of the
        steps divided out."""
        share = 0.5 * (routed.prefill_share + self._prefill_share(model, now))
        running = 0.5 * (routed.ahead.running + model.last_running)
        self.decode_slope.observe((1.0 - share) * decode_s / (tokens - 1), running)

    def observe(
        self, address: str, ttft_s: float, prompt_tokens: int, cached_tokens: int, ahead: Snapshot
    ) -> None:
        """One measured TTFT for the learner: plain values, whatever path they came from."""
        self.learner.observe(address, ttft_s, prompt_tokens, cached_tokens, ahead)
        self._to_share.append(
            LearnedSample(
                self.name,
                address,
                (
                    ttft_s,
                    float(prompt_tokens),
                    float(cached_tokens),
                    ahead.tokens_ahead,
                    ahead.pairs_ahead,
                    ahead.running,
                ),
            )
        )

    def on_pod_removed(self, address: str) -> None:
        """Its queue model, learned speed and routed prefixes go. Requests still in flight
        to it are not waited for: an answer that comes after teaches nothing, since the
        pod left (often failing)."""
        self.pods.pop(address, None)
        self.learner.forget(address)
        self.routed_prefixes.drop_pod(address)
        for request_id in [r for r, routed in self._pending.items() if routed.address == address]:
            del self._pending[request_id]

    def take_learned(self, now: float) -> list[LearnedSample]:
        taken = [
            replace(s, values=(*s.values[:-1], max(0.0, now - s.values[-1])))
            if s.ref and s.values[0] == REQUEST_ROUTED
            else s
            for s in self._to_share
        ]
        self._to_share.clear()
        return taken

    def learn_from_peers(self, samples: Sequence[LearnedSample], now: float) -> None:
        """Other pickers' answers teach this learner as its own do: every picker then
        fits the pool's cost shape and each pod's speed from all of the pool's answers,
        so replicas price pods alike instead of each from its third of them. The requests
        they route join this scorer's model of the pod's queue, as its own do, until they
        hear the answer: each picker then prices what waits ahead on a pod from the whole
        pool's requests, not from a third of them and a count of the rest."""
        self._expire_peer_requests(now)
        for sample in samples:
            values = sample.values
            if sample.ref:
                # A peer with `sharedQueue` on, and this picker with it off: not applied.
                if self.params.sharedQueue and not self._peer_request(sample, now):
                    self.rejected_samples += 1
                continue
            if len(values) != SAMPLE_FIELDS or not all(math.isfinite(v) and v >= 0 for v in values):
                self.rejected_samples += 1
                continue
            ttft_s, prompt, cached, tokens_ahead, pairs_ahead, running = values
            ahead = Snapshot(tokens_ahead, pairs_ahead, running)
            self.learner.observe(sample.pod, ttft_s, int(prompt), int(cached), ahead)

    def _peer_request(self, sample: LearnedSample, now: float) -> bool:
        """Applies another picker's record about one of its requests; False if malformed."""
        values, address, request_id = sample.values, sample.pod, sample.ref
        if not values or not all(math.isfinite(v) and v >= 0 for v in values):
            return False
        if request_id in self._pending:
            return True  # this picker's own request: its own record is exact
        if values[0] == REQUEST_ROUTED and len(values) == ROUTED_FIELDS:
            _, tokens, pairs, prefill_s, ttft_s, age_s = values
            model = self.pods.get(address)
            if model is None:
                model = self.pods[address] = PodModel()
            if request_id in model.queue.items:
                # Read again (a batch the store delivered twice): the first reading
                # stands. It is the nearer to when the request was routed, and it holds
                # the request's place in the pod's admission order (`PodQueue.ahead`).
                return True
            model.peer_requests += 1
            routed_at = now - age_s
            done_at = routed_at + ttft_s
            model.queue.items[request_id] = Inflight(
                tokens, pairs, routed_at, max(prefill_s, 1e-6), done_at, peer=True
            )
            leave = (done_at + PEER_REQUEST_GRACE_S, address, request_id)
            heapq.heappush(self._peer_requests, leave)
            if len(self._peer_requests) > MAX_PENDING:
                _, old_address, old_id = heapq.heappop(self._peer_requests)
                self._drop_peer_request(old_address, old_id, None)
            return True
        if values[0] == REQUEST_ANSWERED and len(values) == 1:
            self._drop_peer_request(address, request_id, now)
            return True
        return False

    def _drop_peer_request(self, address: str, request_id: str, answered_at: float | None) -> None:
        model = self.pods.get(address)
        if model is None or request_id in self._pending:
            return
        if model.queue.remove(request_id, answered_at) is not None:
            model.peer_requests -= 1
            if answered_at is not None:
                model.finished_at.append(answered_at)

    def _expire_peer_requests(self, now: float) -> None:
        expiring = self._peer_requests
        while expiring and expiring[0][0] <= now:
            _, address, request_id = heapq.heappop(expiring)
            model = self.pods.get(address)
            item = model.queue.items.get(request_id) if model is not None else None
            # A record routed again since (a later, longer life) keeps it.
            if item is not None and item.done_at + PEER_REQUEST_GRACE_S <= now:
                self._drop_peer_request(address, request_id, None)

"""The simulated vLLM engine: scheduler, KV block pool, prefix cache and LoRA slots. No I/O.

The engine never reads a clock. Callers pass ``now`` (seconds, any epoch) and the engine
answers how long each step takes on the simulated GPU, so the same code runs in real time
behind ``epp sim`` and in virtual time inside the replay benchmark::

    engine = SimEngine(EngineConfig(block_size=16, profile=get_profile("h100-llama3-8b")))
    engine.add_request(SimRequest("r1", prompt_token_ids=[...], max_tokens=64), now)
    while engine.has_unfinished():
        out = engine.step(now)          # schedules and "runs" one batch
        now = out.end                   # tokens in ``out.progress`` exist at ``out.end``
        publish(out.events)             # KV events of this step, one batch

Scheduling follows vLLM's V1 scheduler: running requests first (decode, or the next chunk of
a chunked prefill) within ``max_num_batched_tokens``, preempting the most recently admitted
running request (recompute) when blocks run out; then waiting requests in arrival order,
each starting with its longest cached prefix, admitted while there are sequence slots, token
budget, blocks and a LoRA slot (a request whose adapter is not in the batch waits while
``max_loras`` adapters are). Full blocks are hashed with vLLM's recipe and published once,
when stored (never on reuse); evictions publish ``BlockRemoved`` lazily at allocation.
"""

from __future__ import annotations

import zlib
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .histogram import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
)
from .profiles import DEFAULT_PROFILE, LatencyProfile, get_profile
from .vllm_hash import BlockHasher, HashAlgo, lora_extra_keys, published_id

# published_id, bound once: it runs for every stored block.
_from_bytes = int.from_bytes

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


class RequestRejected(ValueError):
    """The request can never run on this engine (too long, unknown adapter, ...).

    ``str(exc)`` is vLLM's message; ``reason`` a short label to count rejections by.
    """

    def __init__(self, message: str, reason: str = "invalid request", param: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.param = param  # the request field at fault, as vLLM's error names it


@dataclass(slots=True)
class SimRequest:
    """One generation request, already tokenized.

    ``output_token_ids`` fixes the generated tokens (a trace can replay exact outputs);
    otherwise they are a deterministic function of the prompt and adapter, so an identical
    request generates identical tokens, like greedy decoding.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    lora_name: str | None = None
    output_token_ids: list[int] | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    report_full: bool = False  # vLLM's vllm_xargs kv_cache_report_mode == "full"


@dataclass(slots=True)
class RequestProgress:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]
    first_token: bool  # the first generated token is among new_token_ids
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class StepOutcome:
    start: float
    duration: float  # simulated GPU seconds
    progress: list[RequestProgress]
    events: list[KVEvent]  # the KV-event batch of this step (may be empty)
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # default: the profile's KV capacity / block_size
    profile: LatencyProfile = field(default_factory=lambda: get_profile(DEFAULT_PROFILE))
    max_num_seqs: int | None = None  # defaults come from the profile
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    loras: dict[str, str] = field(default_factory=dict)  # adapter name -> path (hashed)
    max_loras: int = 1
    enable_prefix_caching: bool = True
    hash_algo: HashAlgo = "sha256"
    hash_seed: str | None = None  # None: PYTHONHASHSEED or vLLM's default
    vocab_size: int = 32000
    first_output_token_id: int = 16  # generated ids avoid the control-token range below


@dataclass(slots=True)
class EngineMetrics:
    """Gauges and counters with vLLM /metrics semantics (a snapshot of mutable stats)."""

    num_requests_running: int
    num_requests_waiting: int
    num_waiting_for_capacity: int
    num_waiting_deferred: int  # held back by the LoRA slot limit
    kv_cache_usage_perc: float
    running_lora_adapters: list[str]
    waiting_lora_adapters: list[str]
    stats: EngineStats


@dataclass(slots=True)
class EngineStats:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    request_success: Counter[str] = field(default_factory=Counter)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))


class _Req:
    __slots__ = (
        "arrival",
        "block_ids",
        "digests",
        "extra_keys",
        "first_extra",
        "last_token_time",
        "lora",
        "lora_id",
        "max_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed",
        "num_outputs",
        "num_prompt",
        "out_state",
        "preemptions",
        "published_extra",
        "report_full",
        "req",
        "scheduled_once",
        "tokens",
    )

    def __init__(self, req: SimRequest, arrival: float, lora_id: int | None, path: str | None):
        self.req = req
        self.arrival = arrival
        self.tokens = list(req.prompt_token_ids)
        self.num_prompt = len(self.tokens)
        self.max_tokens = req.max_tokens
        self.num_outputs = 0
        self.num_computed = 0
        self.block_ids: list[int] = []
        self.digests: list[bytes] = []
        self.num_cached_blocks = 0  # leading blocks already in the cache map
        self.num_cached_tokens = -1  # prefix hit at first admission (-1: not yet admitted)
        self.lora = req.lora_name
        self.lora_id = lora_id
        keys = lora_extra_keys(req.lora_name, path) if req.lora_name and path is not None else None
        self.extra_keys = keys
        # vLLM appends the cache salt to the first block's extra keys.
        self.first_extra = (*(keys or ()), req.cache_salt) if req.cache_salt else None
        self.published_extra = [req.lora_name] if req.lora_name else None
        self.report_full = req.report_full
        self.preemptions = 0
        self.scheduled_once = False
        self.last_token_time = 0.0
        seed = zlib.crc32(array("q", self.tokens).tobytes(), zlib.crc32((self.lora or "").encode()))
        self.out_state = seed or 1


class SimEngine:
    def __init__(self, config: EngineConfig | None = None):
        cfg = config or EngineConfig()
        prof = cfg.profile
        self.config = cfg
        self.profile = prof
        self.block_size = cfg.block_size
        num_blocks = cfg.num_blocks or max(2, prof.kv_tokens // cfg.block_size)
        self.pool = BlockPool(num_blocks)
        self.hasher = BlockHasher(cfg.block_size, cfg.hash_algo, cfg.hash_seed)
        self.max_num_seqs = cfg.max_num_seqs or prof.max_num_seqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or prof.max_num_batched_tokens
        capacity = self.pool.num_usable * cfg.block_size
        self.max_model_len = min(cfg.max_model_len or prof.max_model_len, capacity)
        if cfg.loras and cfg.max_loras < 1:
            raise ValueError("max_loras must be at least 1 when LoRA adapters are served")
        self.lora_ids = {name: i + 1 for i, name in enumerate(cfg.loras)}
        self.max_loras = cfg.max_loras
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.requests: dict[str, _Req] = {}
        self.stats = EngineStats()
        self._pending_events: list[KVEvent] = []
        self._step_start = 0.0
        self._vocab_lo = min(cfg.first_output_token_id, cfg.vocab_size - 1)
        self._vocab_span = max(1, cfg.vocab_size - self._vocab_lo)
        # Gauges as vLLM publishes them: computed when a step ends, so a reader mid-step
        # sees the previous step's state. (time the gauges become visible, the gauges)
        self._published = self._gauges()
        self._new_requests = 0  # requests first scheduled in the step being built
        self._next_gauges: tuple[float, EngineMetrics] | None = None

    # ---------------------------------------------------------------- requests
    def validate(self, req: SimRequest) -> None:
        """Raises RequestRejected with vLLM 0.32's wording when ``req`` can never run.

        Like vLLM, a prompt that fits leaves ``max_tokens`` to be clamped to the room left
        (``add_request`` does it); only a prompt that leaves no room at all is refused.
        """
        n = len(req.prompt_token_ids)
        limit = self.max_model_len
        if n == 0:
            raise RequestRejected("The prompt cannot be empty.")
        if req.max_tokens < 1:
            raise RequestRejected(
                f"max_tokens must be at least 1, got {req.max_tokens}.", param="max_tokens"
            )
        if req.max_tokens > limit:
            raise RequestRejected(
                f"max_tokens={req.max_tokens} cannot be greater than max_model_len={limit}. "
                f"Please request fewer output tokens. (parameter=max_tokens, "
                f"value={req.max_tokens})",
                reason="max_tokens over max_model_len",
                param="max_tokens",
            )
        if n > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt contains {n} input tokens, which exceeds this limit even without "
                "any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={n})",
                reason=f"longer than max_model_len ({limit} tokens)",
                param="input_tokens",
            )
        if n == limit:
            raise RequestRejected(
                "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                reason=f"prompt fills max_model_len ({limit} tokens)",
                param="max_tokens",
            )
        if req.lora_name is not None and req.lora_name not in self.lora_ids:
            raise RequestRejected(
                f"The model `{req.lora_name}` does not exist.", reason="unknown LoRA adapter"
            )
        if req.request_id in self.requests:
            raise RequestRejected(f"Request id {req.request_id} already running.")

    def add_request(self, req: SimRequest, now: float) -> None:
        """Queues ``req``; its ``max_tokens`` is clamped to the context left, as in vLLM."""
        self.validate(req)
        req.max_tokens = min(req.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        lora_path = self.config.loras.get(req.lora_name) if req.lora_name else None
        r = _Req(req, now, self.lora_ids.get(req.lora_name or ""), lora_path)
        self.requests[req.request_id] = r
        self.waiting.append(r)

    def abort(self, request_id: str, now: float) -> bool:
        """Drops a request (client went away); its blocks are released, cached ones stay."""
        r = self.requests.pop(request_id, None)
        if r is None:
            return False
        if r in self.running:
            self.running.remove(r)
            self.pool.free(r.block_ids)
        else:
            self.waiting.remove(r)
            if r.block_ids:
                self.pool.free(r.block_ids)
        self.stats.request_success["abort"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def reset_prefix_cache(self) -> bool:
        """Clears the prefix cache; AllBlocksCleared goes out with the next step's batch."""
        if not self.pool.reset_cache():
            return False
        self._pending_events.append(AllBlocksCleared())
        return True

    # ---------------------------------------------------------------- stepping
    def step(self, now: float) -> StepOutcome:
        """Schedules one batch at ``now`` and runs it; tokens exist at ``outcome.end``."""
        self._step_start = now
        events = self._pending_events
        self._pending_events = []
        scheduled = self._schedule(events)
        prefill_tokens = decode_seqs = decode_context = 0
        prefill_pairs = 0.0
        for r, n in scheduled:
            nc = r.num_computed
            if n == 1 and nc >= r.num_prompt:
                decode_seqs += 1
                decode_context += nc + 1
            else:  # a prompt chunk, or recomputing a preempted request's tokens
                prefill_tokens += n
                # Causal attention of this chunk over everything before it (cached prefix and
                # earlier chunks) and over itself.
                prefill_pairs += n * (nc + n / 2)
        duration = self.profile.step_seconds(
            prefill_tokens, prefill_pairs, decode_seqs, decode_context, self._new_requests
        )
        self._new_requests = 0
        end = now + duration
        progress = [p for r, n in scheduled if (p := self._advance(r, n, end)) is not None]
        if self._next_gauges is not None and self._next_gauges[0] <= now:
            self._published = self._next_gauges[1]
        self._next_gauges = (end, self._gauges())
        return StepOutcome(now, duration, progress, events, prefill_tokens, decode_seqs)

    def _schedule(self, events: list[KVEvent]) -> list[tuple[_Req, int]]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[_Req, int]] = []
        preempted = False
        i = 0
        bs = self.block_size
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            nc = r.num_computed
            n = min(len(r.tokens) - nc, budget)
            if n <= 0:
                i += 1
                continue
            if n == 1 and nc % bs and (nc + 1) % bs:
                # Decode inside a block: no new block, none completed (the common case).
                scheduled.append((r, 1))
                budget -= 1
                i += 1
                continue
            while not self._allocate(r, n, events):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
            else:
                scheduled.append((r, n))
                budget -= n
                i += 1
                continue
            break  # r itself was preempted: nothing later in the list remains
        if not preempted:
            self._admit_waiting(budget, scheduled, events)
        return scheduled

    def _admit_waiting(
        self, budget: int, scheduled: list[tuple[_Req, int]], events: list[KVEvent]
    ) -> None:
        if not self.waiting:
            return
        loras = {r.lora for r in self.running if r.lora}
        skipped: list[_Req] = []
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = waiting[0]
            if r.lora and r.lora not in loras and len(loras) >= self.max_loras:
                skipped.append(waiting.popleft())
                continue
            hit_blocks: list[int] = []
            if r.num_computed == 0 and self.config.enable_prefix_caching:
                # At least one token must be computed to sample from, as in vLLM.
                max_hit = (len(r.tokens) - 1) // self.block_size
                self._ensure_digests(r, max_hit)
                hit_blocks = self.pool.longest_cached_prefix(r.digests[:max_hit])
            num_hit = len(hit_blocks) * self.block_size
            n = min(len(r.tokens) - r.num_computed - num_hit, budget)
            if not self._can_allocate(r, r.num_computed + num_hit + n, hit_blocks):
                break
            waiting.popleft()
            if hit_blocks:
                self.pool.touch(hit_blocks)
                r.block_ids = hit_blocks
                r.num_computed = num_hit
                r.num_cached_blocks = len(hit_blocks)
                if r.report_full:
                    events.append(self._stored_event(r, 0, len(hit_blocks), parent=None))
            if r.num_cached_tokens < 0:
                r.num_cached_tokens = num_hit
            if r.preemptions == 0 and not r.scheduled_once:
                self.stats.prefix_cache_queries += len(r.tokens)
                self.stats.prefix_cache_hits += num_hit
            if not r.scheduled_once:
                r.scheduled_once = True
                self._new_requests += 1
                self.stats.queue_time.observe(max(0.0, self._step_start - r.arrival))
            self._allocate(r, n, events)
            self.running.append(r)
            if r.lora:
                loras.add(r.lora)
            scheduled.append((r, n))
            budget -= n
        waiting.extendleft(reversed(skipped))

    def _blocks_needed(self, r: _Req, num_tokens: int, num_new_hits: int = 0) -> int:
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - len(r.block_ids) - num_new_hits)

    def _can_allocate(self, r: _Req, num_tokens: int, hit_blocks: list[int]) -> bool:
        need = self._blocks_needed(r, num_tokens, len(hit_blocks))
        return need <= self.pool.num_free - self.pool.evictable_among(hit_blocks)

    def _allocate(self, r: _Req, n: int, events: list[KVEvent]) -> bool:
        """Slots for ``n`` more tokens of ``r``; stores the blocks they complete."""
        need = self._blocks_needed(r, r.num_computed + n)
        if need:
            removed: list[BlockRemoved] = []
            blocks = self.pool.allocate(need, removed)
            if blocks is None:
                return False
            events.extend(removed)
            r.block_ids.extend(blocks)
        if self.config.enable_prefix_caching:
            self._store_full_blocks(r, r.num_computed + n, events)
        return True

    def _store_full_blocks(self, r: _Req, num_tokens: int, events: list[KVEvent]) -> None:
        full = min(num_tokens, len(r.tokens)) // self.block_size
        first = r.num_cached_blocks
        if full <= first:
            return
        self._ensure_digests(r, full)
        digests = r.digests
        self.pool.cache_many(r.block_ids[first:full], digests[first:full])
        r.num_cached_blocks = full
        parent = published_id(digests[first - 1]) if first > 0 else None
        events.append(self._stored_event(r, first, full, parent))

    def _stored_event(self, r: _Req, first: int, end: int, parent: int | None) -> BlockStored:
        bs = self.block_size
        return BlockStored(
            block_hashes=[_from_bytes(d[-8:], "big") for d in r.digests[first:end]],
            parent_block_hash=parent,
            token_ids=r.tokens[first * bs : end * bs],
            block_size=bs,
            lora_id=r.lora_id,
            lora_name=r.lora,
            extra_keys=[r.published_extra] * (end - first),
            session_id=r.req.session_id,
        )

    def _ensure_digests(self, r: _Req, num_blocks: int) -> None:
        have = len(r.digests)
        if have >= num_blocks:
            return
        self.hasher.extend(r.digests, r.tokens, num_blocks, r.extra_keys, r.first_extra)

    def _preempt(self, r: _Req) -> None:
        """Recompute preemption: drop the request's KV and send it back to the queue front."""
        self.pool.free(r.block_ids)
        r.block_ids = []
        r.num_computed = 0
        r.num_cached_blocks = 0
        r.preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(r)

    def _next_output_token(self, r: _Req) -> int:
        forced = r.req.output_token_ids
        if forced is not None and r.num_outputs < len(forced):
            return forced[r.num_outputs]
        # xorshift32: cheap, deterministic per prompt, spread over the vocabulary.
        x = r.out_state
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        r.out_state = x
        return self._vocab_lo + x % self._vocab_span

    def _advance(self, r: _Req, n: int, end: float) -> RequestProgress | None:
        r.num_computed += n
        if r.num_computed < len(r.tokens):
            return None  # a prefill chunk that does not reach the end samples nothing
        token = self._next_output_token(r)
        r.tokens.append(token)
        r.num_outputs += 1
        stats = self.stats
        first = r.num_outputs == 1
        if first:
            stats.ttft.observe(end - r.arrival)
            stats.prompt_tokens += r.num_prompt
        else:
            stats.itl.observe(end - r.last_token_time)
        stats.generation_tokens += 1
        r.last_token_time = end
        finished = r.num_outputs >= r.max_tokens
        if finished:
            self.running.remove(r)
            self.pool.free(r.block_ids)
            del self.requests[r.req.request_id]
            stats.request_success["length"] += 1
            stats.e2e.observe(end - r.arrival)
        return RequestProgress(
            request_id=r.req.request_id,
            new_token_ids=[token],
            first_token=first,
            finished=finished,
            finish_reason="length" if finished else None,
            num_prompt_tokens=r.num_prompt,
            num_cached_tokens=max(0, r.num_cached_tokens),
        )

    # ---------------------------------------------------------------- metrics
    def snapshot_metrics(self, now: float | None = None) -> EngineMetrics:
        """The gauges as published at the end of the last step that ended by ``now``.

        vLLM computes its scheduler gauges (running, waiting, KV usage) when a step ends,
        so a scrape during a step reads the previous step's state and a request that
        arrived since is not yet counted. ``now=None`` reads the state after the last
        step. Counters and histograms (``stats``) are live.
        """
        pending = self._next_gauges
        if pending is not None and (now is None or pending[0] <= now):
            self._published = pending[1]
            self._next_gauges = None
        return self._published

    def _gauges(self) -> EngineMetrics:
        running, waiting = self.running, self.waiting
        deferred = 0
        running_loras: list[str] = []
        waiting_loras: list[str] = []
        if self.lora_ids:
            loaded = {r.lora for r in running if r.lora}
            if len(loaded) >= self.max_loras:
                deferred = sum(1 for r in waiting if r.lora and r.lora not in loaded)
            running_loras = sorted(loaded)
            waiting_loras = sorted({r.lora for r in waiting if r.lora})
        return EngineMetrics(
            num_requests_running=len(running),
            num_requests_waiting=len(waiting),
            num_waiting_for_capacity=len(waiting) - deferred,
            num_waiting_deferred=deferred,
            kv_cache_usage_perc=self.pool.usage(),
            running_lora_adapters=running_loras,
            waiting_lora_adapters=waiting_loras,
            stats=self.stats,
        )

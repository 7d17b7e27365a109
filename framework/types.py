"""Plain data shared by the gateway, the scheduler, the KV index and the benchmarks.

Everything here is a small typed record with no I/O, so the decision logic can be
driven by the live gateway and by the replay simulator in virtual time alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

Medium = Literal["GPU", "CPU"]

# A request's time-to-first-token objective in milliseconds (request header).
SLO_TTFT_HEADER = "x-slo-ttft-ms"


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """How much of a prompt one pod holds: its longest run of consecutive blocks."""

    blocks: int
    medium: Medium = "GPU"  # the slowest tier seen along the matched run
    tokens: int = 0  # blocks x the pod's block size, when the caller knows the block size


class Api(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model server (a vLLM pod) as discovery describes it."""

    address: str  # "ip:port", where Envoy sends the request
    metrics_url: str = ""  # default http://<address>/metrics
    kv_events: str | None = None  # the pod's ZMQ PUB endpoint, e.g. tcp://10.0.0.5:5557
    kv_replay: str | None = None  # the pod's ZMQ ROUTER replay endpoint
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.metrics_url:
            object.__setattr__(self, "metrics_url", f"http://{self.address}/metrics")

    def label(self, key: str, default: str | None = None) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return default


@dataclass(slots=True)
class PodMetrics:
    """What the pod's /metrics page said at its last successful scrape."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # fraction 0..1 of KV blocks in use
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_loras: int = 0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    # `process_start_time_seconds`: a new value means the pod's process restarted.
    process_start_time: float | None = None
    scraped_at: float = 0.0  # monotonic seconds; 0 = never
    # Seconds between the pod's last two scrapes (0 = one or none yet): how old a scrape
    # gets before the next is due, so a pool scraped every few seconds is not taken for
    # one whose scrapes stopped.
    scrape_interval_s: float = 0.0
    consecutive_failures: int = 0

    def mark_scraped(self, at: float, before: PodMetrics) -> None:
        """Stamps a scrape taken at `at`; `before` is what the pod's metrics were until now
        (this same object when a scrape is copied into it)."""
        last = before.scraped_at
        # A clock or process reset (`at` not after the last) keeps the interval known.
        self.scrape_interval_s = at - last if 0.0 < last < at else before.scrape_interval_s
        self.scraped_at = at


@dataclass(slots=True)
class Inflight:
    """What this gateway (and, with shared pool state, its peers) sent to a pod and has
    not yet seen finish."""

    requests: int = 0
    prompt_tokens: int = 0
    adapters: Counter[str] = field(default_factory=Counter)
    # Of those, the ones whose first response byte has not come back yet: the prefill
    # work this gateway has queued at the pod (estimated prompt tokens).
    prefilling: int = 0
    prefilling_tokens: int = 0
    # Predicted prefill seconds this gateway routed to the pod since it started: a
    # counter that only grows (peers read its rate through the shared pool state).
    routed_prefill_s: float = 0.0
    # Of the counts above, the part other pickers sharing this pool reported (through
    # the shared pool state; 0 for a picker alone): the rest is this gateway's own.
    peer_requests: int = 0
    peer_prompt_tokens: int = 0
    peer_prefilling: int = 0
    peer_prefilling_tokens: int = 0
    # Predicted prefill seconds per second other pickers routed to the pod, over the
    # last second: their share of the pod's prefill utilisation.
    peer_prefill_rate: float = 0.0


@dataclass(slots=True)
class PodState:
    """Everything the scheduler knows about one candidate pod."""

    endpoint: Endpoint
    metrics: PodMetrics = field(default_factory=PodMetrics)
    inflight: Inflight = field(default_factory=Inflight)
    ready: bool = True  # false while the pod's metrics scrape keeps failing
    ttft_ewma_s: float | None = None  # observed time to first token
    prefill_tok_per_s: float | None = None  # learned online from observed TTFTs

    @property
    def address(self) -> str:
        return self.endpoint.address


@dataclass(slots=True)
class LLMRequest:
    """An OpenAI request as the scheduler sees it (parsed once, by epp.request_parser)."""

    request_id: str
    path: str
    api: Api
    model: str  # the `model` field as the client sent it
    stream: bool = False
    adapter: str | None = None  # LoRA adapter name when `model` names one
    prompt: str | None = None  # completions/embeddings/responses text prompt
    prompt_token_ids: list[int] | None = None  # when the client sent token ids
    messages: list[dict[str, Any]] | None = None  # chat messages, as sent
    # Chat fields that reach the chat template (tools, documents, chat_template_kwargs,
    # add_generation_prompt, continue_final_message, reasoning_effort), as sent.
    chat_template_args: dict[str, Any] | None = None
    cache_salt: str | None = None
    max_tokens: int | None = None
    session_id: str | None = None  # from the x-session-id header, for session affinity
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def text_for_hashing(self) -> str:
        """A stable text rendering of the prompt, for character-based approximations."""
        if self.prompt is not None:
            return self.prompt
        if self.messages is not None:
            parts: list[str] = []
            for m in self.messages:
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(
                        str(p.get("text", "")) for p in content if isinstance(p, dict)
                    )
                parts.append(f"<{m.get('role', '')}>{content or ''}")
            return "".join(parts)
        if self.prompt_token_ids is not None:
            return " ".join(map(str, self.prompt_token_ids))
        return ""

    def estimated_prompt_tokens(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        # ~4 characters per token is the usual rule of thumb for English BPE vocabularies.
        return max(1, len(self.text_for_hashing()) // 4)


@dataclass(frozen=True, slots=True)
class Usage:
    """The `usage` object of an OpenAI response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None


@dataclass(slots=True)
class Decision:
    """The scheduler's answer: endpoints in preference order (first = primary)."""

    endpoints: list[PodState]
    profile: str = "default"
    # Per-candidate score components, for the debug explain line.
    explain: dict[str, dict[str, float]] = field(default_factory=dict)
    # Prompt token ids computed while scheduling, reused for speculative index entries.
    prompt_token_ids: list[int] | None = None
    # The chosen pod's predicted time to first token, when the policy predicts one.
    predicted_ttft_s: float | None = None
    # The prefill work (seconds) the policy predicts this request puts on the chosen pod.
    predicted_prefill_s: float = 0.0
    # The scheduler's own per-request state (its SchedulingContext), handed back to it
    # with the outcome, so no scheduler keeps a table of requests in flight.
    context: Any = None
    # Where Envoy must send the request when that differs from the pod's own address
    # (pod address -> address to dial; data-parallel ranks behind one port).
    forward: dict[str, str] = field(default_factory=dict)
    # Headers to add to the request on its way to the pod.
    request_headers: tuple[tuple[str, str], ...] = ()
    # Headers for the client's response (e.g. a session token), handed to Envoy as
    # `envoy.lb` dynamic metadata that the gateway config copies onto the response.
    response_headers: tuple[tuple[str, str], ...] = ()

    def destination_of(self, address: str) -> str:
        return self.forward.get(address, address)


@dataclass(slots=True)
class Outcome:
    """What happened to one routed request, as the response path observed it.

    (Not frozen: one is built per request, and a frozen dataclass pays a setattr call per
    field to build.)"""

    address: str  # the endpoint that served it (a fallback's when one answered)
    ok: bool
    status: int = 0  # HTTP status; 0 when no response arrived
    usage: Usage | None = None
    ttft_s: float | None = None  # routing decision -> first response byte
    duration_s: float | None = None  # routing decision -> end of the response
    now: float = 0.0  # the flow's clock when the request ended

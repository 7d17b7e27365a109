"""The three extension points of a scheduling profile — Filter, Scorer, Picker — the
per-request context they read, and the opt-in lifecycle hooks.

Plugins are plain objects with synchronous methods and no I/O: everything a decision
needs (token ids, prefix matches, the current time) is gathered once per request by the
scheduler's prepare step and handed over in `SchedulingContext`. Plugins that learn from
routing and outcomes (routing history, session stickiness, service rates) say so by also
deriving from `RoutingHook` / `OutcomeHook`, and update their own state only there,
never while scoring; plugins that learn nothing carry no hook methods at all.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from .scheduling import PrefillProgressView
from .types import Decision, LLMRequest, Outcome, PodState, PrefixHit

PluginKind = Literal[
    "filter",
    "scorer",
    "picker",
    "profile-handler",
    "tokenizer",
    "data-source",  # where pod signals come from (metrics scrape, discovery notifications)
    "extractor",  # what is read out of a data source
    "parser",  # how request bodies are parsed
    "producer",  # per-request data for scorers (prefix matches)
]


class PluginParams(BaseModel):
    """Base of every plugin's `parameters` block.

    Unknown keys are kept here so the config loader can report every one of them at once,
    each with its line, as an error. Parameters that upstream endpoint pickers define and
    that smart-epp satisfies by its own design (its index exports metrics, its block keys
    do not depend on a hash seed, ...) are listed in `upstream_notes`, keyed by their dotted
    path inside `parameters`, with the reason; the loader accepts them and reports the
    reason once at start-up, so nothing is silently ignored. A dotted path ending in `.*`
    accepts everything below it.
    """

    model_config = ConfigDict(extra="allow", populate_by_name=True, frozen=True)
    upstream_notes: ClassVar[Mapping[str, str]] = {}
    # Mapping-valued parameters whose keys the loader checks against `upstream_notes`
    # (dotted paths below the parameter), e.g. llm-d's `indexerConfig`.
    nested_parameters: ClassVar[frozenset[str]] = frozenset()


@dataclass(slots=True)
class SchedulingContext:
    """What the prepare step learned about one request, shared by every plugin."""

    request: LLMRequest
    now: float  # the scheduler clock (monotonic seconds, or virtual time in a replay)
    prompt_tokens: int
    token_ids: list[int] | None = None
    # Longest cached run per pod address, from the KV index; None when not looked up.
    prefix_hits: Mapping[str, PrefixHit] | None = None
    # Blocks each candidate pod holds in all (its prefix cache's fill, from the KV index),
    # looked up with the prefix hits; None when not known.
    held_blocks: Mapping[str, int] | None = None
    # Block size (tokens) each candidate pod uses, when known.
    block_sizes: Mapping[str, int] = field(default_factory=dict)
    # The prompt's block keys per candidate pod (its block size and key scope), as the
    # prefix lookup computed them; None when not looked up.
    prompt_keys: Mapping[str, Sequence[int]] | None = None
    # Prefill progress of the requests in flight, from the pods' KV events; None without
    # a KV index fed by events.
    prefill_progress: PrefillProgressView | None = None
    rng: random.Random = field(default_factory=random.Random)
    explain: bool = False  # collect per-pod components for the explain line
    # Per-plugin scratch space: values computed while scoring that `on_routed` reuses,
    # and per-pod extra components for the explain line.
    scratch: dict[str, Any] = field(default_factory=dict)
    components: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per-plugin state a routing hook keeps until the request's outcome (small records:
    # everything else in the context is dropped once the request is routed).
    kept: dict[str, Any] = field(default_factory=dict)
    # (stage, plugin type, plugin name, start, end) on the perf_counter clock, for tracing;
    # None (nothing recorded) unless the scheduler was asked to record timings.
    timings: list[tuple[str, str, str, float, float]] | None = None

    def hit_tokens(self, address: str) -> int:
        """Prompt tokens pod `address` already holds, per the KV index."""
        if self.prefix_hits is None:
            return 0
        hit = self.prefix_hits.get(address)
        if hit is None or hit.blocks <= 0:
            return 0
        return min(self.prompt_tokens, hit.blocks * self.block_sizes.get(address, 0))


class Plugin:
    """Common base: a type name for the registry and the parameters it was built with."""

    type_name: ClassVar[str]
    kind: ClassVar[PluginKind]
    Params: ClassVar[type[PluginParams]] = PluginParams
    # The prepare step tokenizes / queries the KV index only when some plugin asks.
    needs_tokens: ClassVar[bool] = False
    needs_prefix_hits: ClassVar[bool] = False

    def __init__(self, name: str, params: PluginParams) -> None:
        self.name = name
        self.params = params


class RoutingHook(ABC):
    """Opt-in: a plugin that learns from where requests were sent."""

    @abstractmethod
    def on_routed(self, ctx: SchedulingContext, chosen: PodState) -> None:
        """The request of `ctx` was sent to `chosen` (its reply is on its way to Envoy)."""


class OutcomeHook(ABC):
    """Opt-in: a plugin that learns from how requests ended."""

    @abstractmethod
    def on_outcome(self, ctx: SchedulingContext, outcome: Outcome) -> None:
        """The request of `ctx` ended (normally, with an error, or on client reset)."""


class PoolHook(ABC):
    """Opt-in: a plugin that keeps state per pod and lets it go when the pod leaves."""

    @abstractmethod
    def on_pod_removed(self, address: str) -> None:
        """`address` left the pool (discovery no longer lists it as serving). What the
        plugin learned of it goes: a pod that serves from the address later is another
        process, maybe on another device, with an empty cache."""


@dataclass(frozen=True, slots=True)
class LearnedSample:
    """One record a plugin shares, in plain values, with the instance of the same plugin
    (by name) in the other pickers: an answer it learned from, or (with `ref`, the
    request's id) a request it routed or saw answered."""

    plugin: str
    pod: str
    values: tuple[float, ...]
    ref: str = ""


class SharedLearning(ABC):
    """Opt-in: a plugin whose learning is shared by the pickers of one pool (shared pool state).
    Each picker hands on the records its instance made and feeds its peers' records to its
    own, so that every picker learns from every answer, not a share."""

    @abstractmethod
    def take_learned(self, now: float) -> list[LearnedSample]:
        """The records made since the last call (a bounded backlog), as of `now` (the
        picker's clock: a record that carries a time hands it on as an age)."""

    @abstractmethod
    def learn_from_peers(self, samples: Sequence[LearnedSample], now: float) -> None:
        """Records other pickers' instances of this plugin made, received at `now` (the
        picker's clock); malformed ones are counted and ignored."""


class DecisionHook(ABC):
    """Opt-in: a plugin that adds to the decision once the picker has chosen (headers for
    the request or the response, the address Envoy dials)."""

    @abstractmethod
    def on_decided(self, ctx: SchedulingContext, decision: Decision) -> None:
        """`decision.endpoints[0]` is the chosen pod; the request has not left yet."""


class Filter(Plugin):
    kind = "filter"

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        raise NotImplementedError


class Scorer(Plugin):
    kind = "scorer"

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        """One score in [0, 1] per pod, in the order given (1 = best)."""
        raise NotImplementedError


class Picker(Plugin):
    kind = "picker"

    def pick(
        self, ctx: SchedulingContext, pods: Sequence[PodState], scores: Sequence[float]
    ) -> list[PodState]:
        """The chosen pods, primary first."""
        raise NotImplementedError


class ProfileHandler(Plugin):
    """Chooses which profile(s) run for a request and how their results combine.

    smart-epp runs one profile per request; a handler says how many profiles it can run
    (`max_profiles`), and the config loader refuses configs with more.
    """

    kind = "profile-handler"
    max_profiles: ClassVar[int] = 1


def min_max_inverted(values: Sequence[float]) -> list[float]:
    """Scores 1 for the smallest value and 0 for the largest, linear in between.

    This is the Inference Extension's normalisation for "less is better" signals (queue
    length, running requests); equal values all score 1.
    """
    lo = min(values)
    hi = max(values)
    if hi <= lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]

"""The contracts around a routing decision: the scheduler the request flow asks, and the
data producers a scheduler asks (tokenization, prefix lookup)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from .types import Decision, LLMRequest, Outcome, PodState, PrefixHit


class Scheduler(Protocol):
    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        """Ranks `candidates` (already narrowed to ready pods that may serve the request).

        Returns an empty `Decision.endpoints` when no candidate can take the request; the
        gateway answers 503 then.
        """
        ...

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        """The decision has been sent to Envoy (speculative index entries, routing history
        for approximate prefix scoring, session affinity)."""
        ...

    def on_outcome(self, request: LLMRequest, decision: Decision, outcome: Outcome) -> None:
        """The request ended (normally, with an error, or on client reset)."""
        ...


# How much memory a tokenizer's prompt -> token ids cache may use by default.
DEFAULT_TOKENIZER_CACHE_BYTES = 64 * 1024 * 1024


class PromptTokenizer(Protocol):
    async def tokenize(self, request: LLMRequest, pods: Sequence[PodState]) -> list[int] | None:
        """The prompt's token ids as the pods will see them, or None when unavailable."""
        ...


class PrefixMatcher(Protocol):
    """Finds, per pod, the longest run of the prompt's blocks the pod holds.

    With `keys_out`, also leaves there each pod's block keys of the prompt (at its block
    size and key scope), as the lookup computed them."""

    async def match(
        self,
        token_ids: Sequence[int],
        request: LLMRequest,
        block_sizes: Mapping[str, int],
        keys_out: dict[str, Sequence[int]] | None = None,
    ) -> Mapping[str, PrefixHit]: ...

    def match_sync(
        self,
        token_ids: Sequence[int],
        request: LLMRequest,
        block_sizes: Mapping[str, int],
        keys_out: dict[str, Sequence[int]] | None = None,
    ) -> Mapping[str, PrefixHit] | None:
        """The same without awaiting, or None when the backend cannot answer synchronously."""
        ...

    def held_blocks(self, addresses: Collection[str]) -> Mapping[str, int] | None:
        """Blocks each pod holds in all (its prefix cache's fill), or None when unknown."""
        ...

    def speculate(
        self,
        token_ids: Sequence[int],
        request: LLMRequest,
        address: str,
        block_size: int,
        ttl_s: float,
        keys: Sequence[int] | None = None,
    ) -> None:
        """Marks the prompt's blocks as held by `address` for `ttl_s` seconds (`keys`: the
        prompt's keys for that pod when `match` computed them)."""
        ...


class PrefillProgressView(Protocol):
    """How far pods have got through the prefill of the requests sent to them, from their
    KV events (kv_index/progress.py)."""

    def watch(self, request_id: str, address: str, keys: Sequence[int], block_size: int) -> None:
        """`keys`: the request's prompt blocks that `address` does not hold, in order."""
        ...

    def forget(self, request_id: str) -> None: ...

    def computed(self, request_id: str) -> tuple[int, int] | None:
        """(tokens computed, tokens watched), or None when the request is not watched."""
        ...

    def confirmed(self, address: str) -> bool:
        """Whether the pod's events have shown the prefill of a watched block."""
        ...

    def lag_s(self, address: str) -> float:
        """How long after the pod stored blocks its events arrive (0 when unknown)."""
        ...

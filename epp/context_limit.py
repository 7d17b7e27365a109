"""Which pods can hold a request: vLLM refuses one that does not fit its context.

vLLM lists each base model's `max_model_len` on /v1/models (the model catalog keeps it per
pod) and answers 400 to a request whose prompt fills or exceeds it, or whose `max_tokens`
exceeds it; a smaller `max_tokens` it clamps to the room left. A pool may mix context
lengths (pods started with a longer `--max-model-len` for long prompts): a prompt only some
pods can hold must go to one of them, and a prompt no pod can hold is refused here, in
vLLM's words, instead of being sent to a pod that will refuse it (and priced meanwhile as
prefill no pod will run). The check needs the prompt's token count, so it runs only when
the prompt's token ids are known (sent by the client or tokenized for the cache scorers);
with an estimate from characters nothing is narrowed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..framework.types import PodState
from .errors import RequestError

ContextLimitOf = Callable[[str], int | None]


def holds(prompt_tokens: int, max_tokens: int | None, limit: int) -> bool:
    """Whether a request runs within `limit` tokens of context: its prompt leaves room for
    one output token and its `max_tokens` (vLLM clamps it to the room left) is not past
    the limit."""
    return prompt_tokens < limit and (max_tokens is None or max_tokens <= limit)


def context_problem(prompt_tokens: int, max_tokens: int | None, limit: int) -> RequestError | None:
    """The 400 vLLM (0.32) answers when a request cannot run within `limit` tokens of
    context; None when it can."""
    if holds(prompt_tokens, max_tokens, limit):
        return None
    if max_tokens is not None and max_tokens > limit:
        return RequestError.bad_request(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. "
            f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
            "max_tokens",
        )
    if prompt_tokens > limit:
        return RequestError.bad_request(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {prompt_tokens} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={prompt_tokens})",
            "input_tokens",
        )
    return RequestError.bad_request(  # the prompt fills the context
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        "max_tokens",
    )


def pods_that_hold(
    pods: Sequence[PodState],
    prompt_tokens: int,
    max_tokens: int | None,
    limit_of: ContextLimitOf,
) -> list[PodState]:
    """The candidates whose context holds the request (a pod whose limit is unknown is
    taken to). Raises the 400 of the pod with the longest context when none does."""
    fitting: list[PodState] = []
    longest = 0  # the longest context among the pods that cannot hold it
    for pod in pods:
        limit = limit_of(pod.address)
        if limit is None or holds(prompt_tokens, max_tokens, limit):
            fitting.append(pod)
        elif limit > longest:
            longest = limit
    if fitting or not longest:
        return fitting
    refusal = context_problem(prompt_tokens, max_tokens, longest)
    assert refusal is not None
    raise refusal

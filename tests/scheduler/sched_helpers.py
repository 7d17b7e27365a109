"""Builders for pods and requests used across the scheduler tests."""

from __future__ import annotations

from collections import Counter
from itertools import count

from smart_epp.framework.types import Api, Endpoint, Inflight, LLMRequest, PodMetrics, PodState

_ids = count()


def pod(
    address: str,
    *,
    waiting: int = 0,
    running: int = 0,
    kv: float = 0.0,
    adapters: tuple[str, ...] = (),
    waiting_adapters: tuple[str, ...] = (),
    max_loras: int = 0,
    block_size: int | None = 16,
    num_gpu_blocks: int | None = None,
    inflight: int = 0,
    inflight_adapters: dict[str, int] | None = None,
    labels: dict[str, str] | None = None,
    ready: bool = True,
) -> PodState:
    return PodState(
        endpoint=Endpoint(address=address, labels=tuple((labels or {}).items())),
        metrics=PodMetrics(
            waiting=waiting,
            running=running,
            kv_usage=kv,
            running_adapters=frozenset(adapters),
            waiting_adapters=frozenset(waiting_adapters),
            max_loras=max_loras,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
        ),
        inflight=Inflight(requests=inflight, adapters=Counter(inflight_adapters or {})),
        ready=ready,
    )


def request(
    *,
    tokens: list[int] | None = None,
    prompt: str | None = None,
    model: str = "tiny",
    adapter: str | None = None,
    session_id: str | None = None,
    messages: list[dict] | None = None,
) -> LLMRequest:
    return LLMRequest(
        request_id=f"req-{next(_ids)}",
        path="/v1/chat/completions" if messages is not None else "/v1/completions",
        api=Api.CHAT if messages is not None else Api.COMPLETIONS,
        model=adapter or model,
        adapter=adapter,
        prompt=prompt,
        prompt_token_ids=tokens,
        messages=messages,
        session_id=session_id,
    )

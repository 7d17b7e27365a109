"""Recording the gateway's traffic so `epp replay --format recorded` can replay it.

Off by default: prompts are user data. With recording on, every finished request becomes
one JSONL row (arrival time, model, API, token counts); with `include_content` the prompt
itself (token ids, messages or text) is kept too, which is what lets a replay reproduce
prefix sharing.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from smart_epp.epp.scheduler_api import Scheduler
from smart_epp.epp.types import Decision, LLMRequest, PodState, Usage

log = logging.getLogger(__name__)

RECORDED_VERSION = 1
MAX_OPEN_REQUESTS = 100_000  # arrivals awaiting their response; oldest dropped beyond


def recorded_line(
    timestamp_s: float,
    model: str,
    prompt_tokens: int,
    output_tokens: int,
    *,
    api: str = "completions",
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> str:
    """One JSONL line of the recorded-traffic format.

    Content (prompt, messages or token ids) is optional because prompts are user data;
    without it the replay still reproduces timing and sizes, but no prefix sharing.
    """
    row: dict[str, Any] = {
        "v": RECORDED_VERSION,
        "timestamp": round(timestamp_s, 6),
        "model": model,
        "api": api,
        "prompt_tokens": int(prompt_tokens),
        "output_tokens": int(output_tokens),
    }
    if prompt_token_ids is not None:
        row["prompt_token_ids"] = list(prompt_token_ids)
    elif messages is not None:
        row["messages"] = messages
    elif prompt is not None:
        row["prompt"] = prompt
    return json.dumps(row, separators=(",", ":"))


class TrafficRecorder:
    """A `Scheduler` wrapper that writes one recorded-traffic row per finished request.

    Timestamps are seconds since the first request, so a recording replays from 0. Rows
    are written when responses end (in completion order); the replay sorts by timestamp.
    """

    def __init__(
        self,
        inner: Scheduler,
        out: IO[str],
        *,
        include_content: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self._out = out
        self._include_content = include_content
        self._clock = clock
        self._epoch: float | None = None
        self._arrivals: dict[str, tuple[float, list[int] | None]] = {}

    @classmethod
    def to_file(cls, inner: Scheduler, path: Path, **kwargs: Any) -> TrafficRecorder:
        return cls(inner, path.open("a", encoding="utf-8", buffering=1), **kwargs)

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        return await self.inner.schedule(request, candidates)

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        now = self._clock()
        if self._epoch is None:
            self._epoch = now
        if len(self._arrivals) >= MAX_OPEN_REQUESTS:
            self._arrivals.pop(next(iter(self._arrivals)))
        tokens = decision.prompt_token_ids if self._include_content else None
        self._arrivals[request.request_id] = (now - self._epoch, tokens)
        self.inner.on_routed(request, decision)

    def on_response(
        self,
        request: LLMRequest,
        address: str,
        usage: Usage | None,
        ttft_s: float | None,
        ok: bool,
    ) -> None:
        self.inner.on_response(request, address, usage, ttft_s, ok)
        arrival = self._arrivals.pop(request.request_id, None)
        if arrival is None or not ok:
            return
        at, tokens = arrival
        prompt_tokens = usage.prompt_tokens if usage else request.estimated_prompt_tokens()
        output_tokens = usage.completion_tokens if usage else (request.max_tokens or 0)
        content: dict[str, Any] = {}
        if self._include_content:  # recorded_line keeps the first of these that is set
            content = {
                "prompt_token_ids": tokens,
                "messages": request.messages,
                "prompt": request.prompt,
            }
        try:
            self._out.write(
                recorded_line(
                    at, request.model, prompt_tokens, output_tokens, api=str(request.api),
                    **content,
                ) + "\n"
            )  # fmt: skip
        except (OSError, ValueError) as exc:  # a full disk must not fail requests
            log.warning("traffic recording failed: %s", exc)

    def close(self) -> None:
        self._out.close()

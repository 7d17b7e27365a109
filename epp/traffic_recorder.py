"""Recording the gateway's traffic so `epp replay --format recorded` can replay it.

Off by default: prompts are user data. With recording on, every finished request becomes
one JSONL row (arrival time, model, API, token counts); with `include_content` the prompt
itself (token ids, messages or text) is kept too, which is what lets a replay reproduce
prefix sharing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from ..framework.lifecycle import FlowRequest, OutcomeObserver, RoutedObserver
from ..framework.types import Outcome
from .flowcontrol.objectives import OBJECTIVE_HEADER, SLO_TTFT_HEADER

log = logging.getLogger(__name__)

RECORDED_VERSION = 1


def _slo_ms(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


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
    objective: str | None = None,
    slo_ttft_ms: float | None = None,
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
    if objective:
        row["objective"] = objective
    if slo_ttft_ms is not None:
        row["slo_ttft_ms"] = slo_ttft_ms
    if prompt_token_ids is not None:
        row["prompt_token_ids"] = list(prompt_token_ids)
    elif messages is not None:
        row["messages"] = messages
    elif prompt is not None:
        row["prompt"] = prompt
    return json.dumps(row, separators=(",", ":"))


class TrafficRecorder(RoutedObserver, OutcomeObserver):
    """A request-flow hook that writes one recorded-traffic row per finished request.

    Timestamps are seconds since the first request was routed, so a recording replays
    from 0. Rows are written when responses end (in completion order); the replay sorts
    by timestamp. What a row needs from routing time (the arrival, the token ids) is kept
    on the request's own flow state, so the recorder holds no table of its own.
    """

    def __init__(
        self,
        out: IO[str],
        *,
        include_content: bool = False,
    ) -> None:
        self._out = out
        self._include_content = include_content
        self._epoch: float | None = None

    @classmethod
    def to_file(cls, path: Path, **kwargs: Any) -> TrafficRecorder:
        return cls(path.open("a", encoding="utf-8", buffering=1), **kwargs)

    def on_routed(self, flow: FlowRequest) -> None:
        if self._epoch is None:
            self._epoch = flow.routed_at
        if self._include_content and flow.decision is not None:
            # The token ids the scheduler computed are dropped once routing is done.
            flow.request.prompt_token_ids = flow.decision.prompt_token_ids

    def on_outcome(self, flow: FlowRequest, outcome: Outcome) -> None:
        if not outcome.ok or self._epoch is None:
            return
        request = flow.request
        usage = outcome.usage
        at = flow.routed_at - self._epoch
        prompt_tokens = usage.prompt_tokens if usage else request.estimated_prompt_tokens()
        output_tokens = usage.completion_tokens if usage else (request.max_tokens or 0)
        content: dict[str, Any] = {}
        if self._include_content:  # recorded_line keeps the first of these that is set
            content = {
                "prompt_token_ids": request.prompt_token_ids,
                "messages": request.messages,
                "prompt": request.prompt,
            }
        try:
            self._out.write(
                recorded_line(
                    at, request.model, prompt_tokens, output_tokens, api=str(request.api),
                    objective=request.headers.get(OBJECTIVE_HEADER),
                    slo_ttft_ms=_slo_ms(request.headers.get(SLO_TTFT_HEADER)),
                    **content,
                ) + "\n"
            )  # fmt: skip
        except (OSError, ValueError) as exc:  # a full disk must not fail requests
            log.warning("traffic recording failed: %s", exc)

    def close(self) -> None:
        self._out.close()

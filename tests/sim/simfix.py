"""Readers for the real vLLM captures in tests/fixtures/vllm, shaped for simulator tests."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.paths import VLLM_FIXTURES


@dataclass(frozen=True)
class CapturedRequest:
    idx: int
    name: str
    endpoint: str
    body: dict[str, Any]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    lora_name: str | None
    lora_path: str | None
    t_send: float
    instance: int
    response: dict[str, Any] | None  # the full JSON answer of a non-streaming request


def _outputs(r: dict[str, Any]) -> list[int]:
    if "response" in r:
        return list(r["response"]["choices"][0].get("token_ids") or [])
    out: list[int] = []
    for data in r["sse_data"]:
        if data == "[DONE]":
            continue
        for choice in json.loads(data)["choices"]:
            out += choice.get("token_ids") or []
    return out


def captured_requests(scenario: str) -> list[CapturedRequest]:
    """Every request of a scenario, in send order."""
    rows = [json.loads(line) for line in (VLLM_FIXTURES / scenario / "requests.jsonl").open()]
    rows.sort(key=lambda r: r["idx"])
    return [
        CapturedRequest(
            idx=r["idx"],
            name=r["name"],
            endpoint=r["endpoint"],
            body=r["request"],
            prompt_token_ids=r["prompt_token_ids"],
            output_token_ids=_outputs(r),
            lora_name=r.get("lora_name"),
            lora_path=r.get("lora_path"),
            t_send=r["t_send"],
            instance=r.get("instance", 1),
            response=r.get("response"),
        )
        for r in rows
    ]


def decoded_batches(scenario: str) -> list[dict[str, Any]]:
    path = VLLM_FIXTURES / scenario / "events.decoded.jsonl"
    return [json.loads(line) for line in path.open()]


def raw_frames(scenario: str) -> list[list[bytes]]:
    path = VLLM_FIXTURES / scenario / "events.raw.jsonl"
    return [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in path.open()]


def scenario_file(scenario: str, name: str) -> Path:
    return VLLM_FIXTURES / scenario / name

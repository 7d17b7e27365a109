"""Readers for the real vLLM captures under tests/fixtures/vllm."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from support.paths import VLLM_FIXTURES

SCENARIOS = ("basic", "eviction", "lora", "restart", "cbor")
CAPTURE_POD = "127.0.0.1:8100"
CAPTURE_MODEL = "tiny"
CAPTURE_BLOCK_SIZE = 32


@dataclass(frozen=True)
class Frame:
    instance: int
    topic: bytes
    seq: int
    payload: bytes


@dataclass(frozen=True)
class CapturedRequest:
    name: str
    instance: int
    adapter: str | None
    tokens: list[int]  # prompt ids + generated ids, in order

    def cached_tokens(self) -> list[int]:
        # The last generated token never had its KV computed, so its block is not stored.
        return self.tokens[:-1]


def frames(scenario: str) -> list[Frame]:
    out = []
    with open(VLLM_FIXTURES / scenario / "events.raw.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            topic, seq, payload = (base64.b64decode(f) for f in row["frames_b64"])
            assert int.from_bytes(seq, "big") == row["seq"]
            out.append(Frame(row["instance"], topic, row["seq"], payload))
    return out


def decoded(scenario: str) -> list[dict]:
    with open(VLLM_FIXTURES / scenario / "events.decoded.jsonl") as fh:
        return [json.loads(line) for line in fh]


def _output_ids(row: dict) -> list[int]:
    if "response" in row:
        return list(row["response"]["choices"][0]["token_ids"] or [])
    ids: list[int] = []
    for data in row["sse_data"]:
        if data == "[DONE]":
            continue
        for choice in json.loads(data).get("choices", []):
            ids.extend(choice.get("token_ids") or [])
    return ids


def requests(scenario: str) -> list[CapturedRequest]:
    out = []
    with open(VLLM_FIXTURES / scenario / "requests.jsonl") as fh:
        for line in fh:
            row = json.loads(line)
            out.append(
                CapturedRequest(
                    name=row["name"],
                    instance=row.get("instance", 1),
                    adapter=row.get("lora_name"),
                    tokens=list(row["prompt_token_ids"]) + _output_ids(row),
                )
            )
    return out

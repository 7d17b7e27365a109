"""Timing requests against a live OpenAI-compatible vLLM pod (or `epp sim`) over HTTP.

Prompts are token-id lists (vLLM's completions API takes them), so their lengths are exact
and each one is unique: ids are drawn from a seeded generator over a range every
tokenizer has, and a cold prompt shares no full block with any earlier one.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ..replay.live import StreamTiming, read_stream

# Token ids below 10 are control tokens in small vocabularies; 500 fits the tiny test model.
_TOKEN_LO, _TOKEN_HI = 10, 500
_JSON = {"Content-Type": "application/json"}


class ProbeError(RuntimeError):
    """The target did not answer as a vLLM pod does."""


@dataclass(frozen=True, slots=True)
class PodInfo:
    model: str
    max_model_len: int
    kv_tokens: int
    block_size: int


class Prompts:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def make(self, n: int) -> list[int]:
        return [self._rng.randrange(_TOKEN_LO, _TOKEN_HI) for _ in range(n)]


class Probe:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str = "") -> None:
        self.session = session
        self.base = base_url.rstrip("/")
        self.model = model

    async def pod_info(self) -> PodInfo:
        async with self.session.get(f"{self.base}/v1/models") as resp:
            if resp.status != 200:
                raise ProbeError(f"GET /v1/models answered {resp.status}")
            cards = (await resp.json()).get("data") or []
        card = next((c for c in cards if not self.model or c.get("id") == self.model), None)
        if card is None:
            names = ", ".join(str(c.get("id")) for c in cards) or "none"
            raise ProbeError(f"model {self.model!r} not served (served: {names})")
        self.model = str(card["id"])
        if not card.get("max_model_len"):
            raise ProbeError("/v1/models gives no max_model_len")
        async with self.session.get(f"{self.base}/metrics") as resp:
            text = await resp.text()
        labels = _cache_config(text)
        try:
            block_size = int(labels["block_size"])
            blocks = int(labels["num_gpu_blocks"])
        except (KeyError, ValueError):
            raise ProbeError("/metrics has no vllm:cache_config_info with num_gpu_blocks") from None
        return PodInfo(self.model, int(card["max_model_len"]), blocks * block_size, block_size)

    async def round_trip_floor(self, n: int = 7) -> float:
        """Median time of a request the server answers without the engine (GET /health)."""
        times = []
        for _ in range(n):
            started = time.perf_counter()
            async with self.session.get(f"{self.base}/health") as resp:
                await resp.read()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    async def reset_prefix_cache(self) -> bool:
        """vLLM exposes it only in dev mode; False when the pod refuses."""
        async with self.session.post(f"{self.base}/reset_prefix_cache") as resp:
            await resp.read()
            return resp.status == 200

    async def stream(self, prompt: list[int], max_tokens: int) -> StreamTiming:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        data = json.dumps(body).encode()  # encoded before the clock starts
        started = time.perf_counter()
        async with self.session.post(
            f"{self.base}/v1/completions", data=data, headers=_JSON
        ) as resp:
            if resp.status != 200:
                raise ProbeError(f"completion answered {resp.status}: {await resp.text()}")
            # A token can decode to no text (small vocabularies): every chunk with a choice
            # counts; asking for token ids instead would echo the whole prompt back.
            timing = await read_stream(resp, started, every_choice=True)
        if timing.ttft_s is None:
            raise ProbeError("a completion streamed no token")
        return timing


def cached_tokens(timing: StreamTiming) -> int | None:
    details = (timing.usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


def _cache_config(text: str) -> dict[str, str]:
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                return dict(sample.labels)
    return {}

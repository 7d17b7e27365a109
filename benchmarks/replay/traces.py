"""Workloads to replay: Mooncake JSONL, ShareGPT, synthetic shared-prefix and recorded traffic.

Every loader returns a list of `TraceRequest`s. Prompts are kept as shared segments
(token arrays reused by every request that shares them) and only joined into one token
list when a request is actually sent, so a 4,000-request Mooncake trace with 15k-token
prompts fits in a few tens of MB.
"""

from __future__ import annotations

import json
import random
import re
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import xxhash
import yaml

TraceFormat = Literal["mooncake", "sharegpt", "shared-prefix", "recorded"]
TRACE_FORMATS: tuple[str, ...] = get_args(TraceFormat)

DEFAULT_MODEL = "model"
MOONCAKE_BLOCK_TOKENS = 512
# Token ids stay inside a typical Llama-sized vocabulary and away from the special ids at 0.
VOCAB_LOW, VOCAB_HIGH = 1_000, 32_000


class TraceError(ValueError):
    """A trace file that cannot be read; the message says which line and why."""


@dataclass(slots=True)
class TraceRequest:
    """One request of a workload, independent of how it will be sent."""

    index: int
    timestamp_s: float  # on the trace's own clock (0 = first request)
    output_tokens: int
    segments: tuple[Sequence[int], ...]  # prompt = concatenation of these token runs
    model: str = DEFAULT_MODEL
    group: str | None = None  # shared-prefix group / conversation, for reporting
    messages: list[dict[str, Any]] | None = None  # chat text, when the source had text
    prompt_text: str | None = None  # completion text, when the source had text
    input_tokens: int = field(default=0)
    objective: str | None = None  # the InferenceObjective it names, when known
    slo_ttft_s: float | None = None  # its TTFT SLO, when it has one

    def __post_init__(self) -> None:
        if not self.input_tokens:
            self.input_tokens = sum(len(s) for s in self.segments)

    def token_ids(self) -> list[int]:
        return list(chain.from_iterable(self.segments))

    def text(self) -> str:
        """A text prompt for live mode: the source text, or one word per token id."""
        if self.prompt_text is not None:
            return self.prompt_text
        return tokens_to_text(self.token_ids())


# ---------------------------------------------------------------------------------------
# Deterministic token material


def _seeded_tokens(key: str, n: int) -> array[int]:
    """`n` token ids determined only by `key`: equal keys give equal tokens."""
    rng = np.random.default_rng(xxhash.xxh64_intdigest(key.encode()))
    out = array("i")
    out.frombytes(rng.integers(VOCAB_LOW, VOCAB_HIGH, size=n, dtype=np.int32).tobytes())
    return out


_SYLLABLES = (
    "ka", "ri", "to", "na", "mu", "se", "lo", "pi", "an", "be", "du", "fe", "gi", "ho", "ju",
    "ke", "la", "me", "no", "po", "qu", "ra", "si", "ti", "vu", "wa", "xe", "yo", "za", "ce",
)  # fmt: skip


def token_word(token_id: int) -> str:
    """A pronounceable word unique to `token_id` (base-30 syllables)."""
    n = len(_SYLLABLES)
    parts = []
    t = token_id
    while True:
        parts.append(_SYLLABLES[t % n])
        t //= n
        if t == 0:
            break
    return "".join(parts)


def tokens_to_text(token_ids: Iterable[int]) -> str:
    return " ".join(token_word(t) for t in token_ids)


_WORD_RE = re.compile(r"\w+|[^\w\s]")


def text_to_tokens(text: str) -> list[int]:
    """A stable word-level tokenisation for text sources in sim mode (no model vocabulary
    is needed to compare routing policies, only that equal prefixes give equal ids)."""
    span = VOCAB_HIGH - VOCAB_LOW
    return [VOCAB_LOW + xxhash.xxh32_intdigest(w.encode()) % span for w in _WORD_RE.findall(text)]


# ---------------------------------------------------------------------------------------
# Mooncake


class MooncakeBlocks:
    """Maps Mooncake block ids to 512-token runs; the same id always gives the same run."""

    def __init__(self, salt: str = "mooncake") -> None:
        self._salt = salt
        self._cache: dict[int, array[int]] = {}

    def block(self, block_id: int) -> array[int]:
        run = self._cache.get(block_id)
        if run is None:
            run = _seeded_tokens(f"{self._salt}:{block_id}", MOONCAKE_BLOCK_TOKENS)
            self._cache[block_id] = run
        return run


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, row


def _int_field(row: dict[str, Any], name: str, where: str, minimum: int = 0) -> int:
    value = row.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{where}: `{name}` must be an integer >= {minimum}, got {value!r}")
    return value


def load_mooncake(
    path: Path, limit: int | None = None, model: str = DEFAULT_MODEL
) -> list[TraceRequest]:
    """Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.

    Block id i stands for 512 tokens; the last block is cut to the input length. A prompt
    longer than its blocks is completed with tokens unique to that request.
    """
    blocks = MooncakeBlocks()
    out: list[TraceRequest] = []
    for lineno, row in _read_jsonl(path):
        where = f"{path}:{lineno}"
        ts_ms = row.get("timestamp")
        if not isinstance(ts_ms, int | float) or ts_ms < 0:
            raise TraceError(f"{where}: `timestamp` must be a non-negative number of ms")
        input_len = _int_field(row, "input_length", where, 1)
        output_len = _int_field(row, "output_length", where, 1)
        hash_ids = row.get("hash_ids")
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
        ):
            raise TraceError(f"{where}: `hash_ids` must be a list of integers")
        segments: list[Sequence[int]] = []
        remaining = input_len
        for block_id in hash_ids:
            if remaining <= 0:
                break
            run = blocks.block(block_id)
            segments.append(run if remaining >= len(run) else run[:remaining])
            remaining -= len(run)
        if remaining > 0:
            segments.append(_seeded_tokens(f"mooncake-tail:{len(out)}", remaining))
        out.append(
            TraceRequest(
                index=len(out),
                timestamp_s=ts_ms / 1000.0,
                output_tokens=output_len,
                segments=tuple(segments),
                model=model,
                input_tokens=input_len,
            )
        )
        if limit is not None and len(out) >= limit:
            break
    _rebase_timestamps(out)
    return out


def _rebase_timestamps(requests: list[TraceRequest]) -> None:
    if requests:
        t0 = min(r.timestamp_s for r in requests)
        for r in requests:
            r.timestamp_s -= t0


# ---------------------------------------------------------------------------------------
# ShareGPT


_ROLE_BY_SPEAKER = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def load_sharegpt(
    path: Path, limit: int | None = None, model: str = DEFAULT_MODEL, max_turns: int = 8
) -> list[TraceRequest]:
    """ShareGPT JSON: a list of `{"conversations": [{"from": "human"|"gpt", "value"}]}`.

    Every user turn becomes one chat request carrying the conversation so far (so later
    turns share earlier turns as a prefix); the assistant reply's length is the output.
    The file has no timestamps: arrivals come from --qps (all timestamps are 0).
    """
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: not JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise TraceError(f"{path}: expected a JSON list of conversations")
    out: list[TraceRequest] = []
    for conv_no, conv in enumerate(data):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            raise TraceError(f"{path}: conversation {conv_no} has no `conversations` list")
        history: list[dict[str, Any]] = []
        conv_id = str(conv.get("id", conv_no))
        for turn_no, turn in enumerate(turns[: 2 * max_turns]):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise TraceError(f"{path}: conversation {conv_no} turn {turn_no} is malformed")
            role = _ROLE_BY_SPEAKER.get(str(turn.get("from")))
            if role is None:
                continue  # system notes and unknown speakers carry no request
            if role == "assistant" and history and history[-1]["role"] == "user":
                messages = list(history)
                prompt_tokens = text_to_tokens(_chat_text(messages))
                out.append(
                    TraceRequest(
                        index=len(out),
                        timestamp_s=0.0,
                        output_tokens=max(1, len(text_to_tokens(turn["value"]))),
                        segments=(array("i", prompt_tokens or [VOCAB_LOW]),),
                        model=model,
                        group=conv_id,
                        messages=messages,
                    )
                )
                if limit is not None and len(out) >= limit:
                    return out
            history.append({"role": role, "content": turn["value"]})
    return out


def _chat_text(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<{m['role']}> {m['content']} " for m in messages)


# ---------------------------------------------------------------------------------------
# Synthetic shared prefix (inference-perf's `shared_prefix` data generator)


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    num_groups: int = 10
    num_prompts_per_group: int = 10
    system_prompt_len: int = 1000
    question_len: int = 100
    output_len: int = 100
    multi_turn: bool = False
    turns: int = 1  # rounds per prompt when multi_turn (each round carries the history)

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> SharedPrefixSpec:
        # Accept inference-perf's nesting: data: {type: shared_prefix, shared_prefix: {...}}.
        if "data" in raw and isinstance(raw["data"], dict):
            raw = raw["data"]
        if "shared_prefix" in raw and isinstance(raw["shared_prefix"], dict):
            raw = raw["shared_prefix"]
        known = {f for f in cls.__dataclass_fields__}
        renamed = {"enable_multi_turn_chat": "multi_turn"}
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            key = renamed.get(key, key)
            if key in known:
                kwargs[key] = value
        spec = cls(**kwargs)
        for name in ("num_groups", "num_prompts_per_group", "system_prompt_len", "output_len"):
            if not isinstance(getattr(spec, name), int) or getattr(spec, name) < 1:
                raise TraceError(f"shared-prefix `{name}` must be a positive integer")
        if spec.multi_turn and spec.turns < 2:
            return cls(**{**kwargs, "turns": 3})
        return spec


def generate_shared_prefix(
    spec: SharedPrefixSpec, seed: int = 0, model: str = DEFAULT_MODEL, shuffle: bool = True
) -> list[TraceRequest]:
    """`num_groups` system prompts, each followed by `num_prompts_per_group` questions.

    With multi_turn, each prompt is a conversation of `turns` rounds; round k repeats the
    earlier questions and answers, so it shares them as a prefix. Requests are shuffled
    (seeded) the way inference-perf samples them, but a conversation's rounds keep order.
    """
    rounds = spec.turns if spec.multi_turn else 1
    per_prompt: list[list[TraceRequest]] = []
    for g in range(spec.num_groups):
        system = _seeded_tokens(f"sp:{seed}:sys:{g}", spec.system_prompt_len)
        for p in range(spec.num_prompts_per_group):
            history: list[Sequence[int]] = [system]
            convo: list[TraceRequest] = []
            for k in range(rounds):
                question = _seeded_tokens(f"sp:{seed}:q:{g}:{p}:{k}", spec.question_len)
                history.append(question)
                convo.append(
                    TraceRequest(
                        index=0,
                        timestamp_s=0.0,
                        output_tokens=spec.output_len,
                        segments=tuple(history),
                        model=model,
                        group=f"group-{g}",
                    )
                )
                history.append(_seeded_tokens(f"sp:{seed}:a:{g}:{p}:{k}", spec.output_len))
            per_prompt.append(convo)
    order = list(range(len(per_prompt)))
    if shuffle:
        random.Random(seed).shuffle(order)
    out: list[TraceRequest] = []
    # Round-major: all first rounds (shuffled), then all second rounds, ...
    for k in range(rounds):
        for i in order:
            req = per_prompt[i][k]
            req.index = len(out)
            out.append(req)
    return out


def load_shared_prefix(
    path: Path, limit: int | None = None, seed: int = 0, model: str = DEFAULT_MODEL
) -> list[TraceRequest]:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise TraceError(f"{path}: not YAML/JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise TraceError(f"{path}: expected a mapping of shared-prefix parameters")
    out = generate_shared_prefix(SharedPrefixSpec.from_mapping(raw), seed=seed, model=model)
    return out[:limit] if limit is not None else out


# ---------------------------------------------------------------------------------------
# Recorded traffic (what `epp serve` can write when asked to)


def load_recorded(path: Path, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for lineno, row in _read_jsonl(path):
        where = f"{path}:{lineno}"
        ts = row.get("timestamp")
        if not isinstance(ts, int | float):
            raise TraceError(f"{where}: `timestamp` must be a number of seconds")
        model = row.get("model")
        if not isinstance(model, str) or not model:
            raise TraceError(f"{where}: `model` must be a non-empty string")
        prompt_tokens = _int_field(row, "prompt_tokens", where, 1)
        output_tokens = _int_field(row, "output_tokens", where, 1)
        messages = row.get("messages")
        prompt = row.get("prompt")
        ids = row.get("prompt_token_ids")
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            tokens: Sequence[int] = array("i", ids)
        elif isinstance(messages, list):
            tokens = array("i", text_to_tokens(_chat_text(messages)))
        elif isinstance(prompt, str):
            tokens = array("i", text_to_tokens(prompt))
        else:
            tokens = _seeded_tokens(f"recorded:{lineno}", prompt_tokens)
        objective = row.get("objective")
        slo_ms = row.get("slo_ttft_ms")
        out.append(
            TraceRequest(
                index=len(out),
                timestamp_s=float(ts),
                output_tokens=output_tokens,
                segments=(tokens,),
                model=model,
                messages=messages if isinstance(messages, list) else None,
                prompt_text=prompt if isinstance(prompt, str) else None,
                objective=objective if isinstance(objective, str) and objective else None,
                slo_ttft_s=slo_ms / 1000.0 if isinstance(slo_ms, int | float) else None,
            )
        )
        if limit is not None and len(out) >= limit:
            break
    _rebase_timestamps(out)
    return out


# ---------------------------------------------------------------------------------------
# Format detection and the single entry point


def detect_format(path: Path) -> TraceFormat:
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return "shared-prefix"
    with path.open() as f:
        head = f.read(4096).lstrip()
        if head.startswith("["):
            return "sharegpt"  # one JSON document, possibly a single huge line
        # A JSON-lines row holding prompt token ids runs past any fixed prefix: read it whole.
        f.seek(0)
        first = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        row = None
    if isinstance(row, dict):
        if "hash_ids" in row:
            return "mooncake"
        if "prompt_tokens" in row:
            return "recorded"
        if "num_groups" in row or "data" in row or "shared_prefix" in row:
            return "shared-prefix"
    raise TraceError(f"{path}: cannot tell the trace format; pass --format")


def load_trace(
    path: Path,
    fmt: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
) -> list[TraceRequest]:
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    fmt = fmt or detect_format(path)
    if fmt == "mooncake":
        return load_mooncake(path, limit, model)
    if fmt == "sharegpt":
        return load_sharegpt(path, limit, model)
    if fmt == "shared-prefix":
        return load_shared_prefix(path, limit, seed, model)
    if fmt == "recorded":
        return load_recorded(path, limit)
    raise TraceError(f"unknown trace format {fmt!r} (one of {', '.join(TRACE_FORMATS)})")


def infinite_cache_hit_rate(requests: Iterable[TraceRequest], block_size: int) -> float:
    """The prefix hit rate of one pod with an unbounded cache that saw every request:
    the ceiling no routing policy can beat. Counts whole blocks, like vLLM."""
    seen: set[int] = set()
    hit = total = 0
    for req in requests:
        tokens = array("i", req.token_ids())
        total += len(tokens)
        parent = 0
        prefix_alive = True
        for start in range(0, len(tokens) - block_size + 1, block_size):
            key = xxhash.xxh64_intdigest(tokens[start : start + block_size].tobytes(), parent)
            parent = key
            if prefix_alive and key in seen:
                hit += block_size
            else:
                prefix_alive = False
                seen.add(key)
    return hit / total if total else 0.0

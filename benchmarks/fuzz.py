"""Property-based fuzz of the two parsers that read untrusted bytes.

- The request parser (`parse_request`): every input must end as a parsed request or a
  RequestError with a 4xx status and an OpenAI-shaped JSON body. Anything else (any other
  exception, a 5xx) is a crash: the gateway would answer it 500 with a traceback.
- The KV-event path (`decode_batch` then `IngestState.apply`): every frame must decode or
  raise DecodeError, and every decoded batch must apply without raising.

Hypothesis draws the seeds: OpenAI-shaped bodies with hostile values (deep nesting, huge
and negative integers, wrong types), raw bytes, well-formed event batches with hostile
fields. Each seed is checked as drawn and then with `--mutations` cheap byte-level
mutations (cut, flipped, a bracket or quote inserted, a slice repeated), which is where
most of the case count comes from: drawing one structured seed costs milliseconds,
checking a case microseconds. The CI tests (tests/gateway/test_gateway_fuzz.py and
tests/kv_index/test_kvindex_fuzz.py) run a few hundred seeds; this benchmark the full count:

    python -m smart_epp.benchmarks.fuzz [--parser-cases 100000] [--kv-cases 100000]

Writes benchmarks/results/fuzz.json (cases run and crashes found, per target).
"""

from __future__ import annotations

import argparse
import json
import random
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from smart_epp.epp.errors import RequestError
from smart_epp.epp.request_limits import DEFAULT_ALLOWED_PATHS
from smart_epp.epp.request_parser import parse_request
from smart_epp.kv_index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    decode_batch,
    encode_batch,
    encode_batch_positional,
)
from smart_epp.kv_index.ingest import IngestState

RESULTS = Path(__file__).resolve().parent / "results" / "fuzz.json"

# ----------------------------------------------------------------- request bodies

_scalars = (
    st.none()
    | st.booleans()
    # The widest integers msgpack carries; JSON ones beyond come from the fields below.
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=15,
)
_token_ids = st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=20)
_prompts = st.one_of(
    st.text(max_size=30),
    st.lists(st.text(max_size=10), max_size=4),
    _token_ids,
    st.lists(_token_ids, max_size=3),
    json_values,
)
_content = st.one_of(
    st.text(max_size=20),
    st.lists(
        st.dictionaries(st.sampled_from(["type", "text", "image_url"]), json_values), max_size=3
    ),
    json_values,
)
_messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "system", "assistant"]) | json_values,
            "content": _content,
        },
    )
    | json_values,
    max_size=4,
)
_openai_fields = {
    "model": st.sampled_from(["tiny", ""]) | json_values,
    "prompt": _prompts,
    "input": _prompts,
    "messages": _messages,
    "stream": st.booleans() | json_values,
    "max_tokens": st.integers(min_value=-5, max_value=2**70) | json_values,
    "cache_salt": st.text(max_size=5) | json_values,
    "instructions": st.text(max_size=5) | json_values,
}
_documents = st.fixed_dictionaries({}, optional=_openai_fields) | json_values


@st.composite
def _deep(draw: st.DrawFn) -> bytes:
    """Bodies nested far past any limit, as arrays, objects or a mix, valid JSON or cut."""
    depth = draw(st.integers(min_value=1, max_value=5000))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    body = b'{"model":"tiny","prompt":' + opener * depth + b"1" + closer * depth + b"}"
    cut = draw(st.booleans())
    return body[: draw(st.integers(0, len(body)))] if cut else body


def _encode(document: Any) -> bytes:
    return msgspec.json.encode(document)


request_bodies = st.one_of(
    _documents.map(_encode),
    _deep(),
    st.binary(max_size=64),
)
request_paths = (
    st.sampled_from([*DEFAULT_ALLOWED_PATHS, "/v1/completions?x=1", "/v1/chat/completions/"])
    | st.sampled_from(
        ["/reset_prefix_cache", "/metrics", "/", "/v1/../metrics", "//v1/completions"]
    )
    | st.text(max_size=20)
)


def request_input(path: str, body: bytes) -> bytes:
    """One fuzz input: the path, a newline, the body (so mutations reach both)."""
    return path.encode("utf-8", "surrogatepass") + b"\n" + body


request_inputs = st.builds(request_input, request_paths, request_bodies)


def check_request_input(data: bytes) -> None:
    path, _, body = data.partition(b"\n")
    check_request(path.decode("utf-8", "replace"), body)


def check_request(path: str, body: bytes) -> None:
    """Raises AssertionError (or the escaping exception) when the parser crashed."""
    try:
        request = parse_request(path, {"x-session-id": "s"}, body, "fuzz")
    except RequestError as error:
        assert 400 <= error.status < 500, f"status {error.status}"
        shaped = json.loads(error.body())["error"]
        assert shaped["code"] == error.status and shaped["message"]
        return
    # What the scheduler reads from every request must be readable too.
    request.text_for_hashing()
    request.estimated_prompt_tokens()


# ----------------------------------------------------------------- KV event frames

_hashes = st.integers(min_value=0, max_value=2**64 - 1) | st.binary(max_size=9)
_event_token_ids = st.lists(
    st.integers(min_value=0, max_value=40) | st.integers(min_value=-(2**63), max_value=2**64 - 1),
    max_size=40,
)
_stored = st.builds(
    BlockStored,
    block_hashes=st.lists(_hashes, max_size=4),
    parent_block_hash=st.none() | _hashes,
    token_ids=_event_token_ids,
    block_size=st.sampled_from([0, 1, 4, 16])
    | st.integers(min_value=-(2**63), max_value=2**63 - 1),
    lora_id=st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1),
    medium=st.none() | st.sampled_from(["GPU", "CPU", "gpu", ""]) | st.text(max_size=4),
    lora_name=st.none() | st.text(max_size=6),
    extra_keys=st.none() | st.lists(json_values, max_size=3),
)
_removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(_hashes, max_size=4),
    medium=st.none() | st.sampled_from(["GPU", "CPU"]),
)
_batches = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=True, allow_infinity=True),
    events=st.lists(_stored | _removed | st.just(AllBlocksCleared()), max_size=6),
    data_parallel_rank=st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1),
)


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    """A well-formed batch with one byte changed, or cut short."""
    payload = draw(_batches.map(encode_batch))
    if not payload:
        return payload
    at = draw(st.integers(0, len(payload) - 1))
    if draw(st.booleans()):
        return payload[:at]
    return payload[:at] + bytes([draw(st.integers(0, 255))]) + payload[at + 1 :]


kv_frames = st.one_of(
    _batches.map(encode_batch),
    _batches.map(encode_batch_positional),
    _mutated(),
    json_values.map(msgspec.msgpack.encode),
    st.binary(max_size=64),
)


def check_kv_frame(payload: bytes, state: IngestState | None = None) -> None:
    """Raises when decoding or applying `payload` crashed (DecodeError is the clean refusal)."""
    try:
        batch, _skipped = decode_batch(payload)
    except DecodeError:
        return
    (state or IngestState()).apply("10.0.0.1:8000", batch, "tiny")


# ----------------------------------------------------------------- runner

_INSERTS = (b"[", b"{", b'"', b"\\", b"]", b"}", b",", b":", b"\xff", b"\x00", b"\xdc")


def mutations(data: bytes, rnd: random.Random, count: int) -> list[bytes]:
    """`count` variants of `data`: cut short, a byte flipped, a byte inserted, a slice repeated."""
    out: list[bytes] = []
    for _ in range(count):
        if not data:
            out.append(bytes([rnd.randrange(256)]))
            continue
        at = rnd.randrange(len(data))
        kind = rnd.randrange(4)
        if kind == 0:
            out.append(data[:at])
        elif kind == 1:
            out.append(data[:at] + bytes([rnd.randrange(256)]) + data[at + 1 :])
        elif kind == 2:
            out.append(data[:at] + rnd.choice(_INSERTS) + data[at:])
        else:
            end = min(len(data), at + rnd.randrange(1, 16))
            out.append(data[:end] + data[at:end] * rnd.randrange(1, 50) + data[end:])
    return out


def run_target(
    name: str,
    strategy: st.SearchStrategy[bytes],
    check: Callable[[bytes], None],
    cases: int,
    mutations_per_seed: int,
) -> dict[str, Any]:
    """Runs `check` on `cases` inputs (seeds and their mutations); crashes are collected,
    not raised, so one crash does not end the run."""
    crashes: list[str] = []
    ran = drawn = 0
    seeds = max(1, cases // (1 + mutations_per_seed))

    @settings(
        max_examples=seeds,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy, st.randoms(use_true_random=False))
    def case(seed: bytes, rnd: random.Random) -> None:
        nonlocal ran, drawn
        # Built before counting: hypothesis may abandon a seed while `rnd` draws from it.
        inputs = [seed, *mutations(seed, rnd, mutations_per_seed)]
        drawn += 1
        for data in inputs:
            ran += 1
            try:
                check(data)
            except Exception:
                crashes.append(f"{data!r:.300}\n{traceback.format_exc(limit=4)}")

    started = time.perf_counter()
    case()
    elapsed = time.perf_counter() - started
    print(f"{name}: {ran} cases ({drawn} drawn seeds) in {elapsed:.1f} s, {len(crashes)} crashes")
    for crash in crashes[:3]:
        print(crash)
    return {
        "cases": ran,
        "drawn_seeds": drawn,
        "crashes": len(crashes),
        "seconds": round(elapsed, 1),
        "examples": crashes[:5],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parser-cases", type=int, default=100_000)
    parser.add_argument("--kv-cases", type=int, default=100_000)
    parser.add_argument(
        "--mutations", type=int, default=19, help="mutated variants checked per drawn seed"
    )
    parser.add_argument("--no-write", action="store_true", help="do not write the results file")
    args = parser.parse_args(argv)
    state = IngestState()  # one pod's state across frames, as a live stream keeps it
    results = {
        "request_parser": run_target(
            "request parser",
            request_inputs,
            check_request_input,
            args.parser_cases,
            args.mutations,
        ),
        "kv_frames": run_target(
            "KV frames",
            kv_frames,
            lambda p: check_kv_frame(p, state),
            args.kv_cases,
            args.mutations,
        ),
    }
    if not args.no_write:
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if any(r["crashes"] for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())

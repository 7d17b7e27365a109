"""Reading `usage` from JSON and SSE responses chunk by chunk."""

from __future__ import annotations

import json

from smart_epp.epp.usage import MAX_JSON_BYTES, UsageReader
from smart_epp.framework.types import Usage

USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}


def feed(reader: UsageReader, data: bytes, size: int) -> Usage | None:
    for i in range(0, len(data), size):
        reader.feed(data[i : i + size])
    return reader.finish()


def test_json_body_split_anywhere() -> None:
    body = json.dumps({"id": "x", "choices": [{"text": "a" * 500}], "usage": USAGE}).encode()
    for size in (1, 7, 64, len(body)):
        assert feed(UsageReader("application/json"), body, size) == Usage(12, 3, 8)


def test_sse_last_usage_wins_and_lines_may_split() -> None:
    events = [
        {"choices": [{"text": "a"}], "usage": None},
        {"choices": [{"text": "b"}], "usage": {"prompt_tokens": 12, "completion_tokens": 1}},
        {"choices": [], "usage": USAGE},
    ]
    stream = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
    for size in (1, 5, 33, len(stream)):
        assert feed(UsageReader("text/event-stream; charset=utf-8"), stream, size) == Usage(
            12, 3, 8
        )


def test_responses_api_usage_names() -> None:
    body = {"response": {"usage": {"input_tokens": 4, "output_tokens": 2}}}
    stream = f"event: response.completed\ndata: {json.dumps(body)}\n\n".encode()
    assert feed(UsageReader("text/event-stream"), stream, 10) == Usage(4, 2, None)
    plain = json.dumps({"usage": {"input_tokens": 5, "output_tokens": 6}}).encode()
    assert feed(UsageReader("application/json"), plain, 3) == Usage(5, 6, None)


def test_garbage_and_missing_usage_give_none() -> None:
    assert feed(UsageReader("application/json"), b"{broken", 3) is None
    assert feed(UsageReader("application/json"), b'{"id": 1}', 3) is None
    assert feed(UsageReader("text/event-stream"), b'data: {"usage": [1]}\n\n', 4) is None
    assert feed(UsageReader("text/plain"), json.dumps({"usage": USAGE}).encode(), 4) is None


def test_oversized_json_is_not_kept() -> None:
    reader = UsageReader("application/json")
    reader.feed(b"[" + b" " * MAX_JSON_BYTES)
    reader.feed(json.dumps({"usage": USAGE}).encode())
    assert reader.finish() is None


def test_format_recognised_from_the_body_when_no_content_type() -> None:
    body = json.dumps({"usage": USAGE}).encode()
    assert feed(UsageReader(None), b"  \n" + body, 5) == Usage(12, 3, 8)
    stream = f"data: {json.dumps({'usage': USAGE})}\n\ndata: [DONE]\n\n".encode()
    assert feed(UsageReader(None), stream, 4) == Usage(12, 3, 8)
    assert feed(UsageReader(None), b"plain text usage", 4) is None

"""Reads the `usage` object out of OpenAI responses as their chunks pass by. Pure.

JSON responses are kept (up to a bound) and decoded once at the end, reading only
`usage`; SSE streams are scanned line by line, holding only the unfinished last line, and
only lines that mention "usage" are decoded (the last non-null one wins, which is the
final chunk with `stream_options.include_usage`).
"""

from __future__ import annotations

import msgspec

from ..framework.types import Usage


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # The Responses API names them input/output tokens.
    input_tokens: int | None = None
    output_tokens: int | None = None
    prompt_tokens_details: _Details | None = None
    input_tokens_details: _Details | None = None


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None
    # Responses API streaming: the final event carries {"response": {"usage": ...}}.
    response: _WithUsage | None = None


_decoder = msgspec.json.Decoder(_WithUsage)

# A JSON response larger than this is not kept for usage (it still passes unchanged).
MAX_JSON_BYTES = 8 * 1024 * 1024
_MARKER = b'"usage"'
_SNIFF_BYTES = 6


def _to_usage(raw: _WithUsage) -> Usage | None:
    u = raw.usage
    if u is None and raw.response is not None:
        u = raw.response.usage
    if u is None:
        return None
    details = u.prompt_tokens_details or u.input_tokens_details
    prompt = u.prompt_tokens if u.prompt_tokens is not None else u.input_tokens
    completion = u.completion_tokens if u.completion_tokens is not None else u.output_tokens
    return Usage(
        prompt_tokens=prompt or 0,
        completion_tokens=completion or 0,
        cached_tokens=details.cached_tokens if details is not None else None,
    )


def _decode(document: bytes | memoryview) -> Usage | None:
    try:
        return _to_usage(_decoder.decode(document))
    except msgspec.DecodeError:
        return None


class UsageReader:
    """Feed response chunks in order; `usage` holds the last usage seen."""

    __slots__ = ("_json_parts", "_json_size", "_pending", "_undecided", "sse", "usage")

    def __init__(self, content_type: str | None) -> None:
        """`content_type` None: recognise the format from the first bytes of the body."""
        self.usage: Usage | None = None
        self._pending = b""
        self._json_size = 0
        self._undecided = content_type is None
        self._set_format(content_type or "")

    def _set_format(self, content_type: str) -> None:
        self.sse = content_type.startswith("text/event-stream")
        self._json_parts: list[bytes] | None = (
            None if self.sse or "json" not in content_type else []
        )

    def _recognise(self, head: bytes) -> None:
        self._undecided = False
        if head.startswith((b"{", b"[")):
            self._set_format("application/json")
        elif head.startswith((b"data:", b"event:", b":", b"id:")):
            self._set_format("text/event-stream")

    def feed(self, chunk: bytes) -> None:
        if self._undecided:
            # Hold the first few bytes until they tell the format apart.
            chunk = self._pending + chunk
            if len(chunk.lstrip()) < _SNIFF_BYTES:
                self._pending = chunk
                return
            self._pending = b""
            self._recognise(chunk.lstrip())
        if self.sse:
            self._feed_sse(chunk)
        elif self._json_parts is not None:
            self._json_size += len(chunk)
            if self._json_size > MAX_JSON_BYTES:
                self._json_parts = None
            else:
                self._json_parts.append(chunk)

    def finish(self) -> Usage | None:
        if self._undecided and self._pending:
            held, self._pending = self._pending, b""
            self._recognise(held.lstrip())
            self.feed(held)
        if self.sse:
            if self._pending:
                self._scan_line(self._pending)
                self._pending = b""
        elif self._json_parts:
            parts = self._json_parts
            self._json_parts = None
            found = _decode(parts[0] if len(parts) == 1 else b"".join(parts))
            if found is not None:
                self.usage = found
        return self.usage

    def _feed_sse(self, chunk: bytes) -> None:
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._pending = data
            return
        self._pending = data[cut + 1 :]
        if _MARKER not in data:
            return
        for line in data[:cut].split(b"\n"):
            if _MARKER in line:
                self._scan_line(line)

    def _scan_line(self, line: bytes) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        found = _decode(line[5:].strip())
        if found is not None:
            self.usage = found

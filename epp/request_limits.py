"""What the gateway accepts before it reads a request: paths, JSON shape, token ids.

Pure checks, called by the request parser, so hostile input is refused with a clean 4xx
(OpenAI error shape) before any routing code sees it:
- only the inference paths a pod serves are forwarded; engine admin endpoints such as
  `/reset_prefix_cache`, `/metrics` or `/sleep` are answered 404 by the gateway itself;
- a body nested deeper, or holding more JSON values, than any OpenAI request needs is
  refused (400) instead of exhausting the stack or the CPU of every later step;
- prompt token ids must fit the 32-bit ids every tokenizer uses (the KV block keys pack
  them as unsigned 32-bit integers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import RequestError

# The OpenAI-compatible paths vLLM serves, plus its tokenizer endpoints. Everything else a
# vLLM pod answers (/metrics, /health, /reset_prefix_cache, /sleep, /load_lora_adapter,
# /collective_rpc, ...) is an operator's endpoint and must not be reachable by clients.
DEFAULT_ALLOWED_PATHS: tuple[str, ...] = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/models",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/score",
    "/v1/rerank",
    "/tokenize",
    "/detokenize",
)

# Chat requests with tools and structured content reach a depth of about 10; 64 leaves
# room for deep JSON schemas in `response_format` / tool parameters.
DEFAULT_MAX_DEPTH = 64
# Values (array items and object members) in one body: a 256k-token id prompt is 256k.
DEFAULT_MAX_ELEMENTS = 1_000_000
MAX_TOKEN_ID = (1 << 32) - 1


def normalize_path(path: str) -> str:
    """The path without its query string or trailing slash ("/" stays "/")."""
    bare = path.split("?", 1)[0]
    return bare.rstrip("/") or "/"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    # None: every path is accepted (library use, replays); the gateway always sets a list.
    allowed_paths: frozenset[str] | None = field(
        default_factory=lambda: frozenset(DEFAULT_ALLOWED_PATHS)
    )
    max_depth: int = DEFAULT_MAX_DEPTH
    max_elements: int = DEFAULT_MAX_ELEMENTS

    @classmethod
    def with_paths(cls, paths: tuple[str, ...] | list[str] | None) -> RequestLimits:
        if paths is None:
            return cls()
        return cls(allowed_paths=frozenset(normalize_path(p) for p in paths))

    def check_path(self, path: str) -> None:
        allowed = self.allowed_paths
        if allowed is not None and normalize_path(path) not in allowed:
            raise RequestError.not_found(f"no inference endpoint at {path.split('?', 1)[0]!r}")

    def too_deep(self) -> RequestError:
        return RequestError.bad_request(
            f"request body is nested more than {self.max_depth} levels deep"
        )

    def check_shape(self, document: Any) -> None:
        """Raises 400 when `document` is deeper or larger than the limits allow.

        Iterative, so the check itself cannot overflow the stack it protects.
        """
        max_depth = self.max_depth
        budget = self.max_elements
        stack: list[tuple[Any, int]] = [(document, 1)]
        pop, push = stack.pop, stack.append
        while stack:
            value, depth = pop()
            if depth > max_depth:
                raise self.too_deep()
            children = value.values() if type(value) is dict else value
            budget -= len(children)
            if budget < 0:
                raise RequestError.bad_request(
                    f"request body holds more than {self.max_elements} JSON values"
                )
            for child in children:
                kind = type(child)
                if kind is dict or kind is list:
                    push((child, depth + 1))


def check_token_ids(token_ids: list[int], param: str) -> None:
    # min/max run in C; a per-item range test in Python would cost more than the parse.
    if token_ids and (min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID):
        raise RequestError.bad_request(
            f"'{param}' token ids must be between 0 and {MAX_TOKEN_ID}", param
        )

"""Envoy's own error replies, rewritten in the OpenAI error shape (`local_reply_config`).

Each mapper names the condition Envoy reports (a response flag, a status, or the response
code details through a CEL filter), the status the client gets and a readable message.
The picker's own replies (400/404/413/429/503 from ext_proc) are already OpenAI-shaped and
match none of these, so they pass through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LocalReplyMapper:
    filter: dict[str, Any]  # an AccessLogFilter, as Envoy's YAML/JSON
    status: int
    message: str
    type: str = "service_unavailable"


def _flags(*flags: str) -> dict[str, Any]:
    return {"response_flag_filter": {"flags": list(flags)}}


def _cel(expression: str) -> dict[str, Any]:
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": "type.googleapis.com/"
                "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": expression,
            },
        }
    }


def _status(code: int) -> dict[str, Any]:
    return {
        "status_code_filter": {
            "comparison": {"op": "EQ", "value": {"default_value": code, "runtime_key": "_"}}
        }
    }


LOCAL_REPLY_MAPPERS: tuple[LocalReplyMapper, ...] = (
    LocalReplyMapper(
        # ext_proc could not reach the picker (fail-close), or the picker's stream broke.
        _cel("response.code_details.startsWith('ext_proc_error')"),
        503,
        "the endpoint picker is unavailable; retry shortly",
    ),
    LocalReplyMapper(
        _flags("UH", "NR"), 503, "no healthy endpoint in the inference pool to serve the request"
    ),
    LocalReplyMapper(
        _flags("UF", "URX", "UO"),
        503,
        "could not connect to any endpoint of the inference pool (the chosen pod and its "
        "fallbacks refused); retry shortly",
    ),
    LocalReplyMapper(
        _flags("UC", "UR"),
        502,
        "the model server closed the connection before answering",
        "bad_gateway",
    ),
    LocalReplyMapper(
        _cel("response.code_details == 'request_payload_too_large'"),
        413,
        "request body exceeds the gateway's buffer limit",
        "invalid_request_error",
    ),
    LocalReplyMapper(_status(426), 426, "HTTP/1.1 or later is required", "invalid_request_error"),
)

"""The protobuf boundary: builds and reads Envoy ext_proc messages.

This is the one module that imports generated Envoy messages. `read_event` turns each
message Envoy sends into a plain event record; the reply builders hand out opaque reply
objects the server writes back unchanged (`describe_reply` reads one back as plain data,
for tests and logs).

Responses that do not depend on the request (the "continue" replies of the response path,
the routing replies for a given destination) are built once and kept *serialized*: the
gRPC handler registered by `add_ext_proc_service` writes `bytes` as they are, so the hot
path neither builds nor serializes them again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, TypeAlias

import grpc
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
UPSTREAM_ADDRESS_ATTRIBUTE = "upstream.address"
RESPONSE_CODE_ATTRIBUTE = "response.code"
EXT_PROC_FILTER_NAME = "envoy.filters.http.ext_proc"

# Envoy's gRPC client copes with larger frames, but the Inference Extension settled on
# chunks below 64 KiB so each stays inside one HTTP/2 default window update.
STREAMED_CHUNK_BYTES = 62_000

# The generated messages are untyped: to mypy these aliases stand for `Any`.
ProcessingRequest: TypeAlias = ep.ProcessingRequest
ProcessingResponse: TypeAlias = ep.ProcessingResponse
# What the server writes: a response message, or one already serialized.
Reply: TypeAlias = ProcessingResponse | bytes


class BodyMode(IntEnum):
    """Mirror of envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode."""

    NONE = 0
    STREAMED = 1
    BUFFERED = 2
    BUFFERED_PARTIAL = 3
    FULL_DUPLEX_STREAMED = 4
    GRPC = 5


def _serialize(message: Reply) -> bytes:
    if type(message) is bytes:
        return message
    # An exact-type test does not narrow the union; what reaches here is a response message.
    serialized: bytes = message.SerializeToString()  # type: ignore[union-attr]
    return serialized


def add_ext_proc_service(
    server: grpc.aio.Server,
    process: Callable[[Any, grpc.aio.ServicerContext], Any],
) -> None:
    """Registers `process` as the bidirectional ExternalProcessor.Process handler."""
    handlers = {
        "Process": grpc.stream_stream_rpc_method_handler(
            process,
            request_deserializer=ep.ProcessingRequest.FromString,
            response_serializer=_serialize,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


# ---------------------------------------------------------------- constant replies

CONTINUE_REQUEST_HEADERS: bytes = ep.ProcessingResponse(
    request_headers=ep.HeadersResponse()
).SerializeToString()
CONTINUE_RESPONSE_HEADERS: bytes = ep.ProcessingResponse(
    response_headers=ep.HeadersResponse()
).SerializeToString()
CONTINUE_RESPONSE_BODY: bytes = ep.ProcessingResponse(
    response_body=ep.BodyResponse()
).SerializeToString()
CONTINUE_REQUEST_TRAILERS: bytes = ep.ProcessingResponse(
    request_trailers=ep.TrailersResponse()
).SerializeToString()
CONTINUE_RESPONSE_TRAILERS: bytes = ep.ProcessingResponse(
    response_trailers=ep.TrailersResponse()
).SerializeToString()

_OVERWRITE = core.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def _header_option(key: str, value: str) -> core.HeaderValueOption:
    return core.HeaderValueOption(
        header=core.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def _routing_common(destination: str, extra_headers: Sequence[tuple[str, str]]) -> Any:
    options = [_header_option(DESTINATION_HEADER, destination)]
    options.extend(_header_option(k, v) for k, v in extra_headers)
    # clear_route_cache: the route is chosen again now that the destination header exists,
    # which is how the gateway config tells routed requests from fail-open ones.
    return ep.CommonResponse(
        header_mutation=ep.HeaderMutation(set_headers=options), clear_route_cache=True
    )


def _lb_metadata(
    destination: str, response_headers: Sequence[tuple[str, str]] = ()
) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    fields = metadata.fields[LB_NAMESPACE].struct_value.fields
    fields[DESTINATION_HEADER].string_value = destination
    # Response headers travel as `envoy.lb` metadata: the gateway config's route copies
    # them onto the response (`%DYNAMIC_METADATA(envoy.lb:<name>)%`), which costs no
    # extra message per request.
    for name, value in response_headers:
        fields[name].string_value = value
    return metadata


def _headers_phase_reply(
    destination: str,
    extra_headers: Sequence[tuple[str, str]] = (),
    response_headers: Sequence[tuple[str, str]] = (),
) -> ProcessingResponse:
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=_routing_common(destination, extra_headers)),
        dynamic_metadata=_lb_metadata(destination, response_headers),
    )


def _body_phase_reply(
    destination: str,
    extra_headers: Sequence[tuple[str, str]] = (),
    response_headers: Sequence[tuple[str, str]] = (),
) -> ProcessingResponse:
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=_routing_common(destination, extra_headers)),
        dynamic_metadata=_lb_metadata(destination, response_headers),
    )


_ROUTING_CACHE_LIMIT = 4096
_headers_phase_cache: dict[str, bytes] = {}
_body_phase_cache: dict[str, bytes] = {}


def _route(
    cache: dict[str, bytes],
    build: Callable[..., ProcessingResponse],
    destination: str,
    extra_headers: Sequence[tuple[str, str]],
    response_headers: Sequence[tuple[str, str]] = (),
) -> Reply:
    # Replies that add headers (a generated request id) are unique to their request.
    if extra_headers or response_headers:
        return build(destination, extra_headers, response_headers)
    reply = cache.get(destination)
    if reply is None:
        if len(cache) >= _ROUTING_CACHE_LIMIT:
            cache.clear()  # pools churn rarely; a full reset keeps this bounded and simple
        reply = cache[destination] = build(destination).SerializeToString()
    return reply


def route_in_headers_phase(
    destination: str,
    extra_headers: Sequence[tuple[str, str]] = (),
    response_headers: Sequence[tuple[str, str]] = (),
) -> Reply:
    """The decision as the reply to the request headers (full-duplex, or bodiless requests)."""
    return _route(
        _headers_phase_cache, _headers_phase_reply, destination, extra_headers, response_headers
    )


def route_in_body_phase(
    destination: str,
    extra_headers: Sequence[tuple[str, str]] = (),
    response_headers: Sequence[tuple[str, str]] = (),
) -> Reply:
    """The decision as the reply to a buffered request body."""
    return _route(
        _body_phase_cache, _body_phase_reply, destination, extra_headers, response_headers
    )


def streamed_request_body(body: bytes, end_of_stream: bool = True) -> list[Reply]:
    """The held request body handed back in full-duplex mode, in chunks Envoy accepts."""
    return _streamed(body, end_of_stream, request=True)


def streamed_response_body(chunk: bytes, end_of_stream: bool) -> list[Reply]:
    """A response chunk passed back unchanged in full-duplex response mode."""
    return _streamed(chunk, end_of_stream, request=False)


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS = tuple(bytes((n,)) for n in range(0x80))


def _length_delimited_tag(message: Any, field: str) -> bytes:
    number = message.DESCRIPTOR.fields_by_name[field].number
    return _varint(number << 3 | 2)


# The path from ProcessingResponse down to StreamedBodyResponse.body, as wire tags. These
# replies carry the whole request body, so they are encoded directly: one copy of the
# body instead of building five nested messages and serializing them.
_TO_STREAMED = (
    _length_delimited_tag(ep.BodyResponse, "response"),
    _length_delimited_tag(ep.CommonResponse, "body_mutation"),
    _length_delimited_tag(ep.BodyMutation, "streamed_response"),
)
_REQUEST_BODY_TAG = _length_delimited_tag(ep.ProcessingResponse, "request_body")
_RESPONSE_BODY_TAG = _length_delimited_tag(ep.ProcessingResponse, "response_body")
_BODY_TAG = _length_delimited_tag(ep.StreamedBodyResponse, "body")
_END_OF_STREAM = (
    _varint(ep.StreamedBodyResponse.DESCRIPTOR.fields_by_name["end_of_stream"].number << 3)
    + b"\x01"
)


def _streamed_chunk(chunk: bytes | memoryview, last: bool, outer_tag: bytes) -> bytes:
    parts: list[bytes | memoryview] = []
    size = 0
    if chunk:  # proto3 leaves an empty field out
        parts += (_BODY_TAG, _varint(len(chunk)), chunk)
        size = len(_BODY_TAG) + len(parts[1]) + len(chunk)
    if last:
        parts.append(_END_OF_STREAM)
        size += len(_END_OF_STREAM)
    for tag in (*reversed(_TO_STREAMED), outer_tag):
        length = _varint(size)
        parts[:0] = (tag, length)
        size += len(tag) + len(length)
    return b"".join(parts)


def _streamed(body: bytes, end_of_stream: bool, *, request: bool) -> list[Reply]:
    tag = _REQUEST_BODY_TAG if request else _RESPONSE_BODY_TAG
    if len(body) <= STREAMED_CHUNK_BYTES:
        return [_streamed_chunk(body, end_of_stream, tag)]
    view = memoryview(body)
    starts = range(0, len(body), STREAMED_CHUNK_BYTES)
    last_start = starts[-1]
    return [
        _streamed_chunk(view[s : s + STREAMED_CHUNK_BYTES], end_of_stream and s == last_start, tag)
        for s in starts
    ]


_JSON_CONTENT_TYPE = [_header_option("content-type", "application/json")]


def immediate_response(
    status: int, body: bytes, details: str, request_id: str | None = None
) -> ProcessingResponse:
    """Ends the exchange with a local reply from Envoy (errors, shedding)."""
    headers = list(_JSON_CONTENT_TYPE)
    if request_id:
        headers.append(_header_option("x-request-id", request_id))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ep.HeaderMutation(set_headers=headers),
            body=body,
            details=details,
        )
    )


# ---------------------------------------------------------------- reading requests


def headers_of(http_headers: Any) -> dict[str, str]:
    """Header map of an HttpHeaders message; Envoy sends values in `raw_value` bytes."""
    headers: dict[str, str] = {}
    for header in http_headers.headers.headers:
        raw = header.raw_value  # each field read is a upb lookup: read it once
        headers[header.key] = raw.decode("latin-1") if raw else header.value
    return headers


def body_modes(message: ProcessingRequest) -> tuple[BodyMode, BodyMode] | None:
    """(request, response) body modes Envoy announced on this stream's first message."""
    if not message.HasField("protocol_config"):
        return None
    config = message.protocol_config
    return BodyMode(config.request_body_mode), BodyMode(config.response_body_mode)


def _string_values(value: struct_pb2.Value) -> list[str]:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    if kind == "list_value":
        out: list[str] = []
        for item in value.list_value.values:
            out.extend(_string_values(item))
        return out
    return []


def subset_hint(message: ProcessingRequest) -> list[str] | None:
    """Addresses the request must stay within, or None when no hint was given."""
    if not message.HasField("metadata_context"):
        return None
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    return _string_values(namespace.fields[SUBSET_KEY])


def response_code(message: ProcessingRequest) -> int | None:
    """The HTTP status from the `response.code` attribute, when the filter asks for it."""
    attributes = message.attributes.get(EXT_PROC_FILTER_NAME)
    if attributes is None or RESPONSE_CODE_ATTRIBUTE not in attributes.fields:
        return None
    value = attributes.fields[RESPONSE_CODE_ATTRIBUTE]
    if value.WhichOneof("kind") != "number_value":
        return None
    return int(value.number_value)


def served_endpoint(message: ProcessingRequest) -> str | None:
    """The endpoint that actually served the request, as the gateway reports it.

    Prefers the Inference Extension's `envoy.lb` / served key; plain Envoy instead sends
    the `upstream.address` attribute when the filter asks for it.
    """
    if message.HasField("metadata_context"):
        namespace = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
        if namespace is not None and SERVED_KEY in namespace.fields:
            values = _string_values(namespace.fields[SERVED_KEY])
            if values:
                return values[0]
    attributes = message.attributes.get(EXT_PROC_FILTER_NAME)
    if attributes is not None and UPSTREAM_ADDRESS_ATTRIBUTE in attributes.fields:
        value = attributes.fields[UPSTREAM_ADDRESS_ATTRIBUTE]
        if value.WhichOneof("kind") == "string_value":
            address: str = value.string_value
            if address:
                return address
    return None


# ---------------------------------------------------------------- plain events
# Plain (not frozen) slotted records: one is built per message on the hot path, and a
# frozen dataclass pays a setattr call per field to build.


@dataclass(slots=True)
class RequestHeaders:
    headers: dict[str, str]
    end_of_stream: bool
    subset: list[str] | None  # the subset hint, when the gateway sent one


@dataclass(slots=True)
class RequestBody:
    chunk: bytes
    end_of_stream: bool


@dataclass(slots=True)
class RequestTrailers:
    pass


@dataclass(slots=True)
class ResponseHeaders:
    headers: dict[str, str]
    end_of_stream: bool
    served: str | None  # the endpoint that answered, when Envoy reports it


@dataclass(slots=True)
class ResponseBody:
    chunk: bytes
    end_of_stream: bool
    # Only read from a response's first message (see `read_event`).
    status: int | None = None
    served: str | None = None


@dataclass(slots=True)
class ResponseTrailers:
    pass


Event = (
    RequestHeaders | RequestBody | RequestTrailers | ResponseHeaders | ResponseBody
    | ResponseTrailers
)  # fmt: skip
_REQUEST_TRAILERS = RequestTrailers()
_RESPONSE_TRAILERS = ResponseTrailers()


def read_event(message: ProcessingRequest, *, response_started: bool = True) -> Event | None:
    """The plain event of one ProcessingRequest (None for a kind this gateway ignores).

    `response_started=False` marks the first message of the response path: only then are
    the served endpoint and the status read from its metadata and attributes.
    """
    kind = message.WhichOneof("request")
    if kind == "request_body":
        body = message.request_body
        return RequestBody(body.body, body.end_of_stream)
    if kind == "response_body":
        body = message.response_body
        if response_started:
            return ResponseBody(body.body, body.end_of_stream)
        return ResponseBody(
            body.body, body.end_of_stream, response_code(message), served_endpoint(message)
        )
    if kind == "request_headers":
        http = message.request_headers
        return RequestHeaders(headers_of(http), http.end_of_stream, subset_hint(message))
    if kind == "response_headers":
        http = message.response_headers
        return ResponseHeaders(headers_of(http), http.end_of_stream, served_endpoint(message))
    if kind == "request_trailers":
        return _REQUEST_TRAILERS
    if kind == "response_trailers":
        return _RESPONSE_TRAILERS
    return None


@dataclass(frozen=True, slots=True)
class ReplyView:
    """A reply read back as plain data."""

    kind: str  # request_headers, request_body, response_body, immediate_response, ...
    destination: str | None = None  # the x-gateway-destination-endpoint it sets
    metadata_destination: str | None = None  # the same in envoy.lb dynamic metadata
    set_headers: tuple[tuple[str, str], ...] = ()
    status: int | None = None  # immediate responses
    body: bytes = b""  # immediate response body, or a streamed chunk
    end_of_stream: bool = False


def describe_reply(reply: Reply) -> ReplyView:
    message = (
        reply
        if isinstance(reply, ep.ProcessingResponse)
        else ep.ProcessingResponse.FromString(reply)
    )
    kind = message.WhichOneof("response") or ""
    if kind == "immediate_response":
        immediate = message.immediate_response
        headers = tuple(
            (h.header.key, h.header.raw_value.decode() or h.header.value)
            for h in immediate.headers.set_headers
        )
        return ReplyView(
            kind, set_headers=headers, status=immediate.status.code, body=immediate.body
        )
    part = getattr(message, kind)
    common = part.response
    headers = tuple(
        (h.header.key, h.header.raw_value.decode() or h.header.value)
        for h in common.header_mutation.set_headers
    )
    destination = dict(headers).get(DESTINATION_HEADER)
    lb = message.dynamic_metadata.fields.get(LB_NAMESPACE)
    meta = None
    if lb is not None and DESTINATION_HEADER in lb.struct_value.fields:
        meta = lb.struct_value.fields[DESTINATION_HEADER].string_value
    streamed = common.body_mutation.streamed_response
    return ReplyView(
        kind,
        destination=destination,
        metadata_destination=meta,
        set_headers=headers,
        body=streamed.body,
        end_of_stream=streamed.end_of_stream,
    )

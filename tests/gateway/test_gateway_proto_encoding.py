"""The protobuf boundary's hand-encoded replies and header reading agree with protobuf."""

from __future__ import annotations

import pytest
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from smart_epp.proto import extproc as px

# Around every varint length boundary, and past one streamed chunk.
SIZES = [0, 1, 100, 127, 128, 129, 16_383, 16_384, px.STREAMED_CHUNK_BYTES, 62_001, 200_000]


def expected(body: bytes, end_of_stream: bool, *, request: bool) -> list[bytes]:
    chunks = [
        body[i : i + px.STREAMED_CHUNK_BYTES] for i in range(0, len(body), px.STREAMED_CHUNK_BYTES)
    ] or [b""]
    out = []
    for index, chunk in enumerate(chunks):
        streamed = ep.StreamedBodyResponse(
            body=chunk, end_of_stream=end_of_stream and index == len(chunks) - 1
        )
        body_response = ep.BodyResponse(
            response=ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=streamed))
        )
        message = (
            ep.ProcessingResponse(request_body=body_response)
            if request
            else ep.ProcessingResponse(response_body=body_response)
        )
        out.append(message)
    return [m.SerializeToString() for m in out]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("end_of_stream", [True, False])
def test_streamed_replies_match_protobuf_encoding(size: int, end_of_stream: bool) -> None:
    body = bytes(i % 251 for i in range(size))
    assert px.streamed_request_body(body, end_of_stream) == expected(
        body, end_of_stream, request=True
    )
    assert px.streamed_response_body(body, end_of_stream) == expected(
        body, end_of_stream, request=False
    )
    # And Envoy's side reads them back to the same body.
    parsed = [ep.ProcessingResponse.FromString(r) for r in px.streamed_request_body(body)]
    assert (
        b"".join(p.request_body.response.body_mutation.streamed_response.body for p in parsed)
        == body
    )


def test_headers_prefer_raw_value_and_fall_back_to_value() -> None:
    http = ep.HttpHeaders(
        headers=core.HeaderMap(
            headers=[
                core.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                core.HeaderValue(key="x-legacy", value="plain"),
                core.HeaderValue(key="x-latin", raw_value="caf\u00e9".encode("latin-1")),
            ]
        )
    )
    assert px.headers_of(http) == {
        ":path": "/v1/completions",
        "x-legacy": "plain",
        "x-latin": "caf\u00e9",
    }

"""The ext_proc conversation over real gRPC, message by message, where Envoy's own
behaviour cannot show it (subset hints from a gateway, fallback lists, trailers, faults)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from conftest import PickByHeader
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.errors import RequestError
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.server import EppServer
from smart_epp.framework.types import Decision, Endpoint, LLMRequest, PodState

PODS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
FULL_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pm.ProcessingMode.BUFFERED


def headers_message(
    headers: dict[str, str], *, end_of_stream: bool = False, mode: int = FULL_DUPLEX
) -> ep.ProcessingRequest:
    values = [core.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=core.HeaderMap(headers=values), end_of_stream=end_of_stream
        ),
        protocol_config=ep.ProtocolConfiguration(
            request_body_mode=mode, response_body_mode=pm.ProcessingMode.STREAMED
        ),
    )


def body_message(body: bytes, end_of_stream: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=end_of_stream))


def with_subset(message: ep.ProcessingRequest, addresses: list[str]) -> ep.ProcessingRequest:
    hint = struct_pb2.Struct()
    hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(addresses)
    message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


POST = {":method": "POST", ":path": "/v1/completions", "x-request-id": "req-1"}
BODY = json.dumps({"model": "tiny", "prompt": "hello"}).encode()


class Harness:
    def __init__(self, server: EppServer, channel: grpc.aio.Channel) -> None:
        self.server = server
        self.channel = channel
        self.process = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=ep.ProcessingRequest.SerializeToString,
            response_deserializer=ep.ProcessingResponse.FromString,
        )

    async def exchange(
        self, messages: Sequence[ep.ProcessingRequest]
    ) -> list[ep.ProcessingResponse]:
        async def requests() -> AsyncIterator[ep.ProcessingRequest]:
            for message in messages:
                yield message

        return [reply async for reply in self.process(requests())]


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint(a) for a in PODS])
    server = EppServer(RequestFlow(PickByHeader(), datastore))
    await server.start(grpc_port=0, health_port=0, metrics_port=None, host="127.0.0.1")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield Harness(server, channel)
    await server.stop(0)


def destination_of(reply: ep.ProcessingResponse) -> tuple[str, str]:
    common = (
        reply.request_headers.response
        if reply.HasField("request_headers")
        else reply.request_body.response
    )
    header = {
        h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
    }["x-gateway-destination-endpoint"]
    metadata = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return header, metadata["x-gateway-destination-endpoint"].string_value


async def test_full_duplex_answers_headers_then_streamed_body(harness: Harness) -> None:
    replies = await harness.exchange([headers_message(POST), body_message(BODY)])
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    header, metadata = destination_of(replies[0])
    assert header == metadata == PODS[0]
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == BODY and streamed.end_of_stream


async def test_body_split_over_chunks_is_rejoined_and_rechunked(harness: Harness) -> None:
    payload = json.dumps({"model": "tiny", "prompt": "z" * 150_000}).encode()
    pieces = [payload[i : i + 40_000] for i in range(0, len(payload), 40_000)]
    messages = [headers_message(POST)]
    messages += [body_message(p, end_of_stream=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    replies = await harness.exchange(messages)
    chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert [len(c.body) for c in chunks] == [62_000, 62_000, len(payload) - 124_000]
    assert b"".join(c.body for c in chunks) == payload
    assert [c.end_of_stream for c in chunks] == [False, False, True]


async def test_buffered_mode_decides_on_the_body_reply(harness: Harness) -> None:
    replies = await harness.exchange([headers_message(POST, mode=BUFFERED), body_message(BODY)])
    assert replies[0].request_headers.response.ByteSize() == 0  # plain continue
    header, metadata = destination_of(replies[1])
    assert header == metadata == PODS[0]
    assert replies[1].request_body.response.clear_route_cache


async def test_subset_hint_narrows_the_candidates(harness: Harness) -> None:
    first = with_subset(headers_message(POST), [PODS[2], "10.9.9.9:1"])
    replies = await harness.exchange([first, body_message(BODY)])
    assert destination_of(replies[0]) == (PODS[2], PODS[2])


async def test_subset_hint_with_no_known_pod_is_503(harness: Harness) -> None:
    first = with_subset(headers_message(POST), ["10.9.9.9:1"])
    replies = await harness.exchange([first, body_message(BODY)])
    immediate = replies[-1].immediate_response
    assert immediate.status.code == 503
    assert "subset" in json.loads(immediate.body)["error"]["message"]


async def test_fallback_list_when_more_than_one_endpoint_is_asked(harness: Harness) -> None:
    harness.server.flow.destination_count = 2
    headers = {**POST, "x-test-target": PODS[1]}
    replies = await harness.exchange([headers_message(headers), body_message(BODY)])
    header, metadata = destination_of(replies[0])
    assert header == metadata == f"{PODS[1]},{PODS[0]}"


async def test_request_id_is_generated_when_absent(harness: Harness) -> None:
    headers = {":method": "POST", ":path": "/v1/completions"}
    replies = await harness.exchange([headers_message(headers), body_message(BODY)])
    set_headers = {
        h.header.key: h.header.raw_value.decode()
        for h in replies[0].request_headers.response.header_mutation.set_headers
    }
    assert len(set_headers["x-request-id"]) == 32


async def test_trailers_end_the_body_in_full_duplex(harness: Harness) -> None:
    replies = await harness.exchange(
        [
            headers_message(POST),
            body_message(BODY, end_of_stream=False),
            ep.ProcessingRequest(request_trailers=ep.HttpTrailers()),
        ]
    )
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == BODY and not streamed.end_of_stream


class Exploding(PickByHeader):
    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        if request.headers.get("x-explode"):
            raise RuntimeError("scheduler bug")
        if request.headers.get("x-shed"):
            raise RequestError.shed()
        return await super().schedule(request, candidates)


async def test_scheduler_fault_is_500_and_the_server_keeps_serving(harness: Harness) -> None:
    harness.server.flow.scheduler = Exploding()
    replies = await harness.exchange(
        [headers_message({**POST, "x-explode": "1"}), body_message(BODY)]
    )
    immediate = replies[-1].immediate_response
    assert immediate.status.code == 500
    assert "req-1" in json.loads(immediate.body)["error"]["message"]
    replies = await harness.exchange([headers_message({**POST, "x-shed": "1"}), body_message(BODY)])
    assert replies[-1].immediate_response.status.code == 429
    replies = await harness.exchange([headers_message(POST), body_message(BODY)])
    assert destination_of(replies[0])[0] == PODS[0]
    assert harness.server.flow.open_requests() == 0


async def test_stream_that_ends_early_releases_inflight(harness: Harness) -> None:
    # Decision made, then the stream ends without any response: the client went away.
    replies = await harness.exchange([headers_message(POST), body_message(BODY)])
    assert len(replies) == 2
    assert harness.server.flow.open_requests() == 0
    scheduler = harness.server.flow.scheduler
    assert isinstance(scheduler, PickByHeader)
    assert [f.ok for f in scheduler.finished] == [False]


async def test_health_reports_serving_on_both_ports(harness: Harness) -> None:
    for port in (harness.server.health_port, harness.server.grpc_port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                assert answer.status == health_pb2.HealthCheckResponse.SERVING

"""A request's trace through real Envoy reaches a real OTLP/gRPC receiver: the one the
opentelemetry-proto package generates the service for, started here."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from support.backends import echo_backends
from support.envoy import async_running_envoy
from support.net import async_wait_until
from support.paths import TINY_MODEL

from smart_epp.epp.config import parse_config
from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.scheduler import build_scheduler
from smart_epp.epp.server import EppServer
from smart_epp.epp.tracing import RequestTracing
from smart_epp.framework.types import Endpoint
from smart_epp.kv_index.memory import MemoryBlockIndex

pytestmark = pytest.mark.envoy

CONFIG = f"""\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: local-tokenizer
  parameters:
    modelName: tiny
    path: {TINY_MODEL}
- type: decode-filter
- type: precise-prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: precise-prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SECRET = "the quarterly numbers are confidential"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list:
        return [
            span
            for export in self.requests
            for resource in export.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]


@contextlib.asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[Receiver, int]]:
    receiver = Receiver()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield receiver, port
    finally:
        await server.stop(0)


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


async def test_one_request_is_traced_through_envoy_to_an_otlp_receiver() -> None:
    async with otlp_receiver() as (receiver, port), echo_backends(2) as pods:
        datastore = Datastore()
        datastore.set_endpoints([Endpoint(b.address) for b in pods])
        scheduler = build_scheduler(parse_config(CONFIG), index=MemoryBlockIndex())
        scheduler.record_timings = True
        flow = RequestFlow(scheduler, datastore)
        tracing = RequestTracing(f"http://127.0.0.1:{port}")
        flow.add_hook(tracing)
        server = EppServer(flow)
        server.record_marks = True
        await server.start(grpc_port=0, health_port=0, metrics_port=None, host="127.0.0.1")
        try:
            async with (
                async_running_envoy(
                    epp_port=server.grpc_port, secure_serving=False, response_path="ext-proc"
                ) as envoy,
                aiohttp.ClientSession() as http,
            ):
                body = {"model": "tiny", "stream": True,
                        "messages": [{"role": "user", "content": SECRET}]}  # fmt: skip
                headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
                async with http.post(
                    f"{envoy.url}/v1/chat/completions", json=body, headers=headers
                ) as response:
                    assert response.status == 200
                    await response.read()
                await async_wait_until(lambda: flow.open_requests() == 0, what="request end")
        finally:
            await server.stop(0)
            await asyncio.to_thread(tracing.close)

    spans = receiver.spans()
    by_name = {s.name: s for s in spans}
    root = by_name["epp.request"]
    assert root.trace_id.hex() == TRACE_ID  # W3C trace context taken from the request
    assert root.parent_span_id.hex() == PARENT_ID
    assert {s.trace_id.hex() for s in spans} == {TRACE_ID}
    expected = {"parse", "schedule", "tokenize", "index lookup", "reply",
                "Filter decode-filter/decode-filter",
                "Scorer precise-prefix-cache-scorer/precise-prefix-cache-scorer",
                "Scorer queue-scorer/queue-scorer",
                "Picker max-score-picker/max-score-picker"}  # fmt: skip
    assert expected <= set(by_name), sorted(by_name)
    schedule = by_name["schedule"]
    assert by_name["tokenize"].parent_span_id == schedule.span_id
    assert by_name["parse"].parent_span_id == root.span_id
    for span in spans:  # children lie inside the request's span
        assert root.start_time_unix_nano <= span.start_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano
    reply = attributes(by_name["reply"])
    assert reply["smart_epp.ttft_seconds"] > 0
    assert reply["gen_ai.usage.output_tokens"] == 5
    assert reply["smart_epp.usage.cached_tokens"] == 16
    assert reply["smart_epp.endpoint.served"] in {p.address for p in pods}
    assert attributes(schedule)["smart_epp.prompt_tokens"] > 0
    assert attributes(root)["gen_ai.request.model"] == "tiny"
    exported = b"".join(r.SerializeToString() for r in receiver.requests)
    assert SECRET.encode() not in exported
    assert json.dumps(SECRET).encode() not in exported


def test_tracing_off_records_nothing_and_loads_no_tracer() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from smart_epp.epp import serve_cmd, server, scheduler\n"
        "from smart_epp.epp.scheduler import build_scheduler\n"
        "from smart_epp.framework.types import Api, Endpoint, LLMRequest, PodState\n"
        "s = build_scheduler('gie-default')\n"
        "r = LLMRequest('r', '/v1/completions', Api.COMPLETIONS, 'm', prompt='hi')\n"
        "d = s.schedule_sync(r, [PodState(Endpoint('a:1'))])\n"
        "assert d.context.timings is None\n"
        "assert 'smart_epp.epp.tracing' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr

"""OpenTelemetry traces of each request, exported over OTLP/gRPC.

On only when an endpoint is given (`epp serve --otlp-endpoint`, or the standard
`OTEL_EXPORTER_OTLP_ENDPOINT`): otherwise this module is not even imported, the scheduler
records no timings and the gateway no instants, so tracing costs nothing when off.

A request's spans are built when it ends, from instants the gateway and the scheduler
recorded on the way (the hot path never touches the OpenTelemetry SDK):

    epp.request (SERVER; parent from the request's W3C `traceparent`/`tracestate`)
    ├── parse                      the OpenAI body
    ├── schedule
    │   ├── tokenize               (when the profile needs token ids)
    │   ├── index lookup           (when it needs prefix matches)
    │   └── <Filter|Scorer|Picker> <type>/<name>, one per plugin
    └── reply                      routed -> end of the response; TTFT and usage

Attributes carry the model, API, chosen and serving endpoints, token counts, cached
tokens (reported and predicted), TTFT and status. Prompts and completions never appear.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..framework.lifecycle import FlowRequest, OutcomeObserver
from ..framework.plugins import SchedulingContext
from ..framework.types import Outcome
from .scheduler import PREDICTED_CACHED_TOKENS

log = logging.getLogger(__name__)

ARRIVED = "arrived"  # FlowRequest.marks: the request's first message reached the gateway
PARSE_START = "parse_start"


class RequestTracing(OutcomeObserver):
    """Turns each finished request into spans and hands them to a batching OTLP exporter."""

    def __init__(self, endpoint: str, *, service_name: str = "smart-epp") -> None:
        self.endpoint = endpoint
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("smart_epp.epp")
        self._propagator = TraceContextTextMapPropagator()
        # perf_counter seconds (the flow's clock) -> epoch nanoseconds
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def on_outcome(self, flow: FlowRequest, outcome: Outcome) -> None:
        request = flow.request
        marks = flow.marks or {}
        parent = self._propagator.extract(request.headers)
        begin = marks.get(ARRIVED, marks.get(PARSE_START, flow.received_at))
        attributes: dict[str, Any] = {
            "gen_ai.request.model": request.model,
            "smart_epp.api": request.api.value,
            "smart_epp.request_id": request.request_id,
            "smart_epp.stream": request.stream,
        }
        if request.adapter:
            attributes["smart_epp.adapter"] = request.adapter
        root = self._tracer.start_span(
            "epp.request", context=parent, kind=SpanKind.SERVER,
            start_time=self._ns(begin), attributes=attributes,
        )  # fmt: skip
        inside = trace.set_span_in_context(root)
        if PARSE_START in marks:
            self._span("parse", inside, marks[PARSE_START], flow.received_at)
        decision = flow.decision
        ctx = decision.context if decision is not None else None
        schedule = self._tracer.start_span(
            "schedule", context=inside, start_time=self._ns(flow.received_at)
        )
        if isinstance(ctx, SchedulingContext):
            schedule.set_attribute("smart_epp.prompt_tokens", ctx.prompt_tokens)
            predicted = ctx.kept.get(PREDICTED_CACHED_TOKENS)
            if predicted is not None:
                schedule.set_attribute("smart_epp.predicted_cached_tokens", int(predicted))
            within = trace.set_span_in_context(schedule)
            for stage, type_name, name, start, end in ctx.timings or ():
                label = name if stage == "Prepare" else f"{stage} {type_name}/{name}"
                span = self._tracer.start_span(label, context=within, start_time=self._ns(start))
                span.set_attribute("smart_epp.extension_point", stage)
                span.end(end_time=self._ns(end))
        if decision is not None:
            schedule.set_attribute("smart_epp.profile", decision.profile)
        if flow.primary is not None:
            schedule.set_attribute("smart_epp.endpoint.chosen", flow.primary)
        schedule.end(end_time=self._ns(flow.routed_at or flow.received_at))

        reply = self._tracer.start_span(
            "reply", context=inside, start_time=self._ns(flow.routed_at or flow.received_at)
        )
        reply.set_attribute("smart_epp.endpoint.served", outcome.address)
        reply.set_attribute("http.response.status_code", outcome.status)
        if outcome.ttft_s is not None:
            reply.set_attribute("smart_epp.ttft_seconds", outcome.ttft_s)
        if flow.first_byte_at is not None:
            reply.add_event("first byte", timestamp=self._ns(flow.first_byte_at))
        usage = outcome.usage
        if usage is not None:
            reply.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            reply.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
            if usage.cached_tokens is not None:
                reply.set_attribute("smart_epp.usage.cached_tokens", usage.cached_tokens)
        reply.end(end_time=self._ns(outcome.now))
        if not outcome.ok:
            root.set_status(Status(StatusCode.ERROR, f"status {outcome.status}"))
        root.set_attribute("http.response.status_code", outcome.status)
        root.end(end_time=self._ns(outcome.now))

    def _span(self, name: str, parent: Any, start: float, end: float) -> None:
        self._tracer.start_span(name, context=parent, start_time=self._ns(start)).end(
            end_time=self._ns(end)
        )

    def close(self, timeout_s: float = 5.0) -> None:
        """Exports what is still batched, then stops the exporter."""
        try:
            self._provider.force_flush(int(timeout_s * 1000))
        finally:
            self._provider.shutdown()


__all__ = ["ARRIVED", "PARSE_START", "RequestTracing"]

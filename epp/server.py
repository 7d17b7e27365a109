"""The ext_proc gRPC server: one `Exchange` per HTTP request that Envoy streams to us.

Request path: parse the OpenAI body, narrow the candidates (readiness, subset hint), ask
the Scheduler, answer Envoy with the destination header + `envoy.lb` metadata.
Response path: learn the served endpoint, read `usage` as chunks pass (after each chunk
has been answered, so the stream is never held up), close the in-flight accounting and
report to the Scheduler.

Adapter resolution: `adapter_resolver(model)` returns the LoRA adapter a model name
refers to, or None for a base model; the default knows no adapters. The scheduler's
owner supplies one built from the pool's served adapters.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.errors import RequestError
from smart_epp.epp.gateway_metrics import GatewayMetrics
from smart_epp.epp.request_limits import RequestLimits
from smart_epp.epp.request_parser import AdapterResolver, no_adapters, parse_request
from smart_epp.epp.scheduler_api import Scheduler
from smart_epp.epp.types import LLMRequest
from smart_epp.epp.usage import UsageReader
from smart_epp.proto import extproc as px
from smart_epp.proto.eds import add_pool_eds
from smart_epp.proto.extproc import BodyMode

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
HEALTH_SERVICES = ("", "liveness", "readiness", px.SERVICE_NAME)


@dataclass(slots=True)
class ServerOptions:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # How many endpoints go into the destination (primary first, then fallbacks).
    destination_count: int = 1
    # Used when Envoy does not announce its body mode on the stream (older Envoy).
    default_request_body_mode: BodyMode = BodyMode.FULL_DUPLEX_STREAMED
    pool_name: str = "default"
    # Which paths reach the pods, and how large a JSON body may be (see request_limits).
    request_limits: RequestLimits = field(default_factory=RequestLimits)


class Exchange:
    """The state of one HTTP request/response as seen over one ext_proc stream."""

    __slots__ = (
        "_after",
        "_body_parts",
        "_body_size",
        "_headers",
        "_reader",
        "_response_seen",
        "_started",
        "_subset",
        "done",
        "finished",
        "first_byte_at",
        "gw",
        "picked_at",
        "primary",
        "request",
        "request_id",
        "request_mode",
        "response_mode",
        "served",
        "status",
    )

    def __init__(self, gateway: EppServer) -> None:
        self.gw = gateway
        self.request_mode: BodyMode | None = None
        self.response_mode = BodyMode.STREAMED
        self.request_id = ""
        self.request: LLMRequest | None = None
        self.primary: str | None = None
        self.served: str | None = None
        self.status = 0
        self.done = False  # the stream must end (an immediate response was sent)
        self.finished = False
        self.picked_at = 0.0
        self.first_byte_at = 0.0
        self._headers: dict[str, str] = {}
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._subset: list[str] | None = None
        self._reader: UsageReader | None = None
        self._response_seen = False
        self._started = time.perf_counter()
        # Work to do once the replies are on their way to Envoy.
        self._after: Callable[[], None] | None = None

    # -------------------------------------------------------------- dispatch

    async def handle(self, message: px.ProcessingRequest) -> list[px.Reply]:
        if self.request_mode is None:
            modes = px.body_modes(message)
            if modes is None:
                self.request_mode = self.gw.options.default_request_body_mode
            else:
                self.request_mode, self.response_mode = modes
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._on_request_headers(message)
            if kind == "request_body":
                return await self._on_request_body(message.request_body)
            if kind == "request_trailers":
                return await self._on_request_trailers()
        except RequestError as error:
            return [self._refuse(error)]
        except Exception:
            log.exception("request %s failed in the endpoint picker", self.request_id or "?")
            return [self._refuse(RequestError.internal(self.request_id or "?"))]
        try:
            if kind == "response_headers":
                return self._on_response_headers(message)
            if kind == "response_body":
                return self._on_response_body(message)
            if kind == "response_trailers":
                self._after = self._finish_ok
                return [px.CONTINUE_RESPONSE_TRAILERS]
        except Exception:
            # The response already flows; never break it over bookkeeping.
            log.exception("request %s: response bookkeeping failed", self.request_id or "?")
            return [self._continue_response(kind, message)]
        return []

    def after_replies(self) -> None:
        action = self._after
        if action is not None:
            self._after = None
            action()

    # -------------------------------------------------------------- request path

    async def _on_request_headers(self, message: px.ProcessingRequest) -> list[px.Reply]:
        http = message.request_headers
        self._headers = headers = px.headers_of(http)
        self.request_id = headers.get("x-request-id", "")
        self._subset = px.subset_hint(message)
        if http.end_of_stream:
            return await self._decide(b"", headers_phase=True)
        if self.request_mode is BodyMode.FULL_DUPLEX_STREAMED:
            return []  # the headers reply carries the decision, so it waits for the body
        return [px.CONTINUE_REQUEST_HEADERS]

    async def _on_request_body(self, http_body: px.ProcessingRequest) -> list[px.Reply]:
        chunk = http_body.body
        if chunk:
            self._body_size += len(chunk)
            if self._body_size > self.gw.options.max_body_bytes:
                raise RequestError.too_large(self.gw.options.max_body_bytes)
            self._body_parts.append(chunk)
        if not http_body.end_of_stream:
            return []
        full_duplex = self.request_mode is BodyMode.FULL_DUPLEX_STREAMED
        return await self._decide(self._take_body(), headers_phase=full_duplex, body_eos=True)

    async def _on_request_trailers(self) -> list[px.Reply]:
        if self.request_mode is not BodyMode.FULL_DUPLEX_STREAMED or self.request is not None:
            return [px.CONTINUE_REQUEST_TRAILERS]
        replies = await self._decide(self._take_body(), headers_phase=True, body_eos=False)
        if self.done:
            return replies
        replies.append(px.CONTINUE_REQUEST_TRAILERS)
        return replies

    def _take_body(self) -> bytes:
        parts = self._body_parts
        self._body_parts = []
        if not parts:
            return b""
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _decide(
        self, body: bytes, *, headers_phase: bool, body_eos: bool = False
    ) -> list[px.Reply]:
        gw = self.gw
        extra_headers: tuple[tuple[str, str], ...] = ()
        if not self.request_id:
            self.request_id = uuid.uuid4().hex
            extra_headers = (("x-request-id", self.request_id),)
        request = parse_request(
            self._headers.get(":path", "/"),
            self._headers,
            body,
            self.request_id,
            gw.adapter_resolver,
            gw.options.request_limits,
        )
        self.request = request
        gw.metrics.objective(request.model, request.adapter or request.model).requests.inc()

        candidates = gw.datastore.ready_pods()
        if self._subset is not None:
            allowed = set(self._subset)
            candidates = [p for p in candidates if p.address in allowed]
        if not candidates:
            raise RequestError.no_endpoint(
                "no endpoint in the requested subset is available"
                if self._subset is not None
                else "no endpoint available to serve the request"
            )
        started = time.perf_counter()
        decision = await gw.scheduler.schedule(request, candidates)
        self.picked_at = now = time.perf_counter()
        gw.metrics.scheduler_e2e.observe(now - started)
        if not decision.endpoints:
            raise RequestError.no_endpoint()

        chosen = decision.endpoints[: gw.options.destination_count]
        destination = chosen[0].address if len(chosen) == 1 else ",".join(p.address for p in chosen)
        self.primary = self.served = chosen[0].address
        gw.datastore.begin(self.primary, request)
        self._after = lambda: gw.scheduler.on_routed(request, decision)

        if not headers_phase:
            return [px.route_in_body_phase(destination, extra_headers)]
        replies = [px.route_in_headers_phase(destination, extra_headers)]
        if self.request_mode is BodyMode.FULL_DUPLEX_STREAMED and (body_eos or body):
            replies.extend(px.streamed_request_body(body, end_of_stream=body_eos))
        return replies

    def _refuse(self, error: RequestError) -> px.Reply:
        self.done = True
        self.status = error.status
        request = self.request
        model, target = (
            ("", "") if request is None else (request.model, request.adapter or request.model)
        )
        self.gw.metrics.errors.labels(model, target, str(error.status)).inc()
        if request is not None and self.primary is not None:
            self._finish(ok=False)
        return px.immediate_response(
            error.status, error.body(), f"epp_{error.status}", self.request_id or None
        )

    # -------------------------------------------------------------- response path

    def _continue_response(self, kind: str | None, message: px.ProcessingRequest) -> px.Reply:
        if kind == "response_headers":
            return px.CONTINUE_RESPONSE_HEADERS
        if kind == "response_body" and self.response_mode is not BodyMode.FULL_DUPLEX_STREAMED:
            return px.CONTINUE_RESPONSE_BODY
        if kind == "response_body":
            body = message.response_body
            return px.streamed_response_body(body.body, body.end_of_stream)[0]
        return px.CONTINUE_RESPONSE_TRAILERS

    def _learn_response(self, message: px.ProcessingRequest, status: int | None) -> None:
        """First message of the response: its status, and which endpoint answered."""
        self._response_seen = True
        if status is None:
            status = px.response_code(message)
        if status is not None:
            self.status = status
        request = self.request
        served = px.served_endpoint(message)
        if request is not None and served and served != self.served:
            # A fallback (or a retry) answered: move the in-flight count to it.
            # (`begin` ignores an address outside the pool.)
            datastore = self.gw.datastore
            datastore.end(self.served or "", request)
            datastore.begin(served, request)
            self.served = served

    def _on_response_headers(self, message: px.ProcessingRequest) -> list[px.Reply]:
        http = message.response_headers
        headers = px.headers_of(http)
        status = headers.get(":status", "")
        self._reader = UsageReader(headers.get("content-type", ""))
        self._learn_response(message, int(status) if status.isdigit() else None)
        if http.end_of_stream:
            self._after = self._finish_ok
        return [px.CONTINUE_RESPONSE_HEADERS]

    def _on_response_body(self, message: px.ProcessingRequest) -> list[px.Reply]:
        # The shipped Envoy config skips the response headers message (one round trip
        # less per request): the status and the served endpoint then come as attributes
        # of the first body message, and the body's format is recognised from its bytes.
        if not self._response_seen:
            self._learn_response(message, None)
        if self._reader is None:
            self._reader = UsageReader(None)
        http_body = message.response_body
        chunk = http_body.body
        eos = http_body.end_of_stream
        if not self.first_byte_at and chunk:
            self.first_byte_at = time.perf_counter()
        reader = self._reader
        if chunk:
            if eos:
                self._after = lambda: (reader.feed(chunk), self._finish_ok())
            else:
                self._after = lambda: reader.feed(chunk)
        elif eos:
            self._after = self._finish_ok
        if self.response_mode is BodyMode.FULL_DUPLEX_STREAMED:
            return px.streamed_response_body(chunk, eos)
        return [px.CONTINUE_RESPONSE_BODY]

    def _finish_ok(self) -> None:
        self._finish(ok=200 <= self.status < 400)

    def _finish(self, ok: bool) -> None:
        """Closes the request's accounting exactly once (end of stream, error or reset)."""
        if self.finished:
            return
        self.finished = True
        request = self.request
        if request is None or self.served is None:
            return
        gw = self.gw
        gw.datastore.end(self.served, request)
        usage = self._reader.finish() if self._reader is not None else None
        ttft = self.first_byte_at - self.picked_at if self.first_byte_at else None
        metrics = gw.metrics
        target = request.adapter or request.model
        objective = metrics.objective(request.model, target)
        objective.duration.observe(time.perf_counter() - self._started)
        if usage is not None:
            objective.input_tokens.observe(usage.prompt_tokens)
            objective.output_tokens.observe(usage.completion_tokens)
        if not ok and self.status >= 400 and not self.done:
            metrics.errors.labels(request.model, target, str(self.status)).inc()
        try:
            gw.scheduler.on_response(request, self.served, usage, ttft, ok)
        except Exception:
            log.exception("scheduler.on_response failed for request %s", self.request_id)

    def close(self) -> None:
        """The stream ended: anything still open ended without a complete response.

        Envoy may cancel the stream as soon as it has the reply to the last response
        chunk, before the work queued behind that reply ran; run it now.
        """
        try:
            self.after_replies()
        except Exception:
            log.exception("request %s: response bookkeeping failed", self.request_id or "?")
        if not self.finished:
            self._finish(ok=False)


class EppServer:
    """The ext_proc service, its gRPC health service and its metrics endpoint."""

    def __init__(
        self,
        scheduler: Scheduler,
        datastore: Datastore,
        *,
        adapter_resolver: AdapterResolver = no_adapters,
        options: ServerOptions | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.datastore = datastore
        self.adapter_resolver = adapter_resolver
        self.options = options or ServerOptions()
        self.metrics = metrics or GatewayMetrics(
            self.options.pool_name, lambda: len(datastore.ready_pods())
        )
        self.grpc_port = 0
        self.health_port = 0
        self.metrics_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        self._health_servicer = health.aio.HealthServicer()
        self.active_streams = 0

    async def process(
        self, requests: AsyncIterator[px.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        exchange = Exchange(self)
        self.active_streams += 1
        # context.read() rather than `async for` over `requests`: one async-generator
        # layer less per message, measurably cheaper on grpc.aio.
        read, write, end = context.read, context.write, grpc.aio.EOF
        try:
            while (message := await read()) is not end:
                replies = await exchange.handle(message)  # type: ignore[arg-type]
                for reply in replies:
                    await write(reply)
                exchange.after_replies()
                if exchange.done:
                    return
        finally:
            self.active_streams -= 1
            exchange.close()

    async def start(
        self,
        grpc_port: int = 9002,
        health_port: int | None = 9003,
        metrics_port: int | None = 9090,
        host: str = "0.0.0.0",
    ) -> None:
        """Starts serving; a port of 0 picks a free one (see the *_port attributes)."""
        options = [
            ("grpc.so_reuseport", 0),
            # Envoy keeps one HTTP/2 connection with many streams; allow plenty of them.
            ("grpc.max_concurrent_streams", 10_000),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
        self._grpc = grpc.aio.server(options=options)
        px.add_ext_proc_service(self._grpc, self.process)
        health_pb2_grpc.add_HealthServicer_to_server(self._health_servicer, self._grpc)
        add_pool_eds(self._grpc, self.datastore)  # Envoy's view of the pool, for fallbacks
        self.grpc_port = self._grpc.add_insecure_port(f"{host}:{grpc_port}")
        await self._grpc.start()
        if health_port is not None:
            self._health = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self._health_servicer, self._health)
            self.health_port = self._health.add_insecure_port(f"{host}:{health_port}")
            await self._health.start()
        for service in HEALTH_SERVICES:
            await self._health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        if metrics_port is not None:
            self.metrics_port = self.metrics.serve(metrics_port, host)

    async def stop(self, grace: float | None = 1.0) -> None:
        for service in HEALTH_SERVICES:
            await self._health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        servers = [s for s in (self._grpc, self._health) if s is not None]
        await asyncio.gather(*(s.stop(grace) for s in servers))
        self._grpc = self._health = None
        self.metrics.close()

    async def wait_for_termination(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()


__all__ = ["EppServer", "Exchange", "ServerOptions"]

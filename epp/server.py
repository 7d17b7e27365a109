"""The ext_proc gRPC server: one `Exchange` per HTTP request that Envoy streams to us.

`Exchange` is a sans-IO state machine in the spirit of h11: plain events in (decoded by
`proto.extproc.read_event`), replies out, no sockets and no gRPC, so it is tested by
feeding it events. It translates Envoy's protocol to and from the `RequestFlow`, which
owns the request's life: candidates, scheduling, in-flight accounting, re-booking to the
endpoint that served, and the outcome hooks.

Request path: parse the OpenAI body, route through the flow, answer Envoy with the
destination header + `envoy.lb` metadata. Response path, when Envoy announces no
response body processing (the shipped config): the ext_proc stream ends after routing
and the request waits in the `ResponseLog` for Envoy's access-log record, so a response
never depends on the picker staying up. When Envoy streams the response through
ext_proc: learn the status and the served endpoint, read `usage` as chunks pass (after
each chunk has been answered, so the stream is never held up), and finish the flow.

Adapter resolution: `adapter_resolver(model)` returns the LoRA adapter a model name
refers to, or None for a base model; the default knows no adapters.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import Enum

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..framework.lifecycle import FlowRequest
from ..proto import access_log
from ..proto import extproc as px
from ..proto.eds import add_pool_eds
from ..proto.extproc import BodyMode
from .errors import RequestError
from .flow import RequestFlow
from .gateway_metrics import GatewayMetrics
from .request_limits import RequestLimits
from .request_parser import AdapterResolver, no_adapters, parse_request
from .response_log import ResponseLog
from .usage import UsageReader

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
HEALTH_SERVICES = ("", "liveness", "readiness", px.SERVICE_NAME)


@dataclass(slots=True)
class ServerOptions:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Used when Envoy does not announce its body mode on the stream (older Envoy).
    default_request_body_mode: BodyMode = BodyMode.FULL_DUPLEX_STREAMED
    pool_name: str = "default"
    # Which paths reach the pods, and how large a JSON body may be (see request_limits).
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    # Several worker processes share the ext_proc port (SO_REUSEPORT; the kernel
    # spreads Envoy's connections over them).
    reuse_port: bool = False


class Phase(Enum):
    """Where one exchange stands."""

    REQUEST_HEADERS = "request-headers"  # nothing received yet
    REQUEST_BODY = "request-body"  # headers seen, body arriving
    ROUTED = "routed"  # the decision was sent; waiting for the response
    RESPONSE = "response"  # the response is flowing
    DONE = "done"  # finished, or refused with an immediate response


class Exchange:
    """The state of one HTTP request/response as seen over one ext_proc stream."""

    __slots__ = (
        "_after",
        "_arrived",
        "_awaits_log",
        "_body_parts",
        "_body_size",
        "_headers",
        "_labels",
        "_reader",
        "_subset",
        "_unrouted",
        "flow",
        "gw",
        "phase",
        "refused",
        "request_id",
        "request_mode",
        "response_mode",
        "status",
        "tracked",
    )

    def __init__(self, gateway: EppServer) -> None:
        self.gw = gateway
        self.flow: RequestFlow = gateway.flow
        self.phase = Phase.REQUEST_HEADERS
        self.request_mode: BodyMode | None = None
        self.response_mode = BodyMode.STREAMED
        self.request_id = ""
        self.tracked: FlowRequest | None = None
        self.refused = False  # an immediate response was sent: the stream must end
        self.status = 0
        self._headers: dict[str, str] = {}
        self._labels = ("", "")  # (model, target model) of the parsed request
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._subset: list[str] | None = None
        self._unrouted: FlowRequest | None = None  # started, not routed yet (maybe queued)
        self._reader: UsageReader | None = None
        self._arrived = 0.0  # when the first message came, recorded only for tracing
        # Address Envoy dialled -> the pod it stands for, when the two differ.
        # Work to do once the replies are on their way to Envoy.
        self._after: Callable[[], None] | None = None
        # The outcome comes from the access log, not from this stream.
        self._awaits_log = False

    @property
    def done(self) -> bool:
        """The stream must end (an immediate response was sent)."""
        return self.refused

    def set_modes(self, modes: tuple[BodyMode, BodyMode] | None) -> None:
        """The body modes Envoy announced on the stream's first message (None: not told)."""
        if self.request_mode is not None:
            return
        if modes is None:
            self.request_mode = self.gw.options.default_request_body_mode
        else:
            self.request_mode, self.response_mode = modes

    # -------------------------------------------------------------- dispatch

    async def handle(self, event: px.Event | None) -> list[px.Reply]:
        if self.request_mode is None:
            self.set_modes(None)
        kind = type(event)
        if kind is px.ResponseBody or kind is px.ResponseHeaders or kind is px.ResponseTrailers:
            try:
                return self._on_response(event)  # type: ignore[arg-type]
            except Exception:
                # The response already flows; never break it over bookkeeping.
                log.exception("request %s: response bookkeeping failed", self.request_id or "?")
                return [self._continue_response(event)]  # type: ignore[arg-type]
        try:
            if kind is px.RequestBody:
                return await self._on_request_body(event)  # type: ignore[arg-type]
            if kind is px.RequestHeaders:
                return await self._on_request_headers(event)  # type: ignore[arg-type]
            if kind is px.RequestTrailers:
                return await self._on_request_trailers()
        except RequestError as error:
            return [self._refuse(error)]
        except Exception:
            log.exception("request %s failed in the endpoint picker", self.request_id or "?")
            return [self._refuse(RequestError.internal(self.request_id or "?"))]
        return []

    def after_replies(self) -> None:
        action = self._after
        if action is not None:
            self._after = None
            action()

    # -------------------------------------------------------------- request path

    async def _on_request_headers(self, event: px.RequestHeaders) -> list[px.Reply]:
        if self.gw.record_marks:
            self._arrived = time.perf_counter()
        self._headers = headers = event.headers
        self.request_id = headers.get("x-request-id", "")
        self._subset = event.subset
        self.phase = Phase.REQUEST_BODY
        if event.end_of_stream:
            return await self._decide(b"", headers_phase=True)
        if self.request_mode is BodyMode.FULL_DUPLEX_STREAMED:
            return []  # the headers reply carries the decision, so it waits for the body
        return [px.CONTINUE_REQUEST_HEADERS]

    async def _on_request_body(self, event: px.RequestBody) -> list[px.Reply]:
        chunk = event.chunk
        if chunk:
            self._body_size += len(chunk)
            if self._body_size > self.gw.options.max_body_bytes:
                raise RequestError.too_large(self.gw.options.max_body_bytes)
            self._body_parts.append(chunk)
        if not event.end_of_stream:
            return []
        full_duplex = self.request_mode is BodyMode.FULL_DUPLEX_STREAMED
        return await self._decide(self._take_body(), headers_phase=full_duplex, body_eos=True)

    async def _on_request_trailers(self) -> list[px.Reply]:
        if self.request_mode is not BodyMode.FULL_DUPLEX_STREAMED or self.tracked is not None:
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
        parse_start = time.perf_counter() if gw.record_marks else 0.0
        request = parse_request(
            self._headers.get(":path", "/"),
            self._headers,
            body,
            self.request_id,
            gw.adapter_resolver,
            gw.options.request_limits,
        )
        self._labels = (request.model, request.adapter or request.model)
        gw.metrics.objective(*self._labels).requests.inc()
        flow = self.flow
        tracked = flow.start(request)
        self._unrouted = tracked
        if gw.record_marks:
            tracked.marks = {"arrived": self._arrived or parse_start, "parse_start": parse_start}
        started = time.perf_counter()
        try:
            chosen = await flow.route(tracked, self._subset)
        except RequestError:
            gw.metrics.record_attempt(self._labels[1], None)
            raise
        finally:
            self._unrouted = None
            gw.metrics.scheduler_e2e.observe(time.perf_counter() - started)
        gw.metrics.record_attempt(self._labels[1], chosen[0].address)
        self.tracked = tracked
        self.phase = Phase.ROUTED
        if self.response_mode is BodyMode.NONE:
            # Registered before the reply leaves, so its record cannot arrive first.
            gw.response_log.expect(tracked)
            self._awaits_log = True
        decision = tracked.decision
        response_headers: tuple[tuple[str, str], ...] = ()
        if decision is not None and (decision.forward or decision.request_headers):
            # The request goes to another address than the pod's own (data-parallel
            # ranks behind one port); the flow maps the served address back.
            destination = ",".join(decision.destination_of(p.address) for p in chosen)
            extra_headers = (*extra_headers, *decision.request_headers)
        else:
            destination = (
                chosen[0].address if len(chosen) == 1 else ",".join(p.address for p in chosen)
            )
        if decision is not None:
            response_headers = decision.response_headers
        self._after = lambda: flow.routed(tracked)

        if not headers_phase:
            return [px.route_in_body_phase(destination, extra_headers, response_headers)]
        replies = [px.route_in_headers_phase(destination, extra_headers, response_headers)]
        if self.request_mode is BodyMode.FULL_DUPLEX_STREAMED and (body_eos or body):
            replies.extend(px.streamed_request_body(body, end_of_stream=body_eos))
        return replies

    def _refuse(self, error: RequestError) -> px.Reply:
        self.phase = Phase.DONE
        self.refused = True
        self.status = error.status
        tracked = self.tracked
        if tracked is not None:  # the outcome hooks count the error
            self.flow.finish(tracked, ok=False, status=error.status)
        else:
            self.gw.metrics.errors.labels(*self._labels, str(error.status)).inc()
        return px.immediate_response(
            error.status, error.body(), f"epp_{error.status}", self.request_id or None
        )

    # -------------------------------------------------------------- response path

    def _continue_response(self, event: px.Event) -> px.Reply:
        if isinstance(event, px.ResponseHeaders):
            return px.CONTINUE_RESPONSE_HEADERS
        if isinstance(event, px.ResponseBody):
            if self.response_mode is not BodyMode.FULL_DUPLEX_STREAMED:
                return px.CONTINUE_RESPONSE_BODY
            return px.streamed_response_body(event.chunk, event.end_of_stream)[0]
        return px.CONTINUE_RESPONSE_TRAILERS

    def _on_response(self, event: px.Event) -> list[px.Reply]:
        kind = type(event)
        if kind is px.ResponseBody:
            return self._on_response_body(event)  # type: ignore[arg-type]
        if kind is px.ResponseHeaders:
            return self._on_response_headers(event)  # type: ignore[arg-type]
        self._after = self._finish_ok
        return [px.CONTINUE_RESPONSE_TRAILERS]

    def _learn_response(self, status: int | None, served: str | None) -> None:
        """First message of the response: its status, and which endpoint answered."""
        self.phase = Phase.RESPONSE
        if status is not None:
            self.status = status
        tracked = self.tracked
        if tracked is not None and served:
            self.flow.served_by(tracked, served)

    def _on_response_headers(self, event: px.ResponseHeaders) -> list[px.Reply]:
        headers = event.headers
        status = headers.get(":status", "")
        self._reader = UsageReader(headers.get("content-type", ""))
        self._learn_response(int(status) if status.isdigit() else None, event.served)
        if event.end_of_stream:
            self._after = self._finish_ok
        return [px.CONTINUE_RESPONSE_HEADERS]

    def _on_response_body(self, event: px.ResponseBody) -> list[px.Reply]:
        # The shipped Envoy config skips the response headers message (one round trip
        # less per request): the status and the served endpoint then come as attributes
        # of the first body message, and the body's format is recognised from its bytes.
        if self.phase is not Phase.RESPONSE:
            self._learn_response(event.status, event.served)
        if self._reader is None:
            self._reader = UsageReader(None)
        chunk = event.chunk
        eos = event.end_of_stream
        tracked = self.tracked
        if chunk and tracked is not None and tracked.first_byte_at is None:
            self.flow.first_byte(tracked)
        reader = self._reader
        if chunk:
            if eos:

                def feed_and_finish() -> None:
                    reader.feed(chunk)
                    self._finish_ok()

                self._after = feed_and_finish
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
        """Ends the request's flow exactly once (end of stream, error or reset)."""
        self.phase = Phase.DONE
        tracked = self.tracked
        if tracked is None or tracked.finished:
            return
        usage = self._reader.finish() if self._reader is not None else None
        self.flow.finish(tracked, ok=ok, status=self.status, usage=usage)

    def close(self) -> None:
        """The stream ended: anything still open ended without a complete response.

        Envoy may cancel the stream as soon as it has the reply to the last response
        chunk, before the work queued behind that reply ran; run it now.
        """
        try:
            self.after_replies()
        except Exception:
            log.exception("request %s: response bookkeeping failed", self.request_id or "?")
        if self._unrouted is not None:  # the client left while the request waited for room
            self.flow.abandon(self._unrouted)
            self._unrouted = None
        if self.tracked is not None and not self.tracked.finished and not self._awaits_log:
            self._finish(ok=False)


class EppServer:
    """The ext_proc service, its gRPC health service and its metrics endpoint."""

    def __init__(
        self,
        flow: RequestFlow,
        *,
        adapter_resolver: AdapterResolver = no_adapters,
        options: ServerOptions | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.flow = flow
        self.datastore = flow.datastore
        self.adapter_resolver = adapter_resolver
        self.options = options or ServerOptions()
        datastore = flow.datastore
        self.metrics = metrics or GatewayMetrics(
            self.options.pool_name, lambda: len(datastore.ready_pods()), datastore.ready_pods
        )
        # Durations, token counts and response errors come from each request's outcome.
        flow.add_hook(self.metrics.outcome_recorder())
        self.response_log = ResponseLog(flow)
        # Arrival and parse instants on each request, for tracing (off: not recorded).
        self.record_marks = False
        self.grpc_port = 0
        self.health_port = 0
        self.metrics_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        self._health_servicer = health.aio.HealthServicer()
        self._expiry: asyncio.Task[None] | None = None
        self.active_streams = 0

    async def process(
        self, requests: AsyncIterator[px.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        exchange = Exchange(self)
        self.active_streams += 1
        # context.read() rather than `async for` over `requests`: one async-generator
        # layer less per message, measurably cheaper on grpc.aio.
        read, write, end = context.read, context.write, grpc.aio.EOF
        read_event, body_modes = px.read_event, px.body_modes
        try:
            while (message := await read()) is not end:
                if exchange.request_mode is None:
                    exchange.set_modes(body_modes(message))
                event = read_event(
                    message,
                    response_started=exchange.phase is not Phase.ROUTED,
                )
                replies = await exchange.handle(event)
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
        tls: grpc.ServerCredentials | None = None,
        ready: bool = True,
    ) -> None:
        """Starts serving; a port of 0 picks a free one (see the *_port attributes).

        With `tls`, the ext_proc port serves TLS; the health port stays plaintext, as
        kubelet's gRPC probe speaks it. With `ready=False` only liveness answers SERVING
        until `set_serving(True)` (a replica still catching up)."""
        options = [
            ("grpc.so_reuseport", 1 if self.options.reuse_port else 0),
            # Envoy keeps one HTTP/2 connection with many streams; allow plenty of them.
            ("grpc.max_concurrent_streams", 10_000),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
        self._grpc = grpc.aio.server(options=options)
        px.add_ext_proc_service(self._grpc, self.process)
        access_log.add_logs_service(self._grpc, self.response_log.on_records)
        health_pb2_grpc.add_HealthServicer_to_server(self._health_servicer, self._grpc)
        add_pool_eds(self._grpc, self.datastore)  # Envoy's view of the pool, for fallbacks
        bind = f"[{host}]" if ":" in host else host  # an IPv6 address such as ::
        address = f"{bind}:{grpc_port}"
        self.grpc_port = (
            self._grpc.add_insecure_port(address)
            if tls is None
            else self._grpc.add_secure_port(address, tls)
        )
        await self._grpc.start()
        if health_port is not None:
            self._health = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self._health_servicer, self._health)
            self.health_port = self._health.add_insecure_port(f"{bind}:{health_port}")
            await self._health.start()
        await self.set_serving(ready)
        if not ready:
            await self._health_servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        if metrics_port is not None:
            self.metrics_port = self.metrics.serve(metrics_port, host)
        self._expiry = asyncio.create_task(self._expire_overdue())

    async def _expire_overdue(self, interval_s: float = 30.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.response_log.expire()

    async def set_serving(self, serving: bool) -> None:
        """What every health service answers (NOT_SERVING: Envoy and kubelet stop sending)."""
        status = health_pb2.HealthCheckResponse.SERVING
        if not serving:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for service in HEALTH_SERVICES:
            await self._health_servicer.set(service, status)

    async def stop(self, grace: float | None = 1.0) -> None:
        await self.set_serving(False)
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        servers = [s for s in (self._grpc, self._health) if s is not None]
        await asyncio.gather(*(s.stop(grace) for s in servers))
        self._grpc = self._health = None
        self.metrics.close()

    async def wait_for_termination(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()


__all__ = ["EppServer", "Exchange", "Phase", "ServerOptions"]

"""RequestFlow and the sans-IO Exchange, driven directly: no gRPC server, no Envoy.

The Exchange is fed the plain events `proto.extproc.read_event` produces and its replies
are read back with `describe_reply`; the flow runs on an injected clock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.errors import RequestError
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.server import EppServer, Exchange, Phase
from smart_epp.framework.lifecycle import (
    CandidateFilter,
    FlowRequest,
    OutcomeObserver,
    RoutedObserver,
)
from smart_epp.framework.types import Api, Decision, Endpoint, LLMRequest, Outcome, PodState
from smart_epp.proto import extproc as px

PODS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
BODY = json.dumps({"model": "tiny", "prompt": "hello world " * 10}).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FirstCandidate:
    """Routes to the first candidate (fallbacks after it); records every hook call."""

    routed: list[str] = field(default_factory=list)
    outcomes: list[tuple[str, Outcome]] = field(default_factory=list)

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        return Decision(endpoints=list(candidates))

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        self.routed.append(request.request_id)

    def on_outcome(self, request: LLMRequest, decision: Decision, outcome: Outcome) -> None:
        self.outcomes.append((request.request_id, outcome))


class Watcher(RoutedObserver, OutcomeObserver):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def on_routed(self, flow: FlowRequest) -> None:
        self.events.append(("routed", flow.request.request_id))

    def on_outcome(self, flow: FlowRequest, outcome: Outcome) -> None:
        self.events.append(("outcome", flow.request.request_id))


class OnlyLast(CandidateFilter):
    def candidates(self, request: LLMRequest, pods: Sequence[PodState]) -> list[PodState]:
        return list(pods[-1:])


def request(rid: str = "r1", prompt: str = "hello") -> LLMRequest:
    return LLMRequest(rid, "/v1/completions", Api.COMPLETIONS, "tiny", prompt=prompt)


def pool() -> Datastore:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint(a) for a in PODS])
    return datastore


def inflight(datastore: Datastore) -> dict[str, int]:
    return {p.address: p.inflight.requests for p in datastore.pods()}


# ----------------------------------------------------------------------------- the flow


async def test_route_books_the_primary_and_finish_releases_it_exactly_once() -> None:
    clock, datastore, scheduler = Clock(), pool(), FirstCandidate()
    flow = RequestFlow(scheduler, datastore, clock=clock)
    tracked = flow.start(request())
    chosen = await flow.route(tracked)
    assert chosen[0].address == PODS[0] and len(chosen) == 1
    assert inflight(datastore)[PODS[0]] == 1 and flow.open_requests() == 1
    flow.routed(tracked)
    clock.now += 0.25
    flow.first_byte(tracked)
    clock.now += 1.0
    outcome = flow.finish(tracked, ok=True, status=200)
    assert outcome is not None
    assert outcome.ttft_s == pytest.approx(0.25) and outcome.duration_s == pytest.approx(1.25)
    assert flow.finish(tracked, ok=False) is None  # exactly once
    assert inflight(datastore)[PODS[0]] == 0 and flow.open_requests() == 0
    assert scheduler.routed == ["r1"] and [rid for rid, _ in scheduler.outcomes] == ["r1"]


async def test_a_fallback_that_served_takes_over_the_in_flight_load() -> None:
    datastore = pool()
    flow = RequestFlow(FirstCandidate(), datastore, destination_count=2)
    tracked = flow.start(request())
    chosen = await flow.route(tracked)
    assert [p.address for p in chosen] == PODS[:2]
    flow.served_by(tracked, PODS[1])
    assert inflight(datastore) == {PODS[0]: 0, PODS[1]: 1, PODS[2]: 0}
    outcome = flow.finish(tracked, ok=True, status=200)
    assert outcome is not None and outcome.address == PODS[1]
    assert sum(inflight(datastore).values()) == 0


async def test_candidates_are_ready_pods_in_the_subset_then_the_hooks_filters() -> None:
    datastore = pool()
    datastore.pods()[0].ready = False
    flow = RequestFlow(FirstCandidate(), datastore)
    assert [p.address for p in flow.candidates(request(), None)] == PODS[1:]
    assert [p.address for p in flow.candidates(request(), [PODS[0], PODS[1]])] == [PODS[1]]
    flow.add_hook(OnlyLast())
    assert [p.address for p in flow.candidates(request(), None)] == [PODS[2]]
    with pytest.raises(RequestError) as refused:
        await flow.route(flow.start(request()), [PODS[0]])
    assert refused.value.status == 503


async def test_hooks_hear_every_request_and_a_faulty_hook_breaks_nothing() -> None:
    class Faulty(OutcomeObserver):
        def on_outcome(self, flow: FlowRequest, outcome: Outcome) -> None:
            raise RuntimeError("boom")

    watcher = Watcher()
    datastore = pool()
    flow = RequestFlow(FirstCandidate(), datastore, hooks=[Faulty(), watcher])
    for rid in ("a", "b"):
        tracked = flow.start(request(rid))
        await flow.route(tracked)
        flow.routed(tracked)
        flow.finish(tracked, ok=True, status=200)
    assert watcher.events == [("routed", "a"), ("outcome", "a"), ("routed", "b"), ("outcome", "b")]
    with pytest.raises(TypeError):
        flow.add_hook(object())


async def test_the_open_table_is_bounded_and_overflow_releases_the_oldest() -> None:
    datastore = pool()
    scheduler = FirstCandidate()
    flow = RequestFlow(scheduler, datastore, max_open=2)
    for rid in ("a", "b", "c"):
        await flow.route(flow.start(request(rid)))
    assert flow.open_requests() == 2
    assert inflight(datastore)[PODS[0]] == 2
    assert [(rid, o.ok) for rid, o in scheduler.outcomes] == [("a", False)]


# ------------------------------------------------------------------------- the exchange


def exchange(destinations: int = 1) -> tuple[Exchange, RequestFlow, FirstCandidate]:
    scheduler = FirstCandidate()
    flow = RequestFlow(scheduler, pool(), destination_count=destinations)
    server = EppServer(flow)
    ex = Exchange(server)
    ex.set_modes((px.BodyMode.FULL_DUPLEX_STREAMED, px.BodyMode.FULL_DUPLEX_STREAMED))
    return ex, flow, scheduler


HEADERS = {":method": "POST", ":path": "/v1/completions", "x-request-id": "req-1"}


async def run(ex: Exchange, event: px.Event) -> list[px.ReplyView]:
    replies = await ex.handle(event)
    ex.after_replies()
    return [px.describe_reply(r) for r in replies]


async def test_full_duplex_exchange_goes_through_its_phases() -> None:
    ex, flow, scheduler = exchange()
    assert ex.phase is Phase.REQUEST_HEADERS
    assert await run(ex, px.RequestHeaders(HEADERS, False, None)) == []  # held for the body
    assert ex.phase is Phase.REQUEST_BODY
    replies = await run(ex, px.RequestBody(BODY, True))
    assert ex.phase is Phase.ROUTED
    assert replies[0].kind == "request_headers"
    assert replies[0].destination == replies[0].metadata_destination == PODS[0]
    assert replies[1].kind == "request_body" and replies[1].body == BODY
    assert scheduler.routed == ["req-1"]  # after the replies were handed out
    sse = b'data: {"choices":[{"text":"x"}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3}}\n\n'
    first = await run(ex, px.ResponseBody(sse, False, 200, PODS[1]))
    assert ex.phase is Phase.RESPONSE and first[0].body == sse
    await run(ex, px.ResponseBody(usage + b"data: [DONE]\n\n", True))
    assert ex.phase is Phase.DONE and flow.open_requests() == 0
    (rid, outcome) = scheduler.outcomes[0]
    assert rid == "req-1" and outcome.ok and outcome.address == PODS[1]  # the fallback served
    assert outcome.usage is not None and outcome.usage.prompt_tokens == 12
    assert outcome.ttft_s is not None and outcome.ttft_s >= 0


async def test_bad_json_is_refused_with_an_openai_error_and_nothing_is_booked() -> None:
    ex, flow, scheduler = exchange()
    await run(ex, px.RequestHeaders(HEADERS, False, None))
    (reply,) = await run(ex, px.RequestBody(b"{not json", True))
    assert reply.kind == "immediate_response" and reply.status == 400
    assert json.loads(reply.body)["error"]["type"] == "invalid_request_error"
    assert ex.done and flow.open_requests() == 0 and scheduler.routed == []


async def test_fallback_list_and_a_client_reset_before_the_response() -> None:
    ex, flow, scheduler = exchange(destinations=2)
    await run(ex, px.RequestHeaders(HEADERS, False, None))
    replies = await run(ex, px.RequestBody(BODY, True))
    assert replies[0].destination == f"{PODS[0]},{PODS[1]}"
    ex.close()  # the stream ended with no response: the client went away
    assert flow.open_requests() == 0
    assert [o.ok for _, o in scheduler.outcomes] == [False]
    assert sum(p.inflight.requests for p in flow.datastore.pods()) == 0


async def test_buffered_exchange_answers_the_body_and_a_bodiless_request_the_headers() -> None:
    ex, _, _ = exchange()
    ex.request_mode = None
    ex.set_modes((px.BodyMode.BUFFERED, px.BodyMode.STREAMED))
    (cont,) = await run(ex, px.RequestHeaders(HEADERS, False, None))
    assert cont.kind == "request_headers" and cont.destination is None
    (routed,) = await run(ex, px.RequestBody(BODY, True))
    assert routed.kind == "request_body" and routed.destination == PODS[0]
    get, _, _ = exchange()
    (reply,) = await run(
        get, px.RequestHeaders({":method": "GET", ":path": "/v1/models"}, True, None)
    )
    assert reply.kind == "request_headers" and reply.destination == PODS[0]

"""Admission and flow control through the request flow, on an injected clock: no I/O."""

from __future__ import annotations

import asyncio
import json

import pytest
from fchelpers import Clock, FirstCandidate, objectives, pool, request, set_load

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.errors import RequestError
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.flowcontrol.admission import AdmissionController
from smart_epp.epp.flowcontrol.queue import BandLimits
from smart_epp.epp.flowcontrol.settings import QueueSettings
from smart_epp.epp.server import EppServer, Exchange
from smart_epp.proto import extproc as px
from smart_epp.scorers.saturation_detectors import UtilizationDetector


class Observed:
    def __init__(self) -> None:
        self.dispatches: list[tuple[int, float]] = []
        self.rejections: list[tuple[int, str]] = []

    def dispatched(self, priority: int, waited_s: float) -> None:
        self.dispatches.append((priority, waited_s))

    def rejected(self, priority: int, reason: object) -> None:
        self.rejections.append((priority, str(reason)))


def make(
    clock: Clock,
    datastore: Datastore,
    *,
    flow_control: bool = True,
    ttl_s: float | None = 10.0,
    bands: dict[int, BandLimits] | None = None,
) -> tuple[RequestFlow, AdmissionController, Observed]:
    detector = UtilizationDetector(
        "u", UtilizationDetector.Params(queueDepthThreshold=2, metricsStalenessThreshold=3600)
    )
    observed = Observed()
    admission = AdmissionController(
        detector,
        datastore.ready_pods,
        objectives(),
        flow_control=flow_control,
        queue=QueueSettings(ttl_s=ttl_s, bands=bands or {}),
        clock=clock,
        observer=observed,
    )
    flow = RequestFlow(FirstCandidate(), datastore, clock=clock, admission=admission)
    return flow, admission, observed


def saturate(datastore: Datastore, clock: Clock, waiting: int = 2) -> None:
    for pod in datastore.pods():
        set_load(pod, clock, waiting=waiting)


def error_body(error: RequestError) -> dict[str, object]:
    return json.loads(error.body())["error"]  # type: ignore[no-any-return]


async def test_not_saturated_goes_straight_through() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, _ = make(clock, datastore)
    tracked = flow.start(request("r1", "batch"))
    chosen = await flow.route(tracked)
    assert chosen[0].address == datastore.pods()[0].address
    assert admission.waiting() == 0
    # The booked request, not scraped yet: 1/2 on one pod of two.
    assert admission.saturation() == pytest.approx(0.25)
    flow.finish(tracked, ok=True, status=200)


async def test_sheddable_is_refused_with_429_when_saturated() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, observed = make(clock, datastore)
    saturate(datastore, clock)
    with pytest.raises(RequestError) as refused:
        await flow.route(flow.start(request("r1", "batch")))
    assert refused.value.status == 429
    body = error_body(refused.value)
    assert body["type"] == "rate_limit_exceeded" and body["code"] == 429
    assert "saturated" in str(body["message"]) and "'batch'" in str(body["message"])
    assert observed.rejections == [(-1, "saturated")]
    assert admission.waiting() == 0


async def test_without_flow_control_non_sheddable_pass_while_saturated() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, _ = make(clock, datastore, flow_control=False)
    saturate(datastore, clock)
    chosen = await flow.route(flow.start(request("r1", "standard")))
    assert chosen and admission.waiting() == 0


async def test_queued_requests_dispatch_by_priority_when_a_pod_has_room() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, observed = make(clock, datastore)
    saturate(datastore, clock)
    order: list[str] = []

    async def send(rid: str, objective: str) -> None:
        tracked = flow.start(request(rid, objective))
        await flow.route(tracked)
        order.append(rid)

    tasks = [
        asyncio.create_task(send("std-1", "standard")),
        asyncio.create_task(send("crit-1", "critical")),
        asyncio.create_task(send("std-2", "standard")),
    ]
    await asyncio.sleep(0)
    assert admission.waiting() == 3 and order == []
    clock.now += 1.5
    saturate(datastore, clock, waiting=1)  # room for about one more per pod
    admission.pump()
    await asyncio.gather(*tasks[:2])
    assert order == ["crit-1", "std-1"]
    assert admission.waiting() == 1
    assert observed.dispatches == [(2, 1.5), (0, 1.5)]
    saturate(datastore, clock, waiting=0)
    for pod in datastore.pods():
        pod.inflight.requests = 0
    admission.pump()
    await tasks[2]
    assert order == ["crit-1", "std-1", "std-2"]


async def test_a_finished_request_dispatches_the_next_one() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, _ = make(clock, datastore)
    # Two requests in flight fill the pool (threshold 2, counted through in-flight).
    first = [flow.start(request(f"r{i}")) for i in range(4)]
    for tracked in first:
        await flow.route(tracked)
    assert admission.saturation() >= 1.0
    waiting = asyncio.create_task(flow.route(flow.start(request("late"))))
    await asyncio.sleep(0)
    assert admission.waiting() == 1 and not waiting.done()
    flow.finish(first[0], ok=True, status=200)  # the finish pumps
    chosen = await asyncio.wait_for(waiting, 1.0)
    assert chosen and admission.waiting() == 0


async def test_ttl_expiry_answers_503_or_429_for_sheddable() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, observed = make(clock, datastore, ttl_s=5.0)
    saturate(datastore, clock)
    normal = asyncio.create_task(flow.route(flow.start(request("n1", "standard"))))
    await asyncio.sleep(0)
    clock.now += 4.9
    admission.pump()
    assert not normal.done()
    clock.now += 0.2
    admission.pump()
    with pytest.raises(RequestError) as expired:
        await normal
    assert expired.value.status == 503
    assert "TTL" in str(error_body(expired.value)["message"])
    assert observed.rejections == [(0, "ttl-expired")]
    assert admission.waiting() == 0


async def test_a_queued_sheddable_request_expires_with_429() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, observed = make(clock, datastore, ttl_s=5.0)
    saturate(datastore, clock)
    normal = asyncio.create_task(flow.route(flow.start(request("n1", "standard"))))
    await asyncio.sleep(0)
    # The pool gets some room but not for two: the queue is not empty, so the sheddable
    # request queues behind, and only the higher band is dispatched.
    pods = datastore.pods()
    set_load(pods[0], clock, waiting=1)
    set_load(pods[1], clock, waiting=2)
    shed = asyncio.create_task(flow.route(flow.start(request("s1", "batch"))))
    await asyncio.sleep(0)
    await normal
    assert admission.waiting() == 1
    clock.now += 5.0
    admission.pump()
    with pytest.raises(RequestError) as expired:
        await shed
    assert expired.value.status == 429
    assert observed.rejections == [(-1, "ttl-expired")]


async def test_queue_full_is_429_with_the_limit_named() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, observed = make(clock, datastore, bands={0: BandLimits(max_requests=1)})
    saturate(datastore, clock)
    held = asyncio.create_task(flow.route(flow.start(request("first"))))
    await asyncio.sleep(0)
    with pytest.raises(RequestError) as full:
        await flow.route(flow.start(request("second")))
    assert full.value.status == 429
    assert "holds 1 requests" in str(error_body(full.value)["message"])
    assert observed.rejections == [(0, "queue-full")]
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert admission.waiting() == 0


async def test_fairness_between_tenants_in_one_band() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, _ = make(clock, datastore)
    saturate(datastore, clock)
    order: list[str] = []

    async def send(rid: str, tenant: str) -> None:
        await flow.route(flow.start(request(rid, "standard", fairness=tenant)))
        order.append(rid)

    tasks = [asyncio.create_task(send(f"heavy-{i}", "heavy")) for i in range(4)]
    tasks.append(asyncio.create_task(send("light-0", "light")))
    await asyncio.sleep(0)
    saturate(datastore, clock, waiting=0)
    for _ in range(5):
        for pod in datastore.pods():
            pod.inflight.requests = 0
        admission.pump()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order.index("light-0") == 1  # served second, not after the heavy tenant's four


async def test_client_disconnect_while_queued_leaves_the_queue_at_once() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, observed = make(clock, datastore)
    saturate(datastore, clock)
    server = EppServer(flow)
    exchange = Exchange(server)
    exchange.set_modes((px.BodyMode.BUFFERED, px.BodyMode.STREAMED))
    body = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
    headers = {
        ":path": "/v1/completions",
        ":method": "POST",
        "x-request-id": "gone",
        "x-gateway-inference-objective": "standard",
    }
    await exchange.handle(px.RequestHeaders(headers=headers, end_of_stream=False, subset=None))
    handling = asyncio.create_task(exchange.handle(px.RequestBody(chunk=body, end_of_stream=True)))
    await asyncio.sleep(0)
    assert admission.waiting() == 1
    # The ext_proc stream ends (Envoy reset it when the client left): the handler is
    # cancelled and the exchange closed, as EppServer.process does.
    handling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handling
    exchange.close()
    assert admission.waiting() == 0
    assert observed.rejections == [(0, "disconnected")]
    assert flow.open_requests() == 0


async def test_exchange_close_alone_reaches_the_queue() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, _ = make(clock, datastore)
    saturate(datastore, clock)
    server = EppServer(flow)
    exchange = Exchange(server)
    exchange.set_modes((px.BodyMode.BUFFERED, px.BodyMode.STREAMED))
    headers = {":path": "/v1/completions", "x-request-id": "left"}
    await exchange.handle(px.RequestHeaders(headers=headers, end_of_stream=False, subset=None))
    body = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
    handling = asyncio.create_task(exchange.handle(px.RequestBody(chunk=body, end_of_stream=True)))
    await asyncio.sleep(0)
    assert admission.waiting() == 1
    exchange.close()  # the stream's end reaches the flow before any cancellation
    assert admission.waiting() == 0
    handling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handling


async def test_a_released_request_goes_to_the_pod_that_has_room() -> None:
    clock = Clock()
    datastore = pool(clock)
    flow, admission, _ = make(clock, datastore)
    saturate(datastore, clock)
    waiting = asyncio.create_task(flow.route(flow.start(request("held"))))
    await asyncio.sleep(0)
    pods = datastore.pods()
    set_load(pods[0], clock, waiting=3)  # past its limit (2)
    set_load(pods[1], clock, waiting=0)  # drained
    admission.pump()
    chosen = await waiting
    # The scheduler alone would take the first candidate; the released request goes to
    # the pod whose room released it.
    assert chosen[0].address == pods[1].address

"""Access-log records and the ResponseLog that ends requests from them, driven directly
on an injected clock (no gRPC server, no Envoy)."""

from __future__ import annotations

import pytest
from test_gateway_flow import PODS, Clock, FirstCandidate, inflight, pool, request

from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.response_log import ResponseLog
from smart_epp.proto import access_log


def body(status: str, upstream: str, first: str, done: str, flags: str, rid: str) -> str:
    return " ".join(("epp1", status, upstream, first, done, flags, rid))


def test_a_record_is_read_from_an_otlp_export_request() -> None:
    wire = access_log.export_request(
        [body("200", PODS[0], "250000", "1500000", "-", "id with spaces"), "not ours"]
    )
    [record] = access_log.read_records(access_log.ExportLogsServiceRequest.FromString(wire))
    assert record.request_id == "id with spaces"
    assert record.status == 200 and record.upstream == PODS[0] and record.flags == ""
    assert record.first_body_byte_s == pytest.approx(0.25)
    assert record.upstream_done_s == pytest.approx(1.5)


def test_missing_values_read_as_none() -> None:
    record = access_log.parse_record(body("0", "-", "-", "-", "DC", "r"))
    assert record is not None
    assert (record.status, record.upstream, record.first_body_byte_s) == (0, None, None)
    assert record.upstream_done_s is None and record.flags == "DC"
    assert access_log.parse_record("epp1 200 too short") is None


async def routed(flow: RequestFlow, log: ResponseLog, rid: str) -> object:
    tracked = flow.start(request(rid))
    await flow.route(tracked)
    log.expect(tracked)
    flow.routed(tracked)
    return tracked


async def test_a_record_ends_its_request_with_the_served_endpoint_and_timings() -> None:
    clock, datastore, scheduler = Clock(), pool(), FirstCandidate()
    flow = RequestFlow(scheduler, datastore, clock=clock)
    log = ResponseLog(flow)
    await routed(flow, log, "r1")
    await routed(flow, log, "r2")
    clock.now += 5.0  # the batch arrives late: timings come from the record
    log.on_records(
        [
            access_log.parse_record(body("200", PODS[2], "400000", "2000000", "-", "r1")),
            access_log.parse_record(body("200", PODS[0], "100000", "-", "DC", "r2")),
            access_log.parse_record(body("200", PODS[0], "1", "2", "-", "unknown")),
        ]  # type: ignore[list-item]
    )
    outcomes = dict(scheduler.outcomes)
    assert outcomes["r1"].ok and outcomes["r1"].address == PODS[2]  # a fallback served
    assert outcomes["r1"].ttft_s == pytest.approx(0.4)
    assert outcomes["r1"].duration_s == pytest.approx(2.0)
    assert outcomes["r2"].ok is False  # the client went away mid-stream
    assert log.unmatched == 1 and len(log) == 0
    assert sum(inflight(datastore).values()) == 0 and flow.open_requests() == 0


async def test_requests_whose_record_never_comes_expire_as_lost() -> None:
    clock, datastore, scheduler = Clock(), pool(), FirstCandidate()
    flow = RequestFlow(scheduler, datastore, clock=clock)
    log = ResponseLog(flow, max_age_s=60)
    await routed(flow, log, "old")
    clock.now += 50
    await routed(flow, log, "young")
    clock.now += 20
    assert log.expire() == 1
    assert [rid for rid, o in scheduler.outcomes if not o.ok] == ["old"]
    assert len(log) == 1 and sum(inflight(datastore).values()) == 1

"""TTFT objectives (`x-slo-ttft-ms`): a sheddable request no pod is predicted to serve in
time is refused at once; with an objective the default policy goes for the most headroom."""

from __future__ import annotations

import pytest
from fchelpers import Clock, objectives, pool, request

from smart_epp.epp.errors import RequestError
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.flowcontrol.admission import AdmissionController
from smart_epp.epp.flowcontrol.settings import QueueSettings
from smart_epp.epp.scheduler import build_scheduler
from smart_epp.framework.types import SLO_TTFT_HEADER, LLMRequest
from smart_epp.scorers.saturation_detectors import UtilizationDetector


class Observed:
    def __init__(self) -> None:
        self.rejections: list[tuple[int, str]] = []

    def dispatched(self, priority: int, waited_s: float) -> None:
        pass

    def rejected(self, priority: int, reason: object) -> None:
        self.rejections.append((priority, str(reason)))


def make(clock: Clock, waiting: int) -> tuple[RequestFlow, Observed]:
    datastore = pool(clock, waiting=waiting)
    detector = UtilizationDetector(
        "u", UtilizationDetector.Params(queueDepthThreshold=1000, metricsStalenessThreshold=3600)
    )
    observed = Observed()
    admission = AdmissionController(
        detector,
        datastore.ready_pods,
        objectives(),
        flow_control=False,
        queue=QueueSettings(ttl_s=None, bands={}),
        clock=clock,
        observer=observed,
    )
    scheduler = build_scheduler("default", tokenizer=False, clock=clock, seed=0)
    return RequestFlow(scheduler, datastore, clock=clock, admission=admission), observed


def with_slo(req: LLMRequest, ms: int, tokens: int = 4000) -> LLMRequest:
    req.headers[SLO_TTFT_HEADER] = str(ms)
    req.prompt_token_ids = list(range(tokens))
    return req


async def test_sheddable_request_that_no_pod_can_serve_in_time_is_refused() -> None:
    clock = Clock()
    flow, observed = make(clock, waiting=30)  # long queues everywhere, pool not saturated
    with pytest.raises(RequestError) as refused:
        await flow.route(flow.start(with_slo(request("r1", "batch"), ms=1)))
    assert refused.value.status == 429
    assert "time-to-first-token objective of 1 ms" in refused.value.message
    assert observed.rejections == [(-1, "slo-unreachable")]
    # Not sheddable: served even though the objective will be missed.
    chosen = await flow.route(flow.start(with_slo(request("r2", "standard"), ms=1)))
    assert chosen
    # An objective the prediction meets: served.
    chosen = await flow.route(flow.start(with_slo(request("r3", "batch"), ms=3_600_000)))
    assert chosen
    assert len(observed.rejections) == 1


async def test_an_objective_goes_to_the_pod_with_the_smallest_predicted_ttft() -> None:
    clock = Clock()
    flow, _ = make(clock, waiting=0)
    busy, idle = flow.datastore.pods()
    busy.metrics.waiting = 20
    tracked = flow.start(with_slo(request("r1", "standard"), ms=10_000))
    chosen = await flow.route(tracked)
    assert chosen[0].address == idle.address
    assert tracked.decision is not None and tracked.decision.predicted_ttft_s is not None

"""llm-d's data-parallel profile handler through real Envoy: the request goes to the
chosen rank's host on the primary port, names the rank in x-data-parallel-host-port, and
the gateway's accounting stays on the rank."""

from __future__ import annotations

import aiohttp
import pytest
from support.backends import echo_backends
from support.envoy import async_running_envoy
from support.net import async_wait_until

from smart_epp.epp.config import parse_config
from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.scheduler import build_scheduler
from smart_epp.epp.server import EppServer
from smart_epp.framework.lifecycle import FlowRequest, OutcomeObserver
from smart_epp.framework.types import Endpoint, Outcome, PodMetrics

pytestmark = pytest.mark.envoy


class Outcomes(OutcomeObserver):
    def __init__(self) -> None:
        self.seen: list[Outcome] = []

    def on_outcome(self, flow: FlowRequest, outcome: Outcome) -> None:
        self.seen.append(outcome)


async def test_request_reaches_the_primary_port_and_names_the_rank() -> None:
    async with echo_backends(2) as (front, rank):
        config = f"""\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: data-parallel-profile-handler
  parameters:
    primaryPort: {front.port}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""
        datastore = Datastore()
        # Two ranks of one host: the front one busy, the other idle and so chosen.
        datastore.set_endpoints([Endpoint(front.address), Endpoint(rank.address)])
        datastore.get(front.address).metrics = PodMetrics(waiting=9, scraped_at=1.0)
        datastore.get(rank.address).metrics = PodMetrics(waiting=0, scraped_at=1.0)
        outcomes = Outcomes()
        flow = RequestFlow(build_scheduler(parse_config(config)), datastore, hooks=[outcomes])
        server = EppServer(flow)
        await server.start(grpc_port=0, health_port=0, metrics_port=None, host="127.0.0.1")
        try:
            async with (
                async_running_envoy(epp_port=server.grpc_port, secure_serving=False) as envoy,
                aiohttp.ClientSession() as http,
            ):
                body = {"model": "tiny", "prompt": "hello"}
                async with http.post(f"{envoy.url}/v1/completions", json=body) as response:
                    assert response.status == 200
                    assert (await response.json())["backend"] == front.name
                await async_wait_until(lambda: outcomes.seen, what="the outcome")
        finally:
            await server.stop(0)
    [received] = front.received
    assert received.data_parallel_rank == rank.address
    assert received.destination == front.address
    assert not rank.received
    [outcome] = outcomes.seen
    assert outcome.ok and outcome.address == rank.address  # accounted on the rank
    assert datastore.get(rank.address).inflight.requests == 0
    assert datastore.get(front.address).inflight.requests == 0

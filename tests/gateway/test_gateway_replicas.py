"""Several picker replicas behind one Envoy: streams are balanced over the live ones, and a
replica that goes away stops receiving them."""

from __future__ import annotations

import aiohttp
import pytest
import yaml
from conftest import TARGET_HEADER, PickByHeader
from support.backends import echo_backends
from support.envoy import async_running_envoy
from support.net import async_wait_until

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.envoy_cmd import EnvoyOptions, epp_replicas, render_envoy_config
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.server import EppServer
from smart_epp.framework.types import Endpoint


def test_replicas_render_into_one_health_checked_cluster() -> None:
    options = EnvoyOptions(epp_replicas=("10.0.0.1:9002", "10.0.0.2:9002"), epp_health_port=9003)
    config = render_envoy_config(options)
    clusters = {c["name"]: c for c in yaml.safe_load(config)["static_resources"]["clusters"]}
    endpoints = clusters["epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints] == [
        9002,
        9002,
    ]
    assert all(e["endpoint"]["health_check_config"]["port_value"] == 9003 for e in endpoints)
    # The access log goes to every replica, through one single-endpoint cluster each.
    assert {"epp_log_0", "epp_log_1"} <= set(clusters)
    assert "outlier_detection" in config
    assert epp_replicas(EnvoyOptions(epp_host="h", epp_port=1)) == [("h", 1)]
    with pytest.raises(ValueError, match="twice"):
        render_envoy_config(EnvoyOptions(epp_replicas=("10.0.0.1:1", "10.0.0.1:1")))


@pytest.mark.envoy
async def test_streams_go_to_live_replicas_only() -> None:
    async with echo_backends(2) as pods:
        replicas: list[tuple[EppServer, PickByHeader]] = []
        for _ in range(2):
            datastore = Datastore()
            datastore.set_endpoints([Endpoint(b.address) for b in pods])
            scheduler = PickByHeader()
            server = EppServer(RequestFlow(scheduler, datastore))
            await server.start(grpc_port=0, health_port=None, metrics_port=None, host="127.0.0.1")
            replicas.append((server, scheduler))
        addresses = tuple(f"127.0.0.1:{server.grpc_port}" for server, _ in replicas)
        try:
            async with (
                async_running_envoy(
                    epp_replicas=addresses, secure_serving=False, epp_health_interval_s=0.2
                ) as envoy,
                aiohttp.ClientSession() as http,
            ):

                async def send(n: int) -> list[int]:
                    statuses = []
                    for i in range(n):
                        body = {"model": "tiny", "prompt": f"hello {i}"}
                        headers = {TARGET_HEADER: pods[i % 2].address}
                        async with http.post(
                            f"{envoy.url}/v1/completions", json=body, headers=headers
                        ) as response:
                            statuses.append(response.status)
                    return statuses

                assert await send(40) == [200] * 40
                # Envoy's round robin over two healthy replicas gives each a share.
                assert all(len(s.routed) >= 10 for _, s in replicas), [
                    len(s.routed) for _, s in replicas
                ]
                dead, _ = replicas[0]
                await dead.stop(0)
                before = len(replicas[0][1].routed)
                # Once the health check has seen it gone, every stream goes to the other.
                statuses = await send(60)
                assert statuses[-30:] == [200] * 30
                assert len(replicas[0][1].routed) == before
        finally:
            for server, _ in replicas:
                await server.stop(0)


@pytest.mark.envoy
async def test_each_replica_hears_how_its_own_requests_ended() -> None:
    async with echo_backends(2) as pods:
        replicas: list[tuple[EppServer, PickByHeader, Datastore]] = []
        for _ in range(2):
            datastore = Datastore()
            datastore.set_endpoints([Endpoint(b.address) for b in pods])
            scheduler = PickByHeader()
            server = EppServer(RequestFlow(scheduler, datastore))
            await server.start(grpc_port=0, health_port=None, metrics_port=None, host="127.0.0.1")
            replicas.append((server, scheduler, datastore))
        addresses = tuple(f"127.0.0.1:{server.grpc_port}" for server, _, _ in replicas)
        try:
            async with (
                async_running_envoy(epp_replicas=addresses, secure_serving=False) as envoy,
                aiohttp.ClientSession() as http,
            ):
                for i in range(30):
                    body = {"model": "tiny", "prompt": f"hello {i}", "stream": True}
                    async with http.post(f"{envoy.url}/v1/completions", json=body) as response:
                        assert response.status == 200
                        await response.read()
                assert all(len(s.routed) >= 5 for _, s, _ in replicas)

                def all_ended() -> bool:
                    return all(len(s.finished) == len(s.routed) for _, s, _ in replicas)

                await async_wait_until(all_ended, what="every replica's outcomes")
                for server, scheduler, datastore in replicas:
                    assert all(f.ok and f.ttft_s is not None for f in scheduler.finished)
                    assert server.flow.open_requests() == 0
                    assert all(p.inflight.requests == 0 for p in datastore.pods())
        finally:
            for server, _, _ in replicas:
                await server.stop(0)


def test_fail_open_renders_buffered_bodies_unless_told_otherwise() -> None:
    """Fail-open must serve a request whose picker dies mid-decision: only a buffered
    body is still in Envoy's hands then (tests/serve/test_serve_replica_failover.py)."""

    def mode(**options: object) -> str:
        config = yaml.safe_load(render_envoy_config(EnvoyOptions(**options)))  # type: ignore[arg-type]
        [listener] = config["static_resources"]["listeners"]
        filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        [ext_proc] = [f for f in filters if f["name"] == "envoy.filters.http.ext_proc"]
        return ext_proc["typed_config"]["processing_mode"]["request_body_mode"]

    assert mode(failure_mode="open") == "BUFFERED"
    assert mode(failure_mode="close") == "FULL_DUPLEX_STREAMED"
    assert mode(failure_mode="open", body_mode="full-duplex") == "FULL_DUPLEX_STREAMED"
    assert mode(failure_mode="close", body_mode="buffered") == "BUFFERED"


def test_the_pool_stream_is_retried_within_a_second() -> None:
    """While no replica is healthy (all catching up at start) Envoy's EDS stream is
    refused; it must come back within a second of one turning healthy, not 30 s."""
    config = yaml.safe_load(render_envoy_config(EnvoyOptions(epp_replicas=("10.0.0.1:9002",))))
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    source = clusters["inference_pool"]["eds_cluster_config"]["eds_config"]["api_config_source"]
    [service] = source["grpc_services"]
    backoff = service["envoy_grpc"]["retry_policy"]["retry_back_off"]
    assert backoff["max_interval"] == "1s"

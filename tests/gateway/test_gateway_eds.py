"""The pool over EDS, as Envoy's xDS client sees it: pushed on every change, never empty."""

from __future__ import annotations

import grpc
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.server import EppServer
from smart_epp.framework.types import Endpoint
from smart_epp.proto.eds import CLUSTER_LOAD_ASSIGNMENT, POOL_CLUSTER


class NoScheduler:
    async def schedule(self, request: object, candidates: object) -> object:
        raise AssertionError("not used")


def members(response: discovery_pb2.DiscoveryResponse) -> list[str]:
    [resource] = response.resources
    assignment = endpoint_pb2.ClusterLoadAssignment()
    resource.Unpack(assignment)
    assert assignment.cluster_name == POOL_CLUSTER
    return [
        f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}"
        for group in assignment.endpoints
        for e in group.lb_endpoints
    ]


async def test_pool_changes_are_pushed_and_an_empty_pool_is_held_back() -> None:
    datastore = Datastore()
    server = EppServer(RequestFlow(NoScheduler(), datastore))  # type: ignore[arg-type]
    await server.start(grpc_port=0, health_port=None, metrics_port=None, host="127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stream = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel).StreamEndpoints()
            await stream.write(
                discovery_pb2.DiscoveryRequest(
                    type_url=CLUSTER_LOAD_ASSIGNMENT, resource_names=[POOL_CLUSTER]
                )
            )
            # Nothing discovered yet: no answer (an empty one would empty Envoy's pool).
            datastore.set_endpoints([Endpoint("10.0.0.2:8000"), Endpoint("pods.example:80")])
            first = await stream.read()
            assert members(first) == ["10.0.0.2:8000"]  # EDS carries IPs only
            datastore.set_endpoints([Endpoint("10.0.0.2:8000"), Endpoint("10.0.0.3:8000")])
            second = await stream.read()
            assert members(second) == ["10.0.0.2:8000", "10.0.0.3:8000"]
            assert int(second.version_info) > int(first.version_info)
            stream.cancel()
    finally:
        await server.stop(0)

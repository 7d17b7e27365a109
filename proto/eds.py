"""The pool's endpoints for Envoy over EDS (State-of-the-World xDS, one cluster).

Envoy's `override_host` load-balancing policy only routes to hosts its cluster knows; this
service tells it the pool the picker discovered (static list, endpoints file or the
Kubernetes API), on the picker's own gRPC port, so Envoy can honour the picker's fallback
list and, when the picker is gone (fail-open), keep balancing over the last pool it heard
of. Every change in membership is pushed to every open stream as a new version.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from envoy.config.core.v3 import address_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.protobuf import any_pb2


class PoolMembership(Protocol):
    """What EDS reads of the gateway's datastore: the members, and their changes."""

    def pods(self) -> Iterable[Any]: ...

    def add_listener(
        self, on_added: Callable[[Any], None], on_removed: Callable[[Any], None]
    ) -> None: ...


log = logging.getLogger(__name__)

CLUSTER_LOAD_ASSIGNMENT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
# The cluster name the shipped Envoy config gives the pool (deploy/envoy/envoy.yaml.j2).
POOL_CLUSTER = "inference_pool"


def load_assignment(cluster: str, addresses: Iterable[str]) -> endpoint_pb2.ClusterLoadAssignment:
    """A ClusterLoadAssignment of `ip:port` addresses; names that are not IPs are skipped
    (EDS carries addresses, Envoy does not resolve them)."""
    lb_endpoints = []
    for address in sorted(set(addresses)):
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        try:
            ipaddress.ip_address(host)
            port_value = int(port)
        except ValueError:
            log.warning("EDS: skipping pool member %r (not IP:PORT)", address)
            continue
        socket = address_pb2.SocketAddress(address=host, port_value=port_value)
        endpoint = endpoint_components_pb2.Endpoint(
            address=address_pb2.Address(socket_address=socket)
        )
        lb_endpoints.append(endpoint_components_pb2.LbEndpoint(endpoint=endpoint))
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster,
        endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=lb_endpoints)],
    )


if TYPE_CHECKING:
    # The generated servicer is untyped; to mypy the service stands on its own methods.
    _EndpointDiscoveryServicer = object
else:
    _EndpointDiscoveryServicer = eds_pb2_grpc.EndpointDiscoveryServiceServicer


class PoolEndpointDiscovery(_EndpointDiscoveryServicer):
    """Serves `addresses()` as the endpoints of every cluster Envoy asks about."""

    def __init__(self, addresses: Callable[[], Iterable[str]]) -> None:
        self._addresses = addresses
        self._version = 1
        self._wakers: set[asyncio.Event] = set()

    @property
    def version(self) -> int:
        return self._version

    def changed(self, *_: object) -> None:
        """Membership changed: every stream sends the new pool (a datastore listener)."""
        self._version += 1
        for wake in self._wakers:
            wake.set()

    def _response(self, clusters: list[str]) -> discovery_pb2.DiscoveryResponse | None:
        """The current pool for `clusters`; None while it is empty: a picker that has just
        started and not yet discovered its pool must not empty Envoy's (Envoy keeps the
        last pool it was sent, which is what failing open balances over)."""
        addresses = list(self._addresses())
        if not addresses:
            return None
        resources = []
        for cluster in clusters or [POOL_CLUSTER]:
            packed = any_pb2.Any()
            packed.Pack(load_assignment(cluster, addresses))
            resources.append(packed)
        version = str(self._version)
        return discovery_pb2.DiscoveryResponse(
            version_info=version,
            resources=resources,
            type_url=CLUSTER_LOAD_ASSIGNMENT,
            nonce=version,
        )

    async def StreamEndpoints(
        self, request_iterator: object, context: grpc.aio.ServicerContext
    ) -> None:
        wake = asyncio.Event()
        self._wakers.add(wake)
        clusters: list[str] = []
        asked = asyncio.Event()
        ended = False

        async def read_requests() -> None:
            nonlocal ended
            try:
                while (request := await context.read()) is not grpc.aio.EOF:
                    if request.resource_names:  # an ACK may repeat or omit them
                        clusters[:] = list(request.resource_names)
                    asked.set()
                    wake.set()
            finally:
                ended = True
                wake.set()

        reader = asyncio.create_task(read_requests())
        sent: int | None = None
        try:
            while True:
                await wake.wait()
                wake.clear()
                if ended:
                    return
                if asked.is_set() and sent != self._version:
                    response = self._response(clusters)
                    if response is not None:
                        sent = self._version
                        await context.write(response)
        finally:
            self._wakers.discard(wake)
            reader.cancel()


def add_pool_eds(server: grpc.aio.Server, datastore: PoolMembership) -> PoolEndpointDiscovery:
    """Serves `datastore`'s members over EDS on `server`, pushing every change."""
    service = PoolEndpointDiscovery(lambda: (p.address for p in datastore.pods()))
    datastore.add_listener(service.changed, service.changed)
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(service, server)
    return service

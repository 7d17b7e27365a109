"""A whole gateway on the test's event loop: echo backends, an in-process epp, real Envoy."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest
from support.backends import EchoBackend, echo_backends
from support.envoy import EnvoyProcess, async_running_envoy

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.server import EppServer, ServerOptions
from smart_epp.framework.types import Decision, Endpoint, LLMRequest, Outcome, PodState, Usage

TARGET_HEADER = "x-test-target"


@dataclass
class Finished:
    request: LLMRequest
    address: str
    usage: Usage | None
    ttft_s: float | None
    ok: bool


@dataclass
class PickByHeader:
    """Deterministic scheduler: the candidate named by the x-test-target header, else the
    first; records what the server reports back."""

    routed: list[tuple[LLMRequest, Decision]] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)

    async def schedule(self, request: LLMRequest, candidates: Sequence[PodState]) -> Decision:
        wanted = request.headers.get(TARGET_HEADER)
        ordered = sorted(candidates, key=lambda p: p.address != wanted)
        return Decision(endpoints=list(ordered))

    def on_routed(self, request: LLMRequest, decision: Decision) -> None:
        self.routed.append((request, decision))

    def on_outcome(self, request: LLMRequest, decision: Decision, outcome: Outcome) -> None:
        self.finished.append(
            Finished(request, outcome.address, outcome.usage, outcome.ttft_s, outcome.ok)
        )


@dataclass
class Gateway:
    backends: list[EchoBackend]
    datastore: Datastore
    scheduler: PickByHeader
    server: EppServer
    envoy: EnvoyProcess
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.envoy.url


@contextlib.asynccontextmanager
async def gateway(
    body_mode: str = "full-duplex",
    *,
    backends: int = 2,
    options: ServerOptions | None = None,
    destination_count: int = 1,
    register_backends: bool = True,
    tls: grpc.ServerCredentials | None = None,
    pool_backends: Sequence[int] | None = None,
    **envoy_overrides: object,
) -> AsyncIterator[Gateway]:
    """With `tls`, the picker serves ext_proc over TLS and Envoy speaks TLS to it. With
    `pool_backends`, Envoy's pool is those backends, listed statically (else over EDS)."""
    async with echo_backends(backends) as pods:
        datastore = Datastore()
        if register_backends:
            datastore.set_endpoints([Endpoint(b.address) for b in pods])
        scheduler = PickByHeader()
        flow = RequestFlow(scheduler, datastore, destination_count=destination_count)
        server = EppServer(flow, options=options)
        await server.start(grpc_port=0, health_port=0, metrics_port=0, host="127.0.0.1", tls=tls)
        envoy_overrides.setdefault("secure_serving", tls is not None)
        if pool_backends is not None:
            envoy_overrides["pool_endpoints"] = tuple(pods[i].address for i in pool_backends)
        try:
            async with (
                async_running_envoy(
                    epp_port=server.grpc_port, body_mode=body_mode, **envoy_overrides
                ) as envoy,
                aiohttp.ClientSession() as http,
            ):
                yield Gateway(pods, datastore, scheduler, server, envoy, http)
        finally:
            await server.stop(0)


@pytest.fixture(params=["full-duplex", "buffered"])
def body_mode(request: pytest.FixtureRequest) -> str:
    return request.param

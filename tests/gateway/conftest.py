"""A whole gateway on the test's event loop: echo backends, an in-process epp, real Envoy."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import aiohttp
import pytest
from support.backends import EchoBackend, echo_backends
from support.envoy import EnvoyProcess, async_running_envoy

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.server import EppServer, ServerOptions
from smart_epp.epp.types import Decision, Endpoint, LLMRequest, PodState, Usage

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

    def on_response(
        self, request: LLMRequest, address: str, usage: Usage | None, ttft_s: float | None, ok: bool
    ) -> None:
        self.finished.append(Finished(request, address, usage, ttft_s, ok))


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
    register_backends: bool = True,
    **envoy_overrides: object,
) -> AsyncIterator[Gateway]:
    async with echo_backends(backends) as pods:
        datastore = Datastore()
        if register_backends:
            datastore.set_endpoints([Endpoint(b.address) for b in pods])
        scheduler = PickByHeader()
        server = EppServer(scheduler, datastore, options=options)
        await server.start(grpc_port=0, health_port=0, metrics_port=0, host="127.0.0.1")
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

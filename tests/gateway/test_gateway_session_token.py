"""llm-d's session-affinity protocol through real Envoy: the response carries
`x-session-token` naming the pod that was picked, and a request that sends it back lands
on that pod."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from support.backends import EchoBackend, echo_backends
from support.envoy import async_running_envoy

from smart_epp.epp.config import parse_config
from smart_epp.epp.datastore import Datastore
from smart_epp.epp.flow import RequestFlow
from smart_epp.epp.scheduler import build_scheduler
from smart_epp.epp.server import EppServer
from smart_epp.framework.types import Endpoint

pytestmark = pytest.mark.envoy

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: session-affinity-scorer
  - pluginRef: max-score-picker
"""


@contextlib.asynccontextmanager
async def session_gateway(backends: int) -> AsyncIterator[tuple[str, list[EchoBackend]]]:
    async with echo_backends(backends) as pods:
        datastore = Datastore()
        datastore.set_endpoints([Endpoint(b.address) for b in pods])
        scheduler = build_scheduler(parse_config(CONFIG), seed=7)
        server = EppServer(RequestFlow(scheduler, datastore))
        await server.start(grpc_port=0, health_port=0, metrics_port=0, host="127.0.0.1")
        try:
            async with async_running_envoy(
                epp_port=server.grpc_port, secure_serving=False
            ) as envoy:
                yield envoy.url, pods
        finally:
            await server.stop(0)


async def test_session_token_pins_the_following_requests_to_the_pod_it_names() -> None:
    async with session_gateway(4) as (url, pods), aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "hello"}
        async with http.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
            served = (await response.json())["backend"]
            token = response.headers["x-session-token"]
        by_name = {p.name: p for p in pods}
        assert base64.b64decode(token).decode() == by_name[served].address
        for _ in range(12):  # ties alone would be broken at random over 4 pods
            headers = {"x-session-token": token}
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200
                assert (await r.json())["backend"] == served
                assert r.headers["x-session-token"] == token
        # A token for a pod that is not in the pool pins nothing; it is not an error.
        stranger = base64.b64encode(b"10.9.9.9:1").decode()
        async with http.post(
            f"{url}/v1/completions", json=body, headers={"x-session-token": stranger}
        ) as r:
            assert r.status == 200

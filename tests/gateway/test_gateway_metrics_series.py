"""The Inference Extension's request and pool series on the gateway's --metrics-port,
fed by real requests through Envoy."""

from __future__ import annotations

import urllib.request

import pytest
from conftest import TARGET_HEADER, gateway
from prometheus_client.parser import text_string_to_metric_families
from support.net import async_wait_until

from smart_epp.framework.types import PodMetrics

pytestmark = pytest.mark.envoy


def samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        page = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def value(found: dict, series: str, **labels: str) -> float:
    key = (series, tuple(sorted(labels.items())))
    have = sorted(k for k in found if k[0] == series)
    assert key in found, f"{series}{labels} not exported; have {have}"
    return found[key]


async def test_request_and_pool_series_follow_the_requests() -> None:
    async with gateway("full-duplex", response_path="ext-proc") as gw:
        a, b = gw.backends
        gw.datastore.get(a.address).metrics = PodMetrics(
            waiting=4, running=2, kv_usage=0.5, scraped_at=1.0
        )
        gw.datastore.get(b.address).metrics = PodMetrics(
            waiting=0, running=4, kv_usage=0.25, scraped_at=1.0
        )
        body = {"model": "tiny", "prompt": "stream me", "stream": True}
        headers = {TARGET_HEADER: a.address, "x-gateway-inference-fairness-id": "team-a"}
        for _ in range(2):
            async with gw.http.post(f"{gw.url}/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200
                await r.read()
        await async_wait_until(lambda: len(gw.scheduler.finished) == 2, what="both ends")
        port = gw.server.metrics_port
        found = samples(port)
        objective = {"model_name": "tiny", "target_model_name": "tiny"}
        ttft = {**objective, "fairness_id": "team-a", "priority": "", "streaming": "true"}
        assert value(found, "llm_d_epp_request_ttft_seconds_count", **ttft) == 2
        assert value(found, "inference_objective_prompt_cached_tokens_count", **objective) == 2
        assert value(found, "inference_objective_prompt_cached_tokens_sum", **objective) == 32
        ntpot = "inference_objective_normalized_time_per_output_token_seconds_count"
        assert value(found, ntpot, **objective) == 2
        assert value(found, "inference_objective_running_requests", model_name="tiny") == 0
        host, _, port_label = a.address.rpartition(":")
        attempts = {"status": "success", "target_model_name": "tiny", "pod_name": host,
                    "namespace": "", "port": port_label}  # fmt: skip
        assert value(found, "inference_extension_scheduler_attempts_total", **attempts) == 2
        assert value(found, "inference_pool_average_kv_cache_utilization", name="default") == 0.375
        assert value(found, "inference_pool_average_queue_size", name="default") == 2
        assert value(found, "inference_pool_average_running_requests", name="default") == 3
        assert any(name == "inference_extension_info" and v == 1 for (name, _), v in found.items())

        # No endpoint: a failed attempt is counted.
        gw.datastore.set_endpoints([])
        async with gw.http.post(f"{gw.url}/v1/completions", json=body) as r:
            assert r.status == 503
        failure = {"status": "failure", "target_model_name": "tiny", "pod_name": "",
                   "namespace": "", "port": ""}  # fmt: skip
        assert value(samples(port), "inference_extension_scheduler_attempts_total", **failure) == 1

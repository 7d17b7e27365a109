"""`epp serve --workers 2` behind real Envoy: both worker processes decide on the one
ext_proc port, requests sharing a prefix stay on one pod whichever worker decides them,
in-flight counts return to zero although Envoy's access log reaches only some workers,
health and metrics are one port each, and SIGTERM drains and stops every worker.

The workers subscribe to no KV events, so only the shared routed prefixes keep a
prefix's requests together.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from serve_stack import (
    MODEL,
    endpoint_entry,
    epp_process,
    sample,
    served_counts,
    sim_pods,
    text,
    wait_started,
    write_endpoints,
)
from support.envoy import async_running_envoy
from support.net import async_wait_until

pytestmark = [pytest.mark.envoy, pytest.mark.redis]

WORKERS = 2


async def test_two_workers_share_one_port_and_their_routing_state(tmp_path: Path) -> None:
    async with sim_pods() as pool:
        pool_file = tmp_path / "pool.yaml"
        write_endpoints(pool_file, [endpoint_entry(p) for p in pool.pods])
        args = ["--endpoints-file", str(pool_file), "--kv-events-mode", "off",
                "--workers", str(WORKERS)]  # fmt: skip
        with epp_process(tmp_path / "epp.log", *args) as epp:
            await wait_started(epp)
            async with aiohttp.ClientSession() as http:

                async def page() -> str:
                    return await epp.metrics(http)

                async def all_ready() -> bool:
                    ready = sample(await page(), "inference_pool_ready_pods")
                    return ready == WORKERS * len(pool.pods)

                # The supervisor's metrics port is up at once; the workers take a while.
                await async_wait_until(all_ready, 60, "every worker seeing every pod")
            # Envoy threads hold one ext_proc connection each; the kernel spreads those
            # connections over the workers.
            async with (
                async_running_envoy(epp_port=epp.grpc_port, concurrency=8) as envoy,
                aiohttp.ClientSession() as http,
            ):

                async def send(body: dict) -> int:
                    # A new client connection each time, so Envoy spreads the requests
                    # over its threads and so over both workers.
                    connector = aiohttp.TCPConnector(force_close=True)
                    async with aiohttp.ClientSession(connector=connector) as client:
                        before = served_counts(pool)
                        async with client.post(f"{envoy.url}/v1/completions", json=body) as r:
                            assert r.status == 200, await r.text()
                            await r.read()
                    after = served_counts(pool)
                    [pod] = [i for i, (a, b) in enumerate(zip(before, after, strict=True))
                             if b > a]  # fmt: skip
                    return pod

                async def drained() -> bool:
                    return sample(await page(), "inference_objective_running_requests") == 0

                async def applied() -> float:
                    return sample(await page(), "smart_epp_shared_state_routed_entries_total",
                                  direction="applied")  # fmt: skip

                for seed in (71, 72, 73):
                    prefix = text(seed, 600)
                    pods = set()
                    for n in range(8):
                        before = await applied()
                        body = {"model": MODEL, "prompt": f"{prefix} {n}", "max_tokens": 1}
                        pods.add(await send(body))

                        async def synced(before: float = before) -> bool:
                            return await applied() > before

                        # The other worker has the routed prefix (within a sync interval),
                        # and, its access-log record in, the request no longer counts as
                        # queued on its pod, wherever the record arrived.
                        await async_wait_until(synced, 10, "the other worker syncing")
                        await async_wait_until(drained, 10, "the request released")
                    assert len(pods) == 1, f"prefix {seed} spread over pods {pods}"

                metrics = await page()
                decided = [
                    sample(
                        metrics,
                        "inference_extension_scheduler_attempts_total",
                        status="success",
                        worker=str(i),
                    )
                    for i in range(WORKERS)
                ]
                print(f"decisions per worker: {decided}")
                assert sum(decided) == 24
                assert all(d > 0 for d in decided), decided

                await async_wait_until(drained, 15, "every request released")
                assert sample(await page(), "smart_epp_access_log_expired_total") == 0
        assert epp.process.returncode == 0
        log = epp.log()
        assert f"all {WORKERS} workers stopped (exit codes [0, 0])" in log
        assert log.count("drained in") == WORKERS
        assert "Traceback" not in log

"""`epp serve` as tooling runs it: its real CLI in a subprocess, real Envoy in front, four
simulated vLLM pods behind, described by an endpoints file with their KV-event sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from serve_stack import (
    MODEL,
    KVEventRelay,
    endpoint_entry,
    epp_process,
    gateway,
    sample,
    sim_pods,
    text,
    write_endpoints,
)
from support.net import async_wait_until, free_port
from support.relays import MetricsRelay

pytestmark = pytest.mark.envoy


async def test_a_prefix_warmed_on_pod_3_draws_requests_sharing_it(tmp_path: Path) -> None:
    async with sim_pods() as pool:
        pool_file = tmp_path / "pool.yaml"
        write_endpoints(pool_file, [endpoint_entry(p) for p in pool.pods])
        with epp_process(tmp_path / "epp.log", "--endpoints-file", str(pool_file)) as epp:
            async with gateway(epp, pool) as gw:
                # Two prefixes on two pods, asked for in turn: each request must find its own
                # pod (a lucky first pick cannot pass for both).
                prefixes = {3: text(1, 600), 0: text(2, 600)}
                for i, prefix in prefixes.items():
                    await gw.warm(i, f"{prefix} warm")
                for n in range(3):
                    for i, prefix in prefixes.items():
                        body = {"model": MODEL, "prompt": f"{prefix} q{n}", "max_tokens": 2}
                        pod, answer = await gw.via_gateway(body)
                        assert pod == i
                        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert "Traceback" not in epp.log()


async def test_b_adapter_requests_go_to_the_pods_serving_them(tmp_path: Path) -> None:
    async with sim_pods() as pool:
        pool_file = tmp_path / "pool.yaml"
        write_endpoints(pool_file, [endpoint_entry(p) for p in pool.pods])
        with epp_process(tmp_path / "epp.log", "--endpoints-file", str(pool_file)) as epp:
            async with gateway(epp, pool) as gw:
                for n in range(4):
                    body = {"model": "lora-a", "prompt": text(20 + n, 60), "max_tokens": 2}
                    pod, answer = await gw.via_gateway(body)
                    assert pod == 2  # the only pod with lora-a
                    assert answer["model"] == "lora-a"
                    pod, _ = await gw.via_gateway({**body, "model": "lora-b"})
                    assert pod == 0  # the only pod with lora-b
                for n in range(3):  # base-model requests still answered (every pod serves it)
                    await gw.via_gateway({"model": MODEL, "prompt": text(40 + n, 60),
                                          "max_tokens": 2})  # fmt: skip

                # A model no pod serves: 404 from the gateway, as vLLM itself answers it.
                body = {"model": "no-such-model", "prompt": "hello", "max_tokens": 2}
                before = [sum(h.pod.engine.stats.request_success.values()) for h in pool.pods]
                async with gw.http.post(f"{gw.envoy.url}/v1/completions", json=body) as resp:
                    assert resp.status == 404
                    error = (await resp.json())["error"]
                assert "no-such-model" in error["message"]
                assert error["param"] == "model" and error["code"] == 404
                after = [sum(h.pod.engine.stats.request_success.values()) for h in pool.pods]
                assert after == before

                # A prompt longer than every pod's context (their /v1/models max_model_len):
                # 400 from the gateway in vLLM's words, and no pod is asked.
                offered: set[str] = set()  # request ids an engine was asked to take
                for h in pool.pods:
                    engine = h.pod.engine

                    def seen(req, engine_validate=engine.validate):  # type: ignore[no-untyped-def]
                        offered.add(req.request_id)
                        return engine_validate(req)

                    engine.validate = seen  # type: ignore[method-assign]
                limit = pool.pods[0].pod.engine.max_model_len
                await gw.via_gateway({"model": MODEL, "prompt": [7] * 100, "max_tokens": 2})
                assert len(offered) == 1  # an ordinary request reaches a pod's engine
                body = {"model": MODEL, "prompt": [7] * (limit + 10), "max_tokens": 2}
                async with gw.http.post(f"{gw.envoy.url}/v1/completions", json=body) as resp:
                    assert resp.status == 400
                    error = (await resp.json())["error"]
                assert error["message"].startswith(
                    f"This model's maximum context length is {limit} tokens."
                )
                assert error["param"] == "input_tokens" and error["code"] == 400
                assert len(offered) == 1
        assert "Traceback" not in epp.log()


async def test_c_restart_whose_first_batch_is_lost_is_caught_by_the_start_time(
    tmp_path: Path,
) -> None:
    async with sim_pods() as pool:
        metrics_relay = MetricsRelay(lambda: pool.pods[3].metrics_url)
        await metrics_relay.start()
        events_relay = KVEventRelay(pool.pods[3].kv_events_endpoint)
        events_relay.start()
        pool_file = tmp_path / "pool.yaml"
        entries = [endpoint_entry(p) for p in pool.pods[:3]]
        entries.append(
            endpoint_entry(pool.pods[3], metrics=metrics_relay.url, kv_events=events_relay.endpoint)
        )
        write_endpoints(pool_file, entries)
        address = pool.pods[3].http_address
        try:
            with epp_process(tmp_path / "epp.log", "--endpoints-file", str(pool_file)) as epp:
                async with gateway(epp, pool) as gw:
                    await gw.warm(3, text(5, 400))  # the stream is live before the restart
                    replays_before = sample(
                        await gw.metrics(), "smart_epp_kv_replays_total", pod=address, outcome="ok"
                    )
                    assert sample(await gw.metrics(), "smart_epp_pod_restarts_total") == 0

                    # Restart pod 3 while its KV events are being lost and its /metrics is
                    # unreachable, and have the new process cache a prefix meanwhile: the
                    # only batch that says so never reaches the gateway.
                    events_relay.losing = True
                    await metrics_relay.stop()
                    await pool.restart(3)
                    fresh = text(6, 600)
                    await gw.direct(3, {"model": MODEL, "prompt": f"{fresh} warm", "max_tokens": 1})
                    # (Batches published before the relay's SUB reconnected are lost too.)
                    await metrics_relay.start()

                    async def restart_seen() -> bool:
                        page = await gw.metrics()
                        return sample(page, "smart_epp_pod_restarts_total", pod=address) >= 1

                    await async_wait_until(restart_seen, 10, "restart seen on /metrics")
                    page = await gw.metrics()
                    assert sample(page, "smart_epp_pod_restarts_total") == 1  # only pod 3

                    async def replayed() -> bool:
                        page = await gw.metrics()
                        ok = sample(page, "smart_epp_kv_replays_total", pod=address, outcome="ok")
                        return ok > replays_before

                    await async_wait_until(replayed, 10, "pod 3 replayed from 0")
                    events_relay.losing = False  # the replay, not the live stream, recovered it
                    await async_wait_until(gw.all_ready, 10, "pod 3 back in the candidate set")
                    # The lost batch came back through the replay: the prefix the new process
                    # holds draws requests to it, and every request is answered.
                    for n in range(3):
                        body = {"model": MODEL, "prompt": f"{fresh} q{n}", "max_tokens": 2}
                        pod, answer = await gw.via_gateway(body)
                        assert pod == 3
                        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                    statuses = await asyncio.gather(
                        *(
                            gw.status_via_gateway(
                                {"model": MODEL, "prompt": text(70 + n, 80), "max_tokens": 2}
                            )
                            for n in range(8)
                        )
                    )
                    assert statuses == [200] * 8
            log = epp.log()
            assert "Traceback" not in log
            assert f"pod {address} restarted" in log
        finally:
            await events_relay.close()
            await metrics_relay.close()


async def test_d_gateway_metrics_and_debug_explain_line(tmp_path: Path) -> None:
    async with sim_pods(2) as pool:
        pool_file = tmp_path / "pool.yaml"
        write_endpoints(pool_file, [endpoint_entry(p) for p in pool.pods])
        with epp_process(
            tmp_path / "epp.log", "--endpoints-file", str(pool_file), "--log-level", "DEBUG"
        ) as epp:
            async with gateway(epp, pool) as gw:
                address = pool.pods[1].http_address
                await gw.warm(1, text(8, 200))
                for n in range(3):
                    await gw.via_gateway({"model": MODEL, "prompt": text(9 + n, 100),
                                          "max_tokens": 2})  # fmt: skip
                learned = 'smart_epp_pod_learned_cold_ttft_seconds{plugin="predicted-ttft-scorer"'

                async def costs_learned() -> bool:
                    return learned in await gw.metrics()

                # Learned from the answers' access-log records, which trail the responses.
                await async_wait_until(costs_learned, 10, "learned costs in /metrics")

                async def prefills_released() -> bool:
                    return sample(await gw.metrics(), "smart_epp_prefill_progress_requests") == 0

                # Every answered request stops being followed in its pod's KV events.
                await async_wait_until(prefills_released, 10, "followed prefills released")
                page = await gw.metrics()

                # The pod leaves the pool (the endpoints file no longer lists it): what the
                # scorer learned of it goes too, with the pool's own series.
                write_endpoints(pool_file, [endpoint_entry(pool.pods[0])])

                async def departed_pod_forgotten() -> bool:
                    left = await gw.metrics()
                    cost = sample(left, "smart_epp_pod_learned_cold_ttft_seconds", pod=address)
                    return 'inference_pool_ready_pods{name="default"} 1.0' in left and cost == 0

                await async_wait_until(departed_pod_forgotten, 10, "the departed pod forgotten")
        assert 0 < sample(page, "smart_epp_pod_learned_cold_ttft_seconds",
                          pod=address, plugin="predicted-ttft-scorer") < 5  # fmt: skip
        # Scheduler: per-plugin timings (and the e2e histogram exactly once).
        assert sample(page, "inference_extension_plugin_duration_seconds_count",
                      plugin_type="predicted-ttft-scorer") >= 3  # fmt: skip
        assert page.count("# TYPE inference_extension_scheduler_e2e_duration_seconds ") == 1
        assert sample(page, "inference_extension_scheduler_e2e_duration_seconds_count") >= 3
        # Scrape and model catalog.
        assert sample(page, "smart_epp_metrics_scrapes_total", result="ok") > 0
        assert sample(page, "smart_epp_model_catalog_polls_total", result="ok") > 0
        # KV events and the index; the prefills of the new prompts sent through the gateway,
        # seen in their pods' events.
        assert sample(page, "smart_epp_kv_events_total", pod=address, type="BlockStored") > 0
        assert sample(page, "smart_epp_prefill_progress_confirmed_pods") >= 1
        assert sample(page, "smart_epp_kv_index_entries") > 0
        # Gateway.
        assert 'inference_pool_ready_pods{name="default"} 2.0' in page
        log = epp.log()
        decisions = [line for line in log.splitlines() if "decision request=" in line]
        assert len(decisions) >= 3
        assert all("predicted-ttft-scorer=" in line and "picked=" in line for line in decisions)
        assert "Traceback" not in log


async def test_e_central_mode_learns_every_pod_from_one_bound_socket(tmp_path: Path) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    async with sim_pods(publish_to=bind) as pool:
        pool_file = tmp_path / "pool.yaml"
        write_endpoints(pool_file, [endpoint_entry(p) for p in pool.pods])
        with epp_process(
            tmp_path / "epp.log", "--endpoints-file", str(pool_file),
            "--kv-events-mode", "central", "--kv-events-bind", bind,
        ) as epp:  # fmt: skip
            async with gateway(epp, pool) as gw:
                await gw.until_streams_live()
                prefixes = {1: text(21, 500), 2: text(22, 500)}
                for i, prefix in prefixes.items():
                    await gw.warm(i, f"{prefix} warm")
                for n in range(2):
                    for i, prefix in prefixes.items():
                        body = {"model": MODEL, "prompt": f"{prefix} q{n}", "max_tokens": 2}
                        pod, _ = await gw.via_gateway(body)
                        assert pod == i
        assert "Traceback" not in epp.log()


async def test_bad_config_and_log_level_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: EndpointPickerConfig\nplugins:\n  - type: no-such-plugin\n")
    for args, expected in (
        (["--config", str(bad)], "no-such-plugin"),
        (["--config", "nonexistent-config"], "neither a file nor a built-in"),
        (["--log-level", "chatty"], "invalid choice"),
        (["--kv-events-mode", "both"], "invalid choice"),
    ):
        with epp_process(tmp_path / "epp.log", *args) as epp:
            code = await asyncio.to_thread(epp.process.wait, 30)
        assert code == 2, epp.log()
        assert expected in epp.log()

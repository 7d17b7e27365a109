"""The /metrics page: vLLM's names and label sets, parsed by prometheus_client."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from simfix import scenario_file

from smart_epp.benchmarks.sim.engine import EngineConfig, SimEngine, SimRequest
from smart_epp.benchmarks.sim.prom import PodMetrics


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_names_types_and_label_sets_match_the_captured_vllm_page():
    engine = SimEngine(EngineConfig(block_size=32, num_blocks=64, loras={"lora-a": "/a"}))
    mine = families(PodMetrics(engine, "tiny", with_lora=True).render().decode())
    real = families(scenario_file("lora", "metrics.during.txt").read_text())
    names = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_waiting_by_reason",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:cache_config_info",
    ]
    for name in names:
        assert mine[name].type == real[name].type, name
        mine_labels = {frozenset(s.labels) for s in mine[name].samples}
        real_labels = {frozenset(s.labels) for s in real[name].samples}
        if name == "vllm:cache_config_info":
            assert mine_labels.pop() <= real_labels.pop()
        else:
            assert mine_labels == real_labels, name
        if mine[name].type == "histogram":
            les = [s.labels["le"] for s in mine[name].samples if s.name.endswith("_bucket")]
            real_les = [s.labels["le"] for s in real[name].samples if s.name.endswith("_bucket")]
            assert les == real_les, name
    assert mine["vllm:lora_requests_info"].type == real["vllm:lora_requests_info"].type


def test_lora_info_keeps_every_combination_with_its_last_time():
    loras = {"a": "/a", "b": "/b"}
    for mode, expected_waiting in (("vllm", "a"), ("exact", "b")):
        engine = SimEngine(EngineConfig(block_size=16, num_blocks=64, loras=loras, max_loras=1))
        metrics = PodMetrics(engine, "m", lora_info_mode=mode, with_lora=True)
        engine.add_request(SimRequest("a", [1] * 20, 3, lora_name="a"), 0.0)
        engine.add_request(SimRequest("b", [1] * 20, 3, lora_name="b"), 0.0)
        now = 0.0
        for wall in (100.0, 101.0, 102.0, 103.0, 104.0, 105.0, 106.0, 107.0):
            if engine.has_unfinished():
                now = engine.step(now).end
                metrics.record_step(engine, wall)
        series = {
            (s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"]): s.value
            for s in families(metrics.render().decode())["vllm:lora_requests_info"].samples
        }
        assert series[("a", expected_waiting)] < series[("b", "b" if mode == "vllm" else "")]
        assert {s.labels["max_lora"] for s in families(metrics.render().decode())[
            "vllm:lora_requests_info"].samples} == {"1"}  # fmt: skip


def test_no_lora_series_without_adapters():
    engine = SimEngine(EngineConfig(block_size=16, num_blocks=64))
    assert "vllm:lora_requests_info" not in families(PodMetrics(engine, "m").render().decode())

"""The live peer-router benchmark's harness, run with smart-epp alone (no peer binaries)."""

from __future__ import annotations

import pytest
from support.paths import TINY_MODEL

from smart_epp.benchmarks import live_peers
from smart_epp.benchmarks.live_peers import BenchConfig, aggregate, compare, render, run_bench


@pytest.mark.envoy
def test_harness_runs_smart_epp_and_reports_missing_peers(monkeypatch: pytest.MonkeyPatch):
    # As on a machine without the `peers` extra: the peers are reported, not run.
    monkeypatch.setattr(live_peers, "_binary", lambda name: None)
    cfg = BenchConfig(pods=2, requests=16, groups=2, system_len=600, question_len=100, output_len=8)
    doc = run_bench(
        cfg, ["smart-epp", "vllm-router cache_aware"], loads=[0.4], repeats=1, log=lambda _: None
    )
    block = doc["by_load"]["0.4"]
    (run,) = block["runs"]["smart-epp"]
    assert run["ok"] and run["completed"] == 16 and run["failed"] == 0, run
    assert 0 < run["ttft_p50_s"] <= run["ttft_p90_s"] <= run["ttft_p99_s"]
    # What the pods measured from arrival to first token is part of what the client saw.
    assert 0 < run["pod_ttft_mean_s"] < run["ttft_mean_s"]
    assert run["router_cpu_ms_per_request"] > 0  # epp and Envoy did work for each request
    # Fresh pods: their own counters saw exactly this run's 16 requests, and the second
    # and later prompts of each group found the group's 600-token system prompt cached.
    assert sum(run["requests_per_pod"]) == 16
    # Each of the 2 groups has a home pod, read from the pods' x-served-by answers.
    assert sum(run["groups_per_pod"]) == 2 and len(run["groups_per_pod"]) == 2
    assert 0 <= run["groups_on_several_pods"] <= 2
    assert 0.5 < run["pod_prefix_hit_rate"] < 1.0
    assert block["routers"]["smart-epp"]["clean_runs"] == 1
    assert "not installed" in block["unavailable"]["vllm-router cache_aware"]
    assert "pip install" in render(doc)
    # 0.4 of 2 pods' raw prefill capacity (25k tokens/s each, slowed 4x) over 700 tokens.
    assert block["offered_qps"] == pytest.approx(0.4 * 12_500 / 700)


@pytest.mark.envoy
def test_three_replicas_sharing_one_store_serve_the_workload_through_one_envoy():
    cfg = BenchConfig(pods=2, requests=16, groups=2, system_len=600, question_len=100, output_len=8)
    doc = run_bench(cfg, ["smart-epp 3 replicas"], loads=[0.4], repeats=1, log=lambda _: None)
    (run,) = doc["by_load"]["0.4"]["runs"]["smart-epp 3 replicas"]
    assert run["ok"] and run["completed"] == 16 and run["failed"] == 0, run
    # Every group's system prompt was reused after its first request, whichever replica
    # decided: the replicas see the same pods' KV events and each other's routings.
    assert 0.5 < run["pod_prefix_hit_rate"] < 1.0
    assert run["router_cpu_ms_per_request"] > 0
    # Each replica's learned costs are read back from its /metrics.
    learned = run["learned_cold_ttft_s"]
    assert set(learned) == {"epp0", "epp1", "epp2"}
    assert any(learned.values()) and all(
        0 < seconds < 10 for pods in learned.values() for seconds in pods.values()
    )
    # Where the gateway's time went, from the pickers' own histograms: tokenizing is part
    # of scheduling, which is part of the time Envoy saw to the first byte.
    assert 0 < run["gateway_tokenize_s"] < run["gateway_scheduling_s"]
    assert run["gateway_scheduling_s"] < run["gateway_envoy_ttft_s"] < 10


@pytest.mark.envoy
def test_given_the_pods_tokenizer_files_smart_epp_checks_them_then_tokenizes_itself():
    # Pods tokenizing with a real BPE tokenizer; the picker finds the same files under
    # --tokenizers-dir and must agree with the pods' /tokenize before it uses them.
    cfg = BenchConfig(
        pods=2, requests=16, groups=2, system_len=300, question_len=50, output_len=4,
        pod_tokenizer=TINY_MODEL,
    )  # fmt: skip
    doc = run_bench(
        cfg, ["smart-epp", "smart-epp via /tokenize"], [0.4], repeats=1, log=lambda _: None
    )
    runs = doc["by_load"]["0.4"]["runs"]
    (own,) = runs["smart-epp"]
    (asked,) = runs["smart-epp via /tokenize"]
    assert own["ok"] and own["failed"] == 0 and asked["ok"] and asked["failed"] == 0
    assert own["gateway_tokenizer_discovery"] == ["trusted"]
    assert asked["gateway_tokenizer_discovery"] == ["not_found"]
    # Either way the token ids are the pods' own, so the system prompts are found cached.
    assert 0.5 < own["pod_prefix_hit_rate"] < 1.0
    assert 0.5 < asked["pod_prefix_hit_rate"] < 1.0
    # The load is computed from the tokens the pods see, several per generated word.
    block = doc["by_load"]["0.4"]
    assert block["offered_qps"] < 0.5 * (0.4 * 12_500 / 350)


def test_gateway_timings_average_every_picker_and_label_set():
    tokenize = 'extension_point="Prepare",plugin_name="tokenize",plugin_type="tokenize"'
    match = 'extension_point="Prepare",plugin_name="prefix-match",plugin_type="prefix-match"'
    plugin = "inference_extension_plugin_duration_seconds"
    ttft = "llm_d_epp_request_ttft_seconds"
    page = "\n".join([
        "inference_extension_scheduler_e2e_duration_seconds_sum 0.5",
        "inference_extension_scheduler_e2e_duration_seconds_count 100.0",
        f"{plugin}_sum{{{tokenize}}} 0.2",
        f"{plugin}_count{{{tokenize}}} 100.0",
        f"{plugin}_sum{{{match}}} 9.0",
        f"{plugin}_count{{{match}}} 100.0",
        f'{ttft}_sum{{streaming="false"}} 1.0',
        f'{ttft}_count{{streaming="false"}} 10.0',
        f'{ttft}_sum{{streaming="true"}} 7.0',
        f'{ttft}_count{{streaming="true"}} 90.0',
        "",
    ])  # fmt: skip
    other = page.replace(" 0.5\n", " 1.5\n")  # a second replica, slower to schedule
    timings = live_peers.gateway_timings({"epp0": page, "epp1": other})
    assert timings["scheduling_s"] == pytest.approx(0.01)
    assert timings["tokenize_s"] == pytest.approx(0.002)  # prefix-match is not counted
    assert timings["envoy_ttft_s"] == pytest.approx(0.08)
    assert live_peers.gateway_timings({"epp0": "# nothing yet\n"}) == {}


def test_learned_spread_is_the_widest_disagreement_over_pods():
    learned = {"epp0": {"a": 0.10, "b": 0.20}, "epp1": {"a": 0.12, "b": 0.30}, "epp2": {}}
    assert live_peers.learned_spread(learned) == pytest.approx(1.5)
    assert live_peers.learned_spread({"epp0": {"a": 0.1}}) is None


def _run(p90: float, ok: bool = True) -> dict:
    return {
        "ok": ok, "failed": 0, "failure_statuses": [], "ttft_p50_s": p90 / 2,
        "ttft_p90_s": p90, "ttft_p99_s": p90 * 2, "pod_prefix_hit_rate": 0.5,
        "client_cached_token_rate": 0.5, "load_imbalance": 1.0,
    }  # fmt: skip


def test_aggregate_takes_median_and_spread_of_clean_runs_only():
    failed = {**_run(9.0), "failed": 2, "failure_statuses": ["503"]}
    row = aggregate([_run(0.3), _run(0.1), _run(0.2), failed])
    assert row["ttft_p90_s"] == {"median": 0.2, "min": 0.1, "max": 0.3}
    assert row["clean_runs"] == 3 and row["runs"] == 4
    assert row["not_clean"] == ["2 failed: ['503']"]


def test_compare_pairs_repeats_and_divides_medians():
    runs = {"smart-epp": [_run(0.1), _run(0.4)], "peer": [_run(0.2), _run(0.2)]}
    table = {name: aggregate(rs) for name, rs in runs.items()}
    (c,) = compare(table, runs).values()
    assert c["smart_epp_p90_over_peer_p90"] == pytest.approx(0.25 / 0.2)
    assert c["repeats_smart_epp_p90_lower_or_equal"] == 1 and c["paired_repeats"] == 2

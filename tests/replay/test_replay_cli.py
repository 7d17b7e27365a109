"""`epp replay` end to end in sim mode: flags, JSON schema, plots, determinism, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.paths import MOONCAKE_TRACE

from smart_epp.benchmarks.replay.arrivals import (
    ladder_arrivals,
    parse_ladder,
    poisson_arrivals,
    scaled_arrivals,
    stage_times,
)
from smart_epp.benchmarks.replay.traces import TraceRequest
from smart_epp.benchmarks.sim.profiles import get_profile
from smart_epp.epp.cli import build_parser

SUMMARY_KEYS = {
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "e2e_p50_s",
    "output_tok_per_s",
    "completed",
    "failed",
    "prefix_hit_rate",
    "load_imbalance",
    "rejected",
    "rejected_reasons",
    "ttft_prediction_factor",
    "output_tok_per_s_while_arriving",
    "prefill_imbalance",
}


def _replay(argv: list[str]) -> int:
    args = build_parser().parse_args(["replay", *argv])
    return args.func(args)


def _workload_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "sp.yaml"
    path.write_text(
        "num_groups: 6\nnum_prompts_per_group: 5\nsystem_prompt_len: 480\n"
        "question_len: 40\noutput_len: 6\n"
    )
    return path


def test_sim_mode_writes_schema_table_and_plots(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    rc = _replay(
        [
            "--trace", str(MOONCAKE_TRACE), "--format", "mooncake", "--limit", "60",
            "--pods", "4", "--speedup", "4", "--policy", "default", "round-robin",
            "--policy", "llmd-precise", "full-information", "--out", str(out), "--seed", "3",
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "replay_mooncake_synthetic_trace.json").read_text())
    assert doc["trace"] == str(MOONCAKE_TRACE)
    assert doc["pods"] == 4 and doc["profile"] == "h100-llama3-8b"
    assert list(doc["policies"]) == ["default", "round-robin", "llmd-precise", "full-information"]
    # 6 of the first 60 requests are longer than the profile's 32768 tokens: vLLM refuses them.
    too_long = {"longer than max_model_len (32768 tokens)": 6}
    for summary in doc["policies"].values():
        assert set(summary) == SUMMARY_KEYS
        assert summary["completed"] == 54 and summary["failed"] == 6
        assert summary["rejected"] == 6 and summary["rejected_reasons"] == too_long
        assert summary["ttft_p50_s"] <= summary["ttft_p90_s"] <= summary["ttft_p99_s"]
    # Only the default predicts a TTFT for each request it routes.
    assert doc["policies"]["default"]["ttft_prediction_factor"] >= 1
    assert doc["policies"]["round-robin"]["ttft_prediction_factor"] is None
    assert 0 < doc["infinite_cache_prefix_hit_rate"] < 1
    assert (out / "replay_mooncake_synthetic_trace_ttft_cdf.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "TTFT p90" in printed and "llmd-precise" in printed
    assert "rejected" in printed and "longer than max_model_len (32768 tokens)" in printed


def test_long_context_profile_serves_what_the_short_one_rejects(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--trace", str(MOONCAKE_TRACE), "--format", "mooncake", "--limit", "60",
            "--pods", "2", "--speedup", "4", "--policy", "round-robin", "--no-plots",
            "--out", str(out)]  # fmt: skip
    assert _replay([*argv, "--profile", "h100-llama3.1-8b-128k"]) == 0
    doc = json.loads((out / "replay_mooncake_synthetic_trace.json").read_text())
    assert doc["policies"]["round-robin"]["rejected"] == 0
    assert doc["policies"]["round-robin"]["completed"] == 60


def test_profile_file_is_accepted_and_the_limit_is_never_lifted(tmp_path: Path, capsys) -> None:
    trace = _workload_yaml(tmp_path)  # 520-token prompts + 6 output tokens
    profile = tmp_path / "small.yaml"
    data = get_profile("cpu-tiny").model_dump() | {"name": "small", "max_model_len": 512}
    profile.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    argv = ["--trace", str(trace), "--qps", "20", "--pods", "2", "--policy", "round-robin",
            "--no-plots", "--out", str(out), "--profile", str(profile)]  # fmt: skip
    assert _replay(argv) == 0
    summary = json.loads((out / "replay_sp.json").read_text())["policies"]["round-robin"]
    assert summary["rejected"] == 30 and summary["completed"] == 0
    assert summary["rejected_reasons"] == {"longer than max_model_len (512 tokens)": 30}
    capsys.readouterr()
    assert _replay([*argv, "--max-model-len", "1024"]) == 2
    assert "above the 512 tokens of profile small" in capsys.readouterr().out


def test_pod_slowdowns_slow_the_named_pods_and_are_recorded(tmp_path: Path, capsys) -> None:
    trace = _workload_yaml(tmp_path)
    argv = ["--trace", str(trace), "--qps", "0.5", "--pods", "2", "--policy", "round-robin",
            "--no-plots", "--routing-latency", "0"]  # fmt: skip
    ttft = {}
    for name, extra in (("even", []), ("uneven", ["--pod-slowdowns", "3,1"])):
        out = tmp_path / name
        assert _replay([*argv, "--out", str(out), *extra]) == 0
        doc = json.loads((out / "replay_sp.json").read_text())
        ttft[name] = doc["policies"]["round-robin"]["ttft_p50_s"]
        assert doc["pod_slowdowns"] == ([3.0, 1.0] if extra else [])
    # Round-robin sends half the requests, far apart, to the pod three times slower.
    assert ttft["uneven"] > 1.5 * ttft["even"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["replay", "--trace", str(trace), "--pod-slowdowns", "1,0"])
    assert "comma-separated positive numbers" in capsys.readouterr().err


def test_same_seed_same_json_for_the_real_scheduler(tmp_path: Path) -> None:
    trace = _workload_yaml(tmp_path)
    docs = []
    for run in ("a", "b"):
        out = tmp_path / run
        rc = _replay(
            [
                "--trace", str(trace), "--qps", "20", "--pods", "3", "--seed", "5",
                "--policy", "default", "gie-default", "random", "--out", str(out), "--no-plots",
            ]
        )  # fmt: skip
        assert rc == 0
        doc = json.loads((out / "replay_sp.json").read_text())
        assert set(doc.pop("sim_wall_s")) == {"default", "gie-default", "random"}
        docs.append(doc)
    assert docs[0] == docs[1]


def test_ladder_reports_each_stage_and_plots(tmp_path: Path) -> None:
    trace = _workload_yaml(tmp_path)
    out = tmp_path / "lad"
    rc = _replay(
        [
            "--trace", str(trace), "--ladder", "2,8", "--stage-duration", "5", "--pods", "2",
            "--policy", "round-robin", "full-information", "--out", str(out), "--name", "lad",
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "lad.json").read_text())
    assert set(doc["ladder"]) == {"round-robin", "full-information"}
    for stages in doc["ladder"].values():
        assert list(stages) == ["2", "8"]
        assert stages["2"]["completed"] == 10 and stages["8"]["completed"] == 40
    assert (out / "lad_ttft_p90_vs_qps.png").exists()


def test_bad_inputs_are_clear_errors(tmp_path: Path, capsys) -> None:
    trace = _workload_yaml(tmp_path)
    assert _replay(["--trace", str(trace), "--out", str(tmp_path)]) == 2
    assert "--qps" in capsys.readouterr().out
    assert _replay(["--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().out
    assert _replay(["--trace", str(trace), "--qps", "1", "--policy", "magic"]) == 2
    assert "unknown policy" in capsys.readouterr().out
    assert _replay(["--trace", str(trace), "--qps", "1", "--mode", "live"]) == 2
    assert "--target" in capsys.readouterr().out
    assert _replay(["--trace", str(trace), "--qps", "1", "--profile", "h200"]) == 2
    assert "unknown profile 'h200'" in capsys.readouterr().out


def _req(i: int, ts: float) -> TraceRequest:
    return TraceRequest(index=i, timestamp_s=ts, output_tokens=1, segments=([1],))


def test_speedup_spreads_requests_that_share_a_bucket() -> None:
    reqs = [_req(0, 0.0), _req(1, 0.0), _req(2, 0.0), _req(3, 3.0), _req(4, 6.0)]
    assert scaled_arrivals(reqs, 1.0) == [0.0, 1.0, 2.0, 3.0, 6.0]
    assert scaled_arrivals(reqs, 2.0) == [0.0, 0.5, 1.0, 1.5, 3.0]
    # The last bucket has no next timestamp: it spreads over the typical gap.
    tail = [_req(0, 0.0), _req(1, 3.0), _req(2, 3.0)]
    assert scaled_arrivals(tail, 1.0) == [0.0, 3.0, 6.0]
    with pytest.raises(ValueError):
        scaled_arrivals(reqs, 0)


def test_poisson_and_ladder_rates() -> None:
    times = poisson_arrivals(4000, 10.0, seed=1)
    assert times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(0.1, rel=0.05)
    assert poisson_arrivals(10, 10.0, seed=1) == times[:10]
    stages = ladder_arrivals(parse_ladder("2, 4,8"), 10.0)
    assert [len(s.requests) for s in stages] == [20, 40, 80]
    assert [s.start_s for s in stages] == [0.0, 10.0, 20.0]
    t = stage_times(stages, seed=0)
    assert len(t) == 140 and all(x >= 10.0 for x in t[20:60])
    with pytest.raises(ValueError):
        parse_ladder("2,x")

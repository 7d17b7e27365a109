"""benchmarks/policy_grid.py: a written grid brought up to date for one policy."""

from __future__ import annotations

import json

import pytest

from smart_epp.benchmarks.policy_grid import grid_args, main, mooncake_window


def test_updating_a_grid_reruns_only_the_named_policies_in_place(tmp_path):
    grid = ["--requests", "12", "--trace", "shared-prefix", "--load", "0.3",
            "--attention", "0", "--policy", "default", "round-robin", "--jobs", "1",
            "--out", str(tmp_path), "--name", "g"]  # fmt: skip
    assert main(grid) == 0
    path = tmp_path / "g.json"
    written = json.loads(path.read_text())
    key = "shared-prefix load=0.3 attn=0x"
    # As if written by an older default, and a round-robin figure that must stay as is.
    stale = json.loads(path.read_text())
    stale["cells"][key]["default"]["ttft_p90_s"] = 99.0
    stale["cells"][key]["round-robin"]["ttft_p50_s"] = 42.0
    path.write_text(json.dumps(stale))
    assert main(["--update", str(path), "--policy", "default", "--jobs", "1"]) == 0
    updated = json.loads(path.read_text())
    default = updated["cells"][key]["default"]
    assert default["ttft_p90_s"] == written["cells"][key]["default"]["ttft_p90_s"]
    assert updated["cells"][key]["round-robin"]["ttft_p50_s"] == 42.0
    rr = updated["cells"][key]["round-robin"]["ttft_p90_s"]
    best = min(default["ttft_p90_s"], rr)
    assert updated["ttft_p90_relative_to_best"][key]["round-robin"] == rr / best
    assert updated["updates"] == [
        {"policies": ["default"],
         "command": f"benchmarks/policy_grid.py --update {path} --policy default --jobs 1"}
    ]  # fmt: skip


def test_a_mooncake_window_is_a_later_stretch_of_the_trace_started_afresh():
    whole = mooncake_window(30)
    later = mooncake_window(10, 20)
    assert [r.index for r in later] == list(range(10))
    assert later[0].timestamp_s == 0.0
    for mine, theirs in zip(later, whole[20:], strict=True):
        assert mine.token_ids() == theirs.token_ids()
        assert mine.output_tokens == theirs.output_tokens
        assert mine.timestamp_s == theirs.timestamp_s - whole[20].timestamp_s
    # Start 0 is the trace's first requests, as every grid written before had them.
    assert [r.token_ids() for r in mooncake_window(10, 0)] == [r.token_ids() for r in whole[:10]]
    with pytest.raises(ValueError, match="no 10 requests"):
        mooncake_window(10, 10**6)


def test_a_grid_of_a_later_mooncake_window_records_it_and_replays_those_requests(tmp_path):
    grid = ["--requests", "12", "--trace", "mooncake", "--load", "0.3", "--attention", "0",
            "--policy", "round-robin", "--jobs", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main([*grid, "--name", "first"]) == 0
    assert main([*grid, "--name", "later", "--mooncake-start", "600"]) == 0
    first = json.loads((tmp_path / "first.json").read_text())
    later = json.loads((tmp_path / "later.json").read_text())
    assert (first["mooncake_start"], later["mooncake_start"]) == (0, 600)
    key = "mooncake load=0.3 attn=0x"
    # Other prompts, other outputs: the figures differ.
    figures = ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "output_tok_per_s")
    rr_first, rr_later = first["cells"][key]["round-robin"], later["cells"][key]["round-robin"]
    assert all(rr_first[f] != rr_later[f] for f in figures)
    assert grid_args(later).mooncake_start == 600
    with pytest.raises(SystemExit):
        main([*grid, "--name", "bad", "--mooncake-start", "-1"])
    assert not (tmp_path / "bad.json").exists()


def test_a_grid_with_late_signals_records_them_and_its_routers_hear_late(tmp_path):
    grid = ["--requests", "40", "--trace", "shared-prefix", "--load", "1.1", "--attention",
            "0", "--policy", "default", "--jobs", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main([*grid, "--name", "fresh"]) == 0
    assert main([*grid, "--name", "late", "--scrape-interval", "2", "--kv-event-delay", "2"]) == 0
    fresh = json.loads((tmp_path / "fresh.json").read_text())
    late = json.loads((tmp_path / "late.json").read_text())
    assert (fresh["scrape_interval_s"], fresh["kv_event_delay_s"]) == (0.05, 0.05)
    assert (late["scrape_interval_s"], late["kv_event_delay_s"]) == (2.0, 2.0)
    replayed = grid_args(late)
    assert (replayed.scrape_interval, replayed.kv_event_delay) == (2.0, 2.0)
    # With the pods' stored blocks heard of 2 s late, some group's follower is placed
    # before its system prompt shows anywhere, and computes it again elsewhere.
    key = "shared-prefix load=1.1 attn=0x"
    on_time, heard_late = fresh["cells"][key]["default"], late["cells"][key]["default"]
    assert heard_late["prefix_hit_rate"] < on_time["prefix_hit_rate"]
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(SystemExit):
            main([*grid, "--name", "bad", "--scrape-interval", bad])
    assert not (tmp_path / "bad.json").exists()

"""benchmarks/policy_grid.py: a written grid brought up to date for one policy."""

from __future__ import annotations

import json

from smart_epp.benchmarks.policy_grid import main


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

"""benchmarks/grid_change.py: one policy's move between two sets of grids."""

from __future__ import annotations

import json
import math
from pathlib import Path

from smart_epp.benchmarks.grid_change import compare


def figures(p90: float, p50: float = 0.1, tokens: float = 100.0) -> dict[str, float]:
    return {"ttft_p90_s": p90, "ttft_p50_s": p50, "output_tok_per_s_while_arriving": tokens}


def write(folder: Path, cells: dict[str, dict[str, dict[str, float]]]) -> None:
    folder.mkdir()
    (folder / "policy_grid_x.json").write_text(json.dumps({"cells": cells}))


def test_misses_ranks_and_moves_are_counted_against_the_same_peers(tmp_path: Path) -> None:
    peer = figures(1.0, p50=0.1, tokens=100.0)
    write(
        tmp_path / "before",
        {
            "mooncake load=1.1 attn=1x": {"default": figures(1.2), "peer": peer},
            "multi-turn load=0.3 attn=0x": {"default": figures(0.5), "peer": peer},
        },
    )
    write(
        tmp_path / "after",
        {
            # p90 now within 3%, but p50 past 10% and tokens/s past 2% of the peer's.
            "mooncake load=1.1 attn=1x": {
                "default": figures(1.02, p50=0.2, tokens=90.0),
                "peer": peer,
            },
            "multi-turn load=0.3 attn=0x": {"default": figures(0.5), "peer": peer},
        },
    )
    result = compare(tmp_path / "before", tmp_path / "after", "default")
    grid = result["grids"]["policy_grid_x"]
    assert grid["before"]["misses"] == {"p90": 1, "p50": 0, "tokens_while_arriving": 0}
    assert grid["after"]["misses"] == {"p90": 0, "p50": 1, "tokens_while_arriving": 1}
    assert grid["before"]["mean_rank_p90"] == 1.5 and grid["after"]["mean_rank_p90"] == 1.5
    assert grid["after"]["worst_cell"]["cell"] == "mooncake load=1.1 attn=1x"
    assert math.isclose(result["by_workload"]["mooncake"]["change_geomean"], 1.02 / 1.2)
    assert result["by_workload"]["multi-turn"]["change_geomean"] == 1.0
    assert [m["cell"] for m in result["moved_better_beyond_10pct"]] == ["mooncake load=1.1 attn=1x"]
    assert result["moved_worse_beyond_10pct"] == []


def test_a_grid_written_without_the_policy_is_left_out(tmp_path: Path) -> None:
    peer = figures(1.0)
    write(tmp_path / "before", {"mooncake load=1.1 attn=1x": {"peer": peer}})
    write(
        tmp_path / "after",
        {"mooncake load=1.1 attn=1x": {"peer": peer, "default": figures(1.1)}},
    )
    assert compare(tmp_path / "before", tmp_path / "after", "default")["grids"] == {}

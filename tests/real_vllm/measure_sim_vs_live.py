"""How faithful is the simulator: the same trace live through Envoy + `epp serve` in front of
two real vLLM pods and in `epp replay --mode sim` with the profile `epp calibrate` measured
on one of them, for `default` and `round-robin` (benchmarks/sim_vs_live.py does the work).

Both modes must rank the policies alike on TTFT p50, and the sim's TTFT p50 must be within
35% of the live one for each policy. Set SMART_EPP_SIM_VS_LIVE_OUT to keep the table
(benchmarks/results/sim_vs_live.json is written that way).

A measurement run on demand, not part of `./dev test` (its file name keeps pytest's
collection from finding it): on a host where the two CPU pods share two cores with
Envoy, epp and the client it does not meet that goal (README, "How faithful is the
simulator"), and `./dev test` holds only checks that pass. Run it by path:
    .venv/bin/python -m pytest tests/real_vllm/measure_sim_vs_live.py
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_pods import (
    BLOCK_SIZE,
    MODEL_DIR,
    SERVED_MODEL,
    VllmPod,
    dev_mode_pod_config,
    start_pods,
)

from smart_epp.benchmarks.sim_vs_live import P50_TOLERANCE, PodSpec, compare, render

pytestmark = [pytest.mark.real_vllm, pytest.mark.envoy]


@pytest.fixture(scope="module")
def twin_pod(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPod]:
    """A second pod started exactly like the calibrated one."""
    pod = VllmPod(
        dev_mode_pod_config("twin"), vllm_python, tmp_path_factory.mktemp("vllm-twin-logs")
    )
    start_pods([pod])
    try:
        yield pod
    finally:
        pod.stop()


def spec(pod: VllmPod) -> PodSpec:
    return PodSpec(pod.config.address, pod.config.kv_endpoint, pod.config.replay_endpoint)


def test_sim_ranks_policies_like_live_and_its_ttft_p50_is_within_35_percent(
    calibration_pod: VllmPod,
    twin_pod: VllmPod,
    calibrated_profile: Path,
    tmp_path: Path,
    sim_vs_live: list,
) -> None:
    table = compare(
        [spec(calibration_pod), spec(twin_pod)],
        calibrated_profile,
        MODEL_DIR / "tiny-model" / "tokenizer.json",
        SERVED_MODEL,
        BLOCK_SIZE,
        tmp_path,
    )
    shown = render(table)
    sim_vs_live.append(shown)
    if out := os.environ.get("SMART_EPP_SIM_VS_LIVE_OUT"):
        Path(out).write_text(json.dumps(table, indent=2) + "\n")
    for row in table["policies"].values():
        for mode in ("live", "sim"):
            assert row[mode]["all"]["failed"] == 0, shown
            assert row[mode]["all"]["completed"] == table["trace"]["requests"], shown
    assert table["ranking_agrees"], shown
    for policy, row in table["policies"].items():
        assert abs(row["sim_p50_error"]["all"]) <= P50_TOLERANCE, f"{policy}\n{shown}"

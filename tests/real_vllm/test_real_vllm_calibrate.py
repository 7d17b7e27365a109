"""`epp calibrate` against a real vLLM CPU pod, then a sim pod with the profile it wrote.

The check is the one a user would make: the same cold prompts (100-900 tokens) sent to the
real pod and to `epp sim --profile <calibrated>` get times to first token whose median
error is within 35%.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from support.net import free_port
from vllm_pods import (
    BLOCK_SIZE,
    SERVED_MODEL,
    PodConfig,
    VllmPod,
    die_with_parent,
    start_pods,
    stop_process_group,
)

from smart_epp.benchmarks.calibrate.probe import Probe, Prompts
from smart_epp.benchmarks.sim.profiles import load_profile_file
from smart_epp.epp.cli import build_parser

pytestmark = pytest.mark.real_vllm

EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]
COLD_LENGTHS = [100 + 800 * i // 14 for i in range(15)]  # 15 prompts, 100 to 900 tokens


@pytest.fixture(scope="module")
def real_pod(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPod]:
    """A plain pod of its own, with /reset_prefix_cache enabled (vLLM's dev mode)."""
    config = PodConfig(
        name="calibrate",
        http_port=free_port(),
        kv_port=free_port(),
        replay_port=free_port(),
        extra_env=(("VLLM_SERVER_DEV_MODE", "1"),),
    )
    pod = VllmPod(config, vllm_python, tmp_path_factory.mktemp("vllm-calibrate-logs"))
    start_pods([pod])
    try:
        yield pod
    finally:
        pod.stop()


@pytest.fixture(scope="module")
def calibrated(real_pod: VllmPod, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The profile `epp calibrate` writes for the pod (vLLM CPU defaults: chunk 2048, 128 seqs)."""
    out = tmp_path_factory.mktemp("calibrate") / "cpu-tiny-calibrated.yaml"
    args = build_parser().parse_args(
        ["calibrate", "--target", real_pod.url, "--out", str(out),
         "--name", "cpu-tiny-calibrated", "--max-num-batched-tokens", "2048",
         "--max-num-seqs", "128", "--repeats", "5"]
    )  # fmt: skip
    assert args.func(args) == 0
    return out


@pytest.fixture(scope="module")
def sim_pod(calibrated: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [*die_with_parent(), *EPP, "sim", "--port", str(port),
         "--no-kv-events", "--model", SERVED_MODEL, "--block-size", str(BLOCK_SIZE),
         "--profile", str(calibrated)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"pod 0: http://127.0.0.1:{port} "), proc.stderr
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(proc, grace_s=10)  # type: ignore[arg-type]


async def cold_ttfts(real_url: str, sim_url: str) -> list[tuple[int, float, float]]:
    """Each prompt to both pods in turn (unique tokens, so cold on both): (n, real, sim)."""
    prompts = Prompts(seed=11)
    rows = []
    async with aiohttp.ClientSession() as session:
        real, sim = Probe(session, real_url, SERVED_MODEL), Probe(session, sim_url, SERVED_MODEL)
        for n in COLD_LENGTHS:
            prompt = prompts.make(n)
            real_t = (await real.stream(prompt, 1)).ttft_s
            sim_t = (await sim.stream(prompt, 1)).ttft_s
            assert real_t is not None and sim_t is not None
            rows.append((n, real_t, sim_t))
    return rows


def test_calibrated_profile_loads_and_the_sim_answers_cold_prompts_like_the_real_pod(
    calibrated: Path, sim_pod: str, real_pod: VllmPod, fidelity_rows: list
) -> None:
    profile = load_profile_file(calibrated)
    assert profile.max_model_len == real_pod.config.max_model_len
    assert profile.kv_tokens == real_pod.config.num_gpu_blocks * BLOCK_SIZE
    rows = asyncio.run(cold_ttfts(real_pod.url, sim_pod))
    errors = [abs(sim - real) / real * 100 for _, real, sim in rows]
    fidelity_rows.extend(rows)
    assert statistics.median(errors) <= 35, rows


def test_over_long_prompt_gets_the_same_error_from_sim_and_vllm(sim_pod: str, real_pod: VllmPod):
    """The sim pod runs the calibrated profile, so its limit is the real pod's."""
    import json
    import urllib.error
    import urllib.request

    prompt = [10 + i % 400 for i in range(real_pod.config.max_model_len + 20)]
    body = json.dumps({"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    answers = []
    for url in (real_pod.url, sim_pod):
        request = urllib.request.Request(
            f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=60)
        answers.append((err.value.code, json.loads(err.value.read())))
    assert answers[0] == answers[1]
    assert answers[0][0] == 400 and answers[0][1]["error"]["param"] == "input_tokens"

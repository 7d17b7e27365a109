"""`epp calibrate` against a real vLLM CPU pod, then a sim pod with the profile it wrote.

The check is the one a user would make: the same cold prompts (100-900 tokens) sent to the
real pod and to `epp sim --profile <calibrated>` get times to first token whose median
error is within 35%. The pod and its calibrated profile are session fixtures (conftest),
shared with the sim-vs-live replay comparison.
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
from prometheus_client.parser import text_string_to_metric_families
from support.net import async_wait_until, free_port
from vllm_pods import (
    BLOCK_SIZE,
    GATEWAY_SCRAPE_INTERVAL_S,
    SERVED_MODEL,
    VllmPod,
    die_with_parent,
    stop_process_group,
)

from smart_epp.benchmarks.calibrate.cli import scraping
from smart_epp.benchmarks.calibrate.probe import Probe, Prompts
from smart_epp.benchmarks.sim.profiles import load_profile_file

pytestmark = pytest.mark.real_vllm

EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]
COLD_LENGTHS = [100 + 800 * i // 14 for i in range(15)]  # 15 prompts, 100 to 900 tokens
REPEATS = 3  # fresh prompts per length and pod; the median of them is compared


@pytest.fixture(scope="module")
def real_pod(calibration_pod: VllmPod) -> VllmPod:
    return calibration_pod


@pytest.fixture(scope="module")
def calibrated(calibrated_profile: Path) -> Path:
    return calibrated_profile


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


async def idle(session: aiohttp.ClientSession, url: str) -> bool:
    """No request running or waiting on the pod (vLLM's gauges, which `epp sim` also serves)."""
    async with session.get(f"{url}/metrics") as resp:
        page = await resp.text()
    busy = 0.0
    for family in text_string_to_metric_families(page):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            busy += sum(sample.value for sample in family.samples)
    return busy == 0


async def cold_ttfts(real_url: str, sim_url: str) -> list[tuple[int, float, float]]:
    """Median TTFT per prompt length on each pod: (n, real, sim).

    Every run sends a fresh prompt (unique tokens, so cold on both pods) to both pods in
    turn, the order alternating between runs, once both pods are idle; the medians of
    REPEATS runs keep one slow answer on a busy machine from deciding a length's error.
    """
    prompts = Prompts(seed=11)
    real_times: dict[int, list[float]] = {n: [] for n in COLD_LENGTHS}
    sim_times: dict[int, list[float]] = {n: [] for n in COLD_LENGTHS}
    async with (
        aiohttp.ClientSession() as session,
        # As during calibration: both pods scraped as often as the gateway scrapes them.
        scraping(session, real_url, GATEWAY_SCRAPE_INTERVAL_S),
        scraping(session, sim_url, GATEWAY_SCRAPE_INTERVAL_S),
    ):
        real, sim = Probe(session, real_url, SERVED_MODEL), Probe(session, sim_url, SERVED_MODEL)
        for run in range(REPEATS):
            for n in COLD_LENGTHS:
                for url in (real_url, sim_url):
                    await async_wait_until(
                        lambda u=url: idle(session, u), timeout=60, what=f"{url} to be idle"
                    )
                order = [(real, real_times), (sim, sim_times)]
                for probe, times in order if run % 2 == 0 else order[::-1]:
                    # Woken first, as `epp calibrate` measures it: an engine idle for a
                    # while answers its next request several ms late (benchmarks/RESULTS.md, "How
                    # faithful is the simulator"), a cost the profile does not model.
                    await probe.stream(prompts.make(16), 1)
                    ttft = (await probe.stream(prompts.make(n), 1)).ttft_s
                    assert ttft is not None
                    times[n].append(ttft)
    return [
        (n, statistics.median(real_times[n]), statistics.median(sim_times[n])) for n in COLD_LENGTHS
    ]


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

"""`epp calibrate` against a running `epp sim` pod gives back the profile the pod runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.net import free_port

from smart_epp.benchmarks.calibrate.fit import COEFFICIENTS
from smart_epp.benchmarks.sim.profiles import LatencyProfile, load_profile_file
from smart_epp.epp.cli import build_parser

# A slow accelerator: every term is a sizeable part of some measurement, and costs are large
# beside the simulator's own HTTP and hashing time (~5 us per prompt token, plus stalls of
# several ms, on a busy 2-core box), which a calibration measures as part of the pod.
TRUE = LatencyProfile(
    name="roundtrip",
    kv_tokens=200_000,
    max_model_len=1024,
    max_num_batched_tokens=8192,
    max_num_seqs=64,
    step_overhead_s=0.024,
    prefill_s_per_token=4.0e-4,
    prefill_attention_s_per_token_pair=4.0e-7,
    decode_s_per_seq=6.0e-3,
    decode_kv_read_s_per_token=4.0e-6,
    prefill_s_per_request=0.0,
    source="test profile",
)


@pytest.fixture
def sim_pod(tmp_path: Path):
    profile = tmp_path / "true.yaml"
    profile.write_text(TRUE.to_yaml())
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from smart_epp.epp.cli import main; main()", "sim",
         "--port", str(port), "--no-kv-events", "--profile", str(profile)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the pod listens
        assert line.startswith(f"pod 0: http://127.0.0.1:{port} "), proc.stderr.read()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_calibrating_a_sim_pod_recovers_its_profile(sim_pod: str, tmp_path: Path, capsys):
    out = tmp_path / "fitted.yaml"
    args = build_parser().parse_args(
        ["calibrate", "--target", sim_pod, "--out", str(out), "--name", "fitted",
         "--max-num-batched-tokens", "8192", "--max-num-seqs", "64"]
    )  # fmt: skip
    assert args.func(args) == 0
    fitted = load_profile_file(out)
    assert fitted.name == "fitted"
    assert fitted.max_model_len == TRUE.max_model_len
    assert fitted.kv_tokens == pytest.approx(TRUE.kv_tokens, rel=0.01)
    for name in COEFFICIENTS:
        if name != "prefill_s_per_request":
            assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.15), name
    # The profile has none; what the fit finds is the sim pod's own HTTP and wake-up time
    # per request, which a client sees and a calibration rightly keeps.
    assert fitted.prefill_s_per_request < 0.05
    printed = capsys.readouterr().err
    for group in ("cold prefill", "warm prefix", "decode"):
        assert group in printed and group in fitted.source
    assert "R²" in printed and "median |error|" in printed
    assert yaml.safe_load(out.read_text())["source"].startswith("Measured by `epp calibrate`")


def test_an_unreachable_target_is_a_clear_error(capsys):
    args = build_parser().parse_args(["calibrate", "--target", f"http://127.0.0.1:{free_port()}"])
    assert args.func(args) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_a_negative_scrape_interval_is_refused(capsys):
    args = build_parser().parse_args(
        ["calibrate", "--target", "http://127.0.0.1:1", "--scrape-interval", "-1"]
    )
    assert args.func(args) == 2
    assert "--scrape-interval" in capsys.readouterr().err


def test_scraping_gets_metrics_at_the_interval_only_while_the_block_runs():
    import asyncio

    import aiohttp
    from aiohttp import web

    from smart_epp.benchmarks.calibrate.cli import scraping

    async def scenario() -> tuple[int, int]:
        hits = 0
        five = asyncio.Event()

        async def metrics(_: web.Request) -> web.Response:
            nonlocal hits
            hits += 1
            if hits == 5:
                five.set()
            return web.Response(text="vllm:num_requests_running 0\n")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session:
                async with scraping(session, f"http://127.0.0.1:{port}", 0.02):
                    await asyncio.wait_for(five.wait(), 10)
                during = hits
                # Five scrape periods with the block closed: none may come.
                await asyncio.sleep(0.1)
                return during, hits
        finally:
            await runner.cleanup()

    during, after = asyncio.run(scenario())
    assert during >= 5
    assert after == during

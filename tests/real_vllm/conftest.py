"""Session fixtures for the real-vLLM tier: the vLLM venv and two running pods.

Pod A serves the tiny model plainly; pod B also serves the two LoRA adapters with room
for one at a time. Both publish KV events (PUB + replay ROUTER) and are shared by every
test of the session, so tests use prompts of their own and never assume an empty cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.net import free_port
from support.paths import TOOLS_TEMPLATE
from vllm_pods import (
    GATEWAY_SCRAPE_INTERVAL_S,
    MODEL_DIR,
    PodConfig,
    VllmPod,
    dev_mode_pod_config,
    ensure_vllm_python,
    start_pods,
)

from smart_epp.epp.cli import build_parser

LORA_ADAPTERS = (("lora-a", MODEL_DIR / "tiny-lora-a"), ("lora-b", MODEL_DIR / "tiny-lora-b"))

# What the tier cost, shown in the terminal summary.
_timings: dict[str, float] = {}
_tier_seconds: list[float] = []
_prediction_rows: list[tuple[str, str, int, int]] = []
_fidelity_rows: list[tuple[int, float, float]] = []
_sim_vs_live: list[str] = []


@dataclass(frozen=True)
class PodPair:
    plain: VllmPod
    lora: VllmPod

    def __iter__(self) -> Iterator[VllmPod]:
        return iter((self.plain, self.lora))


def pod_config(name: str, lora: bool = False) -> PodConfig:
    return PodConfig(
        name=name,
        http_port=free_port(),
        kv_port=free_port(),
        replay_port=free_port(),
        lora_modules=LORA_ADAPTERS if lora else (),
        # Renders like the model's own template, plus tools and documents.
        chat_template=TOOLS_TEMPLATE,
    )


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    started = time.monotonic()
    python = ensure_vllm_python()
    _timings["set-up: venv check or install (s)"] = time.monotonic() - started
    return python


@pytest.fixture(scope="session")
def vllm_pods(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodPair]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    pods = PodPair(
        plain=VllmPod(pod_config("a"), vllm_python, logs),
        lora=VllmPod(pod_config("b-lora", lora=True), vllm_python, logs),
    )
    started = time.monotonic()
    start_pods(pods)
    _timings["both pods started, concurrently (s)"] = time.monotonic() - started
    for pod in pods:
        _timings[f"pod {pod.config.name} memory (MiB, PSS)"] = pod.memory_bytes() / 2**20
    try:
        yield pods
    finally:
        stopped = time.monotonic()
        for pod in pods:
            pod.stop()
        _timings["pods stopped (s)"] = time.monotonic() - stopped


@pytest.fixture(scope="session")
def calibration_pod(
    vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmPod]:
    """The pod `epp calibrate` measures, shared by the tests that compare the sim with it."""
    pod = VllmPod(
        dev_mode_pod_config("calibrate"),
        vllm_python,
        tmp_path_factory.mktemp("vllm-calibrate-logs"),
    )
    start_pods([pod])
    try:
        yield pod
    finally:
        pod.stop()


@pytest.fixture(scope="session")
def calibrated_profile(calibration_pod: VllmPod, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The profile `epp calibrate` writes for the pod (vLLM CPU defaults: chunk 2048, 128 seqs),
    measured while its /metrics is scraped as often as `epp serve` scrapes it."""
    out = tmp_path_factory.mktemp("calibrate") / "cpu-tiny-calibrated.yaml"
    args = build_parser().parse_args(
        ["calibrate", "--target", calibration_pod.url, "--out", str(out),
         "--name", "cpu-tiny-calibrated", "--max-num-batched-tokens", "2048",
         "--max-num-seqs", "128", "--repeats", "5",
         "--scrape-interval", str(GATEWAY_SCRAPE_INTERVAL_S)]
    )  # fmt: skip
    started = time.monotonic()
    assert args.func(args) == 0
    _timings["epp calibrate against the real pod (s)"] = time.monotonic() - started
    return out


@pytest.fixture
def pod_a(vllm_pods: PodPair) -> VllmPod:
    return vllm_pods.plain


@pytest.fixture
def pod_b(vllm_pods: PodPair) -> VllmPod:
    return vllm_pods.lora


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Set-up and teardown of the session fixtures are charged to the tests that ran them.
    if "real_vllm" in report.keywords:
        _tier_seconds.append(report.duration)


@pytest.fixture(scope="session")
def prediction_rows() -> list[tuple[str, str, int, int]]:
    """(pod, request, cached tokens the index predicted, cached tokens vLLM reported)."""
    return _prediction_rows


@pytest.fixture(scope="session")
def fidelity_rows() -> list[tuple[int, float, float]]:
    """(prompt tokens, real pod TTFT s, calibrated sim pod TTFT s) for cold prompts."""
    return _fidelity_rows


@pytest.fixture(scope="session")
def sim_vs_live() -> list[str]:
    """The rendered sim-vs-live tables, shown in the summary."""
    return _sim_vs_live


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _tier_seconds:
        return
    write = terminalreporter.write_line
    terminalreporter.section("real vLLM tier")
    write(f"tier total: {sum(_tier_seconds):.1f} s")
    for what, value in _timings.items():
        write(f"{what}: {value:.1f}")
    if _prediction_rows:
        write("cached tokens, predicted by the index vs reported by vLLM:")
        for pod, name, predicted, reported in _prediction_rows:
            mark = "" if predicted == reported else "  <-- differs"
            write(f"  pod {pod:7} {name:28} {predicted:5d} {reported:5d}{mark}")
    if _fidelity_rows:
        write("cold-prompt TTFT, real vLLM pod vs epp sim with the calibrated profile (ms):")
        for n, real, sim in _fidelity_rows:
            write(
                f"  {n:5d} tokens  real {real * 1000:7.1f}  sim {sim * 1000:7.1f}"
                f"  error {abs(sim - real) / real:6.1%}"
            )
    for table in _sim_vs_live:
        write("TTFT of one trace, live (Envoy + epp + 2 real vLLM pods) vs epp replay --mode sim:")
        for line in table.splitlines():
            write(f"  {line}")

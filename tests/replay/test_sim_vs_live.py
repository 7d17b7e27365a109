"""benchmarks/sim_vs_live.py: its trace, and a whole run against `epp sim` pods behind real
Envoy and `epp serve` (the real-vLLM tier runs it against vLLM pods)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.paths import VLLM_FIXTURES

from smart_epp.benchmarks.replay.traces import load_trace
from smart_epp.benchmarks.sim_vs_live import TraceSpec, main, write_trace
from smart_epp.epp.ports import free_port_block

TOKENIZER_DIR = VLLM_FIXTURES / "model" / "tiny-model"
MODEL = "tiny"
BLOCK_SIZE = 32
EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]


def test_trace_carries_the_tokenizers_ids_for_its_text_and_shares_system_prompts(tmp_path):
    from tokenizers import Tokenizer

    spec = TraceSpec(groups=3, per_group=4, rates=(2.0, 20.0))
    path = tmp_path / "trace.jsonl"
    assert write_trace(spec, TOKENIZER_DIR / "tokenizer.json", MODEL, path) == 12
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    for row in rows:
        assert row["prompt_token_ids"] == tokenizer.encode(row["prompt"]).ids
        assert row["prompt_tokens"] == len(row["prompt_token_ids"])
    by_group: dict[str, list[list[int]]] = {}
    for row in rows:
        by_group.setdefault(row["prompt"].split(":")[0], []).append(row["prompt_token_ids"])
    assert len(by_group) == 3
    for prompts in by_group.values():
        shared = 0
        while all(len(ids) > shared and ids[shared] == prompts[0][shared] for ids in prompts):
            shared += 1
        assert len(prompts) == 4 and shared >= spec.system_words
    # The replay reads both: the ids for the simulator, the text for live requests.
    requests = load_trace(path)
    assert requests[0].token_ids() == rows[0]["prompt_token_ids"]
    assert requests[0].text() == rows[0]["prompt"]
    # Two arrival rates: the first half is spread out, the second packed.
    times = [r.timestamp_s for r in requests]
    first, second = times[5] - times[0], times[11] - times[6]
    assert first > 3 * second


@pytest.fixture
def sim_pods(tmp_path: Path) -> Iterator[list[str]]:
    """Two `epp sim` pods with the tiny model's tokenizer and a 4,096-token KV cache."""
    profile = tmp_path / "profile.yaml"
    printed = subprocess.run(
        [*EPP, "sim", "--print-profile", "cpu-tiny"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    profile.write_text(printed)
    base = free_port_block(6)  # HTTP; KV PUB, then replay: one block, so none overlap
    kv = base + 2
    argv = [*EPP, "sim",
            "--pods", "2", "--model", MODEL, "--block-size", str(BLOCK_SIZE),
            "--num-blocks", "128", "--profile", str(profile), "--tokenizer", str(TOKENIZER_DIR),
            "--base-port", str(base), "--kv-events-port", str(kv)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        if not all(line.startswith("pod ") for line in lines):
            proc.terminate()
            raise AssertionError(f"epp sim did not start: {lines} {proc.communicate()[1]}")
        specs = []
        for line in lines:
            words = line.split()
            specs.append(f"{words[2].removeprefix('http://')},{words[4]},{words[6]}")
        yield [str(profile), *specs]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.envoy
def test_a_run_against_sim_pods_replays_every_request_both_ways_for_both_policies(
    sim_pods: list[str], tmp_path: Path
) -> None:
    profile, *pods = sim_pods
    out = tmp_path / "sim_vs_live.json"
    # A short trace keeps the run to seconds; the real-vLLM tier runs the full one.
    argv = ["--profile", profile, "--tokenizer", str(TOKENIZER_DIR / "tokenizer.json"),
            "--model", MODEL, "--block-size", str(BLOCK_SIZE), "--out", str(out),
            "--groups", "3", "--per-group", "4", "--rates", "10,20"]  # fmt: skip
    for spec in pods:
        argv += ["--pod", spec]
    assert main(argv) == 0
    table = json.loads(out.read_text())
    assert set(table["policies"]) == {"default", "round-robin"}
    for row in table["policies"].values():
        assert row["routing_latency_s"] > 0
        for mode in ("live", "sim"):
            parts = row[mode]
            assert set(parts) == {"all", "10/s", "20/s"}
            assert parts["all"]["completed"] == 12 and parts["all"]["failed"] == 0
            assert parts["10/s"]["completed"] == parts["20/s"]["completed"] == 6
            assert parts["all"]["ttft_p50_s"] > 0
        assert row["sim_p50_error"]["all"] == pytest.approx(
            row["sim"]["all"]["ttft_p50_s"] / row["live"]["all"]["ttft_p50_s"] - 1, abs=1e-3
        )
    assert sorted(table["ranking"]["live_ttft_p50_s"]) == ["default", "round-robin"]

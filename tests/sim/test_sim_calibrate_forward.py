"""A profile fitted to gpu_forward.py's timings: recovery, the shipped profile, bad files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from smart_epp.benchmarks.calibrate.forward import GPU_MEMORY_UTILIZATION, forward_profile
from smart_epp.benchmarks.sim.profiles import get_profile, prefill_token_pairs

EPP = [sys.executable, "-c", "from smart_epp.epp.cli import main; main()"]
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
H200_RUNS = [
    RESULTS / "gpu_forward_h200_llama3_8b.json",
    RESULTS / "gpu_forward_h200_llama3_8b_long.json",
]

TRUE = {
    "step_overhead_s": 0.0058,
    "prefill_s_per_token": 2.4e-5,
    "prefill_attention_s_per_token_pair": 1.7e-9,
    "decode_s_per_seq": 1.5e-5,
    "decode_kv_read_s_per_token": 5.2e-8,
}


def synthetic_run(device: str = "Some GPU") -> dict[str, object]:
    """A run whose timings are exactly TRUE's step formula."""
    prefill = []
    for c in (0, 4096, 32768):
        for n in (256, 2048, 8192):
            seconds = (
                TRUE["step_overhead_s"]
                + n * TRUE["prefill_s_per_token"]
                + prefill_token_pairs(n, c) * TRUE["prefill_attention_s_per_token_pair"]
            )
            prefill.append({"new_tokens": n, "cached_tokens": c, "seconds": seconds})
    decode = []
    for b in (1, 32, 256):
        for ctx in (512, 8192):
            seconds = (
                TRUE["step_overhead_s"]
                + b * TRUE["decode_s_per_seq"]
                + b * ctx * TRUE["decode_kv_read_s_per_token"]
            )
            decode.append({"batch": b, "context_tokens": ctx, "seconds": seconds})
    return {
        "model": "m",
        "device": device,
        "shape": {"layers": 2},
        "kv_bytes_per_token": 131072,
        "gpu_memory_total_bytes": 80e9,
        "peak_prefill_bytes": 20e9,
        "prefill": prefill,
        "decode": decode,
    }


def write(tmp_path: Path, name: str, run: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(run))
    return path


def test_exact_timings_give_back_their_coefficients(tmp_path: Path) -> None:
    path = write(tmp_path, "run.json", synthetic_run())
    profile, result = forward_profile([path], "p", 32768, 8192, 256)
    for name, value in TRUE.items():
        assert getattr(profile, name) == pytest.approx(value, rel=1e-3), name
    assert profile.prefill_s_per_request == 0.0
    assert profile.kv_tokens == int((GPU_MEMORY_UTILIZATION * 80e9 - 20e9) // 131072)
    assert all(g.median_abs_pct_error < 0.1 for g in result.groups)


def test_the_shipped_h200_profile_is_what_its_measurements_fit_to() -> None:
    shipped = get_profile("h200-llama3-8b-forward")
    fitted, _ = forward_profile(
        H200_RUNS, shipped.name, shipped.max_model_len, shipped.max_num_batched_tokens,
        shipped.max_num_seqs,
    )  # fmt: skip
    assert fitted == shipped


def test_measured_attention_is_superlinear_on_the_h200() -> None:
    # A 32k-token cold prompt costs more than 4.3x an 8k one (4x if prefill were linear).
    p = get_profile("h200-llama3-8b-forward")

    def cold(n: int) -> float:
        steps = -(-n // p.max_num_batched_tokens)
        pairs = sum(
            prefill_token_pairs(min(p.max_num_batched_tokens, n - done), done)
            for done in range(0, n, p.max_num_batched_tokens)
        )
        return (
            steps * p.step_overhead_s
            + n * p.prefill_s_per_token
            + pairs * (p.prefill_attention_s_per_token_pair)
        )

    assert cold(32768) / cold(8192) > 4.3


def test_files_from_different_gpus_are_refused(tmp_path: Path) -> None:
    a = write(tmp_path, "a.json", synthetic_run("GPU A"))
    b = write(tmp_path, "b.json", synthetic_run("GPU B"))
    with pytest.raises(ValueError, match="device 'GPU B' differs"):
        forward_profile([a, b], "p", 32768, 8192, 256)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not a readable JSON file"),
        (json.dumps({"model": "m"}), "missing device, shape"),
        (json.dumps({**synthetic_run(), "prefill": [{"new_tokens": 5}]}), "malformed"),
        (
            json.dumps({k: v for k, v in synthetic_run().items() if k != "peak_prefill_bytes"}),
            "recorded no GPU memory",
        ),
    ],
)
def test_cli_refuses_a_bad_file_with_a_clear_error(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    out = tmp_path / "p.yaml"
    proc = subprocess.run(
        [*EPP, "calibrate", "--from-forward", str(path),
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert message in " ".join(proc.stderr.split())
    assert not out.exists()


def test_cli_writes_a_loadable_profile(tmp_path: Path) -> None:
    path = write(tmp_path, "run.json", synthetic_run())
    out = tmp_path / "p.yaml"
    proc = subprocess.run(
        [*EPP, "calibrate", "--from-forward", str(path),
         "--name", "my-gpu", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    profile = get_profile(str(out))
    assert profile.name == "my-gpu"
    assert profile.prefill_attention_s_per_token_pair == pytest.approx(1.7e-9, rel=1e-3)

"""Latency profiles as data: the YAML schema, the built-ins, and what the engine charges."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from smart_epp.benchmarks.sim.engine import EngineConfig, SimEngine, SimRequest
from smart_epp.benchmarks.sim.profiles import (
    PROFILES,
    LatencyProfile,
    ProfileError,
    get_profile,
    load_profile_file,
)

FIELDS = (
    "name",
    "kv_tokens",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "step_overhead_s",
    "prefill_s_per_token",
    "prefill_attention_s_per_token_pair",
    "decode_s_per_seq",
    "decode_kv_read_s_per_token",
    "prefill_s_per_request",
    "source",
)


def cold_ttft(profile: LatencyProfile, prompt_tokens: int) -> float:
    """Time to the first token of one cold prompt on an idle engine."""
    engine = SimEngine(EngineConfig(block_size=16, profile=profile, hash_seed="x"))
    engine.add_request(SimRequest("r", list(range(1, prompt_tokens + 1)), max_tokens=1), 0.0)
    now = 0.0
    while engine.has_unfinished():
        out = engine.step(now)
        now = out.end
        if any(p.first_token for p in out.progress):
            return now
    raise AssertionError("no first token")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_builtin_round_trips_through_yaml(name: str, tmp_path: Path):
    profile = PROFILES[name]
    text = profile.to_yaml()
    assert list(yaml.safe_load(text)) == list(FIELDS)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    assert get_profile(str(path)) == profile


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_builtin_charges_prefill_attention_and_says_where_numbers_came_from(name: str):
    profile = PROFILES[name]
    if name != "cpu-tiny":  # the tiny model's attention is too small to separate (its source)
        assert profile.prefill_attention_s_per_token_pair > 0
    for field in ("step_overhead_s", "prefill_s_per_token", "prefill_attention_s_per_token_pair"):
        assert field in profile.source


def test_long_context_profile_accepts_128k():
    profile = get_profile("h100-llama3.1-8b-128k")
    assert profile.max_model_len == 131072
    assert profile.kv_tokens >= profile.max_model_len


def test_30k_cold_prompt_is_more_than_linearly_slower_than_7_5k():
    profile = get_profile("h100-llama3-8b")
    ratio = cold_ttft(profile, 30_000) / cold_ttft(profile, 7_500)
    assert ratio >= 4.5  # linear cost alone would give at most 4.0
    linear = profile.model_copy(update={"prefill_attention_s_per_token_pair": 0.0})
    assert cold_ttft(linear, 30_000) / cold_ttft(linear, 7_500) <= 4.0


def test_chunked_prefill_charges_attention_over_earlier_chunks():
    # Attention only: one 4096-token prompt in 1024-token chunks costs what it costs in one
    # piece, n^2/2 pairs, because each chunk attends over the chunks before it.
    profile = get_profile("h100-llama3-8b").model_copy(
        update={"step_overhead_s": 0.0, "prefill_s_per_token": 0.0}
    )
    whole = SimEngine(EngineConfig(block_size=16, profile=profile, hash_seed="x"))
    chunked = SimEngine(
        EngineConfig(block_size=16, profile=profile, hash_seed="x", max_num_batched_tokens=1024)
    )
    for engine in (whole, chunked):
        engine.add_request(SimRequest("r", list(range(1, 4097)), max_tokens=1), 0.0)
    t_whole = whole.step(0.0).duration
    t_chunked, now = 0.0, 0.0
    for _ in range(4):
        out = chunked.step(now)
        now = out.end
        t_chunked += out.duration
    pairs = 4096 * 4096 / 2
    assert t_whole == pytest.approx(pairs * profile.prefill_attention_s_per_token_pair)
    assert t_chunked == pytest.approx(t_whole)


def test_cached_prefix_makes_attention_of_the_suffix_cost_more():
    profile = get_profile("h100-llama3-8b")
    cold_tail = profile.prefill_seconds(1000, 0)
    warm_tail = profile.prefill_seconds(1000, 20_000)
    assert warm_tail - cold_tail == pytest.approx(
        1000 * 20_000 * profile.prefill_attention_s_per_token_pair
    )


def test_decode_step_reads_each_sequence_context():
    profile = get_profile("h100-llama3-8b")
    engine = SimEngine(EngineConfig(block_size=16, profile=profile, hash_seed="x"))
    engine.add_request(SimRequest("r", list(range(1, 2001)), max_tokens=3), 0.0)
    now = engine.step(0.0).end  # the prompt, and the first token
    out = engine.step(now)
    expected = (
        profile.step_overhead_s
        + profile.decode_s_per_seq
        + 2001 * profile.decode_kv_read_s_per_token
    )
    assert out.num_decode_seqs == 1
    assert out.duration == pytest.approx(expected)


def _write(tmp_path: Path, **changes: object) -> Path:
    data = get_profile("h100-llama3-8b").model_dump()
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"prefill_s_per_token": -1.0}, "prefill_s_per_token"),
        ({"kv_tokens": "lots"}, "kv_tokens"),
        ({"decode_kv_read_s_per_token": None}, "decode_kv_read_s_per_token"),
        ({"prefill_attention_s_per_token": 1e-9}, "prefill_attention_s_per_token"),
    ],
)
def test_bad_field_is_named_in_the_error(tmp_path: Path, changes: dict, field: str):
    path = _write(tmp_path, **changes)
    with pytest.raises(ProfileError, match=f"field '{field}'") as err:
        load_profile_file(path)
    assert str(path) in str(err.value)


def test_unreadable_or_non_mapping_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ProfileError, match="cannot read profile"):
        get_profile(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ProfileError, match="mapping"):
        get_profile(str(bad))
    with pytest.raises(ProfileError, match="unknown profile 'h200'"):
        get_profile("h200")


def _epp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from smart_epp.epp.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_print_profile_prints_the_schema_that_profile_loads_back(tmp_path: Path):
    done = _epp("sim", "--print-profile", "h100-llama3.1-8b-128k")
    assert done.returncode == 0, done.stderr
    path = tmp_path / "printed.yaml"
    path.write_text(done.stdout)
    assert load_profile_file(path) == get_profile("h100-llama3.1-8b-128k")
    bad = _epp("sim", "--print-profile", "nope")
    assert bad.returncode == 2 and "unknown profile 'nope'" in bad.stderr


def test_a_slowed_pod_takes_the_factor_longer_for_every_step():
    base = PROFILES["h100-llama3-8b"]
    slow = base.slowed(1.25)
    assert slow.kv_tokens == base.kv_tokens and slow.max_model_len == base.max_model_len
    for tokens in (300, 7_500, 30_000):
        assert cold_ttft(slow, tokens) == pytest.approx(1.25 * cold_ttft(base, tokens))
    assert base.slowed(1.0) is base
    with pytest.raises(ProfileError, match="positive"):
        base.slowed(0.0)

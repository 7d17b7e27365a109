"""The default policy where prefix caches are small: a new prefix placed on a pod whose
cache is full evicts prefixes that later requests come back for.

The pods are those of the sim-vs-live comparison (a CPU vLLM pod with a 4,096-token KV
cache, prefilling in 32-token chunks, its coefficients as `epp calibrate` measured them)
and 12 groups sharing a ~512-token system prompt: 6 groups fit in one pod's cache, all 12
in two. One pod is 7% faster, as one of the two real pods was: the learned speed factors
then price every cold prompt a little cheaper there.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from smart_epp.benchmarks.replay.arrivals import poisson_arrivals
from smart_epp.benchmarks.replay.cli import Workload, simulate_policy
from smart_epp.benchmarks.replay.report import summarize
from smart_epp.benchmarks.replay.sim import SimConfig, pod_address
from smart_epp.benchmarks.replay.traces import (
    SharedPrefixSpec,
    generate_shared_prefix,
    infinite_cache_hit_rate,
)
from smart_epp.kv_index.lookup import IndexPrefixMatcher

SPEC = SharedPrefixSpec(
    num_groups=12, num_prompts_per_group=6, system_prompt_len=512, question_len=32, output_len=8
)
BLOCK = 32
SEEDS = (0, 1, 2)
PROFILE = {
    "name": "small-cache-chunked",
    "kv_tokens": 4096,
    "max_model_len": 1024,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 32,
    "step_overhead_s": 1.0e-6,
    "prefill_s_per_token": 9.1e-5,
    "prefill_attention_s_per_token_pair": 0.0,
    "decode_s_per_seq": 0.0,
    "decode_kv_read_s_per_token": 0.0,
    "prefill_s_per_request": 0.0055,
    "source": "benchmarks/results/sim_vs_live.json: epp calibrate against a CPU vLLM pod",
}


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "small-cache.yaml"
    path.write_text(yaml.safe_dump(PROFILE))
    return path


def workload(seed: int) -> Workload:
    requests = generate_shared_prefix(SPEC, seed=seed)
    random.Random(seed).shuffle(requests)  # the groups' requests interleave
    for i, req in enumerate(requests):
        req.index = i
    return Workload(requests, poisson_arrivals(len(requests), 2.0, seed))


def hit_rates(profile: Path, slowdowns: tuple[float, ...]) -> list[float]:
    """The default policy's prefix hit rate per seed, as a share of the workload's
    ceiling (one pod with an unbounded cache)."""
    out = []
    for seed in SEEDS:
        wl = workload(seed)
        config = SimConfig(
            pods=2,
            profile=str(profile),
            block_size=BLOCK,
            routing_latency_s=0.01,
            pod_slowdowns=slowdowns,
        )
        results = simulate_policy("default", wl, config, seed)
        assert all(r.ok for r in results)
        rate = summarize(results, [pod_address(0), pod_address(1)]).prefix_hit_rate
        out.append(rate / infinite_cache_hit_rate(wl.requests, BLOCK))
    return out


@pytest.mark.parametrize("slowdowns", [(), (1.0, 1.07), (1.07, 1.0)])
def test_groups_stay_cached_when_one_pod_is_faster(
    profile: Path, slowdowns: tuple[float, ...]
) -> None:
    shares = hit_rates(profile, slowdowns)
    assert min(shares) >= 0.88, shares


def test_without_pricing_the_evicted_prefixes_the_faster_pod_takes_too_many_groups(
    profile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scheduler then does not know how full each pod's cache is: every new group goes
    # to the pod priced a little faster until its cache holds more groups than fit.
    priced = hit_rates(profile, (1.0, 1.07))
    monkeypatch.setattr(IndexPrefixMatcher, "held_blocks", lambda self, addresses: None)
    unpriced = hit_rates(profile, (1.0, 1.07))
    assert sum(unpriced) / len(unpriced) < sum(priced) / len(priced) - 0.08, (unpriced, priced)

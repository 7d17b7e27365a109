"""`--context-limits`: the replay's smart-epp pickers check prompts against the engines'
context as `epp serve` checks them against the pods' /v1/models."""

from __future__ import annotations

from smart_epp.benchmarks.policy_grid import Cell, build_parser, cell_setup_with_options
from smart_epp.benchmarks.replay.cli import simulate_policy
from smart_epp.benchmarks.sim.profiles import get_profile

CELL = Cell("mooncake", 0.3, 1.0)


def _replay(*flags: str) -> dict[int, str | None]:
    args = build_parser().parse_args(["--requests", "60", *flags])
    workload, config = cell_setup_with_options(CELL, args)
    results = simulate_policy("default", workload, config, args.seed)
    limit = get_profile(config.profile).max_model_len
    too_long = {i for i, r in enumerate(workload.requests) if r.input_tokens >= limit}
    assert too_long, "the window holds prompts past the context"
    failed = {r.index: r.error for r in results if not r.ok}
    assert set(failed) == too_long  # the same requests fail either way, and only they
    return failed


LIMIT = get_profile("h100-llama3-8b").max_model_len


def test_without_the_flag_the_pods_refuse_what_their_context_cannot_hold() -> None:
    reasons = set(_replay().values())
    assert reasons <= {
        f"longer than max_model_len ({LIMIT} tokens)",
        f"prompt fills max_model_len ({LIMIT} tokens)",
    }


def test_with_the_flag_the_picker_refuses_it_in_vllms_words() -> None:
    reasons = set(_replay("--context-limits").values())
    assert reasons == {f"picker: This model's maximum context length is {LIMIT} tokens"}

"""The A/B configs under benchmarks/replay/configs load, and each differs from the default
in what its comment says."""

from __future__ import annotations

from pathlib import Path

import pytest

from smart_epp.epp.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "replay" / "configs"
SCORER = "predicted-ttft-scorer"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_replay_config_loads(path: Path) -> None:
    assert load_config(path).plugin_params


@pytest.mark.parametrize(
    ("name", "param", "value"),
    [
        ("default-no-decode-stall.yaml", "decodeStallWeight", 0.0),
        ("default-whole-duplication-price.yaml", "shareDuplicationPrice", False),
    ],
)
def test_a_default_variant_changes_one_scorer_parameter(
    name: str, param: str, value: object
) -> None:
    variant = load_config(CONFIGS / name).plugin_params[SCORER]
    default = load_config(None).plugin_params[SCORER]
    assert getattr(variant, param) == value
    assert getattr(default, param) != value
    others = {k: v for k, v in default.model_dump().items() if k != param}
    assert {k: v for k, v in variant.model_dump().items() if k != param} == others

"""The config conformance corpus: upstream config shapes per version line, each with the
outcome smart-epp must produce (tests/fixtures/configs/expected.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from smart_epp.epp.config import ConfigError, instantiate, load_config_file

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
EXPECTED: dict[str, dict] = yaml.safe_load((CORPUS / "expected.yaml").read_text())


def test_every_config_in_the_corpus_has_an_expected_outcome():
    assert sorted(p.name for p in CORPUS.glob("*.yaml") if p.name != "expected.yaml") == sorted(
        EXPECTED
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_as_expected(name: str) -> None:
    expected = EXPECTED[name]
    path = CORPUS / name
    if expected["outcome"] == "error":
        with pytest.raises(ConfigError) as info:
            load_config_file(path)
        issues = info.value.issues
        for field, fragment in expected["errors"]:
            matching = [i for i in issues if i.path == field]
            assert matching, f"no issue at {field}; got {[str(i) for i in issues]}"
            assert any(fragment in i.message for i in matching), [str(i) for i in matching]
            assert all(i.line is not None for i in matching)  # every error has its line
        assert len(issues) == len(expected["errors"]), [str(i) for i in issues]
        return
    loaded = load_config_file(path)
    plugins = instantiate(loaded)
    [profile] = plugins.profiles
    assert [f.type_name for f in profile.filters] == expected["filters"]
    assert [[s.type_name, w] for s, w in profile.scorers] == expected["scorers"]
    assert profile.picker.type_name == expected["picker"]
    handler = plugins.handler.type_name if plugins.handler is not None else None
    assert handler == expected["handler"]
    assert len(loaded.notes) == expected.get("notes", 0), loaded.notes

"""EndpointPickerConfig loading: built-ins, Inference Extension configs, field-level errors."""

from __future__ import annotations

import pytest

from smart_epp.epp.config import (
    BUILTIN_CONFIGS,
    ConfigError,
    builtin_config,
    instantiate,
    load_config,
    parse_config,
    plugin_types,
)

# The Inference Extension's documented default configuration, verbatim in shape: names
# omitted (they default to the type), a profile handler, parameters of the approximate
# prefix scorer, and top-level keys smart-epp does not use.
GIE_SAMPLE = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates:
- dataLayer
plugins:
- type: single-profile-handler
- type: prefix-cache-scorer
  parameters:
    hashBlockSize: 5
    maxPrefixBlocksToMatch: 256
    lruCapacityPerServer: 31250
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: lora-affinity-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: lora-affinity-scorer
  - pluginRef: max-score-picker
"""

LLMD_SAMPLE = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: single-profile-handler
- type: decode-filter
- type: precise-prefix-cache-scorer
  parameters:
    indexerConfig:
      tokenProcessorConfig:
        blockSize: 64
        hashSeed: "42"
    kvEventsConfig:
      zmqEndpoint: tcp://*:5557
- type: load-aware-scorer
  parameters:
    threshold: 100
- name: picker
  type: max-score-picker
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: precise-prefix-cache-scorer
    weight: 2
  - pluginRef: load-aware-scorer
    weight: 1
  - pluginRef: picker
"""


def test_the_round_robin_config_of_the_benchmarks_builds_a_round_robin_picker():
    from pathlib import Path

    import smart_epp.benchmarks

    path = Path(smart_epp.benchmarks.__file__).parent / "replay" / "configs" / "round-robin.yaml"
    (profile,) = instantiate(load_config(str(path))).profiles
    assert profile.picker.type_name == "round-robin-picker"
    assert profile.scorers == []


def test_every_builtin_config_loads_and_builds_one_profile():
    for name in BUILTIN_CONFIGS:
        plugins = instantiate(builtin_config(name))
        assert len(plugins.profiles) == 1
        assert plugins.profiles[0].picker.type_name == "max-score-picker"
    default = instantiate(load_config(None)).profiles[0]
    assert [s.type_name for s, _ in default.scorers] == ["predicted-ttft-scorer"]
    gie = instantiate(load_config("gie-default")).profiles[0]
    assert [(s.type_name, w) for s, w in gie.scorers] == [
        ("prefix-cache-scorer", 3.0),
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
    ]
    precise = instantiate(load_config("llmd-precise")).profiles[0]
    assert [(s.type_name, w) for s, w in precise.scorers] == [
        ("precise-prefix-cache-scorer", 2.0),
        ("kv-cache-utilization-scorer", 1.0),
        ("queue-scorer", 1.0),
    ]


def test_inference_extension_config_loads_unchanged():
    loaded = parse_config(GIE_SAMPLE)
    profile = instantiate(loaded).profiles[0]
    assert [(s.type_name, w) for s, w in profile.scorers] == [
        ("prefix-cache-scorer", 3.0),
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("lora-affinity-scorer", 1.0),  # an omitted weight is 1
    ]
    prefix = profile.scorers[0][0]
    assert prefix.params.block_chars(None) == 5  # the older parameter name is honoured
    assert loaded.notes == []


def test_llmd_config_loads_with_named_plugins_and_reports_its_indexer_settings():
    loaded = parse_config(LLMD_SAMPLE)
    # The block size is honoured; the hash seed and the ZMQ endpoint are reported with
    # the reason smart-epp needs neither.
    assert loaded.plugin_params["precise-prefix-cache-scorer"].blockSize == 64
    assert [n.split(":")[0] for n in loaded.notes] == [
        "plugins[2] (precise-prefix-cache-scorer).indexerConfig.tokenProcessorConfig.blockSize",
        "plugins[2] (precise-prefix-cache-scorer).indexerConfig.tokenProcessorConfig.hashSeed",
        "plugins[2] (precise-prefix-cache-scorer).kvEventsConfig.zmqEndpoint",
    ]
    profile = instantiate(loaded).profiles[0]
    assert profile.name == "decode"
    assert [f.type_name for f in profile.filters] == ["decode-filter"]
    assert profile.picker.name == "picker"
    assert profile.scorers[1][0].params.threshold == 100


def test_profile_without_picker_gets_max_score_and_no_profiles_uses_all_plugins():
    text = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: random-picker
"""
    profile = instantiate(parse_config(text)).profiles[0]
    assert profile.name == "default"
    assert [s.type_name for s, _ in profile.scorers] == ["queue-scorer"]
    assert profile.picker.type_name == "random-picker"
    text = GIE_SAMPLE.replace("  - pluginRef: max-score-picker\n", "")
    assert instantiate(parse_config(text)).profiles[0].picker.type_name == "max-score-picker"


def test_unknown_parameters_are_errors_naming_the_field_and_line():
    text = GIE_SAMPLE.replace("lruCapacityPerServer: 31250", "lruCapacityPerServr: 31250")
    [(path, line, _, message)] = _issues(text)
    assert path == "plugins[1].parameters.lruCapacityPerServr"
    assert line == 11
    assert "not a parameter of prefix-cache-scorer" in message


def _issues(text: str) -> list[tuple[str, int | None, int | None, str]]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="test.yaml")
    assert "test.yaml" in str(info.value)
    return [(i.path, i.line, i.column, i.message) for i in info.value.issues]


def test_bad_parameter_type_names_field_and_position():
    text = GIE_SAMPLE.replace("maxPrefixBlocksToMatch: 256", "maxPrefixBlocksToMatch: lots")
    [(path, line, column, message)] = _issues(text)
    assert path == "plugins[1].parameters.maxPrefixBlocksToMatch"
    assert (line, column) == (10, 29)
    assert "integer" in message


def test_unknown_type_and_dangling_reference_are_reported_together():
    text = GIE_SAMPLE.replace("- type: queue-scorer", "- type: queue-scorrer")
    issues = _issues(text)
    paths = {(p, line) for p, line, _, _ in issues}
    assert ("plugins[2].type", 12) in paths
    assert ("schedulingProfiles[0].plugins[1].pluginRef", 21) in paths
    unknown = next(m for p, _, _, m in issues if p == "plugins[2].type")
    assert "queue-scorrer" in unknown and "queue-scorer" in unknown


def test_schema_errors_duplicates_and_two_pickers():
    text = GIE_SAMPLE.replace("kind: EndpointPickerConfig", "kind: Config")
    [(path, line, _, _)] = _issues(text)
    assert (path, line) == ("kind", 2)

    text = GIE_SAMPLE.replace("    weight: 3", "    weight: -3")
    [(path, line, _, message)] = _issues(text)
    assert (path, line) == ("schedulingProfiles[0].plugins[0].weight", 20)
    assert "greater than or equal to 0" in message

    text = GIE_SAMPLE.replace("- type: queue-scorer", "- type: queue-scorer\n  nmae: q")
    [(path, line, _, message)] = _issues(text)
    assert (path, line) == ("plugins[2].nmae", 13)

    # A profile handler referenced from a profile is accepted and plays no part in it.
    profile = instantiate(parse_config(GIE_SAMPLE + "  - pluginRef: single-profile-handler\n"))
    assert len(profile.profiles[0].scorers) == 4

    two_pickers = (
        GIE_SAMPLE.replace(
            "- type: max-score-picker", "- type: max-score-picker\n- type: random-picker"
        )
        + "  - pluginRef: random-picker\n"
    )
    [(path, _, _, message)] = _issues(two_pickers)
    assert path == "schedulingProfiles[0].plugins" and "one picker" in message

    dup = GIE_SAMPLE.replace("- type: kv-cache-utilization-scorer", "- type: queue-scorer")
    issues = _issues(dup)
    assert ("plugins[3].name", 13) in {(p, line) for p, line, _, _ in issues}


def test_not_yaml_and_not_a_mapping():
    [(path, line, _, message)] = _issues("plugins: [\n  - type: x\n")
    assert path == "" and line is not None and "YAML" in message
    [(_, _, _, message)] = _issues("- just\n- a list\n")
    assert "mapping" in message


def test_registry_has_the_documented_type_names():
    names = set(plugin_types())
    assert {
        "lora-affinity-filter",
        "saturation-filter",
        "label-selector-filter",
        "by-label-selector",
        "role-filter",
        "precise-prefix-cache-scorer",
        "prefix-cache-scorer",
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "running-requests-size-scorer",
        "lora-affinity-scorer",
        "load-aware-scorer",
        "active-request-scorer",
        "session-affinity-scorer",
        "predicted-ttft-scorer",
        "max-score-picker",
        "random-picker",
        "weighted-random-picker",
    } <= names

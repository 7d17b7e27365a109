"""The flowControl and saturationDetector sections of an EndpointPickerConfig."""

from __future__ import annotations

import pytest
from fchelpers import Clock, pool

from smart_epp.epp.config import ConfigError, load_config, parse_config
from smart_epp.epp.flowcontrol.build import build_admission, build_detector, flow_control_enabled
from smart_epp.epp.flowcontrol.settings import gate_enabled, queue_settings
from smart_epp.scorers.saturation_detectors import ConcurrencyDetector, UtilizationDetector

FULL = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: ["flowControl"]
plugins:
  - type: max-score-picker
  - name: tokens
    type: concurrency-detector
    parameters: {concurrencyMode: tokens, maxTokenConcurrency: 64000}
flowControl:
  maxBytes: 2Gi
  maxRequests: 10k
  defaultRequestTTL: 1m30s
  defaultPriorityBand: {maxRequests: 100, fairnessPolicyRef: global-strict-fairness-policy}
  defaultNegativePriorityBand: {maxRequests: 10}
  priorityBands:
    - {priority: 2, maxRequests: 500, maxBytes: 64Mi}
    - {priority: -5, maxBytes: 1Mi}
  saturationDetector: {pluginRef: tokens}
"""


def test_a_full_flow_control_section() -> None:
    loaded = parse_config(FULL)
    assert flow_control_enabled(loaded)
    settings = queue_settings(loaded.config.flowControl)
    assert settings.ttl_s == 90.0
    assert settings.max_bytes == 2 * 2**30 and settings.max_requests == 10_000
    assert settings.default_band.max_requests == 100
    assert settings.default_band.fairness == "global-strict"
    assert settings.bands[2].max_requests == 500 and settings.bands[2].max_bytes == 64 * 2**20
    # A negative band without its own request limit inherits the negative template's.
    assert settings.bands[-5].max_requests == 10 and settings.bands[-5].max_bytes == 2**20
    detector = build_detector(loaded)
    assert isinstance(detector, ConcurrencyDetector)
    assert detector.params.maxTokenConcurrency == 64_000


def test_flow_control_is_off_without_the_gate_and_says_so() -> None:
    loaded = parse_config(FULL.replace('featureGates: ["flowControl"]', ""))
    assert not flow_control_enabled(loaded)
    assert any("feature gate is off" in w for w in loaded.notes)
    assert gate_enabled(["flowControl=true"]) and not gate_enabled(["flowControl=false"])
    assert not gate_enabled(["flowControl", "flowControl=false"])


def test_ttl_zero_means_no_ttl_and_omitted_means_60s() -> None:
    base = "plugins: [{type: max-score-picker}]\nflowControl: {defaultRequestTTL: 0s}\n"
    assert queue_settings(parse_config(base).config.flowControl).ttl_s is None
    omitted = parse_config("plugins: [{type: max-score-picker}]\nflowControl: {}\n")
    assert queue_settings(omitted.config.flowControl).ttl_s == 60.0


def test_the_older_inline_saturation_detector_section() -> None:
    loaded = parse_config(
        "plugins: [{type: max-score-picker}]\n"
        "saturationDetector:\n  queueDepthThreshold: 7\n  kvCacheUtilThreshold: 0.9\n"
        "  metricsStalenessThreshold: 500ms\n"
    )
    detector = build_detector(loaded)
    assert isinstance(detector, UtilizationDetector)
    p = detector.params
    assert (p.queueDepthThreshold, p.kvCacheUtilThreshold, p.metricsStalenessThreshold) == (
        7,
        0.9,
        0.5,
    )


@pytest.mark.parametrize(
    ("yaml_text", "where", "message"),
    [
        (
            "plugins: [{type: max-score-picker}]\nflowControl: {saturationDetector: "
            "{pluginRef: nope}}\n",
            "flowControl.saturationDetector.pluginRef",
            "no plugin named 'nope'",
        ),
        (
            "plugins: [{type: max-score-picker}]\nsaturationDetector: "
            "{pluginRef: max-score-picker}\n",
            "saturationDetector.pluginRef",
            "is not one of utilization-detector, concurrency-detector, prefill-backlog-detector",
        ),
        (
            "plugins: [{type: max-score-picker}]\nflowControl: {maxBytes: lots}\n",
            "flowControl.maxBytes",
            "not a quantity",
        ),
        (
            "plugins: [{type: max-score-picker}]\nflowControl: {defaultRequestTTL: soon}\n",
            "flowControl.defaultRequestTTL",
            "not a duration",
        ),
        (
            "plugins: [{type: max-score-picker}]\nflowControl: {priorityBands: "
            "[{priority: 1}, {priority: 1}]}\n",
            "flowControl.priorityBands",
            "configured twice",
        ),
        (
            "plugins: [{type: max-score-picker}]\nflowControl: {priorityBands: "
            "[{priority: 1, fairnessPolicyRef: lottery}]}\n",
            "fairnessPolicyRef",
            "unknown fairness policy",
        ),
    ],
)
def test_config_errors_name_the_field(yaml_text: str, where: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml_text, "epp.yaml")
    text = str(caught.value)
    assert where in text and message in text


def test_the_shipped_default_flow_control_config() -> None:
    loaded = load_config("default-flow-control")
    assert flow_control_enabled(loaded)
    assert loaded.notes == []
    clock = Clock()
    admission = build_admission(loaded, pool(clock).ready_pods, clock=clock)
    assert admission.flow_control and admission.ttl_s == 25.0
    assert admission.saturation() == 0.0
    # The built-in default keeps flow control off, like upstream.
    assert not flow_control_enabled(load_config("default"))

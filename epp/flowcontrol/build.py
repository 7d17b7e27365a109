"""Builds a pool's admission controller from a loaded EndpointPickerConfig."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...framework.registry import registered_plugins
from ...framework.types import PodState
from ...scorers.saturation_detectors import SaturationDetector, UtilizationDetector
from ..config import LoadedConfig
from .admission import AdmissionController, AdmissionObserver
from .objectives import ObjectiveTable
from .settings import FLOW_CONTROL_GATE, gate_enabled, queue_settings


def flow_control_enabled(loaded: LoadedConfig) -> bool:
    return gate_enabled(loaded.config.featureGates, FLOW_CONTROL_GATE)


def build_detector(loaded: LoadedConfig) -> SaturationDetector:
    """The configured detector: `flowControl.saturationDetector`, else the top-level
    `saturationDetector` (a pluginRef or inline thresholds), else a default
    `utilization-detector`."""
    config = loaded.config
    ref = config.flowControl.saturationDetector if config.flowControl else None
    ref = ref or config.saturationDetector
    if ref is not None and ref.pluginRef is not None:
        spec = next(p for p in config.plugins if p.ref == ref.pluginRef)
        cls = registered_plugins()[spec.type]
        detector = cls(spec.ref, loaded.plugin_params[spec.ref])
        assert isinstance(detector, SaturationDetector)
        return detector
    inline = ref.inline_parameters() if ref is not None else {}
    return UtilizationDetector(
        UtilizationDetector.type_name, UtilizationDetector.Params.model_validate(inline)
    )


def build_admission(
    loaded: LoadedConfig,
    pods: Callable[[], Sequence[PodState]],
    *,
    clock: Callable[[], float],
    objectives: ObjectiveTable | None = None,
    observer: AdmissionObserver | None = None,
) -> AdmissionController:
    return AdmissionController(
        build_detector(loaded),
        pods,
        objectives,
        flow_control=flow_control_enabled(loaded),
        queue=queue_settings(loaded.config.flowControl),
        clock=clock,
        observer=observer,
    )

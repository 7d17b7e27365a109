"""The `flowControl` and `saturationDetector` sections of an EndpointPickerConfig.

Both follow llm-d's EndpointPickerConfig: flow control is off unless the `flowControl`
feature gate is on (`featureGates: ["flowControl"]`); its section sets the queue bounds
(per priority band and overall, in requests and bytes, as Kubernetes quantities), the
default queue-wait TTL (60 s) and the saturation detector (`pluginRef` to a
`utilization-detector` or `concurrency-detector` plugin; a `utilization-detector` with
upstream defaults when none is named). The Inference Extension's older top-level
`saturationDetector` with inline thresholds (`queueDepthThreshold`,
`kvCacheUtilThreshold`, `metricsStalenessThreshold`) is read too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...framework.units import parse_duration, parse_quantity
from .queue import BandLimits, Fairness

FLOW_CONTROL_GATE = "flowControl"
DEFAULT_TTL_S = 60.0
FAIRNESS_POLICIES: dict[str, Fairness] = {
    "round-robin-fairness-policy": "round-robin",
    "global-strict-fairness-policy": "global-strict",
}
ORDERING_POLICIES = ("fcfs-ordering-policy",)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SaturationDetectorRef(_Section):
    """`saturationDetector`: a plugin reference, or the older inline thresholds."""

    pluginRef: str | None = None
    queueDepthThreshold: int | None = Field(default=None, gt=0)
    kvCacheUtilThreshold: float | None = Field(default=None, gt=0.0, le=1.0)
    metricsStalenessThreshold: float | None = Field(default=None, gt=0.0)

    @field_validator("metricsStalenessThreshold", mode="before")
    @classmethod
    def _duration(cls, value: object) -> float | None:
        return None if value is None else parse_duration(value)

    def inline_parameters(self) -> dict[str, Any]:
        fields = ("queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold")
        return {k: getattr(self, k) for k in fields if getattr(self, k) is not None}


def _quantity(value: object) -> int | None:
    return None if value is None else parse_quantity(value)


class PriorityBandSpec(_Section):
    priority: int = 0
    maxBytes: int | None = None
    maxRequests: int | None = None
    fairnessPolicyRef: str | None = None
    orderingPolicyRef: str | None = None

    @field_validator("maxBytes", "maxRequests", mode="before")
    @classmethod
    def _quantities(cls, value: object) -> int | None:
        return _quantity(value)

    @field_validator("fairnessPolicyRef")
    @classmethod
    def _fairness(cls, value: str | None) -> str | None:
        if value is not None and value not in FAIRNESS_POLICIES:
            raise ValueError(f"unknown fairness policy; known: {', '.join(FAIRNESS_POLICIES)}")
        return value

    @field_validator("orderingPolicyRef")
    @classmethod
    def _ordering(cls, value: str | None) -> str | None:
        if value is not None and value not in ORDERING_POLICIES:
            raise ValueError(f"unknown ordering policy; known: {', '.join(ORDERING_POLICIES)}")
        return value

    def limits(self, base: BandLimits | None = None) -> BandLimits:
        base = base or BandLimits()
        return BandLimits(
            # 0 or unset means the default, as upstream.
            max_requests=self.maxRequests or base.max_requests,
            max_bytes=self.maxBytes or base.max_bytes,
            fairness=FAIRNESS_POLICIES[self.fairnessPolicyRef]
            if self.fairnessPolicyRef
            else base.fairness,
        )


class FlowControlSpec(_Section):
    maxBytes: int | None = None
    maxRequests: int | None = None
    defaultRequestTTL: float | None = None
    defaultPriorityBand: PriorityBandSpec | None = None
    defaultNegativePriorityBand: PriorityBandSpec | None = None
    priorityBands: list[PriorityBandSpec] = Field(default_factory=list)
    saturationDetector: SaturationDetectorRef | None = None
    usageLimitPolicyPluginRef: str | None = None  # accepted; smart-epp applies no usage limit
    enableEviction: bool = False  # accepted; smart-epp never evicts requests in flight

    @field_validator("maxBytes", "maxRequests", mode="before")
    @classmethod
    def _quantities(cls, value: object) -> int | None:
        return _quantity(value)

    @field_validator("defaultRequestTTL", mode="before")
    @classmethod
    def _ttl(cls, value: object) -> float | None:
        return None if value is None else parse_duration(value)

    @field_validator("priorityBands")
    @classmethod
    def _unique(cls, bands: list[PriorityBandSpec]) -> list[PriorityBandSpec]:
        seen = [b.priority for b in bands]
        for p in seen:
            if seen.count(p) > 1:
                raise ValueError(f"priority {p} is configured twice")
        return bands


def gate_enabled(feature_gates: list[str] | None, gate: str = FLOW_CONTROL_GATE) -> bool:
    """Whether a feature gate is on: "name" or "name=true" (the last mention wins)."""
    enabled = False
    for entry in feature_gates or ():
        name, _, value = entry.partition("=")
        if name.strip() == gate:
            enabled = value.strip().lower() in ("", "true")
    return enabled


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """Everything the flow-control queue needs, resolved from the config."""

    ttl_s: float | None = DEFAULT_TTL_S  # None: no TTL ("0s")
    bands: dict[int, BandLimits] = field(default_factory=dict)
    default_band: BandLimits = field(default_factory=BandLimits)
    default_negative_band: BandLimits | None = None
    max_requests: int = 0
    max_bytes: int = 0


def queue_settings(spec: FlowControlSpec | None) -> QueueSettings:
    if spec is None:
        return QueueSettings()
    default = spec.defaultPriorityBand.limits() if spec.defaultPriorityBand else BandLimits()
    negative = (
        spec.defaultNegativePriorityBand.limits(default)
        if spec.defaultNegativePriorityBand
        else None
    )
    bands: dict[int, BandLimits] = {}
    for band in spec.priorityBands:
        template = negative if (band.priority < 0 and negative is not None) else default
        bands[band.priority] = band.limits(template)
    ttl = spec.defaultRequestTTL
    return QueueSettings(
        ttl_s=DEFAULT_TTL_S if ttl is None else (ttl or None),
        bands=bands,
        default_band=default,
        default_negative_band=negative,
        max_requests=spec.maxRequests or 0,
        max_bytes=spec.maxBytes or 0,
    )


DetectorType = Literal["utilization-detector", "concurrency-detector", "prefill-backlog-detector"]
DETECTOR_TYPES: tuple[DetectorType, ...] = (
    "utilization-detector",
    "concurrency-detector",
    "prefill-backlog-detector",
)

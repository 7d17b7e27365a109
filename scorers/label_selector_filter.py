"""Label filters: keep pods whose endpoint labels match.

`label-selector-filter` (alias llm-d's `by-label-selector`): a Kubernetes label selector,
`matchLabels` (all must be equal) and `matchExpressions` (In, NotIn, Exists,
DoesNotExist).
`by-label` (llm-d): the pod's `label` must be one of `validValues`; pods without the
label pass only when `allowsNoLabel`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..framework.plugins import Filter, PluginParams, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import PodState


def keep_labelled(
    pods: Sequence[PodState], label: str, values: Collection[str], allow_unlabelled: bool
) -> list[PodState]:
    """The pods whose `label` is one of `values`; pods without it only if allowed."""
    out = []
    for pod in pods:
        value = pod.endpoint.label(label)
        if value is None:
            if allow_unlabelled:
                out.append(pod)
        elif value in values:
            out.append(pod)
    return out


class LabelExpression(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)

    def matches(self, pod: PodState) -> bool:
        value = pod.endpoint.label(self.key)
        if self.operator == "Exists":
            return value is not None
        if self.operator == "DoesNotExist":
            return value is None
        if self.operator == "In":
            return value is not None and value in self.values
        return value is None or value not in self.values


class LabelSelectorParams(PluginParams):
    matchLabels: dict[str, str] = Field(default_factory=dict)
    matchExpressions: list[LabelExpression] = Field(default_factory=list)


@register_plugin("by-label-selector")
class LabelSelectorFilter(Filter):
    type_name = "label-selector-filter"
    Params = LabelSelectorParams
    params: LabelSelectorParams

    def matches(self, pod: PodState) -> bool:
        for key, value in self.params.matchLabels.items():
            if pod.endpoint.label(key) != value:
                return False
        return all(expr.matches(pod) for expr in self.params.matchExpressions)

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        return [p for p in pods if self.matches(p)]


class ByLabelParams(PluginParams):
    label: str = Field(min_length=1)
    validValues: list[str] = Field(default_factory=list)
    allowsNoLabel: bool = False


@register_plugin()
class ByLabelFilter(Filter):
    type_name = "by-label"
    Params = ByLabelParams
    params: ByLabelParams

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        p = self.params
        return keep_labelled(pods, p.label, p.validValues, p.allowsNoLabel)

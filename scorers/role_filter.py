"""Role filters for prefill/decode disaggregated pools (llm-d's role label).

`role-filter` keeps pods whose `label` (default `llm-d.ai/role`) is `role` or `both`;
pods without the label count as `both` when `unlabeledIsBoth` (default true).
`prefill-filter` and `decode-filter` are llm-d's names for the two fixed roles: decode
accepts `decode`, `both` and unlabelled pods; prefill accepts only `prefill`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import Filter, PluginParams, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import PodState
from .label_selector_filter import keep_labelled

ROLE_LABEL = "llm-d.ai/role"
BOTH = "both"


class RoleParams(PluginParams):
    role: str = Field(default="decode", min_length=1)
    label: str = ROLE_LABEL
    unlabeledIsBoth: bool = True


def keep_role(
    pods: Sequence[PodState], role: str, label: str, unlabeled_is_both: bool
) -> list[PodState]:
    return keep_labelled(pods, label, (role, BOTH), unlabeled_is_both)


@register_plugin()
class RoleFilter(Filter):
    type_name = "role-filter"
    Params = RoleParams
    params: RoleParams

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        return keep_role(pods, self.params.role, self.params.label, self.params.unlabeledIsBoth)


@register_plugin()
class DecodeFilter(Filter):
    type_name = "decode-filter"

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        return keep_role(pods, "decode", ROLE_LABEL, unlabeled_is_both=True)


@register_plugin()
class PrefillFilter(Filter):
    type_name = "prefill-filter"

    def filter(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[PodState]:
        return keep_labelled(pods, ROLE_LABEL, ("prefill",), allow_unlabelled=False)

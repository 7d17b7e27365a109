"""Profile handlers: which scheduling profile runs, and what happens to its result.

- `single-profile-handler`: runs the one profile of the config (the Inference
  Extension's default; a config with more profiles is refused when loaded).
- `data-parallel-profile-handler` (llm-d): vLLM data-parallel ranks each listen on their
  own port but are served through one front port. The profile picks a rank as usual;
  Envoy is then sent to the same host on `primaryPort`, with the chosen rank's
  `host:port` in the `x-data-parallel-host-port` request header.
"""

from __future__ import annotations

from pydantic import Field

from ..framework.plugins import DecisionHook, PluginParams, ProfileHandler, SchedulingContext
from ..framework.registry import register_plugin
from ..framework.types import Decision

DATA_PARALLEL_HEADER = "x-data-parallel-host-port"


@register_plugin()
class SingleProfileHandler(ProfileHandler):
    type_name = "single-profile-handler"


class DataParallelParams(PluginParams):
    primaryPort: int = Field(default=8000, ge=1, le=65535)


def _host(address: str) -> str:
    host, _, _ = address.rpartition(":")
    return host or address


@register_plugin()
class DataParallelProfileHandler(ProfileHandler, DecisionHook):
    type_name = "data-parallel-profile-handler"
    Params = DataParallelParams
    params: DataParallelParams

    def on_decided(self, ctx: SchedulingContext, decision: Decision) -> None:
        if not decision.endpoints:
            return
        port = self.params.primaryPort
        for pod in decision.endpoints:
            decision.forward[pod.address] = f"{_host(pod.address)}:{port}"
        rank = decision.endpoints[0].address
        decision.request_headers = (*decision.request_headers, (DATA_PARALLEL_HEADER, rank))

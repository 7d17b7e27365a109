"""session-affinity-scorer: keep a session on the pod that served it last.

The session is the request's `session_id` (the x-session-id header); the pod that served
it scores 1, every other pod 0. Requests without a session score 0 everywhere. Sessions
are remembered in an LRU of `capacity` entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pydantic import Field

from ..framework.plugins import PluginParams, RoutingHook, SchedulingContext, Scorer
from ..framework.registry import register_plugin
from ..framework.types import PodState


class SessionAffinityParams(PluginParams):
    capacity: int = Field(default=100_000, gt=0)


@register_plugin()
class SessionAffinityScorer(Scorer, RoutingHook):
    type_name = "session-affinity-scorer"
    Params = SessionAffinityParams
    params: SessionAffinityParams

    def __init__(self, name: str, params: SessionAffinityParams) -> None:
        super().__init__(name, params)
        self._pod_of_session: OrderedDict[str, str] = OrderedDict()

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        session = ctx.request.session_id
        target = self._pod_of_session.get(session) if session else None
        return [1.0 if target is not None and p.address == target else 0.0 for p in pods]

    def on_routed(self, ctx: SchedulingContext, chosen: PodState) -> None:
        session = ctx.request.session_id
        if not session:
            return
        self._pod_of_session[session] = chosen.address
        self._pod_of_session.move_to_end(session)
        while len(self._pod_of_session) > self.params.capacity:
            self._pod_of_session.popitem(last=False)

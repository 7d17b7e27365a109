"""session-affinity-scorer: keep a session on the pod that served it (llm-d's protocol).

Two strategies, as in llm-d's router:

- `encoded_endpoint_header` (default, stateless): the response carries the header
  `x-session-token` (`encodedEndpointHeaderConfig.header`) whose value is the base64 of the
  pod that was picked; a client that sends it back on its next request scores that pod 1
  and every other pod 0. The gateway keeps no state.
- `session_id` (stateful): the client names its session in a request header
  (`sessionIdConfig.sources`, default `x-session-id`); the pod a session was last routed to
  scores 1. Bindings unused for `evictionTtlSeconds` (300) are forgotten, and at most
  `capacity` are kept (least recently used first out).

A token that does not decode, or names a pod that is not a candidate, scores 0 everywhere.
"""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..framework.plugins import (
    DecisionHook,
    PluginParams,
    RoutingHook,
    SchedulingContext,
    Scorer,
)
from ..framework.registry import register_plugin
from ..framework.types import Decision, LLMRequest, PodState

DEFAULT_TOKEN_HEADER = "x-session-token"
DEFAULT_SESSION_HEADER = "x-session-id"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EncodedEndpointHeaderConfig(_Strict):
    header: str = DEFAULT_TOKEN_HEADER


class SessionSource(_Strict):
    header: str = Field(min_length=1)


class SessionIdConfig(_Strict):
    sources: list[SessionSource] = Field(
        default_factory=lambda: [SessionSource(header=DEFAULT_SESSION_HEADER)], min_length=1
    )
    evictionTtlSeconds: float = Field(default=300.0, gt=0)
    evictionSweepSeconds: float = Field(default=10.0, gt=0)


class SessionAffinityParams(PluginParams):
    strategy: Literal["encoded_endpoint_header", "session_id"] = "encoded_endpoint_header"
    encodedEndpointHeaderConfig: EncodedEndpointHeaderConfig = Field(
        default_factory=EncodedEndpointHeaderConfig
    )
    sessionIdConfig: SessionIdConfig = Field(default_factory=SessionIdConfig)
    # Pins the pod of another profile (prefill) in disaggregated serving.
    profileName: str | None = None
    capacity: int = Field(default=100_000, gt=0)

    @model_validator(mode="after")
    def _one_profile(self) -> SessionAffinityParams:
        if self.profileName:
            raise ValueError(
                "profileName pins the pod of another profile (disaggregated serving), "
                "which smart-epp does not implement"
            )
        return self


def encode_token(address: str) -> str:
    return base64.b64encode(address.encode()).decode("ascii")


def decode_token(token: str) -> str | None:
    try:
        return base64.b64decode(token.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


@register_plugin()
class SessionAffinityScorer(Scorer, RoutingHook, DecisionHook):
    type_name = "session-affinity-scorer"
    Params = SessionAffinityParams
    params: SessionAffinityParams

    def __init__(self, name: str, params: SessionAffinityParams) -> None:
        super().__init__(name, params)
        self._token_header = params.encodedEndpointHeaderConfig.header.strip().lower()
        self._session_headers = [s.header.strip().lower() for s in params.sessionIdConfig.sources]
        # session -> (pod address, last use on the scheduler clock)
        self._pod_of_session: OrderedDict[str, tuple[str, float]] = OrderedDict()

    @property
    def stateless(self) -> bool:
        return self.params.strategy == "encoded_endpoint_header"

    def session_of(self, request: LLMRequest) -> str | None:
        for header in self._session_headers:
            value = request.headers.get(header)
            if value:
                return value
        if DEFAULT_SESSION_HEADER in self._session_headers:
            return request.session_id
        return None

    def _target(self, ctx: SchedulingContext) -> str | None:
        if self.stateless:
            token = ctx.request.headers.get(self._token_header)
            return decode_token(token) if token else None
        session = self.session_of(ctx.request)
        if session is None:
            return None
        bound = self._pod_of_session.get(session)
        if bound is None:
            return None
        address, last_used = bound
        if ctx.now - last_used > self.params.sessionIdConfig.evictionTtlSeconds:
            del self._pod_of_session[session]
            return None
        return address

    def score(self, ctx: SchedulingContext, pods: Sequence[PodState]) -> list[float]:
        target = self._target(ctx)
        return [1.0 if target is not None and p.address == target else 0.0 for p in pods]

    def on_decided(self, ctx: SchedulingContext, decision: Decision) -> None:
        if self.stateless and decision.endpoints:
            token = encode_token(decision.endpoints[0].address)
            decision.response_headers = (
                *decision.response_headers,
                (self._token_header, token),
            )

    def on_routed(self, ctx: SchedulingContext, chosen: PodState) -> None:
        if self.stateless:
            return
        session = self.session_of(ctx.request)
        if not session:
            return
        self._pod_of_session[session] = (chosen.address, ctx.now)
        self._pod_of_session.move_to_end(session)
        while len(self._pod_of_session) > self.params.capacity:
            self._pod_of_session.popitem(last=False)

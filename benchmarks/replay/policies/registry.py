"""Policies by name: the peers in this package, the full-information reference, and
smart-epp's own scheduler for any built-in or file EndpointPickerConfig."""

from __future__ import annotations

from pathlib import Path

from ..sim import RoutedPolicy
from .aibrix import AIBrixPrefixCache
from .context import PolicyContext
from .full_information import FullInformation
from .sglang import SGLangCacheAware
from .simple import (
    LeastQueue,
    PowerOfTwo,
    RandomChoice,
    RoundRobin,
)

PEER_POLICIES = (
    "round-robin",
    "random",
    "least-queue",
    "power-of-two",
    "sglang-cache-aware",
    "aibrix-prefix-cache",
)
CONFIG_POLICIES = ("default", "gie-default", "llmd-precise")
ALL_POLICIES = ("default", *PEER_POLICIES, "gie-default", "llmd-precise", "full-information")
# Former names still accepted.
ALIASES = {"oracle": "full-information"}


class UnknownPolicy(ValueError):
    pass


def known_policy(name: str) -> bool:
    return name in ALL_POLICIES or name in ALIASES or Path(name).is_file()


def build_policy(name: str, ctx: PolicyContext) -> RoutedPolicy:
    if name == "round-robin":
        return RoutedPolicy(name, RoundRobin())
    if name == "random":
        return RoutedPolicy(name, RandomChoice(ctx.seed))
    if name == "least-queue":
        return RoutedPolicy(name, LeastQueue(ctx.seed))
    if name == "power-of-two":
        return RoutedPolicy(name, PowerOfTwo(ctx.seed))
    if name == "sglang-cache-aware":
        return RoutedPolicy(name, SGLangCacheAware())
    if name == "aibrix-prefix-cache":
        return RoutedPolicy(name, AIBrixPrefixCache())
    if name in ("full-information", "oracle"):
        return RoutedPolicy(name, FullInformation(ctx.pool.engines))
    if name in CONFIG_POLICIES or Path(name).is_file():
        from .smart_epp import build_config_policy

        return build_config_policy(name, ctx)
    raise UnknownPolicy(
        f"unknown policy {name!r}: one of {', '.join(ALL_POLICIES)}, "
        "or an EndpointPickerConfig file"
    )

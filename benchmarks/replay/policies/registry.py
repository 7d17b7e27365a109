"""Policies by name: the peers in this package, the full-information reference, and
smart-epp's own scheduler for any built-in or file EndpointPickerConfig."""

from __future__ import annotations

from pathlib import Path

from ..sim import RoutedPolicy
from .aibrix import AIBrixPrefixCache
from .context import PolicyContext, split_count
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


def split_pickers(name: str) -> tuple[str, int]:
    """`default@3`: policy `default` run by 3 pickers of one pool sharing state (replicas
    behind one Envoy); a name without `@` is one router."""
    base, count = split_count(name)
    if base == name:
        return name, 1
    if not count.isdigit() or int(count) < 1:
        raise UnknownPolicy(f"{name!r}: the count after '@' is a number of pickers, 1 or more")
    return base, int(count)


def known_policy(name: str) -> bool:
    try:
        name, _ = split_pickers(name)
    except UnknownPolicy:
        return False
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


def build_pickers(spec: str, ctx: PolicyContext) -> list[RoutedPolicy]:
    """The pickers of policy `spec` (`NAME` or `NAME@COUNT`, see `split_pickers`), sharing
    state as `epp serve --shared-state` replicas do; one is the policy alone."""
    name, count = split_pickers(spec)
    if count == 1:
        return [build_policy(name, ctx)]
    if name in CONFIG_POLICIES or Path(name).is_file():
        from .smart_epp import build_config_pickers

        return build_config_pickers(name, ctx, count)
    raise UnknownPolicy(f"{name!r} runs as one router: several pickers are smart-epp's")

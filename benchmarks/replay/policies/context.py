"""What a policy is built from in the replay, and how a policy is named in reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..sim import SimPool


@dataclass(frozen=True, slots=True)
class PolicyContext:
    pool: SimPool
    clock: Callable[[], float]  # the simulation's virtual clock
    seed: int
    model: str
    # Whether smart-epp's pickers check prompts against the engines' context lengths
    # (SimConfig.context_limits).
    context_limits: bool = False


def split_count(name: str) -> tuple[str, str]:
    """`default@3` -> ("default", "3"): a policy and the text of its picker count ("" when
    the name has no `@`)."""
    base, sep, count = name.rpartition("@")
    return (base, count) if sep else (name, "")


def policy_label(name: str) -> str:
    """How a policy is shown: its name, or a config file's stem (with `@N` pickers kept)."""
    base, count = split_count(name)
    shown = Path(base).stem if base.endswith((".yaml", ".yml")) else base
    return shown if base == name else f"{shown}@{count}"

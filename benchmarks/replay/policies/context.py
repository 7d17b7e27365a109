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


def policy_label(name: str) -> str:
    """How a policy is shown: its name, or a config file's stem (with `@N` pickers kept)."""
    base, sep, count = name.rpartition("@")
    if not sep:
        base, count = name, ""
    shown = Path(base).stem if base.endswith((".yaml", ".yml")) else base
    return f"{shown}{sep}{count}"

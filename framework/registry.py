"""The plugin registry: type name -> plugin class.

Plugin modules register themselves with `@register_plugin` when imported; whoever builds
schedulers (the config loader) imports the catalog of built-in plugins first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .plugins import Plugin

_REGISTRY: dict[str, type[Plugin]] = {}
P = TypeVar("P", bound=type[Plugin])


def register_plugin(*aliases: str) -> Callable[[P], P]:
    """Class decorator: registers a plugin under its `type_name` and any aliases."""

    def wrap(cls: P) -> P:
        for type_name in (cls.type_name, *aliases):
            existing = _REGISTRY.get(type_name)
            if existing is not None and existing is not cls:
                raise ValueError(f"plugin type {type_name!r} registered twice")
            _REGISTRY[type_name] = cls
        return cls

    return wrap


def registered_plugins() -> dict[str, type[Plugin]]:
    """Every plugin type registered so far."""
    return dict(_REGISTRY)

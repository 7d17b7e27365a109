"""InferenceObjective objects: a request's priority, from the objective it names.

A request names its objective with the `x-gateway-inference-objective` header (the
Inference Extension's). Objectives come from `InferenceObjective` objects — in
Kubernetes, or outside it from a YAML file holding the same objects (a list, a
multi-document stream, or a `kind: List`). `spec.priority` is an integer, default 0,
higher first; a negative priority marks the objective's requests sheddable. A name no
object defines gets the default priority (and is counted), never an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ...framework.types import SLO_TTFT_HEADER
from ..watched_file import WatchedFile

__all__ = ["SLO_TTFT_HEADER"]

log = logging.getLogger(__name__)

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
DEFAULT_PRIORITY = 0


class ObjectivesError(ValueError):
    """An objectives document that cannot be used; the message names the source and object."""


@dataclass(frozen=True, slots=True)
class Objective:
    name: str
    priority: int = DEFAULT_PRIORITY
    pool: str | None = None  # spec.poolRef.name; None = any pool

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


def _objects(documents: Iterable[Any]) -> Iterable[Any]:
    for doc in documents:
        if doc is None:
            continue
        if isinstance(doc, list):
            yield from doc
        elif isinstance(doc, dict) and doc.get("kind") == "List":
            yield from doc.get("items") or []
        else:
            yield doc


def objective_from_object(raw: Any, where: str) -> Objective:
    """One InferenceObjective object (a parsed YAML document or an API object)."""
    if not isinstance(raw, dict):
        raise ObjectivesError(f"{where}: expected an InferenceObjective mapping")
    kind = raw.get("kind", "InferenceObjective")
    if kind != "InferenceObjective":
        raise ObjectivesError(f"{where}: kind {kind!r} is not InferenceObjective")
    metadata = raw.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if not isinstance(name, str) or not name:
        raise ObjectivesError(f"{where}: metadata.name is required")
    spec = raw.get("spec") or {}
    if not isinstance(spec, dict):
        raise ObjectivesError(f"{where} ({name}): spec must be a mapping")
    priority = spec.get("priority", DEFAULT_PRIORITY)
    if priority is None:
        priority = DEFAULT_PRIORITY
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ObjectivesError(f"{where} ({name}): spec.priority must be an integer")
    pool_ref = spec.get("poolRef")
    pool = pool_ref.get("name") if isinstance(pool_ref, dict) else None
    return Objective(name=name, priority=priority, pool=pool if isinstance(pool, str) else None)


def parse_objectives(
    text: str, source: str = "<objectives>", pool: str | None = None
) -> dict[str, Objective]:
    """Objectives by name from YAML text; those whose poolRef names another pool are skipped."""
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise ObjectivesError(f"{source}: not valid YAML: {exc}") from None
    found: dict[str, Objective] = {}
    for i, raw in enumerate(_objects(documents)):
        objective = objective_from_object(raw, f"{source}: object {i + 1}")
        if pool is not None and objective.pool is not None and objective.pool != pool:
            continue
        if objective.name in found:
            raise ObjectivesError(f"{source}: objective {objective.name!r} is defined twice")
        found[objective.name] = objective
    return found


class ObjectiveTable:
    """The objectives in force; replaced as a whole on reload."""

    def __init__(
        self,
        objectives: Mapping[str, Objective] | None = None,
        on_unknown: Callable[[str], None] | None = None,
    ) -> None:
        self._objectives: dict[str, Objective] = dict(objectives or {})
        self.on_unknown = on_unknown
        self.unknown = 0  # requests that named an objective nobody defined

    def replace(self, objectives: Mapping[str, Objective]) -> None:
        self._objectives = dict(objectives)

    def __len__(self) -> int:
        return len(self._objectives)

    def get(self, name: str) -> Objective | None:
        return self._objectives.get(name)

    def priority(self, name: str | None) -> int:
        """The priority of a named objective; the default for none or an unknown name."""
        if not name:
            return DEFAULT_PRIORITY
        objective = self._objectives.get(name)
        if objective is not None:
            return objective.priority
        self.unknown += 1
        if self.on_unknown is not None:
            self.on_unknown(name)
        return DEFAULT_PRIORITY


class ObjectivesFileWatcher(WatchedFile):
    """Loads an objectives file into a table and reloads it whenever it changes.

    A file that fails to load leaves the previous objectives in force."""

    what = "objectives file"
    load_errors = (ObjectivesError,)

    def __init__(
        self,
        path: Path,
        table: ObjectiveTable,
        pool: str | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        super().__init__(path, on_error)
        self.table = table
        self.pool = pool

    def missing(self) -> Exception:
        return ObjectivesError(f"{self.path}: file is missing; keeping the objectives")

    def load(self, text: str) -> None:
        objectives = parse_objectives(text, str(self.path), self.pool)
        self.table.replace(objectives)
        log.info("objectives: %d loaded from %s", len(objectives), self.path)

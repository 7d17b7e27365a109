"""InferenceObjective objects from the Kubernetes API, watched the way the pool is.

The objectives of the picker's namespace whose `spec.poolRef` names its pool (or names no
pool) are kept in the objective table, updated on every change the watch reports. An
object that does not parse is logged and left out; the others stay in force.
"""

from __future__ import annotations

import logging
from typing import Any

from ..k8s_discovery import Backoff, KubernetesApi, KubernetesDiscoveryOptions, list_and_watch
from .objectives import Objective, ObjectivesError, ObjectiveTable, objective_from_object

log = logging.getLogger(__name__)

# The Inference Extension serves InferenceObjective under its experimental group.
OBJECTIVE_API_VERSION = "inference.networking.x-k8s.io/v1alpha2"


class KubernetesObjectivesWatcher:
    def __init__(
        self,
        options: KubernetesDiscoveryOptions,
        table: ObjectiveTable,
        api: KubernetesApi | None = None,
    ) -> None:
        self.options = options
        self.table = table
        self.api = api or KubernetesApi(options)
        self.errors = 0
        self.updates = 0
        self._known: dict[str, Objective] = {}

    @property
    def path(self) -> str:
        return (
            f"/apis/{OBJECTIVE_API_VERSION}/namespaces/{self.options.namespace}/inferenceobjectives"
        )

    async def run(self) -> None:
        try:
            await list_and_watch(
                self.api,
                self.path,
                {},
                self._listed,
                self._event,
                self._failed,
                Backoff(self.options.backoff_min_s, self.options.backoff_max_s),
            )
        finally:
            await self.api.close()

    def _convert(self, obj: dict[str, Any]) -> Objective | None:
        try:
            objective = objective_from_object(obj, "InferenceObjective")
        except ObjectivesError as exc:
            self.errors += 1
            log.warning("InferenceObjective left out: %s", exc)
            return None
        if objective.pool is not None and objective.pool != self.options.pool_name:
            return None
        return objective

    def _listed(self, items: list[dict[str, Any]]) -> None:
        known: dict[str, Objective] = {}
        for item in items:
            objective = self._convert(item)
            if objective is not None:
                known[objective.name] = objective
        self._known = known
        self._publish()

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if not isinstance(name, str):
            return
        objective = None if kind == "DELETED" else self._convert(obj)
        if objective is None:
            self._known.pop(name, None)
        else:
            self._known[name] = objective
        self._publish()

    def _publish(self) -> None:
        self.table.replace(dict(self._known))
        self.updates += 1
        log.info("objectives: %d from the Kubernetes API", len(self._known))

    def _failed(self, reason: str, exc: Exception) -> None:
        self.errors += 1
        log.warning("InferenceObjective watch: %s (%s); retrying", reason, exc)

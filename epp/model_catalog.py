"""Which models each pod serves: base models and LoRA adapters, from GET /v1/models.

vLLM lists its base model (`parent: null`) and every loaded adapter (`parent` = the base
model) on /v1/models. `ModelCatalog` keeps the last good list per pod (pure state, no
I/O); `ModelCatalogPoller` refreshes it every few seconds over one keep-alive HTTP
session and follows the pool through the datastore's listeners. Adapters a pod's
scraped `vllm:lora_requests_info` names count as served too (they show up there as soon
as a request for them runs, before the next poll).

What a model name means for routing (`resolve_adapter`, `servers`):
- an adapter any pod serves -> the request is for that adapter, and only pods serving
  it are candidates;
- a base model some pod serves -> only the pods serving that base model are candidates;
- a name no pod lists, while at least one pod has told us its models -> 404, the
  answer vLLM itself gives for an unknown model;
- nothing known yet (no pod answered /v1/models with a model: still starting, or
  servers that do not list models) -> the request passes through untouched.
A failed poll keeps the pod's previous list: a pod that is briefly down is not
forgotten, a pod that left the pool is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client import Counter

from ..framework.types import Endpoint, PodState
from .errors import RequestError
from .scrape import polling_session

log = logging.getLogger(__name__)

CATALOG_POLLS = Counter(
    "smart_epp_model_catalog_polls_total", "GET /v1/models polls of pods, by result", ["result"]
)


@dataclass(frozen=True, slots=True)
class ServedModels:
    """One pod's /v1/models answer: its base models, its adapters (name -> parent) and
    the longest request its engine accepts (vLLM's `max_model_len` on the base model's
    card; None when the server does not say)."""

    base: frozenset[str]
    adapters: dict[str, str | None]
    max_model_len: int | None = None

    def __contains__(self, model: object) -> bool:
        return model in self.base or model in self.adapters


def parse_models(document: Any) -> ServedModels:
    """Reads an OpenAI/vLLM model list; ValueError when it is not one."""
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        raise ValueError("not an OpenAI model list (no `data` array)")
    base: set[str] = set()
    adapters: dict[str, str | None] = {}
    limits: list[int] = []
    for card in document["data"]:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str) or not card["id"]:
            raise ValueError("model entry without a string `id`")
        parent = card.get("parent")
        if parent is None:
            base.add(card["id"])
            limit = card.get("max_model_len")
            if limit is not None:
                if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                    raise ValueError(
                        f"model {card['id']!r}: `max_model_len` must be a positive integer"
                    )
                limits.append(limit)
        elif isinstance(parent, str):
            adapters[card["id"]] = parent
        else:
            raise ValueError(f"model {card['id']!r}: `parent` must be a string or null")
    # One engine serves every name a pod lists (adapters run on the base model's engine,
    # their cards say null); should the base cards differ, the smallest limit is safe.
    return ServedModels(frozenset(base), adapters, min(limits) if limits else None)


class UnknownModelError(RequestError):
    def __init__(self, model: str) -> None:
        super().__init__(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


class ModelCatalog:
    """Per pod, the models it serves (pure state; the poller feeds it).

    Lookups run per request, so the catalog keeps model -> pods maps, rebuilt on the
    (rare) changes; only a name that is neither a listed base model nor a listed adapter
    costs a pass over the pods' scraped adapters.
    """

    def __init__(self, pods: Callable[[], Iterable[PodState]] | None = None) -> None:
        self._served: dict[str, ServedModels] = {}
        # Live pod states, for the adapters their scraped lora_requests_info names.
        self._pods = pods or (lambda: ())
        self._base_servers: dict[str, frozenset[str]] = {}
        self._adapter_servers: dict[str, frozenset[str]] = {}

    # ---- updates -----------------------------------------------------------------------

    def update(self, address: str, served: ServedModels) -> bool:
        """Records a pod's list; True when it differs from what was known."""
        if not served.base and not served.adapters:
            # A server that lists nothing tells us nothing (not a vLLM pod, or starting).
            changed = self._served.pop(address, None) is not None
        else:
            changed = self._served.get(address) != served
            self._served[address] = served
        if changed:
            self._reindex()
        return changed

    def forget(self, address: str) -> None:
        if self._served.pop(address, None) is not None:
            self._reindex()

    def _reindex(self) -> None:
        base: dict[str, set[str]] = {}
        adapters: dict[str, set[str]] = {}
        for address, served in self._served.items():
            for model in served.base:
                base.setdefault(model, set()).add(address)
            for adapter in served.adapters:
                adapters.setdefault(adapter, set()).add(address)
        self._base_servers = {m: frozenset(a) for m, a in base.items()}
        self._adapter_servers = {m: frozenset(a) for m, a in adapters.items()}

    # ---- queries -----------------------------------------------------------------------

    def known(self) -> bool:
        return bool(self._served)

    def served_by(self, address: str) -> ServedModels | None:
        return self._served.get(address)

    def context_limit(self, address: str) -> int | None:
        """The longest request (prompt + output tokens) the pod's engine accepts; None
        when unknown."""
        served = self._served.get(address)
        return served.max_model_len if served is not None else None

    def base_model_of_pod(self, address: str) -> str | None:
        """The pod's base model. vLLM serves one per process, possibly under several
        names (--served-model-name a b); the smallest name stands for all of them, so
        every replica picks the same one."""
        served = self._served.get(address)
        if served is None or not served.base:
            return None
        return min(served.base)

    def parent_of(self, adapter: str) -> str | None:
        for served in self._served.values():
            parent = served.adapters.get(adapter)
            if parent is not None:
                return parent
        return None

    def _scraped_servers(self, adapter: str) -> set[str]:
        return {
            pod.address
            for pod in self._pods()
            if adapter in pod.metrics.running_adapters or adapter in pod.metrics.waiting_adapters
        }

    def resolve_adapter(self, model: str) -> str | None:
        """The server's `adapter_resolver`: the adapter `model` names, None for a base
        model; raises UnknownModelError (404) for a model no pod serves."""
        if model in self._adapter_servers:
            return model
        if model in self._base_servers:
            return None
        if self._scraped_servers(model):
            return model
        if self._served:
            raise UnknownModelError(model)
        return None

    def servers(self, model: str) -> AbstractSet[str] | None:
        """Addresses of the pods serving `model` (base or adapter); None when nothing is
        known about it, so the caller should not narrow."""
        found = self._base_servers.get(model)  # never empty when present
        if found:
            return found
        found = self._adapter_servers.get(model, frozenset()) | self._scraped_servers(model)
        if found or self._served:
            return found
        return None


class ModelCatalogPoller:
    """Refreshes a ModelCatalog from every pod's GET /v1/models."""

    def __init__(
        self,
        catalog: ModelCatalog,
        interval_s: float = 2.0,
        timeout_s: float = 1.0,
        *,
        on_change: Callable[[str, ServedModels], None] | None = None,
        session_factory: Callable[[], aiohttp.ClientSession] | None = None,
    ) -> None:
        self.catalog = catalog
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_change = on_change
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None
        self._endpoints: dict[str, Endpoint] = {}
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[bool]] = set()

    # ---- datastore listeners -------------------------------------------------------------

    def on_endpoint_added(self, endpoint: Endpoint) -> None:
        self._endpoints[endpoint.address] = endpoint
        if self._session is not None:
            self.refresh_soon(endpoint.address)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self._endpoints.pop(endpoint.address, None)
        self.catalog.forget(endpoint.address)

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self, first_refresh_timeout_s: float = 2.0) -> None:
        """Starts polling; the first round is awaited (bounded) so that the first requests
        already know the pool's models."""
        if self._session is not None:
            return
        factory = self._session_factory or (lambda: polling_session(self.timeout_s))
        self._session = factory()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.refresh_all(), first_refresh_timeout_s)
        self._task = asyncio.create_task(self._run(), name="model-catalog")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._pending) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- polling -------------------------------------------------------------------------

    def refresh_soon(self, address: str) -> None:
        task = asyncio.ensure_future(self.refresh(address))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self.refresh(a) for a in list(self._endpoints)))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh_all()
            except Exception:
                log.exception("model catalog refresh failed")

    async def refresh(self, address: str) -> bool:
        """Polls one pod; True when its list was read."""
        if self._session is None or address not in self._endpoints:
            return False
        try:
            async with self._session.get(f"http://{address}/v1/models") as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(
                        resp.request_info, (), status=resp.status, message=resp.reason or ""
                    )
                served = parse_models(await resp.json(content_type=None))
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            CATALOG_POLLS.labels("error").inc()
            log.debug("GET %s/v1/models failed: %r", address, exc)
            return False
        CATALOG_POLLS.labels("ok").inc()
        if address not in self._endpoints:
            return False  # the pod left while we were asking
        if self.catalog.update(address, served):
            log.info(
                "pod %s serves %s (adapters: %s)",
                address,
                ",".join(sorted(served.base)) or "-",
                ",".join(sorted(served.adapters)) or "-",
            )
            if self.on_change is not None:
                try:
                    self.on_change(address, served)
                except Exception:
                    log.exception("model catalog listener failed for %s", address)
        return True

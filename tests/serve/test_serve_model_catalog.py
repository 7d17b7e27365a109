"""The model catalog: vLLM's /v1/models parsed, adapter resolution, candidate narrowing,
and the poller against real simulated pods over HTTP."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from serve_stack import MODEL, sim_pods
from support.paths import VLLM_FIXTURES

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.errors import RequestError
from smart_epp.epp.model_catalog import (
    ModelCatalog,
    ModelCatalogPoller,
    ServedModels,
    parse_models,
)
from smart_epp.epp.model_routing import ServedModelFilter
from smart_epp.framework.types import (
    Api,
    Endpoint,
    LLMRequest,
    PodMetrics,
    PodState,
)


def test_vllm_model_list_gives_base_model_and_adapters_with_parent() -> None:
    served = parse_models(json.loads((VLLM_FIXTURES / "lora" / "models.json").read_text()))
    assert served.base == {"tiny"}
    assert served.adapters == {"lora-a": "tiny", "lora-b": "tiny"}
    # The engine's context comes on the base model's card (the adapters' say null).
    assert served.max_model_len == 1024
    basic = parse_models(json.loads((VLLM_FIXTURES / "basic" / "models.json").read_text()))
    assert basic.adapters == {} and len(basic.base) == 1


def test_a_model_list_without_max_model_len_leaves_the_context_unknown() -> None:
    served = parse_models({"data": [{"id": "m", "parent": None}]})
    assert served.max_model_len is None
    catalog = ModelCatalog()
    catalog.update("10.0.0.1:8000", served)
    assert catalog.context_limit("10.0.0.1:8000") is None
    assert catalog.context_limit("10.0.0.9:8000") is None  # a pod never heard from


@pytest.mark.parametrize(
    "document",
    [
        [],
        {"object": "list"},
        {"data": [{"object": "model"}]},
        {"data": [{"id": "a", "parent": 3}]},
        {"data": [{"id": "a", "max_model_len": "4096"}]},
        {"data": [{"id": "a", "max_model_len": 0}]},
        {"data": [{"id": "a", "max_model_len": True}]},
    ],
)
def test_malformed_model_lists_are_refused(document: object) -> None:
    with pytest.raises(ValueError):
        parse_models(document)


def _pod(address: str, running: Sequence[str] = ()) -> PodState:
    return PodState(Endpoint(address), metrics=PodMetrics(running_adapters=frozenset(running)))


def test_resolution_and_servers() -> None:
    pods = [_pod("10.0.0.1:8000"), _pod("10.0.0.2:8000", running=["hot"])]
    catalog = ModelCatalog(lambda: pods)
    # Nothing known yet: pass everything through, narrow nothing.
    assert catalog.resolve_adapter("anything") is None
    assert catalog.servers("anything") is None
    # A server that lists no model says nothing either.
    assert not catalog.update("10.0.0.3:8000", ServedModels(frozenset(), {}))
    assert catalog.servers("anything") is None

    assert catalog.update("10.0.0.1:8000", ServedModels(frozenset({"base"}), {"a": "base"}))
    assert catalog.update("10.0.0.2:8000", ServedModels(frozenset({"base"}), {}))
    assert not catalog.update("10.0.0.2:8000", ServedModels(frozenset({"base"}), {}))
    assert catalog.resolve_adapter("base") is None
    assert catalog.resolve_adapter("a") == "a"
    assert catalog.resolve_adapter("hot") == "hot"  # from the scraped lora_requests_info
    with pytest.raises(RequestError) as refused:
        catalog.resolve_adapter("missing")
    assert refused.value.status == 404 and "missing" in refused.value.message
    assert catalog.servers("a") == {"10.0.0.1:8000"}
    assert catalog.servers("hot") == {"10.0.0.2:8000"}
    assert catalog.servers("base") == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert catalog.servers("missing") == set()
    assert catalog.base_model_of_pod("10.0.0.1:8000") == "base"
    assert catalog.parent_of("a") == "base"

    catalog.forget("10.0.0.1:8000")
    assert catalog.servers("a") == set()


def test_candidates_are_narrowed_to_the_pods_serving_the_model() -> None:
    pods = [_pod("10.0.0.1:8000"), _pod("10.0.0.2:8000")]
    catalog = ModelCatalog(lambda: pods)
    served = ServedModelFilter(catalog)

    def request(model: str, adapter: str | None = None) -> LLMRequest:
        return LLMRequest("r", "/v1/completions", Api.COMPLETIONS, model, adapter=adapter)

    def kept(req: LLMRequest, candidates: list[PodState]) -> list[str]:
        return [p.address for p in served.candidates(req, candidates)]

    assert kept(request("x"), pods) == ["10.0.0.1:8000", "10.0.0.2:8000"]  # nothing known
    catalog.update("10.0.0.1:8000", ServedModels(frozenset({"base"}), {"a": "base"}))
    catalog.update("10.0.0.2:8000", ServedModels(frozenset({"base"}), {}))
    assert kept(request("a", "a"), pods) == ["10.0.0.1:8000"]
    assert kept(request("base"), pods) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    # The only pod with the adapter is not a candidate right now: none left (503).
    assert kept(request("a", "a"), pods[1:]) == []


async def test_poller_learns_each_pods_models_and_keeps_them_through_a_failure() -> None:
    async with sim_pods(3) as pool:
        datastore = Datastore()
        catalog = ModelCatalog(datastore.pods)
        changes: list[str] = []
        poller = ModelCatalogPoller(
            catalog, interval_s=0.05, on_change=lambda address, _: changes.append(address)
        )
        datastore.add_listener(poller.on_endpoint_added, poller.on_endpoint_removed)
        datastore.set_endpoints([Endpoint(p.http_address) for p in pool.pods])
        await poller.start()
        try:
            first, _, third = (p.http_address for p in pool.pods)
            # The first round is done when start() returns.
            engine = pool.pods[2].pod.engine
            assert catalog.served_by(third) == ServedModels(
                frozenset({MODEL}), {"lora-a": MODEL}, engine.max_model_len
            )
            assert catalog.context_limit(third) == engine.max_model_len
            assert catalog.servers("lora-b") == {first}
            assert sorted(changes) == sorted(p.http_address for p in pool.pods)

            await pool.pods[2].runner.cleanup()  # the pod stops answering HTTP
            assert not await poller.refresh(third)
            assert catalog.servers("lora-a") == {third}  # a failed poll forgets nothing

            datastore.set_endpoints([Endpoint(first)])  # the pod leaves the pool
            assert catalog.servers("lora-a") == set()
        finally:
            await poller.stop()

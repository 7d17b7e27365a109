"""Pool membership and in-flight accounting."""

from __future__ import annotations

from smart_epp.epp.datastore import Datastore
from smart_epp.framework.types import Api, Endpoint, LLMRequest


def request(prompt: str = "x" * 40, adapter: str | None = None) -> LLMRequest:
    return LLMRequest("r", "/v1/completions", Api.COMPLETIONS, "m", adapter=adapter, prompt=prompt)


def test_set_endpoints_keeps_state_of_unchanged_addresses() -> None:
    store = Datastore()
    events: list[tuple[str, str]] = []
    store.add_listener(
        lambda e: events.append(("+", e.address)), lambda e: events.append(("-", e.address))
    )
    store.set_endpoints([Endpoint("a:1"), Endpoint("b:1")])
    pod_a = store.get("a:1")
    assert pod_a is not None
    pod_a.metrics.waiting = 7
    store.set_endpoints([Endpoint("a:1"), Endpoint("c:1")])
    assert store.get("a:1") is pod_a and pod_a.metrics.waiting == 7
    assert store.get("b:1") is None
    assert [p.address for p in store.pods()] == ["a:1", "c:1"]
    assert events == [("+", "a:1"), ("+", "b:1"), ("-", "b:1"), ("+", "c:1")]


def test_changed_endpoint_is_reannounced_but_keeps_state() -> None:
    store = Datastore()
    store.set_endpoints([Endpoint("a:1", kv_events="tcp://a:5557")])
    pod = store.get("a:1")
    seen: list[str] = []
    store.add_listener(
        lambda e: seen.append(f"+{e.kv_events}"), lambda e: seen.append(f"-{e.kv_events}")
    )
    store.set_endpoints([Endpoint("a:1", kv_events="tcp://a:6000")])
    assert store.get("a:1") is pod
    assert seen == ["+tcp://a:5557", "-tcp://a:5557", "+tcp://a:6000"]


def test_departure_listeners_hear_of_pods_that_left_not_of_changed_ones() -> None:
    store = Datastore()
    departed: list[str] = []
    store.add_departure_listener(departed.append)
    store.set_endpoints([Endpoint("a:1", kv_events="tcp://a:5557"), Endpoint("b:1")])
    store.set_endpoints([Endpoint("a:1", kv_events="tcp://a:6000"), Endpoint("b:1")])
    assert departed == []
    store.set_endpoints([Endpoint("c:1")])
    assert sorted(departed) == ["a:1", "b:1"]


def test_listener_failure_does_not_stop_others() -> None:
    store = Datastore()
    seen: list[str] = []

    def broken(endpoint: Endpoint) -> None:
        raise RuntimeError("boom")

    store.add_listener(broken, broken)
    store.add_listener(lambda e: seen.append(e.address), lambda e: None)
    store.set_endpoints([Endpoint("a:1")])
    assert seen == ["a:1"]


def test_ready_pods() -> None:
    store = Datastore()
    store.set_endpoints([Endpoint("a:1"), Endpoint("b:1")])
    store.pods()[0].ready = False
    assert [p.address for p in store.ready_pods()] == ["b:1"]


def test_book_and_release_count_requests_tokens_and_adapters() -> None:
    store = Datastore()
    store.set_endpoints([Endpoint("a:1")])
    pod = store.get("a:1")
    assert pod is not None
    assert store.book("a:1", 10, "lora-a")
    assert store.book("a:1", 20, "lora-a")
    assert (pod.inflight.requests, pod.inflight.prompt_tokens) == (2, 30)
    assert pod.inflight.adapters["lora-a"] == 2
    store.release("a:1", 10, "lora-a")
    assert (pod.inflight.requests, pod.inflight.prompt_tokens) == (1, 20)
    store.release("a:1", 20, "lora-a")
    assert (pod.inflight.requests, pod.inflight.prompt_tokens) == (0, 0)
    assert "lora-a" not in pod.inflight.adapters


def test_booking_outside_the_pool_and_releasing_after_the_pod_left_are_harmless() -> None:
    store = Datastore()
    store.set_endpoints([Endpoint("a:1")])
    assert store.book("a:1", 5, None)
    store.set_endpoints([])
    store.release("a:1", 5, None)
    assert not store.book("gone:1", 5, None)

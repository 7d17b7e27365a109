"""InferencePool and Pod objects -> pool spec and endpoints (pure functions)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_kube_api import make_pod, make_pool_v1, make_pool_v1alpha2, parse_label_selector

from smart_epp.epp import k8s_discovery as kd
from smart_epp.epp.k8s_discovery import (
    DiscoveryError,
    PoolSpec,
    endpoints_from_pod,
    kubernetes_discovery_options,
    pod_is_serving,
    pool_spec_from_object,
)

LABELS = {"app": "vllm", "model": "tiny"}


def endpoints(pod: dict, ports: tuple[int, ...] = (8000,)) -> list:
    return endpoints_from_pod(pod, ports, kv_events_port=5557, kv_replay_port=5558)


# --------------------------------------------------------------------------- pools


def test_v1_pool_gives_match_labels_and_every_target_port() -> None:
    spec = pool_spec_from_object(make_pool_v1("p", {"model": "tiny", "app": "vllm"}, [8000, 8001]))
    selector = (("app", "vllm"), ("model", "tiny"))
    assert spec == PoolSpec(selector=selector, target_ports=(8000, 8001))
    assert spec.label_selector == "app=vllm,model=tiny"


def test_v1alpha2_pool_gives_flat_selector_and_target_port_number() -> None:
    spec = pool_spec_from_object(make_pool_v1alpha2("p", {"app": "vllm"}, 8000))
    assert spec == PoolSpec(selector=(("app", "vllm"),), target_ports=(8000,))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"selector": {}, "targetPortNumber": 8000}, "empty"),
        ({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}, "empty"),
        (
            {
                "selector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]},
                "targetPorts": [{"number": 8000}],
            },
            "matchExpressions",
        ),
        ({"selector": {"app": "vllm"}}, "targetPorts nor targetPortNumber"),
        ({"selector": {"app": "vllm"}, "targetPorts": []}, "non-empty"),
        ({"selector": {"app": "vllm"}, "targetPortNumber": "8000"}, "port number"),
        ({"selector": {"app": "vllm"}, "targetPortNumber": 70000}, "port number"),
        ({"selector": {"app": "vllm"}, "targetPorts": [{"name": "http"}]}, "port number"),
        ({"selector": {"app": 3}, "targetPortNumber": 8000}, "map of strings"),
        ({"selector": {"app": "v"}, "targetPorts": [{"number": 1}, {"number": 1}]}, "repeat"),
    ],
)
def test_malformed_pools_are_refused_with_a_reason(spec: dict, message: str) -> None:
    with pytest.raises(DiscoveryError, match=message):
        pool_spec_from_object({"metadata": {"name": "p"}, "spec": spec})


def test_pool_without_spec_is_refused() -> None:
    with pytest.raises(DiscoveryError, match="no spec"):
        pool_spec_from_object({"metadata": {"name": "p"}})


# --------------------------------------------------------------------------- pods


def test_running_ready_pod_is_serving() -> None:
    assert pod_is_serving(make_pod("a", "10.0.0.5", LABELS))


@pytest.mark.parametrize(
    "pod",
    [
        make_pod("a", "10.0.0.5", LABELS, ready=False),
        make_pod("a", "10.0.0.5", LABELS, phase="Pending"),
        make_pod("a", "10.0.0.5", LABELS, phase="Succeeded"),
        make_pod("a", "10.0.0.5", LABELS, deleting=True),
        make_pod("a", None, LABELS),
        {"metadata": {"name": "a"}, "status": {"phase": "Running", "podIP": "10.0.0.5"}},
    ],
    ids=["unready", "pending", "succeeded", "deleting", "no-ip", "no-conditions"],
)
def test_pods_that_cannot_serve_give_no_endpoint(pod: dict) -> None:
    assert not pod_is_serving(pod)
    assert endpoints(pod) == []


def test_pod_endpoint_uses_default_kv_ports_and_pod_labels() -> None:
    [endpoint] = endpoints(make_pod("a", "10.0.0.5", LABELS))
    assert endpoint.address == "10.0.0.5:8000"
    assert endpoint.metrics_url == "http://10.0.0.5:8000/metrics"
    assert endpoint.kv_events == "tcp://10.0.0.5:5557"
    assert endpoint.kv_replay == "tcp://10.0.0.5:5558"
    assert endpoint.labels == (("app", "vllm"), ("model", "tiny"))
    assert endpoint.label("model") == "tiny"


def test_pod_annotations_name_the_kv_sockets() -> None:
    annotations = {kd.KV_EVENTS_PORT_ANNOTATION: "6000", kd.KV_REPLAY_PORT_ANNOTATION: " 6100 "}
    [endpoint] = endpoints(make_pod("a", "10.0.0.5", LABELS, annotations=annotations))
    assert (endpoint.kv_events, endpoint.kv_replay) == (
        "tcp://10.0.0.5:6000",
        "tcp://10.0.0.5:6100",
    )


def test_each_target_port_is_an_endpoint_with_rank_offset_kv_ports() -> None:
    annotations = {kd.KV_EVENTS_PORT_ANNOTATION: "6000"}
    pod = make_pod("a", "10.0.0.5", LABELS, annotations=annotations)
    got = [(e.address, e.kv_events, e.kv_replay) for e in endpoints(pod, (8000, 8002))]
    assert got == [
        ("10.0.0.5:8000", "tcp://10.0.0.5:6000", "tcp://10.0.0.5:5558"),
        ("10.0.0.5:8002", "tcp://10.0.0.5:6001", "tcp://10.0.0.5:5559"),
    ]


def test_ipv6_pod_addresses_are_bracketed() -> None:
    [endpoint] = endpoints(make_pod("a", "fd00::5", LABELS))
    assert endpoint.address == "[fd00::5]:8000"
    assert endpoint.kv_events == "tcp://[fd00::5]:5557"


@pytest.mark.parametrize("value", ["zmq", "-1", "0", "70000", ""])
def test_malformed_kv_annotation_is_an_error(value: str) -> None:
    pod = make_pod("a", "10.0.0.5", LABELS, annotations={kd.KV_EVENTS_PORT_ANNOTATION: value})
    with pytest.raises(DiscoveryError, match="kv-events-port"):
        endpoints(pod)


# --------------------------------------------------------------------------- CLI rule


def options(**overrides: object) -> kd.KubernetesDiscoveryOptions | None:
    kwargs: dict = {
        "pool_name": "pool",
        "namespace": None,
        "api_url": None,
        "token_file": None,
        "ca_file": None,
        "static_pool": False,
        "kv_events_port": 5557,
        "kv_replay_port": 5558,
    }
    kwargs.update(overrides)
    return kubernetes_discovery_options(**kwargs)


def test_outside_a_cluster_discovery_needs_an_api_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert options() is None
    chosen = options(api_url="http://127.0.0.1:1", namespace="ns", token_file=Path("/t"))
    assert chosen is not None
    assert (chosen.api_url, chosen.namespace, chosen.token_file) == (
        "http://127.0.0.1:1",
        "ns",
        Path("/t"),
    )


def test_api_url_without_pool_name_is_refused() -> None:
    with pytest.raises(ValueError, match="--pool-name"):
        options(pool_name=None, api_url="http://127.0.0.1:1")


def test_in_cluster_with_pool_name_uses_the_service_account(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    (tmp_path / "token").write_text("tok")
    (tmp_path / "namespace").write_text("inference\n")
    monkeypatch.setattr(kd, "SERVICE_ACCOUNT_DIR", tmp_path)
    chosen = options()
    assert chosen is not None
    assert chosen.api_url == "https://10.96.0.1:6443"
    assert chosen.namespace == "inference"
    assert chosen.token_file == tmp_path / "token"
    assert chosen.ca_file is None  # no ca.crt there: the system's CAs
    # A static pool or no pool name keeps discovery off even inside a cluster.
    assert options(static_pool=True) is None
    assert options(pool_name=None) is None


def test_namespace_defaults_to_default_without_a_service_account(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(kd, "SERVICE_ACCOUNT_DIR", tmp_path / "absent")
    chosen = options(api_url="http://127.0.0.1:1")
    assert chosen is not None and chosen.namespace == "default"


# --------------------------------------------------------------------------- the fake itself


def test_fake_label_selector_follows_kubernetes_equality_syntax() -> None:
    pod = make_pod("a", "10.0.0.5", LABELS)
    assert parse_label_selector("app=vllm,model==tiny")(pod)
    assert not parse_label_selector("app=vllm,model!=tiny")(pod)
    assert parse_label_selector("app,!zone")(pod)
    assert not parse_label_selector("zone")(pod)

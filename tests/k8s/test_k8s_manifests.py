"""The Kubernetes packages agree with the code: RBAC grants what the watcher asks for,
and the Deployment's arguments, parsed by the real CLI, follow the shipped InferencePool."""

from __future__ import annotations

from pathlib import Path

import pytest
from kustomize import render
from support.hf_cache import hub_snapshot

from smart_epp.epp import k8s_discovery as kd
from smart_epp.epp.cli import build_parser
from smart_epp.epp.tokenizer_discovery import hub_cache_dir


def documents(overlay: str) -> dict[str, dict]:
    """The overlay's objects by kind (the smart-epp ones where a kind repeats)."""
    found: dict[str, dict] = {}
    for obj in render(overlay):
        if obj["kind"] not in found or obj["metadata"]["name"] == "smart-epp":
            found[obj["kind"]] = obj
    return found


def discovery_for(deployment: dict) -> kd.KubernetesDiscoveryOptions | None:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    return kd.kubernetes_discovery_options(
        pool_name=args.pool_name,
        namespace=args.pool_namespace,
        api_url=args.k8s_api,
        token_file=args.k8s_token_file,
        ca_file=args.k8s_ca_file,
        static_pool=bool(args.endpoint or args.endpoints_file),
        kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port,
    )


@pytest.fixture
def in_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(kd, "SERVICE_ACCOUNT_DIR", tmp_path)


def test_role_grants_get_list_watch_on_pods_and_every_pool_api_group() -> None:
    role = documents("inferencepool")["Role"]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = {("", "pods", v) for v in ("get", "list", "watch")} | {
        (group, "inferencepools", v) for group, _ in kd.POOL_API_VERSIONS for v in ("list", "watch")
    }
    assert needed <= granted


def test_deployment_runs_as_the_bound_service_account() -> None:
    docs = documents("inferencepool")
    account = docs["ServiceAccount"]["metadata"]["name"]
    binding = docs["RoleBinding"]
    assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    assert docs["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == account


@pytest.mark.usefixtures("in_cluster")
def test_deployment_discovers_the_shipped_inference_pool() -> None:
    pool = documents("inferencepool")["InferencePool"]
    spec = kd.pool_spec_from_object(pool)
    assert spec.target_ports and spec.selector
    chosen = discovery_for(documents("inferencepool")["Deployment"])
    assert chosen is not None
    assert chosen.pool_name == pool["metadata"]["name"]
    assert chosen.api_url == "https://10.96.0.1:443"
    service = documents("inferencepool")["Service"]
    picker = pool["spec"]["endpointPickerRef"]
    assert service["metadata"]["name"] == picker["name"]
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}


@pytest.mark.usefixtures("in_cluster")
def test_endpoints_file_variant_keeps_discovery_off() -> None:
    assert discovery_for(documents("endpoints-file")["Deployment"]) is None


def test_hf_cache_variant_lets_the_picker_find_the_model_tokenizer(tmp_path: Path) -> None:
    deployment = documents("hf-cache")["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    claim = {v["name"]: v for v in pod["volumes"]}["hf-cache"]["persistentVolumeClaim"]
    assert claim["readOnly"] and mounts["hf-cache"]["readOnly"]
    # HF_HUB_CACHE lies inside the mounted claim...
    mount_path = Path(mounts["hf-cache"]["mountPath"])
    hub = Path(env["HF_HUB_CACHE"])
    assert mount_path in hub.parents
    # ...and a model downloaded there (as `hf download` lays it out) is found by name.
    local_hub = tmp_path / hub.relative_to(mount_path)
    snapshot = hub_snapshot(local_hub, "meta-llama/Llama-3.1-8B-Instruct", "{}")
    found = hub_cache_dir("meta-llama/Llama-3.1-8B-Instruct", cache_dir=local_hub)
    assert found == snapshot
    # Discovery is on unless the arguments turn it off.
    assert build_parser().parse_args(container["args"]).tokenizer_discovery is True

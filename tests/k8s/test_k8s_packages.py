"""Every Kustomize overlay renders with `kubectl kustomize`, and every object it renders
validates: a known apiVersion/kind, the InferencePool against the Inference Extension's v1
schema, the references between objects (Service -> pod ports, RoleBinding -> Role and
ServiceAccount, volumes -> ConfigMaps, --redis-url -> Service), probes on the ports the
real CLI parses from the container's arguments, and a grace period longer than the drain."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from kustomize import K8S, OVERLAYS, Obj, objects, one, render

from smart_epp.epp.cli import build_parser
from smart_epp.epp.config import load_config
from smart_epp.epp.discovery import parse_endpoints_document

SCHEMA = yaml.safe_load(
    (Path(__file__).parent / "data" / "inferencepool-v1-schema.yaml").read_text()
)

KNOWN_KINDS = {
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    ("apps/v1", "Deployment"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("policy/v1", "PodDisruptionBudget"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
PORT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


# ------------------------------------------------------------------ the InferencePool schema

# The CRD's CEL rules (x-kubernetes-validations), as Python over the defaulted object.
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    "self.kind != 'Service' || has(self.port)": lambda ref: (
        ref.get("kind", "Service") != "Service" or "port" in ref
    ),
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": lambda ports: (
        len({p["number"] for p in ports}) == len(ports)
    ),
}


def inference_pool_errors(pool: Obj) -> list[str]:
    """Every way `pool` breaks the v1 schema or its CEL rules (empty: valid)."""
    validator = jsonschema.Draft202012Validator(SCHEMA["openAPIV3Schema"])
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(pool)]
    if errors:
        return errors
    for rule in SCHEMA["celRules"]:
        value: Any = pool
        for part in rule["path"].split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None and not CEL_RULES[rule["rule"]](value):
            errors.append(f"{rule['path']}: {rule['message']}")
    return errors


def test_every_cel_rule_of_the_schema_is_checked() -> None:
    assert {rule["rule"] for rule in SCHEMA["celRules"]} == set(CEL_RULES)


def test_the_schema_refuses_what_the_api_server_refuses() -> None:
    good = one("inferencepool", "InferencePool")
    assert inference_pool_errors(good) == []
    spec = good["spec"]
    broken = {
        "no target port": {**spec, "targetPorts": []},
        "port out of range": {**spec, "targetPorts": [{"number": 70000}]},
        "duplicate ports": {**spec, "targetPorts": [{"number": 8000}, {"number": 8000}]},
        "old field name": {**spec, "targetPortNumber": 8000},
        "no selector labels": {**spec, "selector": {"matchLabels": {}}},
        "Service without port": {**spec, "endpointPickerRef": {"name": "smart-epp"}},
        "bad failure mode": {
            **spec,
            "endpointPickerRef": {**spec["endpointPickerRef"], "failureMode": "Open"},
        },
    }
    for what, bad in broken.items():
        assert inference_pool_errors({**good, "spec": bad}), what


# ------------------------------------------------------------------ every object


def epp_arguments(deployment: Obj, rendered: tuple[Obj, ...] = ()) -> Any:
    """The container's arguments as `epp` parses them. A --config file exists only in the
    container, so the CLI reads the mounted ConfigMap's copy of it from a local file."""
    arguments = []
    for argument in epp_container(deployment)["args"]:
        if argument.startswith("--config=/"):
            text = mounted_file(deployment, argument.split("=", 1)[1], rendered)
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as local:
                local.write(text)
            argument = f"--config={local.name}"
        arguments.append(argument)
    args = build_parser().parse_args(arguments)
    args.container_args = epp_container(deployment)["args"]
    return args


def epp_container(deployment: Obj) -> Obj:
    [container] = [c for c in pod_spec(deployment)["containers"] if c["name"] == "epp"]
    return container


def pod_spec(deployment: Obj) -> Obj:
    return deployment["spec"]["template"]["spec"]


def container_port(container: Obj, port: int | str) -> int:
    """The container's port that `port` (a number or a port name) refers to."""
    for declared in container.get("ports", []):
        if port in (declared["containerPort"], declared.get("name")):
            return declared["containerPort"]
    raise AssertionError(f"container {container['name']} declares no port {port!r}")


def check_metadata(obj: Obj) -> None:
    name = obj["metadata"]["name"]
    assert len(name) <= 253 and DNS_SUBDOMAIN.match(name), name


def check_deployment(deployment: Obj, rendered: tuple[Obj, ...]) -> None:
    spec = deployment["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    pod = pod_spec(deployment)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    config_maps = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "ConfigMap"}
    for volume in volumes.values():
        if "configMap" in volume:
            assert volume["configMap"]["name"] in config_maps, volume
    if "serviceAccountName" in pod:
        accounts = {o["metadata"]["name"] for o in rendered if o["kind"] == "ServiceAccount"}
        assert pod["serviceAccountName"] in accounts
    for container in pod["containers"]:
        image = container["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), image
        names = [p["name"] for p in container.get("ports", [])]
        assert len(set(names)) == len(names)
        assert all(len(n) <= 15 and PORT_NAME.match(n) for n in names), names
        for probe_kind in ("livenessProbe", "readinessProbe"):
            probe = container.get(probe_kind)
            assert probe is not None, f"{container['name']} has no {probe_kind}"
            for handler in ("grpc", "tcpSocket", "httpGet"):
                if handler in probe:
                    container_port(container, probe[handler]["port"])
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, mount
        security = container.get("securityContext", {})
        assert security.get("allowPrivilegeEscalation") is False
        assert pod.get("securityContext", {}).get("runAsNonRoot") is True


def check_service(service: Obj, rendered: tuple[Obj, ...]) -> None:
    selector = service["spec"]["selector"]
    backing = [
        d
        for d in rendered
        if d["kind"] == "Deployment"
        and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert backing, f"service {service['metadata']['name']} selects no pods"
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        containers = pod_spec(backing[0])["containers"]
        assert any(
            target in (p["containerPort"], p.get("name"))
            for c in containers
            for p in c.get("ports", [])
        ), port


def check_role_binding(binding: Obj, rendered: tuple[Obj, ...]) -> None:
    roles = {o["metadata"]["name"] for o in rendered if o["kind"] == "Role"}
    accounts = {o["metadata"]["name"] for o in rendered if o["kind"] == "ServiceAccount"}
    assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] in roles
    for subject in binding["subjects"]:
        assert subject["kind"] == "ServiceAccount" and subject["name"] in accounts


def check_disruption_budget(budget: Obj, rendered: tuple[Obj, ...]) -> None:
    selector = budget["spec"]["selector"]["matchLabels"]
    [deployment] = [
        d
        for d in rendered
        if d["kind"] == "Deployment"
        and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert 0 < budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def check_inference_pool(pool: Obj, rendered: tuple[Obj, ...]) -> None:
    assert inference_pool_errors(pool) == []
    picker = pool["spec"]["endpointPickerRef"]
    service = next(
        o for o in rendered if o["kind"] == "Service" and o["metadata"]["name"] == picker["name"]
    )
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}


def check_route(route: Obj, rendered: tuple[Obj, ...]) -> None:
    pools = {o["metadata"]["name"] for o in rendered if o["kind"] == "InferencePool"}
    for rule in route["spec"]["rules"]:
        for ref in rule["backendRefs"]:
            assert ref["kind"] == "InferencePool" and ref["name"] in pools


CHECKS: dict[str, Callable[[Obj, tuple[Obj, ...]], None]] = {
    "Deployment": check_deployment,
    "Service": check_service,
    "RoleBinding": check_role_binding,
    "PodDisruptionBudget": check_disruption_budget,
    "InferencePool": check_inference_pool,
    "HTTPRoute": check_route,
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates(overlay: str) -> None:
    rendered = render(overlay)
    assert rendered
    for obj in rendered:
        assert (obj["apiVersion"], obj["kind"]) in KNOWN_KINDS, (obj["apiVersion"], obj["kind"])
        check_metadata(obj)
        check = CHECKS.get(obj["kind"])
        if check is not None:
            check(obj, rendered)
    names = [(o["kind"], o["metadata"]["name"]) for o in rendered]
    assert len(set(names)) == len(names)


# ------------------------------------------------------------------ the picker's container


def mounted_file(deployment: Obj, path: str, rendered: tuple[Obj, ...]) -> str:
    """The text a path inside the epp container reads, from the ConfigMap mounted there."""
    container = epp_container(deployment)
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    for mount in container["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix) and "configMap" in volumes[mount["name"]]:
            name = volumes[mount["name"]]["configMap"]["name"]
            config_map = next(
                o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name
            )
            return config_map["data"][path[len(prefix) :]]
    raise AssertionError(f"nothing mounted at {path}")


def prestop_seconds(container: Obj) -> int:
    sleep = container.get("lifecycle", {}).get("preStop", {}).get("sleep")
    return 0 if sleep is None else int(sleep["seconds"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_picker_probes_ports_and_grace_period_follow_its_arguments(overlay: str) -> None:
    deployment = one(overlay, "Deployment", "smart-epp")
    args = epp_arguments(deployment, render(overlay))
    container = epp_container(deployment)
    for probe_kind, service in (("livenessProbe", "liveness"), ("readinessProbe", "readiness")):
        probe = container[probe_kind]["grpc"]
        assert container_port(container, probe["port"]) == args.health_port
        assert probe["service"] == service
    declared = {p["containerPort"] for p in container["ports"]}
    assert {args.grpc_port, args.health_port, args.metrics_port} <= declared
    assert args.secure_serving is True  # ext_proc over TLS, as gateways expect it
    grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
    assert grace > args.drain_timeout + prestop_seconds(container)
    service = one(overlay, "Service", "smart-epp")
    ext_proc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    assert container_port(container, ext_proc["targetPort"]) == args.grpc_port


def test_endpoints_file_overlay_reads_its_pool_from_the_mounted_file() -> None:
    rendered = render("endpoints-file")
    deployment = one("endpoints-file", "Deployment")
    args = epp_arguments(deployment)
    assert deployment["spec"]["replicas"] == 1
    text = mounted_file(deployment, str(args.endpoints_file), rendered)
    endpoints = parse_endpoints_document(text)
    assert endpoints and all(e.kv_events and e.kv_replay for e in endpoints)
    assert objects("endpoints-file", "Role") == []  # no API access needed


@pytest.mark.parametrize("overlay", ["inferencepool", "valkey", "flow-control"])
def test_discovery_overlays_follow_the_shipped_pool(overlay: str) -> None:
    args = epp_arguments(one(overlay, "Deployment", "smart-epp"), render(overlay))
    pool = one(overlay, "InferencePool")
    assert args.pool_name == pool["metadata"]["name"]
    assert args.endpoint == [] and args.endpoints_file is None


def test_valkey_overlay_runs_three_pickers_on_the_shared_index() -> None:
    deployment = one("valkey", "Deployment", "smart-epp")
    args = epp_arguments(deployment)
    assert deployment["spec"]["replicas"] == 3
    assert args.kv_index == "redis"
    url = urlsplit(args.redis_url)
    service = one("valkey", "Service", url.hostname)
    [port] = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    valkey = one("valkey", "Deployment", "smart-epp-valkey")
    [container] = pod_spec(valkey)["containers"]
    assert container_port(container, port["targetPort"]) == 6379
    assert one("valkey", "PodDisruptionBudget")["spec"]["minAvailable"] == 2


def test_flow_control_overlay_config_loads() -> None:
    rendered = render("flow-control")
    deployment = one("flow-control", "Deployment", "smart-epp")
    args = epp_arguments(deployment, rendered)
    loaded = load_config(args.config)  # what `epp serve --config` loads in the container
    assert loaded.config.featureGates is not None and "flowControl" in loaded.config.featureGates
    assert loaded.config.saturationDetector is not None
    mounted = next(a for a in args.container_args if a.startswith("--config="))
    shipped = K8S / "overlays" / "flow-control" / Path(mounted.split("=", 1)[1]).name
    assert yaml.safe_load(shipped.read_text()) == yaml.safe_load(Path(args.config).read_text())


def test_shipped_envoy_config_reaches_the_picker_as_it_serves() -> None:
    """deploy/envoy/envoy-kubernetes.yaml (for a plain Envoy in front of the endpoints-file
    overlay) dials the picker's Service, on its ext_proc port, with TLS as epp serves it."""
    config = yaml.safe_load((K8S.parent / "envoy" / "envoy-kubernetes.yaml").read_text())
    epp = next(c for c in config["static_resources"]["clusters"] if c["name"] == "epp")
    endpoint = epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    address = endpoint["address"]["socket_address"]
    service = one("endpoints-file", "Service", "smart-epp")
    assert address["address"].split(".")[0] == service["metadata"]["name"]
    ext_proc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    assert address["port_value"] == ext_proc["port"]
    args = epp_arguments(one("endpoints-file", "Deployment", "smart-epp"))
    assert ("transport_socket" in epp) is args.secure_serving

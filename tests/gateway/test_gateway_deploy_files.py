"""The shipped deployment files stay valid: the Kubernetes Envoy config is the template's
output, and real Envoy accepts it and every body/failure mode combination."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest
import yaml
from support.paths import REPO

from smart_epp.epp.envoy_cmd import EnvoyOptions, envoy_binary, render_envoy_config

pytestmark = pytest.mark.envoy

KUBERNETES_CONFIG = REPO / "deploy" / "envoy" / "envoy-kubernetes.yaml"


def validate(config: str, tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(config)
    result = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path),
         "--base-id-path", "/dev/null", "--use-dynamic-base-id"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_config_is_the_rendered_template(tmp_path: Path) -> None:
    shipped = KUBERNETES_CONFIG.read_text()
    body = "".join(line for line in shipped.splitlines(keepends=True)[3:])
    rendered = render_envoy_config(EnvoyOptions(epp_host="smart-epp.default.svc.cluster.local"))
    assert body == rendered, "regenerate with the command at the top of the file"
    epp = next(
        c for c in yaml.safe_load(shipped)["static_resources"]["clusters"] if c["name"] == "epp"
    )
    assert epp["type"] == "STRICT_DNS"
    validate(shipped, tmp_path)


def test_every_mode_combination_is_accepted_by_envoy(tmp_path: Path) -> None:
    combos = itertools.product(
        ("buffered", "full-duplex"), ("open", "close"), ((), ("10.1.1.1:80",))
    )
    for body_mode, failure_mode, fallback in combos:
        config = render_envoy_config(
            EnvoyOptions(
                body_mode=body_mode,  # type: ignore[arg-type]
                failure_mode=failure_mode,  # type: ignore[arg-type]
                pool_endpoints=fallback,
                bypass_backend="127.0.0.1:9",
            )
        )
        validate(config, tmp_path)


def test_kubernetes_manifests_parse() -> None:
    for path in sorted((REPO / "deploy" / "k8s").glob("*.yaml")):
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert documents and all("kind" in d and "apiVersion" in d for d in documents), path


def test_bad_render_options_are_refused() -> None:
    with pytest.raises(ValueError, match="body mode"):
        render_envoy_config(EnvoyOptions(body_mode="streamed"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="IP:PORT"):
        render_envoy_config(EnvoyOptions(pool_endpoints=("pods.example:80",)))

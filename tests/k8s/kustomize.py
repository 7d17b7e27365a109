"""Renders the shipped Kustomize overlays with the real `kubectl kustomize`."""

from __future__ import annotations

import functools
import shutil
import subprocess
from typing import Any

import yaml
from support.paths import REPO

K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("endpoints-file", "inferencepool", "valkey", "flow-control", "hf-cache")

Obj = dict[str, Any]


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise RuntimeError(
            "kubectl is needed to render deploy/k8s: apt-get install kubernetes-client "
            "(.ci/run installs it)"
        )
    return path


@functools.cache
def render(overlay: str) -> tuple[Obj, ...]:
    """Every object `kubectl kustomize deploy/k8s/overlays/<overlay>` prints."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {overlay} failed:\n{result.stderr}")
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def objects(overlay: str, kind: str) -> list[Obj]:
    return [o for o in render(overlay) if o["kind"] == kind]


def one(overlay: str, kind: str, name: str | None = None) -> Obj:
    found = [o for o in objects(overlay, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]

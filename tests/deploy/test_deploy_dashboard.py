"""The Grafana dashboard only charts series the gateway really exports."""

from __future__ import annotations

import json
import re

from prometheus_client import REGISTRY, CollectorRegistry
from support.paths import REPO

import smart_epp.epp.scrape
import smart_epp.epp.tokenization
import smart_epp.kv_index.metrics  # noqa: F401  (registers the KV series)
from smart_epp.epp.gateway_metrics import GatewayMetrics
from smart_epp.epp.prefix_audit import PrefixAudit
from smart_epp.epp.scheduler import scheduler_metrics

DASHBOARD = REPO / "deploy" / "dashboards" / "smart-epp.json"
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "unknown": ("",),
}


def exported_series() -> set[str]:
    gateway = GatewayMetrics()
    PrefixAudit(gateway.registry)  # registered on the gateway's registry by `epp serve`
    own = CollectorRegistry()
    scheduler_metrics(own)
    names: set[str] = set()
    for registry in (REGISTRY, gateway.registry, own):
        for family in registry.collect():
            for suffix in SUFFIXES.get(family.type, ("",)):
                names.add(family.name + suffix)
    return names


def test_every_dashboard_query_names_an_exported_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs
    referenced = {
        name
        for expr in exprs
        for name in re.findall(r"\b((?:inference|smart_epp|llm_d_epp)_[a-z_]+)\b", expr)
    }
    assert referenced, "the dashboard queries no smart-epp series"
    missing = referenced - exported_series()
    assert not missing, f"dashboard charts series nobody exports: {sorted(missing)}"

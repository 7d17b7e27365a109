"""`epp audit --metrics URL`: the live prefix-prediction audit of a running `epp serve`,
per pod, read from its /metrics page."""

from __future__ import annotations

import argparse
import sys
import urllib.request
from dataclasses import dataclass
from typing import TextIO

from prometheus_client.parser import text_string_to_metric_families


@dataclass(slots=True)
class PodAudit:
    exact: int = 0
    over: int = 0
    under: int = 0
    over_tokens: float = 0.0
    under_tokens: float = 0.0

    @property
    def audited(self) -> int:
        return self.exact + self.over + self.under


def parse_audit(page: str) -> dict[str, PodAudit]:
    pods: dict[str, PodAudit] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            pod = sample.labels.get("pod")
            if pod is None:
                continue
            if sample.name == "smart_epp_prefix_predictions_total":
                audit = pods.setdefault(pod, PodAudit())
                result = sample.labels.get("result")
                if result in ("exact", "over", "under"):
                    setattr(audit, result, getattr(audit, result) + int(sample.value))
            elif sample.name == "smart_epp_prefix_mispredicted_tokens_total":
                audit = pods.setdefault(pod, PodAudit())
                if sample.labels.get("result") == "over":
                    audit.over_tokens += sample.value
                elif sample.labels.get("result") == "under":
                    audit.under_tokens += sample.value
    return pods


def print_audit(pods: dict[str, PodAudit], out: TextIO) -> None:
    if not pods:
        out.write("no audited responses yet (pods must report cached_tokens: vLLM "
                  "--enable-prompt-tokens-details)\n")  # fmt: skip
        return
    header = f"{'pod':<24} {'audited':>8} {'exact':>8} {'over':>8} {'under':>8} {'mean error':>11}"
    out.write(header + "\n")
    for pod in sorted(pods):
        a = pods[pod]
        mean = (a.under_tokens - a.over_tokens) / a.audited if a.audited else 0.0
        share = f"{100 * a.exact / a.audited:.1f}%" if a.audited else "-"
        out.write(f"{pod:<24} {a.audited:>8} {share:>8} {a.over:>8} {a.under:>8} {mean:>+11.1f}\n")
    out.write("exact: share of predictions equal to the reported cached tokens; mean error: "
              "reported minus predicted, in tokens\n")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        with urllib.request.urlopen(args.metrics, timeout=args.timeout) as response:
            page = response.read().decode()
    except OSError as exc:
        print(f"epp audit: cannot read {args.metrics}: {exc}", file=sys.stderr)
        return 2
    pods = parse_audit(page)
    print_audit(pods, sys.stdout)
    return 1 if args.fail_on_mismatch and any(p.over or p.under for p in pods.values()) else 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="per-pod prefix-prediction audit of a running epp serve",
        description=__doc__,
    )
    parser.add_argument(
        "--metrics", required=True, help="the gateway's metrics URL, e.g. http://epp:9090/metrics"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument(
        "--fail-on-mismatch", action="store_true", help="exit 1 when any prediction missed"
    )
    parser.set_defaults(func=run)

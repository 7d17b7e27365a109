"""The live prefix-prediction audit: predictions recorded at routing, compared with the
cached tokens the pod reported, counted per pod, warned about, and summarised by
`epp audit --metrics URL` from a real metrics endpoint."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

from smart_epp.epp.audit_cmd import parse_audit, print_audit
from smart_epp.epp.config import instantiate, parse_config
from smart_epp.epp.gateway_metrics import GatewayMetrics
from smart_epp.epp.prefix_audit import PrefixAudit
from smart_epp.epp.scheduler import PREDICTED_CACHED_TOKENS, PipelineScheduler
from smart_epp.framework.lifecycle import FlowRequest
from smart_epp.framework.types import Api, Endpoint, LLMRequest, Outcome, PodState, PrefixHit, Usage

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: precise-prefix-cache-scorer
"""


def routed(scheduler: PipelineScheduler, tokens: int, hits: dict[str, PrefixHit]) -> FlowRequest:
    request = LLMRequest("r", "/v1/completions", Api.COMPLETIONS, "m",
                         prompt_token_ids=list(range(tokens)))  # fmt: skip
    pods = [PodState(Endpoint(address)) for address in ("a:1", "b:2")]
    decision = scheduler.schedule_sync(request, pods, prefix_hits=hits)
    scheduler.on_routed(request, decision)
    flow = FlowRequest(request=request, received_at=0.0, decision=decision)
    flow.primary = decision.endpoints[0].address
    return flow


def test_the_prediction_is_capped_like_vllm_and_compared_per_pod(caplog) -> None:
    scheduler = PipelineScheduler(instantiate(parse_config(CONFIG)), default_block_size=16)
    metrics = GatewayMetrics()
    audit = PrefixAudit(metrics.registry, clock=lambda: 100.0)
    # 64 prompt tokens, 4 blocks held: vLLM recomputes the last token, so 48 are reusable.
    flow = routed(scheduler, 64, {"a:1": PrefixHit(blocks=4)})
    assert flow.primary == "a:1"
    assert flow.decision.context.kept[PREDICTED_CACHED_TOKENS] == 48
    audit.on_outcome(flow, Outcome("a:1", ok=True, usage=Usage(64, 1, cached_tokens=48)))
    with caplog.at_level(logging.WARNING):
        for reported in (0, 0, 0, 0):  # the pod lost its cache without telling the index
            flow = routed(scheduler, 64, {"a:1": PrefixHit(blocks=4)})
            audit.on_outcome(flow, Outcome("a:1", ok=True, usage=Usage(64, 1, reported)))
    # A fallback answered: not the pod the prediction was for.
    flow = routed(scheduler, 64, {"a:1": PrefixHit(blocks=4)})
    audit.on_outcome(flow, Outcome("b:2", ok=True, usage=Usage(64, 1, cached_tokens=0)))
    warnings = [r for r in caplog.records if "prefix predictions missed" in r.message]
    assert len(warnings) == 1  # rate-limited: the fourth miss within a minute says nothing
    assert "pod a:1: 3 of its last 4" in warnings[0].getMessage()

    port = metrics.serve(0, "127.0.0.1")
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        out = subprocess.run(
            [sys.executable, "-c", "from smart_epp.epp.cli import main; main()",
             "audit", "--metrics", url, "--fail-on-mismatch"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        metrics.close()
    assert out.returncode == 1, out.stderr
    [row] = [line for line in out.stdout.splitlines() if line.startswith("a:1")]
    assert row.split() == ["a:1", "5", "20.0%", "4", "0", "-38.4"]


def test_audit_summary_of_a_page_without_audits_says_why() -> None:
    out = io.StringIO()
    print_audit(parse_audit("# nothing\n"), out)
    assert "cached_tokens" in out.getvalue()


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/metrics"])
def test_audit_of_an_unreachable_gateway_is_a_clear_error(url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from smart_epp.epp.cli import main; main()",
         "audit", "--metrics", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "cannot read" in out.stderr

"""llm-d's plugins that smart-epp implements: no-hit-lru-scorer, the data-parallel profile
handler, and the stateless session token, each against llm-d's semantics."""

from __future__ import annotations

import base64

from sched_helpers import pod, request
from test_sched_plugins import ctx_for, make

from smart_epp.epp.config import instantiate, parse_config
from smart_epp.epp.scheduler import PipelineScheduler
from smart_epp.framework.types import PrefixHit


def test_no_hit_lru_spreads_cold_requests_and_is_neutral_on_hits():
    scorer = make("no-hit-lru-scorer", lruSize=8)
    pods = [pod("a"), pod("b"), pod("c")]
    cold = ctx_for(prefix_hits={})
    # Nobody served a cold request yet: candidate order, 1 down to 0.
    assert scorer.score(cold, pods) == [1.0, 0.5, 0.0]
    scorer.on_routed(cold, pods[0])
    cold = ctx_for(prefix_hits={})
    # a was used most recently: the never-used pods first, then a.
    assert scorer.score(cold, pods) == [0.0, 1.0, 0.5]
    scorer.on_routed(cold, pods[1])
    cold = ctx_for(prefix_hits={})
    assert scorer.score(cold, pods) == [0.5, 0.0, 1.0]
    warm = ctx_for(prefix_hits={"b": PrefixHit(blocks=2)})
    assert scorer.score(warm, pods) == [0.5, 0.5, 0.5]
    scorer.on_routed(warm, pods[2])  # a warm request does not touch the LRU
    assert scorer.score(ctx_for(prefix_hits={}), pods) == [0.5, 0.0, 1.0]


def test_no_hit_lru_forgets_a_pod_that_left_the_pool():
    scorer = make("no-hit-lru-scorer", lruSize=8)
    pods = [pod("a"), pod("b"), pod("c")]
    for chosen in pods[:2]:
        cold = ctx_for(prefix_hits={})
        scorer.score(cold, pods)
        scorer.on_routed(cold, chosen)
    scorer.on_pod_removed("a")
    # A pod serving from a's address again is one that never took a cold request.
    assert scorer.score(ctx_for(prefix_hits={}), pods) == [1.0, 0.0, 0.5]


DP_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: data-parallel-profile-handler
  parameters:
    primaryPort: 8000
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""


def test_data_parallel_handler_sends_to_the_primary_port_and_names_the_rank():
    scheduler = PipelineScheduler(instantiate(parse_config(DP_CONFIG)), seed=0)
    pods = [pod("10.0.0.5:8001", waiting=3), pod("10.0.0.5:8002", waiting=0)]
    decision = scheduler.schedule_sync(request(tokens=[1, 2, 3]), pods)
    assert decision.endpoints[0].address == "10.0.0.5:8002"
    assert decision.destination_of("10.0.0.5:8002") == "10.0.0.5:8000"
    assert decision.request_headers == (("x-data-parallel-host-port", "10.0.0.5:8002"),)


def test_data_parallel_handler_refuses_a_port_out_of_range():
    text = DP_CONFIG.replace("primaryPort: 8000", "primaryPort: 70000")
    try:
        parse_config(text)
    except ValueError as exc:
        assert "plugins[1].parameters.primaryPort" in str(exc)
    else:
        raise AssertionError("port 70000 was accepted")


def test_session_token_is_written_for_the_chosen_pod_and_read_back():
    scorer = make("session-affinity-scorer")
    pods = [pod("a:1"), pod("b:2")]
    token = base64.b64encode(b"b:2").decode()
    req = request(tokens=[1])
    req.headers["x-session-token"] = token
    assert scorer.score(ctx_for(req), pods) == [0.0, 1.0]
    req.headers["x-session-token"] = "not base64!"
    assert scorer.score(ctx_for(req), pods) == [0.0, 0.0]
    custom = make("session-affinity-scorer", encodedEndpointHeaderConfig={"header": "X-Pin"})
    req = request(tokens=[1])
    req.headers["x-pin"] = token
    assert custom.score(ctx_for(req), pods) == [0.0, 1.0]

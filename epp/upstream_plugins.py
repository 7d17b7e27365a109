"""Plugin types and feature gates that upstream endpoint pickers define, and what smart-epp
does about each one it does not implement.

A config naming one of these types fails to load with the reason below, instead of the
generic "unknown plugin type", so an operator moving a config from the Gateway API
Inference Extension or llm-d's router knows whether a typo or a missing feature stopped it.
The names come from llm-d-router (v0.10) and the Inference Extension (v1.0-v1.3).
"""

from __future__ import annotations

_DISAGG = "prefill/decode (and encode) disaggregation is not implemented in smart-epp"
_FLOW = "a flow-control policy of llm-d's router; smart-epp does not implement this one"
_MULTICLUSTER = "multi-cluster routing is not implemented in smart-epp"

NOT_IMPLEMENTED: dict[str, str] = {
    # profile handlers and deciders of disaggregated serving
    "disagg-profile-handler": _DISAGG,
    "pd-profile-handler": _DISAGG,
    "prefix-based-pd-decider": _DISAGG,
    "always-disagg-pd-decider": _DISAGG,
    "always-disagg-multimodal-decider": _DISAGG,
    "disagg-headers-handler": _DISAGG,
    "prefill-header-handler": _DISAGG,
    "encode-filter": _DISAGG,
    "p2p-source-producer": _DISAGG,
    "header-profile-handler": "choosing the profile from a request header is not implemented",
    # data layer sources and extractors smart-epp has no equivalent for
    "dcgm-data-source": "smart-epp reads no GPU telemetry (DCGM)",
    "dcgm-extractor": "smart-epp reads no GPU telemetry (DCGM)",
    "models-data-source": "smart-epp learns served models from each pod's /v1/models itself",
    "models-data-extractor": "smart-epp learns served models from each pod's /v1/models itself",
    "k8s-notification-source": "smart-epp watches only InferencePools and their pods",
    "topology-extractor": "topology-aware placement is not implemented",
    "topology-affinity-filter": "topology-aware placement is not implemented",
    "topology-affinity-scorer": "topology-aware placement is not implemented",
    "file-discovery": "use `epp serve --endpoints-file` (watched and reloaded on change)",
    "cross-replica-publisher": "replicas share the KV index through Redis instead",
    "local-syncer": "replicas share the KV index through Redis instead",
    "mock-metrics-source": "a test double of llm-d's router",
    "disaggregatedset-rollout-pod-extractor": _DISAGG,
    "disaggregatedset-rollout-screener": _DISAGG,
    # producers, filters and scorers not implemented here
    "burst-prefix-cache-producer": "burst co-location is not implemented",
    "mm-embeddings-cache-producer": "multimodal embedding-cache affinity is not implemented",
    "mm-embeddings-cache-scorer": "multimodal embedding-cache affinity is not implemented",
    "inflight-load-producer": "in-flight load is always tracked by smart-epp's datastore",
    "predicted-latency-producer": "use predicted-ttft-scorer, smart-epp's latency model",
    "latency-scorer": "use predicted-ttft-scorer, smart-epp's latency model",
    "latency-slo-admitter": "SLO-based admission is not implemented",
    "slo-headroom-tier-filter": "SLO-based admission is not implemented",
    "token-load-scorer": "use predicted-ttft-scorer, which counts each pod's in-flight tokens",
    "session-id-producer": "session-affinity-scorer reads its session header directly",
    "session-affinity-filter": "use session-affinity-scorer with a high weight",
    "header-label-affinity-scorer": "not implemented",
    "header-based-testing-filter": "a test double of llm-d's router",
    "prefix-cache-affinity-filter": "not implemented; prefix scorers rank by cached tokens",
    "utilization-filter": "use saturation-filter (queue depth and KV-cache usage thresholds)",
    "endpoint-attribute-filter": "filtering on custom endpoint attributes is not implemented",
    "endpoint-attribute-scorer": "scoring custom endpoint attributes is not implemented",
    "destination-endpoint-served-verifier": "smart-epp always reads the served endpoint",
    "request-attribute-reporter": "not implemented",
    "agent-identity": "not implemented",
    "context-length-aware": "not implemented",
    # request parsers
    "anthropic-parser": "only the OpenAI API is parsed (openai-parser)",
    "vertexai-parser": "only the OpenAI API is parsed (openai-parser)",
    "sglanghttp-parser": "only the OpenAI API is parsed (openai-parser)",
    "vllmgrpc-parser": "only the OpenAI API is parsed (openai-parser)",
    "vllmhttp-parser": "only the OpenAI API is parsed (openai-parser)",
    "passthrough-parser": "smart-epp needs the parsed body to schedule; use openai-parser",
    # flow control policies (the flow-control section decides which it supports)
    "probabilistic-admitter": _FLOW,
    "program-aware-fairness": _FLOW,
    "soft-reflective-ceiling-policy": _FLOW,
    "static-usage-limit-policy": _FLOW,
    "priority-holdback-policy": _FLOW,
    "global-strict-fairness-policy": _FLOW,
    "round-robin-fairness-policy": _FLOW,
    "edf-ordering-policy": _FLOW,
    "fcfs-ordering-policy": _FLOW,
    "slo-deadline-ordering-policy": _FLOW,
    "priority-then-time-eviction-order-policy": _FLOW,
    "sheddable-eviction-filter": _FLOW,
    # multi-cluster variants
    "multicluster-approx-prefix-cache-producer": _MULTICLUSTER,
    "multicluster-file-discovery": _MULTICLUSTER,
    "multicluster-kv-cache-utilization-scorer": _MULTICLUSTER,
    "multicluster-metrics-data-source": _MULTICLUSTER,
    "multicluster-metrics-extractor": _MULTICLUSTER,
    "multicluster-prefix-cache-scorer": _MULTICLUSTER,
    "multicluster-queue-scorer": _MULTICLUSTER,
    "multicluster-session-affinity-filter": _MULTICLUSTER,
}

# featureGates entries smart-epp understands. A gate smart-epp's behaviour already matches
# (True) may be named; naming one with `=false` asks for behaviour smart-epp lacks.
FEATURE_GATES: dict[str, str] = {
    "dataLayer": "smart-epp's data layer (scrapes, KV events, discovery) is always on",
    "prepareDataPlugins": "smart-epp always gathers per-request data before scoring",
    "haPopulateNonLeaderDatastore": "every smart-epp replica keeps its own full datastore",
    "flowControl": "read by the flowControl section",
}

__all__ = ["FEATURE_GATES", "NOT_IMPLEMENTED"]

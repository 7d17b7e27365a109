"""Prometheus metrics of KV-event ingestion and the block index.

Registered once per process on the default registry (the gateway's /metrics page);
per-pod series are removed when the pod leaves the pool.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

INDEX_ENTRIES = Gauge(
    "smart_epp_kv_index_entries", "(block, pod) entries held by the local block index"
)
INDEX_BLOCKS = Gauge("smart_epp_kv_index_blocks", "Distinct blocks held by the local block index")
EVENTS = Counter(
    "smart_epp_kv_events_total", "KV-cache events applied, by pod and type", ["pod", "type"]
)
BLOCKS = Counter(
    "smart_epp_kv_block_hashes_total", "Block hashes ingested, by pod and action", ["pod", "action"]
)
PREFILL_REQUESTS = Gauge(
    "smart_epp_prefill_progress_requests",
    "Requests in flight whose prefill is followed in their pod's KV events",
)
PREFILL_CONFIRMED_PODS = Gauge(
    "smart_epp_prefill_progress_confirmed_pods",
    "Pods whose KV events have shown the prefill of a request this picker sent",
)
DECODE_ERRORS = Counter(
    "smart_epp_kv_decode_errors_total",
    "KV event frames or events that could not be decoded and were dropped",
    ["pod"],
)
SEQUENCE_GAPS = Counter(
    "smart_epp_kv_sequence_gaps_total", "Batches missed on the event stream", ["pod"]
)
REPLAYS = Counter(
    "smart_epp_kv_replays_total", "Replay requests to a pod, by outcome", ["pod", "outcome"]
)
REPLAYED_BATCHES = Counter(
    "smart_epp_kv_replayed_batches_total", "Batches recovered through replay", ["pod"]
)
RESTARTS = Counter(
    "smart_epp_kv_pod_restarts_total", "Pod restarts detected from the event stream", ["pod"]
)
ORPHAN_BLOCKS = Counter(
    "smart_epp_kv_orphan_blocks_total",
    "Stored blocks whose parent was never seen (no key can be computed)",
    ["pod"],
)
APPLY_FAILURES = Counter(
    "smart_epp_kv_apply_failures_total",
    "Decoded batches that failed to apply to the index (skipped; the stream goes on)",
    ["pod"],
)
SUSPECT_FRAMES = Counter(
    "smart_epp_kv_suspect_frames_total",
    "Frames dropped for an implausible sequence number, or an apparent restart the pod's "
    "replay buffer contradicted",
    ["pod"],
)
HASH_MAP_EVICTIONS = Counter(
    "smart_epp_kv_hash_map_evictions_total",
    "vLLM-hash -> key entries dropped to keep a pod's map within the index capacity",
    ["pod"],
)
LAG = Histogram(
    "smart_epp_kv_event_lag_seconds",
    "From the engine's batch timestamp to the batch being applied to the index",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
UNKNOWN_TOPICS = Counter(
    "smart_epp_kv_unknown_topic_total",
    "Batches received on the central socket from a topic naming no pool member",
)
REDIS_UP = Gauge(
    "smart_epp_kv_redis_up",
    "1 while the shared Redis index answers, 0 while routing on local state",
)
REDIS_RESEEDS = Counter(
    "smart_epp_kv_redis_reseeds_total",
    "Times this replica wrote its local index back to Redis (empty or replaced store, or "
    "writes lost during an outage)",
)
REDIS_DIVERGENCE = Gauge(
    "smart_epp_kv_redis_divergence_blocks",
    "Blocks in the shared Redis index minus blocks in this replica's local mirror "
    "(sampled; near 0 when replicas and the store agree)",
)
REDIS_ERRORS = Counter(
    "smart_epp_kv_redis_errors_total", "Redis index operations that failed", ["op"]
)
CATCH_UP_SECONDS = Gauge(
    "smart_epp_kv_catch_up_seconds",
    "How long this replica's start waited for every pod's index to catch up before it "
    "reported ready",
)
CATCH_UP_PENDING = Gauge(
    "smart_epp_kv_catch_up_pending_pods",
    "Pods whose index had not caught up when this replica reported ready (the wait ran out)",
)

_PER_POD = (
    EVENTS,
    BLOCKS,
    DECODE_ERRORS,
    SEQUENCE_GAPS,
    REPLAYS,
    REPLAYED_BATCHES,
    RESTARTS,
    ORPHAN_BLOCKS,
    APPLY_FAILURES,
    SUSPECT_FRAMES,
    HASH_MAP_EVICTIONS,
)


def forget_pod(pod: str) -> None:
    """Drops every per-pod series of a pod that left the pool."""
    for metric in _PER_POD:
        for labels in list(metric._metrics):  # prometheus_client has no public listing
            if labels and labels[0] == pod:
                metric.remove(*labels)

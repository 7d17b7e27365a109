"""Imports every built-in plugin module so each registers its type name."""

from . import (  # noqa: F401
    kv_cache_utilization_scorer,
    label_selector_filter,
    load_aware_scorer,
    local_tokenizer,
    lora_affinity_filter,
    lora_affinity_scorer,
    max_score_picker,
    precise_prefix_cache_scorer,
    predicted_ttft_scorer,
    prefix_cache_scorer,
    profile_handler,
    queue_filters,
    queue_scorer,
    random_picker,
    role_filter,
    running_requests_size_scorer,
    saturation_detectors,
    saturation_filter,
    session_affinity_scorer,
    weighted_random_picker,
)

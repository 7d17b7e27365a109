"""llm-d's data-layer plugins, mapped onto what smart-epp's datastore already does.

- `metrics-data-source`: smart-epp scrapes every endpoint's Prometheus page (the pool
  file's `metrics:` URL, default `http://<address>/metrics`).
- `core-metrics-extractor`: the vLLM series smart-epp reads from that page (queue,
  running requests, KV-cache usage, LoRA state, cache config).
- `endpoint-notification-source`: endpoint add/remove notifications, which smart-epp
  gets from its discovery (pool file or InferencePool watch) and which also drive the
  KV-event subscriptions.

Their parameters are accepted only with the values smart-epp implements; anything else
is refused by name, so a config asking for, say, another metrics path or engine does not
load as if it had been applied.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict

from ..framework.plugins import Plugin, PluginParams
from ..framework.registry import register_plugin


class _Fixed(PluginParams):
    # Every parameter is declared: an unknown one is a config error, not a warning.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class MetricsSourceParams(_Fixed):
    scheme: Literal["http"] = "http"
    path: Literal["/metrics"] = "/metrics"
    insecureSkipVerify: bool = True


@register_plugin()
class MetricsDataSource(Plugin):
    type_name = "metrics-data-source"
    kind = "data-source"
    Params = MetricsSourceParams


class CoreMetricsParams(_Fixed):
    # vLLM's series are the only engine smart-epp reads.
    engineLabelKey: str | None = None
    defaultEngine: Literal["vllm"] = "vllm"
    queuedRequestsSpec: Literal["vllm:num_requests_waiting"] = "vllm:num_requests_waiting"
    runningRequestsSpec: Literal["vllm:num_requests_running"] = "vllm:num_requests_running"
    kvUsageSpec: Literal["vllm:kv_cache_usage_perc"] = "vllm:kv_cache_usage_perc"
    loraSpec: Literal["vllm:lora_requests_info"] = "vllm:lora_requests_info"
    cacheInfoSpec: Literal["vllm:cache_config_info"] = "vllm:cache_config_info"


@register_plugin()
class CoreMetricsExtractor(Plugin):
    type_name = "core-metrics-extractor"
    kind = "extractor"
    Params = CoreMetricsParams


class NotificationSourceParams(_Fixed):
    # Pods are the only objects smart-epp's discovery follows.
    group: Literal[""] = ""
    version: Literal["v1"] = "v1"
    kind: Literal["Pod"] = "Pod"


@register_plugin()
class EndpointNotificationSource(Plugin):
    type_name = "endpoint-notification-source"
    kind = "data-source"
    Params = NotificationSourceParams


class OpenAIParserParams(_Fixed):
    pass


@register_plugin()
class OpenAIParser(Plugin):
    """`openai-parser`: the OpenAI API parser smart-epp always uses (completions, chat
    completions, embeddings, responses)."""

    type_name = "openai-parser"
    kind = "parser"
    Params = OpenAIParserParams

"""local-tokenizer: tokenize one model's prompts in-process instead of asking a pod.

Parameters: `modelName` (as clients send it), `path` (a model folder holding
tokenizer.json and a chat template, as in a Hugging Face checkout), optional
`tokenizerFile` / `chatTemplateFile` overrides, `cacheBytes` (LRU budget). Models with
no local-tokenizer are tokenized through a pod's /tokenize endpoint, which always agrees
with the pods.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..framework.plugins import Plugin, PluginParams
from ..framework.registry import register_plugin
from ..framework.scheduling import DEFAULT_TOKENIZER_CACHE_BYTES as DEFAULT_CACHE_BYTES


class LocalTokenizerParams(PluginParams):
    modelName: str = Field(min_length=1)
    path: str | None = None
    tokenizerFile: str | None = None
    chatTemplateFile: str | None = None
    cacheBytes: int = Field(default=DEFAULT_CACHE_BYTES, gt=0)


@register_plugin()
class LocalTokenizerPlugin(Plugin):
    type_name = "local-tokenizer"
    kind = "tokenizer"
    Params = LocalTokenizerParams
    params: LocalTokenizerParams


class PodTokenizerParams(PluginParams):
    cacheBytes: int = Field(default=DEFAULT_CACHE_BYTES, gt=0)
    timeoutSeconds: float = Field(default=2.0, gt=0)


@register_plugin()
class PodTokenizerPlugin(Plugin):
    """`pod-tokenizer`: settings of the default /tokenize-through-a-pod path."""

    type_name = "pod-tokenizer"
    kind = "tokenizer"
    Params = PodTokenizerParams
    params: PodTokenizerParams


class _VLLMTokenizeServer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    url: str = Field(min_length=1)
    timeout: str | None = None  # Go duration, e.g. "5s"
    mmTimeout: str | None = None


def _seconds(duration: str) -> float:
    """A Go-style duration ("500ms", "5s", "1m") in seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0}
    for suffix in ("ms", "s", "m"):
        if duration.endswith(suffix):
            number = duration[: -len(suffix)]
            try:
                return float(number) * units[suffix]
            except ValueError:
                break
    raise ValueError(f"not a duration: {duration!r} (use e.g. 500ms, 5s)")


class TokenProducerParams(PluginParams):
    modelName: str | None = None
    vllm: _VLLMTokenizeServer | None = None
    cacheBytes: int = Field(default=DEFAULT_CACHE_BYTES, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _supported_backends(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in (
                ("udsTokenizerConfig", "the UDS tokenizer sidecar is not supported"),
                ("estimate", "token-count estimation is not supported; smart-epp tokenizes"),
            ):
                if key in data:
                    raise ValueError(f"{key}: {why}; use vllm.url or a local-tokenizer plugin")
        return data

    def timeout_seconds(self) -> float:
        if self.vllm is not None and self.vllm.timeout:
            return _seconds(self.vllm.timeout)
        return 2.0


@register_plugin()
class TokenProducerPlugin(Plugin):
    """`token-producer` (llm-d): tokenizes prompts through vLLM's `/tokenize`, at
    `vllm.url` (a tokenizer sidecar) when given, else at a pod serving the model."""

    type_name = "token-producer"
    kind = "tokenizer"
    Params = TokenProducerParams
    params: TokenProducerParams

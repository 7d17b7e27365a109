"""local-tokenizer: tokenize one model's prompts in-process instead of asking a pod.

Parameters: `modelName` (as clients send it), `path` (a model folder holding
tokenizer.json and a chat template, as in a Hugging Face checkout), optional
`tokenizerFile` / `chatTemplateFile` overrides, `cacheBytes` (LRU budget). Models with
no local-tokenizer are tokenized through a pod's /tokenize endpoint, which always agrees
with the pods.
"""

from __future__ import annotations

from pydantic import Field

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

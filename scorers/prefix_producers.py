"""llm-d's prefix-match producers, which feed `prefix-cache-scorer` in its current configs.

In llm-d's router a `prefix-cache-scorer` scores whatever prefix matches its producer
(`prefixMatchInfoProducerName`) computed. smart-epp builds the scorer that does the same
work directly when the config is loaded:

- `precise-prefix-cache-producer` (matches from the pods' KV events) -> the scorer becomes
  a `precise-prefix-cache-scorer` using smart-epp's KV index, with the producer's block
  size as the fallback block size;
- `approx-prefix-cache-producer` (matches from the prompts routed to each pod) -> the
  approximate `prefix-cache-scorer` with the producer's parameters (block size, auto-tune,
  match caps, LRU size), the scorer's own parameters taking precedence.

The producers themselves do nothing at request time; `token-producer` (tokenization for
the precise path) is in `local_tokenizer.py`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..framework.plugins import Plugin, PluginParams
from ..framework.registry import register_plugin
from .precise_prefix_cache_scorer import INDEX_NOTES
from .prefix_cache_scorer import PrefixCacheParams


class _TokenProcessorConfig(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    blockSize: int | None = Field(default=None, gt=0)
    blockSizeTokens: int | None = Field(default=None, gt=0)


class PrecisePrefixProducerParams(PluginParams):
    tokenProcessorConfig: _TokenProcessorConfig | None = None
    indexerConfig: dict[str, Any] | None = None
    kvEventsConfig: dict[str, Any] | None = None
    upstream_notes = INDEX_NOTES
    nested_parameters = frozenset({"indexerConfig", "kvEventsConfig", "tokenProcessorConfig"})

    def block_size(self) -> int | None:
        tp = self.tokenProcessorConfig
        if tp is not None and (tp.blockSize or tp.blockSizeTokens):
            return tp.blockSize or tp.blockSizeTokens
        nested = (self.indexerConfig or {}).get("tokenProcessorConfig") or {}
        size = nested.get("blockSize") or nested.get("blockSizeTokens")
        return size if isinstance(size, int) and size > 0 else None


@register_plugin()
class PrecisePrefixCacheProducer(Plugin):
    type_name = "precise-prefix-cache-producer"
    kind = "producer"
    Params = PrecisePrefixProducerParams
    params: PrecisePrefixProducerParams


class ApproxPrefixProducerParams(PrefixCacheParams):
    """llm-d's approximate producer takes the approximate scorer's parameters."""

    def scorer_parameters(self) -> dict[str, Any]:
        """The parameters set here, for the `prefix-cache-scorer` this producer feeds."""
        return self.model_dump(exclude_unset=True)


@register_plugin()
class ApproxPrefixCacheProducer(Plugin):
    type_name = "approx-prefix-cache-producer"
    kind = "producer"
    Params = ApproxPrefixProducerParams
    params: ApproxPrefixProducerParams

"""llm-d's prefix-match producers, which feed `prefix-cache-scorer` in its current configs.

In llm-d's router a `prefix-cache-scorer` scores whatever prefix matches its producer
(`prefixMatchInfoProducerName`) computed. smart-epp builds the scorer that does the same
work directly when the config is loaded:

- `precise-prefix-cache-producer` (matches from the pods' KV events) -> the scorer becomes
  a `precise-prefix-cache-scorer` using smart-epp's KV index, with the producer's block
  size as the fallback block size;
- `approx-prefix-cache-producer` (matches from the prompts routed to each pod) -> the
  approximate `prefix-cache-scorer` with the producer's block size, match cap and LRU size.

The producers themselves do nothing at request time; `token-producer` (tokenization for
the precise path) is in `local_tokenizer.py`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..framework.plugins import Plugin, PluginParams
from ..framework.registry import register_plugin
from .precise_prefix_cache_scorer import INDEX_NOTES
from .prefix_cache_scorer import AUTO_TUNE_REFUSED


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


# The approximate scorer hashes characters; llm-d's producer counts tokens, estimated at
# four characters each (the same estimate its metrics use).
CHARS_PER_TOKEN = 4


class ApproxPrefixProducerParams(PluginParams):
    blockSizeTokens: int = Field(default=16, gt=0)
    blockSize: int | None = Field(default=None, gt=0)  # characters (older name)
    maxPrefixTokensToMatch: int | None = Field(default=None, ge=0)
    maxPrefixBlocksToMatch: int | None = Field(default=None, ge=0)
    lruCapacityPerServer: int = Field(default=31250, gt=0)
    autoTune: bool = False

    @model_validator(mode="after")
    def _no_auto_tune(self) -> ApproxPrefixProducerParams:
        if self.autoTune:
            raise ValueError(AUTO_TUNE_REFUSED)
        return self

    def scorer_parameters(self) -> dict[str, Any]:
        """The equivalent parameters of the approximate `prefix-cache-scorer`."""
        block_chars = self.blockSize or self.blockSizeTokens * CHARS_PER_TOKEN
        if self.maxPrefixTokensToMatch:
            max_blocks = max(1, self.maxPrefixTokensToMatch // self.blockSizeTokens)
        elif self.maxPrefixBlocksToMatch:
            max_blocks = self.maxPrefixBlocksToMatch
        else:
            max_blocks = 131072 // self.blockSizeTokens
        return {
            "blockSize": block_chars,
            "maxPrefixBlocksToMatch": max_blocks,
            "lruCapacityPerServer": self.lruCapacityPerServer,
            "autoTune": self.autoTune,
        }


@register_plugin()
class ApproxPrefixCacheProducer(Plugin):
    type_name = "approx-prefix-cache-producer"
    kind = "producer"
    Params = ApproxPrefixProducerParams
    params: ApproxPrefixProducerParams

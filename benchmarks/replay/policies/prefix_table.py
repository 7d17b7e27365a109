"""The peers' rules for what a prompt chunk is (token ids, or characters), over the one
routed-prefix table and chained-key helper of `scorers.routed_prefixes`.

SGLang's cache-aware router keeps an approximate radix tree per worker and AIBrix a table
of prefix-block hashes; both learn only from their own routing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ....framework.types import LLMRequest
from ....scorers.routed_prefixes import chained_keys


def prompt_units(request: LLMRequest) -> Sequence[int]:
    """The prompt as a sequence of ints: token ids when known, else characters."""
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    return [ord(c) for c in request.text_for_hashing()]


CHARACTERS_PER_TOKEN = 4  # the usual estimate for English BPE vocabularies


def prompt_characters(request: LLMRequest) -> bytes:
    """The prompt as characters (UTF-32, 4 bytes each), for routers that tokenize by
    character. Replayed token ids stand for text: each counts as 4 characters (its id's 4
    bytes), so character blocks keep their size in tokens."""
    if request.prompt_token_ids is not None:
        ids = np.asarray(request.prompt_token_ids, dtype="<u4")
        return ids.view(np.uint8).astype("<u4").tobytes()
    return request.text_for_hashing().encode("utf-32-le")


def character_chunk_keys(chars: bytes, chunk_chars: int, namespace: str = "") -> list[int]:
    """Chained keys of the full `chunk_chars`-character pieces of UTF-32 `chars`."""
    return chained_keys(chars, 4 * chunk_chars, namespace)

"""Block hashes computed exactly as vLLM 0.32 computes them for prefix caching.

Recipe (verified against the real captures): ``H(x) = sha256(ser(x))`` where ``ser`` is
``pickle.dumps(x, protocol=5)`` for the default ``sha256`` algorithm or
``cbor2.dumps(x, canonical=True)`` for ``sha256_cbor``. The chain starts from
``NONE_HASH = H(seed)`` (seed = ``PYTHONHASHSEED`` or ``"vllm-none-hash"``) and block ``i``
is ``d_i = H((d_{i-1}, tuple(block_tokens), extra_keys_i))``. The parent is the full 32-byte
digest; KV events publish only its low 64 bits, read big-endian.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import cbor2

HashAlgo = Literal["sha256", "sha256_cbor"]
HASH_ALGOS: tuple[HashAlgo, ...] = ("sha256", "sha256_cbor")
DEFAULT_SEED = "vllm-none-hash"

ExtraKeys = tuple[Any, ...] | None


def _ser_cbor(obj: object) -> bytes:
    return cbor2.dumps(obj, canonical=True)


_SERIALISERS: dict[str, Callable[[object], bytes]] = {
    # A C-level partial: the serialiser runs once per hashed block.
    "sha256": partial(pickle.dumps, protocol=5),
    "sha256_cbor": _ser_cbor,
}


def default_seed() -> str:
    """The NONE_HASH seed a vLLM process would use in this environment."""
    return os.environ.get("PYTHONHASHSEED") or DEFAULT_SEED


def published_id(digest: bytes) -> int:
    """The uint64 a KV event carries for a 32-byte block digest."""
    return int.from_bytes(digest[-8:], "big")


def lora_extra_keys(name: str, path: str) -> tuple[tuple[str, str, str]]:
    """The hashed extra key of every block of a LoRA request."""
    return (("lora", name, path),)


class BlockHasher:
    """Chains vLLM block digests for one hash algorithm and seed."""

    __slots__ = ("_ser", "algo", "block_size", "none_hash", "seed")

    def __init__(self, block_size: int, algo: HashAlgo = "sha256", seed: str | None = None):
        if algo not in _SERIALISERS:
            raise ValueError(f"unknown prefix-caching hash algorithm {algo!r}")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.algo = algo
        self.block_size = block_size
        self.seed = default_seed() if seed is None else seed
        self._ser = _SERIALISERS[algo]
        self.none_hash = hashlib.sha256(self._ser(self.seed)).digest()

    def block_digest(
        self, parent: bytes | None, block_tokens: Sequence[int], extra_keys: ExtraKeys = None
    ) -> bytes:
        key = (parent if parent is not None else self.none_hash, tuple(block_tokens), extra_keys)
        return hashlib.sha256(self._ser(key)).digest()

    def extend(
        self,
        digests: list[bytes],
        token_ids: Sequence[int],
        num_blocks: int,
        extra_keys: ExtraKeys = None,
        first_block_extra: ExtraKeys = None,
    ) -> None:
        """Appends to ``digests`` (the chain of ``token_ids`` so far) up to ``num_blocks``.

        The engine's hot path: the same digests as ``chain``, without a call per block.
        """
        bs = self.block_size
        ser, sha = self._ser, hashlib.sha256
        have = len(digests)
        parent = digests[-1] if digests else self.none_hash
        append = digests.append
        start = have * bs
        for i in range(have, num_blocks):
            keys = first_block_extra if (i == 0 and first_block_extra is not None) else extra_keys
            end = start + bs
            parent = sha(ser((parent, tuple(token_ids[start:end]), keys))).digest()
            append(parent)
            start = end

    def chain(
        self,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys = None,
        parent: bytes | None = None,
        start_block: int = 0,
        first_block_extra: ExtraKeys = None,
    ) -> list[bytes]:
        """Digests of the full blocks of ``token_ids`` from ``start_block`` on.

        ``parent`` is the digest of block ``start_block - 1`` (None at the start of the
        sequence). ``first_block_extra`` replaces ``extra_keys`` for block 0 only (vLLM
        adds a request's ``cache_salt`` to its first block).
        """
        bs = self.block_size
        digests: list[bytes] = []
        for i in range(start_block, len(token_ids) // bs):
            keys = first_block_extra if (i == 0 and first_block_extra is not None) else extra_keys
            parent = self.block_digest(parent, token_ids[i * bs : (i + 1) * bs], keys)
            digests.append(parent)
        return digests

    def chain_ids(self, token_ids: Sequence[int], extra_keys: ExtraKeys = None) -> list[int]:
        """Published uint64 ids of the full blocks of a token sequence."""
        return [published_id(d) for d in self.chain(token_ids, extra_keys)]

"""Decoding of vLLM KV-cache event batches (msgpack), both wire encodings.

A batch is the array `[ts, events, data_parallel_rank]` (older vLLM: no rank). Each
event is either a msgpack map with a "type" key (vLLM >= 0.2x, msgspec tagged struct)
or a positional array whose first element is the tag (older vLLM, array_like structs).
Unknown extra fields are ignored and missing optional ones take defaults; block hashes
may be unsigned 64-bit ints or bytes. Anything else raises `DecodeError`, which callers
count and drop: one bad frame must never stop ingestion.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = int | bytes


class DecodeError(ValueError):
    """A frame that is not a valid KV event batch."""


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# The positional encoding of older vLLM: same fields, same order, tag first. Decoded
# events are turned back into the plain classes, which is what everything else matches.
class _ArrayBlockStored(BlockStored, tag="BlockStored", array_like=True, frozen=True):
    pass


class _ArrayBlockRemoved(BlockRemoved, tag="BlockRemoved", array_like=True, frozen=True):
    pass


class _ArrayAllBlocksCleared(
    AllBlocksCleared, tag="AllBlocksCleared", array_like=True, frozen=True
):
    pass


_POSITIONAL: dict[type[KVEvent], type[KVEvent]] = {
    BlockStored: _ArrayBlockStored,
    BlockRemoved: _ArrayBlockRemoved,
    AllBlocksCleared: _ArrayAllBlocksCleared,
}
_PLAIN = {positional: plain for plain, positional in _POSITIONAL.items()}


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_fast = msgspec.msgpack.Decoder(EventBatch)
_raw_batch = msgspec.msgpack.Decoder(_RawBatch)
_map_event = msgspec.msgpack.Decoder(KVEvent)
_array_event = msgspec.msgpack.Decoder(
    _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared
)


def _is_array(raw: bytes) -> bool:
    first = raw[0] if raw else 0
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def _from_array(raw: bytes) -> KVEvent:
    event = _array_event.decode(raw)
    return _PLAIN[type(event)](*msgspec.structs.astuple(event))


def decode_batch(payload: bytes) -> tuple[EventBatch, int]:
    """Decodes one payload frame.

    Returns the batch and the number of events skipped inside it (unknown event types
    or malformed single events; the rest of the batch is kept). Raises DecodeError when
    the frame as a whole is unusable.
    """
    try:
        return _fast.decode(payload), 0
    except msgspec.DecodeError:
        pass  # mixed or positional encoding, or unknown event types: slow path below
    try:
        raw = _raw_batch.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not a KV event batch: {exc}") from exc
    events: list[KVEvent] = []
    skipped = 0
    for item in raw.events:
        data = bytes(item)
        try:
            events.append(_from_array(data) if _is_array(data) else _map_event.decode(data))
        except msgspec.DecodeError:
            skipped += 1
    return EventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank), skipped


def encode_batch(batch: EventBatch) -> bytes:
    """The map-per-event encoding vLLM 0.32 publishes (used by tests and tools)."""
    return _encoder.encode(batch)


def encode_batch_positional(batch: EventBatch) -> bytes:
    """The positional, tag-first encoding of older vLLM (used by tests and tools)."""
    events = [_POSITIONAL[type(ev)](*msgspec.structs.astuple(ev)) for ev in batch.events]
    return _encoder.encode([batch.ts, events, batch.data_parallel_rank])


_encoder = msgspec.msgpack.Encoder()

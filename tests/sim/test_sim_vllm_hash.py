"""The simulator's block hashes equal the ones real vLLM 0.32 published."""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
from simfix import captured_requests, decoded_batches

from smart_epp.benchmarks.sim.vllm_hash import (
    BlockHasher,
    default_seed,
    lora_extra_keys,
    published_id,
)

SCENARIOS = [
    ("basic", "sha256", "vllm-none-hash"),
    ("eviction", "sha256", "vllm-none-hash"),
    ("lora", "sha256", "vllm-none-hash"),
    ("restart", "sha256", "vllm-none-hash"),
    ("cbor", "sha256_cbor", "42"),
]


def _stored_ids(scenario: str) -> set[int]:
    ids: set[int] = set()
    for batch in decoded_batches(scenario):
        for event in batch["payload"][1]:
            if event["type"] == "BlockStored":
                ids.update(event["block_hashes"])
    return ids


@pytest.mark.parametrize(("scenario", "algo", "seed"), SCENARIOS)
def test_request_chains_reproduce_every_published_block(scenario, algo, seed):
    hasher = BlockHasher(32, algo, seed)
    computed: set[int] = set()
    for req in captured_requests(scenario):
        keys = lora_extra_keys(req.lora_name, req.lora_path) if req.lora_name else None
        computed.update(hasher.chain_ids(req.prompt_token_ids + req.output_token_ids, keys))
    stored = _stored_ids(scenario)
    assert stored, "fixture has BlockStored events"
    assert stored <= computed


@pytest.mark.parametrize(("scenario", "algo", "seed"), SCENARIOS)
def test_event_token_ids_rehash_to_the_published_ids(scenario, algo, seed):
    hasher = BlockHasher(32, algo, seed)
    digest_of: dict[int, bytes] = {}
    for batch in decoded_batches(scenario):
        for event in batch["payload"][1]:
            if event["type"] != "BlockStored":
                continue
            parent = (
                None
                if event["parent_block_hash"] is None
                else digest_of[event["parent_block_hash"]]
            )
            name = event["lora_name"]
            path = f"/models/tiny-{name}" if name else None
            keys = lora_extra_keys(name, path) if name else None
            digests = hasher.chain(event["token_ids"], keys, parent=parent)
            assert [published_id(d) for d in digests] == event["block_hashes"]
            digest_of.update(zip(event["block_hashes"], digests, strict=True))


def test_wrong_serialisation_matches_nothing():
    wrong = BlockHasher(32, "sha256_cbor", "vllm-none-hash")
    computed: set[int] = set()
    for req in captured_requests("basic"):
        computed.update(wrong.chain_ids(req.prompt_token_ids + req.output_token_ids))
    assert not computed & _stored_ids("basic")


def test_none_hash_follows_the_documented_recipe(monkeypatch):
    assert BlockHasher(16).none_hash == hashlib.sha256(pickle.dumps(default_seed(), 5)).digest()
    cbor = BlockHasher(16, "sha256_cbor", "42").none_hash
    assert cbor == hashlib.sha256(cbor2.dumps("42", canonical=True)).digest()
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert BlockHasher(16).seed == "7"
    monkeypatch.delenv("PYTHONHASHSEED")
    assert BlockHasher(16).seed == "vllm-none-hash"


def test_partial_block_is_not_hashed_and_bad_config_is_refused():
    hasher = BlockHasher(4)
    assert len(hasher.chain_ids(list(range(11)))) == 2
    with pytest.raises(ValueError):
        BlockHasher(4, "md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BlockHasher(0)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_incremental_extend_equals_chain(algo: str) -> None:
    hasher = BlockHasher(4, algo, "seed")  # type: ignore[arg-type]
    tokens = list(range(100, 130))  # 7 full blocks and a partial one
    extra = (("lora", "a", "/p"),)
    first = (("lora", "a", "/p"), "salt")
    expected = hasher.chain(tokens, extra, first_block_extra=first)
    digests: list[bytes] = []
    hasher.extend(digests, tokens, 3, extra, first)
    assert digests == expected[:3]
    hasher.extend(digests, tokens, 7, extra, first)
    assert digests == expected
    hasher.extend(digests, tokens, 5, extra, first)  # never shrinks or rehashes
    assert digests == expected

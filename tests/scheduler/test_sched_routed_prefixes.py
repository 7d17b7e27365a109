"""The one routed-prefix table and chained-key helper the prefix-guessing policies share."""

from __future__ import annotations

from smart_epp.scorers.routed_prefixes import RoutedPrefixTable, chained_keys, unit_chunk_keys


def test_keys_are_chained_and_namespaced() -> None:
    a = unit_chunk_keys(list(range(40)), 16, "m")
    b = unit_chunk_keys([*range(32), 99, 98, 97], 16, "m")
    assert len(a) == 2 and a == b[:2]  # the same first 32 units: the same two keys
    assert unit_chunk_keys([0, *range(1, 40)], 16, "other") != a  # another model's chain
    c = unit_chunk_keys([1, *range(1, 40)], 16, "m")
    assert c[0] != a[0] and c[1] != a[1]  # a different first chunk changes every key after
    assert unit_chunk_keys(list(range(10)), 16) == []
    assert (
        chained_keys(b"abcdefgh", 4)
        == chained_keys(b"abcdXXXX", 4)[:1] + chained_keys(b"abcdefgh", 4)[1:]
    )


def test_longest_run_per_pod_and_lru_eviction() -> None:
    table = RoutedPrefixTable(max_chunks_per_pod=3)
    table.insert("a", [1, 2, 3])
    table.insert("b", [1, 2])
    assert table.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    table.insert("a", [7])  # over the cap of 3: the least recently routed key (1) goes
    assert table.size("a") == 3
    assert table.match([1, 2, 3], ["a"]) == {"a": 0}  # a run must start at the first chunk
    table.insert("b", [5, 6], capacity=1)  # a per-pod cap (the pod's own KV size)
    assert table.size("b") == 1

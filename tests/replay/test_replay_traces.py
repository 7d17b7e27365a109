"""Trace loaders: block-id sharing becomes token sharing, formats parse, bad input is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.paths import MOONCAKE_TRACE

from smart_epp.benchmarks.replay.traces import (
    SharedPrefixSpec,
    TraceError,
    detect_format,
    generate_shared_prefix,
    infinite_cache_hit_rate,
    load_mooncake,
    load_recorded,
    load_sharegpt,
    load_trace,
    text_to_tokens,
)
from smart_epp.epp.traffic_recorder import recorded_line


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_mooncake_equal_block_ids_give_equal_tokens(tmp_path: Path) -> None:
    trace = _write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
            {"timestamp": 1500, "input_length": 1300, "output_length": 6, "hash_ids": [7, 8, 4]},
            {"timestamp": 2000, "input_length": 700, "output_length": 7, "hash_ids": [5, 8]},
        ],
    )
    a, b, c = load_mooncake(trace)
    ta, tb, tc = a.token_ids(), b.token_ids(), c.token_ids()
    assert (len(ta), len(tb), len(tc)) == (1100, 1300, 700)
    # Blocks 7 and 8 are shared (1024 tokens); block 9 vs 4 differ from token 1024 on.
    assert _common_prefix(ta, tb) == 1024
    # Same id at a different position after a different first block still differs: the
    # prompt diverges from the very first token.
    assert _common_prefix(ta, tc) == 0
    assert tc[512:700] == ta[512:700]  # block id 8 always maps to the same tokens
    assert [r.timestamp_s for r in (a, b, c)] == [0.0, 0.5, 1.0]
    assert [r.output_tokens for r in (a, b, c)] == [5, 6, 7]


def test_mooncake_prompt_longer_than_its_blocks_is_padded(tmp_path: Path) -> None:
    trace = _write_jsonl(
        tmp_path / "t.jsonl",
        [{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}],
    )
    (req,) = load_mooncake(trace)
    assert len(req.token_ids()) == 600


def test_mooncake_slice_of_real_trace_shares_tokens_where_ids_match() -> None:
    reqs = load_mooncake(MOONCAKE_TRACE, limit=300)
    assert len(reqs) == 300
    rows = [json.loads(line) for _, line in zip(range(300), MOONCAKE_TRACE.open(), strict=False)]
    by_first: dict[int, int] = {}
    checked = 0
    for i, row in enumerate(rows):
        first = row["hash_ids"][0]
        if first in by_first:
            j = by_first[first]
            shared_ids = _common_prefix(rows[j]["hash_ids"], row["hash_ids"])
            shared = min(shared_ids * 512, row["input_length"], rows[j]["input_length"])
            prefix = _common_prefix(reqs[i].token_ids(), reqs[j].token_ids())
            assert prefix >= shared
            checked += 1
        else:
            by_first[first] = i
    assert checked > 10


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": []}, "input_length"),
        ({"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": "no"}, "hash_ids"),
        ({"timestamp": -1, "input_length": 3, "output_length": 1, "hash_ids": []}, "timestamp"),
    ],
)
def test_mooncake_bad_rows_name_line_and_field(tmp_path: Path, row: dict, field: str) -> None:
    trace = _write_jsonl(tmp_path / "t.jsonl", [row])
    with pytest.raises(TraceError, match=rf"t.jsonl:1: `{field}`"):
        load_mooncake(trace)


def test_sharegpt_turns_become_growing_chat_requests(tmp_path: Path) -> None:
    data = [
        {
            "id": "c1",
            "conversations": [
                {"from": "human", "value": "hello there, how are you"},
                {"from": "gpt", "value": "fine thanks and you"},
                {"from": "human", "value": "tell me a story"},
                {"from": "gpt", "value": "once upon a time there was a router"},
            ],
        },
        {"id": "c2", "conversations": [{"from": "human", "value": "only a question"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    assert detect_format(path) == "sharegpt"
    first, second = load_sharegpt(path)
    assert first.messages == [{"role": "user", "content": "hello there, how are you"}]
    assert second.messages is not None and len(second.messages) == 3
    assert first.output_tokens == len(text_to_tokens("fine thanks and you"))
    # The second turn carries the first as its prefix.
    assert _common_prefix(first.token_ids(), second.token_ids()) >= len(first.token_ids()) - 1


def test_shared_prefix_groups_share_system_prompt() -> None:
    spec = SharedPrefixSpec(
        num_groups=3, num_prompts_per_group=4, system_prompt_len=50, question_len=10, output_len=7
    )
    reqs = generate_shared_prefix(spec, seed=1)
    assert len(reqs) == 12
    assert [r.index for r in reqs] == list(range(12))
    by_group: dict[str, list[list[int]]] = {}
    for r in reqs:
        assert r.input_tokens == 60 and r.output_tokens == 7
        by_group.setdefault(r.group or "", []).append(r.token_ids())
    assert len(by_group) == 3
    groups = list(by_group.values())
    for members in groups:
        for m in members[1:]:
            assert 50 <= _common_prefix(members[0], m) < 60
    assert _common_prefix(groups[0][0], groups[1][0]) < 50
    assert generate_shared_prefix(spec, seed=1)[5].token_ids() == reqs[5].token_ids()


def test_shared_prefix_multi_turn_rounds_extend_history() -> None:
    spec = SharedPrefixSpec(
        num_groups=1,
        num_prompts_per_group=2,
        system_prompt_len=20,
        question_len=5,
        output_len=3,
        multi_turn=True,
        turns=2,
    )
    reqs = generate_shared_prefix(spec, seed=0)
    first_rounds, second_rounds = reqs[:2], reqs[2:]
    assert all(r.input_tokens == 25 for r in first_rounds)
    assert all(r.input_tokens == 33 for r in second_rounds)  # + answer 3 + question 5
    for r2 in second_rounds:
        assert any(r2.token_ids()[:25] == r1.token_ids() for r1 in first_rounds)


def test_shared_prefix_yaml_accepts_inference_perf_layout(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(
        "data:\n  type: shared_prefix\n  shared_prefix:\n    num_groups: 2\n"
        "    num_prompts_per_group: 3\n    system_prompt_len: 30\n    question_len: 4\n"
        "    output_len: 9\n"
    )
    reqs = load_trace(path)
    assert len(reqs) == 6 and all(r.input_tokens == 34 for r in reqs)
    path.write_text("num_groups: 0\n")
    with pytest.raises(TraceError, match="num_groups"):
        load_trace(path)


def test_a_recorded_trace_whose_first_row_is_long_is_still_recognised(tmp_path: Path) -> None:
    ids = list(range(100_000, 102_000))  # ~14 kB of token ids on the first line
    path = tmp_path / "long.jsonl"
    path.write_text("\n" + recorded_line(0.0, "m", len(ids), 8, prompt_token_ids=ids) + "\n")
    assert detect_format(path) == "recorded"
    assert load_trace(path)[0].token_ids() == ids


def test_recorded_round_trip_keeps_content_when_given(tmp_path: Path) -> None:
    lines = [
        recorded_line(100.0, "m", 4, 10, prompt_token_ids=[5, 6, 7, 8]),
        recorded_line(100.5, "m", 3, 11, api="chat", messages=[{"role": "user", "content": "hi"}]),
        recorded_line(101.0, "m", 40, 12),  # sizes only: prompts are user data
    ]
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert detect_format(path) == "recorded"
    a, b, c = load_recorded(path)
    assert a.token_ids() == [5, 6, 7, 8] and a.timestamp_s == 0.0
    assert b.messages == [{"role": "user", "content": "hi"}] and b.timestamp_s == 0.5
    assert c.input_tokens == 40 and c.output_tokens == 12


def test_unknown_format_and_missing_file_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"foo": 1}\n')
    with pytest.raises(TraceError, match="--format"):
        load_trace(path)
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "missing.jsonl")


def test_infinite_cache_ceiling_counts_repeated_full_blocks() -> None:
    spec = SharedPrefixSpec(
        num_groups=1, num_prompts_per_group=4, system_prompt_len=64, question_len=16, output_len=1
    )
    reqs = generate_shared_prefix(spec, seed=0)
    # 4 prompts of 80 tokens; the 64-token system prompt (4 blocks of 16) repeats 3 times.
    assert infinite_cache_hit_rate(reqs, 16) == pytest.approx(3 * 64 / (4 * 80))

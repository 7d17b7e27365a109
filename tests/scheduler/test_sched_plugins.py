"""Each filter, scorer and picker against its documented semantics."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from sched_helpers import pod, request

from smart_epp.epp.config import plugin_types
from smart_epp.framework.plugins import Plugin, SchedulingContext
from smart_epp.framework.types import LLMRequest, PodState, PrefixHit


def make(type_name: str, **params) -> Plugin:
    cls = plugin_types()[type_name]
    return cls(type_name, cls.Params.model_validate(params))


def ctx_for(req: LLMRequest | None = None, *, seed: int = 0, **kw) -> SchedulingContext:
    req = req or request(tokens=list(range(64)))
    prompt = len(req.prompt_token_ids) if req.prompt_token_ids else req.estimated_prompt_tokens()
    return SchedulingContext(
        request=req, now=100.0, prompt_tokens=prompt, token_ids=req.prompt_token_ids,
        rng=random.Random(seed), **kw,
    )  # fmt: skip


def addresses(pods: list[PodState]) -> list[str]:
    return [p.address for p in pods]


# ------------------------------------------------------------------ scorers


def test_queue_scorer_is_min_max_normalised_and_flat_when_equal():
    pods = [pod("a", waiting=0), pod("b", waiting=5), pod("c", waiting=10)]
    assert make("queue-scorer").score(ctx_for(), pods) == [1.0, 0.5, 0.0]
    same = [pod("a", waiting=3), pod("b", waiting=3)]
    assert make("queue-scorer").score(ctx_for(), same) == [1.0, 1.0]


def test_kv_cache_utilization_scorer_is_free_fraction():
    pods = [pod("a", kv=0.0), pod("b", kv=0.25), pod("c", kv=1.0)]
    assert make("kv-cache-utilization-scorer").score(ctx_for(), pods) == [1.0, 0.75, 0.0]


def test_running_requests_size_scorer():
    pods = [pod("a", running=2), pod("b", running=6)]
    assert make("running-requests-size-scorer").score(ctx_for(), pods) == [1.0, 0.0]


def test_lora_affinity_scorer_levels():
    pods = [
        pod("active", adapters=("x",), max_loras=2),
        pod("inflight", inflight_adapters={"x": 1}, max_loras=1),
        pod("waiting", waiting_adapters=("x",), adapters=("y",), max_loras=2),
        pod("room", adapters=("y",), max_loras=2),
        pod("full", adapters=("y", "z"), max_loras=2),
    ]
    scorer = make("lora-affinity-scorer")
    assert scorer.score(ctx_for(request(tokens=[1], adapter="x")), pods) == [
        1.0, 1.0, 0.6, 0.8, 0.0,
    ]  # fmt: skip
    assert scorer.score(ctx_for(request(tokens=[1])), pods) == [1.0] * 5


def test_load_aware_and_active_request_scorers():
    pods = [pod("a", waiting=0), pod("b", waiting=50), pod("c", waiting=500)]
    assert make("load-aware-scorer", threshold=100).score(ctx_for(), pods) == [0.5, 0.25, 0.0]
    pods = [pod("a", inflight=0), pod("b", inflight=2), pod("c", inflight=4)]
    assert make("active-request-scorer").score(ctx_for(), pods) == [1.0, 0.5, 0.0]
    idle = [pod("a"), pod("b")]
    assert make("active-request-scorer").score(ctx_for(), idle) == [1.0, 1.0]


def test_session_affinity_sticks_to_the_last_pod_of_the_session():
    scorer = make("session-affinity-scorer", strategy="session_id", capacity=2)
    pods = [pod("a"), pod("b")]
    first = ctx_for(request(tokens=[1], session_id="s1"))
    assert scorer.score(first, pods) == [0.0, 0.0]
    scorer.on_routed(first, pods[1])
    assert scorer.score(ctx_for(request(tokens=[1], session_id="s1")), pods) == [0.0, 1.0]
    assert scorer.score(ctx_for(request(tokens=[1], session_id="s2")), pods) == [0.0, 0.0]
    assert scorer.score(ctx_for(request(tokens=[1])), pods) == [0.0, 0.0]
    for s in ("s2", "s3"):  # capacity 2: s1 is forgotten
        scorer.on_routed(ctx_for(request(tokens=[1], session_id=s)), pods[0])
    assert scorer.score(ctx_for(request(tokens=[1], session_id="s1")), pods) == [0.0, 0.0]


def test_approximate_prefix_scorer_learns_from_routing_history():
    # 2-token blocks at 4 characters a token: 8-character blocks.
    scorer = make("prefix-cache-scorer", blockSizeTokens=2, autoTune=False)
    shared = "abcdefgh" * 4  # 4 blocks
    pods = [pod("a"), pod("b")]
    first = ctx_for(request(prompt=shared + "11111111"))
    assert scorer.score(first, pods) == [0.0, 0.0]
    scorer.on_routed(first, pods[0])
    # Same 4-block prefix, different fifth block: 4 of 5 blocks match on pod a only.
    assert scorer.score(ctx_for(request(prompt=shared + "22222222")), pods) == [0.8, 0.0]
    # Another model never shares blocks (the chain is seeded with the model name).
    other = ctx_for(request(prompt=shared + "22222222", model="other"))
    assert scorer.score(other, pods) == [0.0, 0.0]
    # A prompt shorter than one block has nothing to match.
    assert scorer.score(ctx_for(request(prompt="abc")), pods) == [0.0, 0.0]


def test_approximate_prefix_scorer_evicts_per_server_lru():
    scorer = make("prefix-cache-scorer", blockSize=4, lruCapacityPerServer=3, autoTune=False)
    a = pod("a")
    old = ctx_for(request(prompt="AAAABBBBCCCC"))
    scorer.on_routed(old, a)
    scorer.on_routed(ctx_for(request(prompt="XXXXYYYY")), a)  # pushes out two old blocks
    assert scorer.score(ctx_for(request(prompt="AAAABBBBCCCC")), [a]) == [0.0]
    assert scorer.score(ctx_for(request(prompt="XXXXYYYY")), [a]) == [1.0]


def test_approximate_prefix_scorer_forgets_a_pod_that_left_the_pool():
    scorer = make("prefix-cache-scorer", blockSizeTokens=2, autoTune=False)
    shared = "abcdefgh" * 4
    pods = [pod("a"), pod("b")]
    for chosen in pods:
        scorer.on_routed(ctx_for(request(prompt=shared)), chosen)
    scorer.on_pod_removed("a")
    assert scorer.score(ctx_for(request(prompt=shared)), pods) == [0.0, 1.0]
    scorer.on_pod_removed("b")
    assert scorer._routed.size("a") == scorer._routed.size("b") == 0
    assert not scorer._routed._pods_by_key


def test_approximate_prefix_blocks_follow_the_upstream_character_rule():
    """llm-d-router `approximateprefix` (hashing.go, types.go): a block of blockSizeTokens
    tokens is blockSizeTokens x averageCharactersPerToken (4) bytes of the prompt, default
    16 tokens; with autoTune the pods' own KV block size replaces it; the last partial
    block is hashed too; the score is the leading matched blocks over all blocks."""
    from smart_epp.scorers.prefix_cache_scorer import prompt_block_hashes

    req = request(prompt="x" * 150)
    assert len(prompt_block_hashes(req, 64, 256)) == 3  # 64 + 64 + a partial 22
    assert len(prompt_block_hashes(request(prompt="x" * 63), 64, 256)) == 0
    assert len(prompt_block_hashes(request(prompt="x" * 1000), 64, 4)) == 4  # truncated
    default = make("prefix-cache-scorer", autoTune=False)
    assert default.params.block_chars(None) == 64
    tuned = make("prefix-cache-scorer")
    assert tuned.params.block_chars(32) == 128  # a pool reporting 32-token blocks
    # Shared 128 characters, then different: with 64-character blocks 2 of 3 blocks match,
    # the partial third block differing.
    pods = [pod("a", block_size=16)]
    first = ctx_for(request(prompt="p" * 128 + "q" * 40))
    tuned.on_routed(first, pods[0])
    second = ctx_for(request(prompt="p" * 128 + "r" * 40))
    assert tuned.score(second, pods) == [pytest.approx(2 / 3)]


def test_approximate_prefix_token_ids_hash_as_four_characters_each():
    """Token ids stand for text at upstream's 4 characters a token: a 16-token block is
    exactly 16 tokens, so prompts sharing 32 of 48 tokens share exactly 2 of 3 blocks."""
    scorer = make("prefix-cache-scorer")  # 16-token blocks (the pods report 16)
    pods = [pod("a", block_size=16), pod("b", block_size=16)]
    base = list(range(1000, 1032))
    first = ctx_for(request(tokens=base + [7] * 16))
    scorer.on_routed(first, pods[0])
    assert scorer.score(ctx_for(request(tokens=base + [9] * 16)), pods) == [
        pytest.approx(2 / 3),
        0.0,
    ]
    # One token different inside the second block: only the first block matches.
    changed = base[:20] + [5] + base[21:] + [7] * 16
    assert scorer.score(ctx_for(request(tokens=changed)), pods) == [pytest.approx(1 / 3), 0.0]


def test_precise_prefix_scorer_is_min_max_normalised_over_holders():
    """llm-d's precise-prefix-cache-scorer (indexedScoresToNormalizedScoredPods): raw
    scores (matched blocks, tier-weighted) are min-max normalised over the pods with a
    match; equal holders all score 1; pods without a match score 0."""
    scorer = make("precise-prefix-cache-scorer")
    pods = [pod("gpu"), pod("cpu"), pod("small"), pod("none"), pod("absent")]
    sizes = {p.address: 16 for p in pods}
    ctx = ctx_for(
        request(tokens=list(range(64))),
        prefix_hits={
            "gpu": PrefixHit(blocks=3),  # raw 3
            "cpu": PrefixHit(blocks=4, medium="CPU"),  # raw 3.2
            "small": PrefixHit(blocks=1),  # raw 1
            "none": PrefixHit(blocks=0),
        },
        block_sizes=sizes,
    )
    scores = scorer.score(ctx, pods)
    assert scores == [pytest.approx(2 / 2.2), 1.0, 0.0, 0.0, 0.0]
    equal = ctx_for(
        request(tokens=list(range(64))),
        prefix_hits={"gpu": PrefixHit(blocks=2), "small": PrefixHit(blocks=2)},
        block_sizes=sizes,
    )
    assert scorer.score(equal, pods) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert scorer.score(ctx_for(), pods) == [0.0] * 5  # no lookup made


# ------------------------------------------------------------------ filters


def test_lora_affinity_filter_prefers_loaded_then_room_then_all():
    loaded = pod("loaded", adapters=("x",), max_loras=1)
    room = pod("room", max_loras=1)
    full = pod("full", adapters=("y",), max_loras=1)
    f = make("lora-affinity-filter")
    req = request(tokens=[1], adapter="x")
    assert addresses(f.filter(ctx_for(req), [loaded, room, full])) == ["loaded"]
    assert addresses(f.filter(ctx_for(req), [room, full])) == ["room"]
    assert addresses(f.filter(ctx_for(req), [full])) == ["full"]
    base = request(tokens=[1])
    assert addresses(f.filter(ctx_for(base), [loaded, room, full])) == ["loaded", "room", "full"]
    # threshold 0: always spread to pods with room.
    spread = make("lora-affinity-filter", threshold=0.0)
    assert addresses(spread.filter(ctx_for(req), [loaded, room, full])) == ["room"]


def test_saturation_filter_drops_saturated_unless_all_are():
    f = make("saturation-filter", queueDepthThreshold=5, kvCacheUtilThreshold=0.8)
    ok = pod("ok", waiting=5, kv=0.8)
    deep = pod("deep", waiting=6)
    full = pod("full", kv=0.81)
    burst = pod("burst", running=2, inflight=9)  # 7 sent beyond the running ones
    assert addresses(f.filter(ctx_for(), [ok, deep, full, burst])) == ["ok"]
    assert addresses(f.filter(ctx_for(), [deep, full])) == ["deep", "full"]
    strict = make("saturation-filter", keepAllWhenSaturated=False)
    assert strict.filter(ctx_for(), [deep, full]) == []


def test_queue_filters():
    pods = [pod("a", waiting=0, kv=0.9), pod("b", waiting=4, kv=0.1), pod("c", waiting=200)]
    assert addresses(make("low-queue-filter").filter(ctx_for(), pods)) == ["a", "b"]
    assert addresses(make("least-queue-filter").filter(ctx_for(), pods)) == ["a", "b"]
    assert addresses(make("least-kv-cache-filter").filter(ctx_for(), pods)) == ["b", "c"]


def test_label_filters():
    pods = [
        pod("a", labels={"zone": "x", "tier": "gold"}),
        pod("b", labels={"zone": "y"}),
        pod("c"),
    ]
    sel = make("label-selector-filter", matchLabels={"zone": "x"})
    assert addresses(sel.filter(ctx_for(), pods)) == ["a"]
    expr = make(
        "by-label-selector",
        matchExpressions=[
            {"key": "zone", "operator": "In", "values": ["x", "y"]},
            {"key": "tier", "operator": "DoesNotExist"},
        ],
    )
    assert addresses(expr.filter(ctx_for(), pods)) == ["b"]
    notin = make(
        "label-selector-filter",
        matchExpressions=[{"key": "zone", "operator": "NotIn", "values": ["x"]}],
    )
    assert addresses(notin.filter(ctx_for(), pods)) == ["b", "c"]
    by = make("by-label", label="zone", validValues=["y"], allowsNoLabel=True)
    assert addresses(by.filter(ctx_for(), pods)) == ["b", "c"]


def test_role_filters():
    pods = [
        pod("p", labels={"llm-d.ai/role": "prefill"}),
        pod("d", labels={"llm-d.ai/role": "decode"}),
        pod("both", labels={"llm-d.ai/role": "both"}),
        pod("none"),
    ]
    assert addresses(make("decode-filter").filter(ctx_for(), pods)) == ["d", "both", "none"]
    assert addresses(make("prefill-filter").filter(ctx_for(), pods)) == ["p"]
    role = make("role-filter", role="prefill", unlabeledIsBoth=False)
    assert addresses(role.filter(ctx_for(), pods)) == ["p", "both"]


# ------------------------------------------------------------------ pickers


def test_max_score_picker_picks_best_and_breaks_ties_at_random():
    pods = [pod("a"), pod("b"), pod("c")]
    picker = make("max-score-picker")
    assert addresses(picker.pick(ctx_for(), pods, [0.1, 0.9, 0.5])) == ["b"]
    wins = Counter(
        picker.pick(ctx_for(seed=s), pods, [1.0, 1.0, 0.2])[0].address for s in range(400)
    )
    assert set(wins) == {"a", "b"} and min(wins.values()) > 120
    top2 = make("max-score-picker", maxNumOfEndpoints=2)
    assert addresses(top2.pick(ctx_for(), pods, [0.1, 0.9, 0.5])) == ["b", "c"]


def test_random_picker_ignores_scores():
    pods = [pod("a"), pod("b")]
    picker = make("random-picker")
    wins = Counter(picker.pick(ctx_for(seed=s), pods, [1.0, 0.0])[0].address for s in range(400))
    assert min(wins.values()) > 120


def test_round_robin_picker_takes_pods_in_turn_by_address_ignoring_scores():
    picker = make("round-robin-picker")
    a, b, c = pod("10.0.0.1:8000"), pod("10.0.0.2:8000"), pod("10.0.0.3:8000")
    # The candidates' order changes from call to call; the rotation follows the addresses.
    orders = [[c, a, b], [b, c, a], [a, b, c], [c, b, a]]
    picks = [picker.pick(ctx_for(), order, [0.0, 1.0, 0.5])[0] for order in orders]
    assert addresses(picks) == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.1:8000"]
    assert picker.pick(ctx_for(), [], []) == []
    fallbacks = make("round-robin-picker", maxNumOfEndpoints=3)
    assert addresses(fallbacks.pick(ctx_for(), [a, b, c], [1.0, 1.0, 1.0])) == [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
        "10.0.0.3:8000",
    ]
    assert addresses(fallbacks.pick(ctx_for(), [a, b, c], [1.0, 1.0, 1.0])) == [
        "10.0.0.2:8000",
        "10.0.0.3:8000",
        "10.0.0.1:8000",
    ]


def test_weighted_random_picker_follows_scores():
    pods = [pod("a"), pod("b"), pod("zero")]
    picker = make("weighted-random-picker")
    wins = Counter(
        picker.pick(ctx_for(seed=s), pods, [3.0, 1.0, 0.0])[0].address for s in range(2000)
    )
    assert wins["zero"] == 0
    assert wins["a"] / 2000 == pytest.approx(0.75, abs=0.05)
    all_zero = Counter(
        picker.pick(ctx_for(seed=s), pods, [0.0, 0.0, 0.0])[0].address for s in range(300)
    )
    assert len(all_zero) == 3

"""Tokenization agrees with vLLM token for token (recorded ids), locally and via /tokenize."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from sched_helpers import pod, request
from support.hf_cache import hub_snapshot
from support.http_server import LocalHTTPServer
from support.paths import TINY_MODEL, VLLM_FIXTURES
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from smart_epp.epp.tokenization import (
    CHUNK_CHARS,
    OFFLOAD_BODY_BYTES,
    LocalTokenizer,
    PodTokenizer,
    TokenizerRouter,
    decode_tokenize_answer,
)
from smart_epp.epp.tokenizer_discovery import TokenizerDiscovery, find_model_dir, hub_cache_dir
from smart_epp.framework.types import LLMRequest


def recorded_requests() -> list[dict]:
    rows = []
    for path in sorted(VLLM_FIXTURES.glob("*/requests.jsonl")):
        rows.extend(json.loads(line) for line in path.open())
    return rows


def as_request(row: dict) -> LLMRequest:
    body = row["request"]
    return request(prompt=body.get("prompt"), messages=body.get("messages"), model=body["model"])


def cache_hits(path: str) -> float:
    return (
        REGISTRY.get_sample_value("smart_epp_tokenize_total", {"path": path, "result": "cache_hit"})
        or 0.0
    )


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer.from_model_dir(TINY_MODEL)


def test_local_tokenizer_matches_vllm_on_every_recorded_request(local):
    rows = recorded_requests()
    assert len(rows) == 32
    kinds = set()
    for row in rows:
        kinds.add("chat" if "messages" in row["request"] else "text")
        assert local.tokenize_sync(as_request(row)) == row["prompt_token_ids"], row["name"]
    assert kinds == {"chat", "text"}


def test_repeated_prompt_comes_from_the_cache(local):
    row = recorded_requests()[0]
    before = cache_hits("local")
    first = local.tokenize_sync(as_request(row))
    second = local.tokenize_sync(as_request(row))
    assert first == second == row["prompt_token_ids"]
    assert cache_hits("local") >= before + 1


def test_a_longer_conversation_only_tokenizes_its_new_turns(local):
    turns = [
        {"role": "system", "content": "You are terse. " * 40},
        {"role": "user", "content": "route the prompt to the pod with the cache " * 10},
        {"role": "assistant", "content": "prefix cache hit on pod three " * 10},
    ]
    local.tokenize_sync(request(messages=turns))
    segments_before = len(local._segments)
    longer = [*turns, {"role": "user", "content": "and the next question"}]
    ids = local.tokenize_sync(request(messages=longer))
    # The rendered chat is cut at special tokens; only the new turn's text pieces are new.
    assert len(local._segments) - segments_before <= 2
    full = local._tok.encode(local.render_chat(longer), add_special_tokens=False).ids
    assert ids == full


def test_chat_without_template_is_reported_not_raised(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((TINY_MODEL / "tokenizer.json").read_text())
    bare = LocalTokenizer.from_model_dir(folder)
    with pytest.raises(ValueError, match="chat template"):
        bare.tokenize_sync(request(messages=[{"role": "user", "content": "hi"}]))


class TokenizePod(LocalHTTPServer):
    """A real HTTP server answering POST /tokenize with vLLM's recorded answers."""

    def __init__(self, answers: dict[str, dict], status: int = 200) -> None:
        super().__init__()
        self.answers = answers
        self.status = status
        self.bodies: list[dict] = []

    async def _tokenize(self, req: web.Request) -> web.Response:
        body = await req.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response({"error": "boom"}, status=self.status)
        answer = self.answers.get(json.dumps(body, sort_keys=True))
        if answer is None:
            return web.json_response({"error": "unexpected body"}, status=400)
        return web.json_response(answer)

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self._tokenize)


@pytest.fixture
async def tokenize_pods():
    answers = {
        json.dumps(r["tokenize_request"], sort_keys=True): r["tokenize_response"]
        for r in recorded_requests()
    }
    broken = TokenizePod(answers, status=500)
    good = TokenizePod(answers)
    await broken.start()
    await good.start()
    yield broken, good
    await broken.stop()
    await good.stop()


async def test_pod_tokenizer_asks_like_vllm_expects_and_falls_over(tokenize_pods):
    broken, good = tokenize_pods
    pods = [pod(broken.address), pod(good.address)]
    tokenizer = PodTokenizer(timeout_s=2.0)
    try:
        rows = [r for r in recorded_requests() if r["name"] in ("chat_lora_b", "base", "chat_1")]
        assert len(rows) == 3
        for row in rows:
            assert await tokenizer.tokenize(as_request(row), pods) == row["prompt_token_ids"]
        # The body is what vLLM was asked when recording (messages + add_generation_prompt).
        assert all(r["tokenize_request"] in good.bodies for r in rows)
        assert broken.bodies  # the failing pod was tried and skipped
        asked = len(good.bodies) + len(broken.bodies)
        before = cache_hits("pod")
        assert await tokenizer.tokenize(as_request(rows[0]), pods) == rows[0]["prompt_token_ids"]
        assert len(good.bodies) + len(broken.bodies) == asked  # served from the LRU
        assert cache_hits("pod") == before + 1
        # Only the broken pod left: cached prompts still resolve, new ones give None.
        cached = await tokenizer.tokenize(as_request(rows[1]), [pods[0]])
        assert cached == rows[1]["prompt_token_ids"]
        fresh = request(prompt="never recorded")
        assert await tokenizer.tokenize(fresh, [pods[0]]) is None
    finally:
        await tokenizer.aclose()


async def test_a_failing_pod_is_backed_off_not_asked_on_every_request(tokenize_pods):
    broken, _ = tokenize_pods
    now = [100.0]
    tokenizer = PodTokenizer(timeout_s=2.0, clock=lambda: now[0])
    only_broken = [pod(broken.address)]
    try:
        for i in range(5):
            assert await tokenizer.tokenize(request(prompt=f"p{i}"), only_broken) is None
        assert len(broken.bodies) == 1  # the rest were answered without a call
        now[0] += 0.6  # past the first back-off (0.5 s): asked again, fails, backs off longer
        assert await tokenizer.tokenize(request(prompt="again"), only_broken) is None
        assert len(broken.bodies) == 2
        now[0] += 0.6  # still inside the doubled back-off
        assert await tokenizer.tokenize(request(prompt="once more"), only_broken) is None
        assert len(broken.bodies) == 2
    finally:
        await tokenizer.aclose()


async def test_router_uses_local_tokenizer_for_configured_models(local, tokenize_pods):
    _, good = tokenize_pods
    pods = [pod(good.address)]
    fallback = PodTokenizer()
    router = TokenizerRouter({"tiny": local}, fallback)
    try:
        rows = {r["name"]: r for r in recorded_requests()}
        assert (
            await router.tokenize(as_request(rows["base"]), pods)
            == rows["base"]["prompt_token_ids"]
        )
        assert good.bodies == []  # "tiny" was tokenized in-process
        lora = rows["lora_a_1"]
        assert await router.tokenize(as_request(lora), pods) == lora["prompt_token_ids"]
        assert len(good.bodies) == 1  # "lora-a" has no local tokenizer: asked the pod
        given = request(tokens=[1, 2, 3])
        assert await router.tokenize(given, pods) == [1, 2, 3]
        # Told the base model, an adapter request uses the base model's local tokenizer.
        based = TokenizerRouter({"tiny": local}, fallback, base_model="tiny")
        adapter_request = request(prompt=lora["request"]["prompt"], adapter="lora-a")
        assert await based.tokenize(adapter_request, pods) == lora["prompt_token_ids"]
        assert len(good.bodies) == 1
    finally:
        await router.aclose()


@pytest.mark.parametrize(
    "answer",
    [b'{"tokens": [1, true]}', b'{"tokens": "1 2"}', b'{"count": 2}', b"[1, 2]", b"<html>"],
)
def test_a_tokenize_answer_without_an_id_list_is_refused(answer: bytes) -> None:
    with pytest.raises(ValueError):  # msgspec.DecodeError is a ValueError
        decode_tokenize_answer(answer)


def test_a_tokenize_answer_gives_its_ids() -> None:
    answer = b'{"count": 3, "max_model_len": 2048, "tokens": [5, 0, 70000]}'
    assert decode_tokenize_answer(answer).tokens == [5, 0, 70000]


# ------------------------------------------------------------------ found on disk


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def tiny_rows() -> list[dict]:
    return [r for r in recorded_requests() if r["request"]["model"] == "tiny"]


def tokenizers_dir(tmp_path: Path) -> Path:
    """A folder laid out as `--tokenizers-dir` expects: <model name>/tokenizer.json."""
    root = tmp_path / "tokenizers"
    root.mkdir()
    (root / "tiny").symlink_to(TINY_MODEL, target_is_directory=True)
    return root


async def test_a_tokenizer_found_on_disk_is_used_once_it_agrees_with_the_pods(
    tmp_path, tokenize_pods
):
    _, good = tokenize_pods
    pods = [pod(good.address)]
    discovery = TokenizerDiscovery([tokenizers_dir(tmp_path)], hub_cache=False)
    router = TokenizerRouter({}, PodTokenizer(), discovery=discovery)
    rows = tiny_rows()
    assert len(rows) >= 8
    try:
        # Until the files are loaded and checked, every prompt goes to a pod.
        first = rows[0]
        assert await router.tokenize(as_request(first), pods) == first["prompt_token_ids"]
        await wait_until(lambda: discovery.state("tiny") != "searching")
        assert discovery.state("tiny") == "verifying"
        for row in rows[1:4]:
            assert await router.tokenize(as_request(row), pods) == row["prompt_token_ids"]
            await wait_until(lambda: not discovery._models["tiny"].checking)
        assert discovery.state("tiny") == "trusted"
        asked = len(good.bodies)
        for row in rows[4:]:
            assert await router.tokenize(as_request(row), pods) == row["prompt_token_ids"]
        assert len(good.bodies) == asked  # in-process from now on
    finally:
        await router.aclose()


async def test_a_tokenizer_that_disagrees_with_the_pods_is_never_used(tmp_path):
    rows = tiny_rows()
    # Pods serving another revision of the model: every id differs from the files'.
    answers = {
        json.dumps(r["tokenize_request"], sort_keys=True): {
            **r["tokenize_response"],
            "tokens": [t + 1 for t in r["tokenize_response"]["tokens"]],
        }
        for r in rows
    }
    other = TokenizePod(answers)
    await other.start()
    discovery = TokenizerDiscovery([tokenizers_dir(tmp_path)], hub_cache=False)
    router = TokenizerRouter({}, PodTokenizer(), discovery=discovery)
    pods = [pod(other.address)]
    try:
        await router.tokenize(as_request(rows[0]), pods)
        await wait_until(lambda: discovery.state("tiny") != "searching")
        shifted = [t + 1 for t in rows[1]["prompt_token_ids"]]
        assert await router.tokenize(as_request(rows[1]), pods) == shifted
        await wait_until(lambda: discovery.state("tiny") != "verifying")
        assert discovery.state("tiny") == "rejected"
        for row in rows[2:6]:
            got = await router.tokenize(as_request(row), pods)
            assert got == [t + 1 for t in row["prompt_token_ids"]]  # still the pods' ids
    finally:
        await router.aclose()
        await other.stop()


async def test_a_model_with_no_tokenizer_on_disk_stays_on_the_pods(tmp_path, tokenize_pods):
    _, good = tokenize_pods
    empty = tmp_path / "empty"
    empty.mkdir()
    discovery = TokenizerDiscovery([empty], hub_cache=False)
    router = TokenizerRouter({}, PodTokenizer(), discovery=discovery)
    rows = tiny_rows()
    try:
        await router.tokenize(as_request(rows[0]), [pod(good.address)])
        await wait_until(lambda: discovery.state("tiny") != "searching")
        assert discovery.state("tiny") == "not_found"
        assert (
            await router.tokenize(as_request(rows[1]), [pod(good.address)])
            == (rows[1]["prompt_token_ids"])
        )
        assert len(good.bodies) == 2
    finally:
        await router.aclose()


def test_the_hub_cache_is_searched_by_model_name(tmp_path):
    tokenizer_json = (TINY_MODEL / "tokenizer.json").read_text()
    snapshot = hub_snapshot(tmp_path / "hub", "org/tiny-chat", tokenizer_json)
    assert hub_cache_dir("org/tiny-chat", cache_dir=tmp_path / "hub") == snapshot
    assert hub_cache_dir("org/other", cache_dir=tmp_path / "hub") is None
    assert hub_cache_dir("not a repo id!", cache_dir=tmp_path / "hub") is None
    # A --tokenizers-dir is searched before the hub.
    root = tokenizers_dir(tmp_path)
    assert find_model_dir("tiny", [root], hub_cache=False) == root / "tiny"
    assert find_model_dir("org/tiny-chat", [root], hub_cache=False) is None


async def test_a_long_prompt_is_tokenized_off_the_event_loop(local):
    text = "the quick brown fox jumps over the lazy dog " * 600
    long = dataclasses.replace(request(prompt=text), body=json.dumps({"prompt": text}).encode())
    assert len(long.body) > OFFLOAD_BODY_BYTES
    order: list[str] = []

    async def tokenize_long() -> None:
        ids = await local.tokenize(long, [])
        assert ids == local._tok.encode(text, add_special_tokens=True).ids
        order.append("long prompt")

    async def other_request() -> None:
        await asyncio.sleep(0)
        order.append("other request")

    await asyncio.gather(tokenize_long(), other_request())
    # On the loop, the long prompt would have finished before anything else ran.
    assert order == ["other request", "long prompt"]


async def test_a_trusted_tokenizer_is_dropped_when_the_pods_change_revision(
    tmp_path, tokenize_pods
):
    _, good = tokenize_pods
    pods = [pod(good.address)]
    discovery = TokenizerDiscovery(
        [tokenizers_dir(tmp_path)], hub_cache=False, verify_requests=1, recheck_every=2
    )
    router = TokenizerRouter({}, PodTokenizer(), discovery=discovery)
    rows = tiny_rows()
    try:
        await router.tokenize(as_request(rows[0]), pods)
        await wait_until(lambda: discovery.state("tiny") != "searching")
        await router.tokenize(as_request(rows[1]), pods)
        await wait_until(lambda: discovery.state("tiny") == "trusted")
        # The pods roll to another revision: their ids no longer match the files'.
        for key, answer in list(good.answers.items()):
            good.answers[key] = {**answer, "tokens": [t + 1 for t in answer["tokens"]]}
        for row in rows[2:6]:
            await router.tokenize(as_request(row), pods)
            await wait_until(lambda: not discovery._models["tiny"].checking)
        assert discovery.state("tiny") == "rejected"
        fresh = rows[6]
        got = await router.tokenize(as_request(fresh), pods)
        assert got == [t + 1 for t in fresh["prompt_token_ids"]]
    finally:
        await router.aclose()


WORDS = st.sampled_from(
    ["route", "pod", "cache", "KV", "it's", "128", "x=1;", "--", "Ünï", "数字", "🙂", "a"]
)
SEPARATORS = st.sampled_from([" ", " ", " ", "  ", "\n", "\t", ", ", ". "])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(WORDS, SEPARATORS), min_size=200, max_size=1500))
def test_long_text_tokenized_in_chunks_matches_the_whole(local, parts):
    text = "".join(w + s for w, s in parts)
    whole = local._tok.encode(text, add_special_tokens=True).ids
    assert local.encode(text, add_special_tokens=True) == whole


def test_a_shared_long_prefix_is_tokenized_once(local):
    system = "You route prompts to the pod that holds their prefix. " * 400
    local.encode(system + "first question about caches", add_special_tokens=True)
    chunks_before = len(local._segments)
    second = system + "a second, different question"
    ids = local.encode(second, add_special_tokens=True)
    assert ids == local._tok.encode(second, add_special_tokens=True).ids
    # Only the chunk holding the new question was tokenized (and cached) again.
    assert len(local._segments) - chunks_before == 1
    assert len(system) > 10 * CHUNK_CHARS


def test_a_tokenizer_that_merges_across_spaces_is_not_chunked():
    # No pre-tokenizer: the whole text is one word, so chunks would tokenize differently.
    one_word = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    assert not LocalTokenizer(one_word, None)._chunked
    split = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    split.pre_tokenizer = WhitespaceSplit()
    assert LocalTokenizer(split, None)._chunked


def test_a_model_name_never_leads_out_of_the_tokenizers_dirs(tmp_path):
    root = tokenizers_dir(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "tokenizer.json").write_text("{}")
    assert find_model_dir("../elsewhere", [root], hub_cache=False) is None
    assert find_model_dir(str(outside), [root], hub_cache=False) is None

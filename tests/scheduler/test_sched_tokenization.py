"""Tokenization agrees with vLLM token for token (recorded ids), locally and via /tokenize."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from prometheus_client import REGISTRY
from sched_helpers import LocalHTTPServer, pod, request
from support.paths import TINY_MODEL, VLLM_FIXTURES

from smart_epp.epp.tokenization import (
    LocalTokenizer,
    PodTokenizer,
    TokenizerRouter,
    decode_tokenize_answer,
)
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

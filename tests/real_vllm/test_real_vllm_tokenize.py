"""smart-epp's local tokenization equals what the real vLLM pod tokenizes."""

from __future__ import annotations

import pytest
from support.paths import TINY_MODEL
from vllm_pods import SERVED_MODEL, VllmPod, unique_prompt

from smart_epp.epp.tokenization import LocalTokenizer
from smart_epp.framework.types import Api, LLMRequest

pytestmark = pytest.mark.real_vllm

CHATS = {
    "system_and_user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Explain the prefix cache in one line."},
    ],
    "multi_turn": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Route this   request\twith  odd   spacing.\n\nTwo lines."},
    ],
    "unicode": [{"role": "user", "content": "naïve café — 東京 🚀 <|not special|>"}],
    "empty_content": [{"role": "user", "content": ""}],
    "long": [{"role": "user", "content": unique_prompt("chat", words=300)}],
}


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer.from_model_dir(TINY_MODEL)


def request(**fields: object) -> LLMRequest:
    api = Api.CHAT if "messages" in fields else Api.COMPLETIONS
    return LLMRequest(request_id="t", path="/v1/x", api=api, model=SERVED_MODEL, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(CHATS))
def test_chat_tokens_equal_vllm_tokenize(pod_a: VllmPod, local: LocalTokenizer, name: str) -> None:
    messages = CHATS[name]
    vllm = pod_a.post_json(
        "/tokenize", {"model": SERVED_MODEL, "messages": messages, "add_generation_prompt": True}
    )
    assert local.tokenize_sync(request(messages=messages)) == vllm["tokens"]


PROMPTS = ["x", "  leading spaces", unique_prompt("plain", words=200)]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_tokens_equal_vllm_tokenize(
    pod_a: VllmPod, local: LocalTokenizer, prompt: str
) -> None:
    vllm = pod_a.post_json("/tokenize", {"model": SERVED_MODEL, "prompt": prompt})
    assert local.tokenize_sync(request(prompt=prompt)) == vllm["tokens"]

"""smart-epp's local tokenization equals what the real vLLM pod tokenizes."""

from __future__ import annotations

import json

import pytest
from support.paths import TINY_MODEL, TOOLS_TEMPLATE
from vllm_pods import SERVED_MODEL, VllmPod, unique_prompt

from smart_epp.epp.request_parser import parse_request
from smart_epp.epp.tokenization import LocalTokenizer, PodTokenizer
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
    return LocalTokenizer.from_model_dir(TINY_MODEL, chat_template_file=TOOLS_TEMPLATE)


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


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
AGENT_TURN = [
    {"role": "system", "content": "You call tools when useful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
]  # fmt: skip
TEMPLATE_CASES = {
    "tools": {
        "messages": AGENT_TURN,
        "tools": [WEATHER_TOOL, {"type": "function", "function": {"name": "no_description"}}],
    },
    "documents": {"messages": AGENT_TURN[:2], "documents": [{"title": "a", "text": "b"}]},
    "continue_final_message": {
        "messages": [*AGENT_TURN[:2], {"role": "assistant", "content": "It is  "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "no_generation_prompt": {"messages": AGENT_TURN[:2], "add_generation_prompt": False},
    "template_kwargs": {
        "messages": AGENT_TURN[:2],
        "tools": [WEATHER_TOOL],
        "chat_template_kwargs": {"enable_thinking": False},
    },
}


@pytest.mark.parametrize("name", sorted(TEMPLATE_CASES))
def test_tool_chats_tokenize_like_the_engine_locally_and_through_tokenize(
    pod_a: VllmPod, local: LocalTokenizer, name: str
) -> None:
    """The engine's own prompt ids (returned by a chat completion) are the reference:
    the local tokenizer and the pod's /tokenize, as the gateway asks it, both match."""
    case = TEMPLATE_CASES[name]
    body = {"model": SERVED_MODEL, "max_tokens": 1, "return_token_ids": True, **case}
    if "tools" in case:  # the pods run no tool-call parser; the tools still reach the template
        body["tool_choice"] = "none"
    engine = pod_a.post_json("/v1/chat/completions", body)["prompt_token_ids"]
    req = parse_request("/v1/chat/completions", {}, json.dumps(body).encode(), "t")
    assert req.chat_template_args  # the template fields were kept
    assert local.tokenize_sync(req) == engine
    remote = pod_a.post_json("/tokenize", PodTokenizer.tokenize_body(req))
    assert remote["tokens"] == engine
    if "tools" in case:  # dropping the template fields would have tokenized differently
        bare = LLMRequest("t", "/v1/x", Api.CHAT, SERVED_MODEL, messages=case["messages"])
        assert local.tokenize_sync(bare) != engine

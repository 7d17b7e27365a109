"""Chat fields that reach the chat template (tools, documents, chat_template_kwargs,
add_generation_prompt, continue_final_message) are parsed, kept in the tokenizer cache
key, rendered locally as vLLM renders them, and sent to /tokenize."""

from __future__ import annotations

import json

import pytest
from support.paths import TINY_MODEL, TOOLS_TEMPLATE

from smart_epp.epp.errors import RequestError
from smart_epp.epp.request_parser import parse_request
from smart_epp.epp.tokenization import LocalTokenizer, PodTokenizer, request_cache_key

TOOL = {"type": "function", "function": {"name": "lookup", "extra": "dropped by vLLM"}}
MESSAGES = [
    {"role": "user", "content": [{"type": "text", "text": "find"}, {"type": "text", "text": "x"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}]},
    {"role": "tool", "tool_call_id": "1", "content": "42"},
]  # fmt: skip


def chat(**fields: object):
    body = {"model": "tiny", "messages": MESSAGES, **fields}
    return parse_request("/v1/chat/completions", {}, json.dumps(body).encode(), "r")


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer.from_model_dir(TINY_MODEL, chat_template_file=TOOLS_TEMPLATE)


def test_template_fields_are_kept_and_change_the_cache_key():
    plain = chat()
    assert plain.chat_template_args is None
    tooled = chat(tools=[TOOL], chat_template_kwargs={"enable_thinking": False})
    assert tooled.chat_template_args == {
        "tools": [TOOL],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert request_cache_key(plain) != request_cache_key(tooled)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": "lookup"}, "tools"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"documents": ["text"]}, "documents"),
    ],
)
def test_bad_template_fields_are_400s_naming_the_field(fields: dict, param: str):
    with pytest.raises(RequestError) as info:
        chat(**fields)
    assert info.value.status == 400
    assert json.loads(info.value.body())["error"]["param"] == param


def test_local_rendering_follows_vllm(local: LocalTokenizer):
    text = local.render_chat(MESSAGES, template_args={"tools": [TOOL]})
    # vLLM's tool model: unknown keys dropped, missing description/parameters as null.
    tool_json = (
        '{"type": "function", "function": '
        '{"name": "lookup", "description": null, "parameters": null}}'
    )
    assert tool_json in text
    assert "find\nx" in text  # text parts joined with newlines
    assert '"arguments": {"q": 1}' in text  # JSON-string arguments parsed into an object
    assert text.endswith("<|im_start|>assistant\n")
    cont = [*MESSAGES[:1], {"role": "assistant", "content": "It is  "}]
    text = local.render_chat(
        cont, template_args={"add_generation_prompt": False, "continue_final_message": True}
    )
    # Cut right after the final message (its trailing spaces kept, as the template kept
    # them): the model continues it.
    assert text.endswith("<|im_start|>assistant\nIt is  ")
    docs = local.render_chat(MESSAGES[:1], template_args={"documents": [{"title": "t"}]})
    assert '# Documents\n{"title": "t"}' in docs


def test_tokenize_body_carries_the_template_fields():
    req = chat(
        tools=[TOOL],
        documents=[{"title": "t"}],
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False},
        reasoning_effort="low",
    )
    body = PodTokenizer.tokenize_body(req)
    assert body is not None
    assert body["tools"] == [TOOL]
    assert body["add_generation_prompt"] is False and body["continue_final_message"] is True
    # /tokenize has no documents field: they travel in chat_template_kwargs, as vLLM's
    # chat endpoint passes them to the template.
    assert body["chat_template_kwargs"] == {
        "enable_thinking": False,
        "documents": [{"title": "t"}],
        "reasoning_effort": "low",
    }
    assert PodTokenizer.tokenize_body(chat())["add_generation_prompt"] is True

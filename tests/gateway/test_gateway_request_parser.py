"""OpenAI bodies -> LLMRequest, and the 400s an OpenAI server would give."""

from __future__ import annotations

import json

import pytest

from smart_epp.epp.errors import RequestError
from smart_epp.epp.request_limits import RequestLimits
from smart_epp.epp.request_parser import parse_request
from smart_epp.framework.types import Api


def parse(path: str, document: object, **kwargs: object) -> object:
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    return parse_request(path, {"x-session-id": "s1"}, body, "rid", **kwargs)  # type: ignore[arg-type]


def test_completions_string_prompt() -> None:
    r = parse("/v1/completions", {"model": "tiny", "prompt": "abcdefgh", "max_tokens": 7})
    assert (r.api, r.model, r.prompt, r.max_tokens, r.stream) == (
        Api.COMPLETIONS, "tiny", "abcdefgh", 7, False
    )  # fmt: skip
    assert r.session_id == "s1" and r.request_id == "rid"
    assert r.estimated_prompt_tokens() == 2


def test_completions_list_of_strings_and_token_ids() -> None:
    assert parse("/v1/completions", {"model": "m", "prompt": ["ab", "cd"]}).prompt == "abcd"
    r = parse("/v1/completions", {"model": "m", "prompt": [1, 2, 3]})
    assert r.prompt_token_ids == [1, 2, 3] and r.estimated_prompt_tokens() == 3
    r = parse("/v1/completions", {"model": "m", "prompt": [[1, 2], [3]]})
    assert r.prompt_token_ids == [1, 2, 3]


def test_chat_with_string_and_content_parts() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}],
        },
    ]
    r = parse("/v1/chat/completions", {"model": "m", "messages": messages, "stream": True})
    assert r.api is Api.CHAT and r.stream and r.messages == messages
    assert r.text_for_hashing() == "<system>be brief<user>hi!"


def test_embeddings_and_responses() -> None:
    assert parse("/v1/embeddings", {"model": "e", "input": "text"}).prompt == "text"
    r = parse("/v1/responses", {"model": "m", "input": "q", "instructions": "sys "})
    assert r.api is Api.RESPONSES and r.prompt == "sys q"
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}]
    r = parse("/v1/responses", {"model": "m", "input": items, "max_output_tokens": 5})
    assert r.messages == items and r.max_tokens == 5


def test_adapter_resolution_and_cache_salt() -> None:
    adapters = {"lora-a": "lora-a"}
    r = parse(
        "/v1/completions",
        {"model": "lora-a", "prompt": "x", "cache_salt": "salt"},
        adapter_resolver=adapters.get,
    )
    assert r.adapter == "lora-a" and r.cache_salt == "salt"
    assert parse("/v1/completions", {"model": "tiny", "prompt": "x"}).adapter is None


def test_body_is_kept_without_copying() -> None:
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    assert parse_request("/v1/completions", {}, body, "r").body is body


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"", None),
        ("/v1/completions", b'"a string"', None),
        ("/v1/completions", {"prompt": "x"}, "model"),
        ("/v1/completions", {"model": "", "prompt": "x"}, "model"),
        ("/v1/completions", {"model": ["m"], "prompt": "x"}, "model"),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": []}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stream": 1}, "stream"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": "9"}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "cache_salt": 3}, "cache_salt"),
        ("/v1/chat/completions", {"model": "m"}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"content": "x"}]}, "messages[0]"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": 5}]},
            "messages[0]",
        ),
        ("/v1/embeddings", {"model": "m", "input": {"a": 1}}, "input"),
        ("/v1/responses", {"model": "m"}, "input"),
        ("/v1/responses", {"model": "m", "input": ["x"]}, "input[0]"),
    ],
)
def test_invalid_bodies_are_400(path: str, body: object, param: str | None) -> None:
    with pytest.raises(RequestError) as caught:
        parse(path, body)
    error = caught.value
    assert error.status == 400 and error.param == param
    shaped = json.loads(error.body())["error"]
    assert set(shaped) >= {"message", "type", "code"} and shaped["code"] == 400


def test_other_paths_are_lenient() -> None:
    r = parse_request("/v1/models", {}, b"", "r")
    assert r.api is Api.OTHER and r.model == ""
    r = parse("/tokenize", {"prompt": "x"})
    assert r.api is Api.OTHER and r.model == ""
    assert parse("/v1/completions?x=1", {"model": "m", "prompt": "p"}).api is Api.COMPLETIONS


# ----------------------------------------------------------------- hostile input


def deep(depth: int, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    return b'{"model": "m", "prompt": ' + opener * depth + b"1" + closer * depth + b"}"


@pytest.mark.parametrize("depth", [64, 65, 1_000, 100_000])
def test_nesting_beyond_the_limit_is_400(depth: int) -> None:
    # The document itself is level 1, the prompt list level 2: 63 brackets fit, 64 do not.
    with pytest.raises(RequestError) as caught:
        parse_request("/v1/completions", {}, deep(depth), "r")
    assert caught.value.status == 400 and "nested" in caught.value.message
    objects = deep(depth, b'{"a":', b"}")
    with pytest.raises(RequestError):
        parse_request("/v1/completions", {}, objects, "r")


def test_nesting_within_the_limit_is_parsed() -> None:
    with pytest.raises(RequestError) as caught:  # parsed, then refused for its prompt type
        parse_request("/v1/completions", {}, deep(63), "r")
    assert caught.value.param == "prompt"
    limits = RequestLimits(max_depth=3)
    assert parse_request("/v1/completions", {}, deep(1), "r", limits=limits).prompt_token_ids == [1]
    with pytest.raises(RequestError) as caught:
        parse_request("/v1/completions", {}, deep(3), "r", limits=limits)
    assert "nested" in caught.value.message


def test_element_count_limit() -> None:
    limits = RequestLimits(max_elements=100)
    body = json.dumps({"model": "m", "prompt": list(range(98))}).encode()
    assert (
        len(parse_request("/v1/completions", {}, body, "r", limits=limits).prompt_token_ids or [])
        == 98
    )
    body = json.dumps({"model": "m", "prompt": list(range(99))}).encode()
    with pytest.raises(RequestError) as caught:
        parse_request("/v1/completions", {}, body, "r", limits=limits)
    assert caught.value.status == 400 and "JSON values" in caught.value.message


@pytest.mark.parametrize("ids", [[-1], [2**32], [1, 2**40], [[1], [2**64]]])
def test_out_of_range_token_ids_are_400(ids: list[object]) -> None:
    with pytest.raises(RequestError) as caught:
        parse("/v1/completions", {"model": "m", "prompt": ids})
    assert caught.value.status == 400 and caught.value.param == "prompt"
    assert parse("/v1/completions", {"model": "m", "prompt": [0, 2**32 - 1]}).prompt_token_ids


@pytest.mark.parametrize(
    "path", ["/reset_prefix_cache", "/metrics", "/health", "/sleep", "/v1/load_lora_adapter", "/"]
)
def test_paths_outside_the_allow_list_are_404(path: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_request(path, {}, b"", "r")
    error = caught.value
    assert error.status == 404
    assert json.loads(error.body())["error"]["type"] == "not_found_error"


def test_allow_list_is_configurable() -> None:
    limits = RequestLimits.with_paths(["/v1/completions/", "/generate"])
    assert parse_request("/generate?x=1", {}, b"{}", "r", limits=limits).api is Api.OTHER
    with pytest.raises(RequestError):
        parse_request("/v1/chat/completions", {}, b"{}", "r", limits=limits)
    anything = RequestLimits(allowed_paths=None)
    assert parse_request("/metrics", {}, b"", "r", limits=anything).api is Api.OTHER

"""OpenAI request bodies -> LLMRequest. Pure: no I/O, no clocks.

Validates only what routing depends on (the `model`, the prompt fields and their types,
`stream`); anything else is the model server's business and passes through untouched.
What any request must satisfy first (an inference path, a bounded JSON shape, token ids in
range) is in `request_limits`; every failure is a RequestError (4xx), never another error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from ..framework.types import Api, LLMRequest
from .chat_render import TEMPLATE_FIELDS
from .errors import RequestError
from .request_limits import RequestLimits, check_token_ids, normalize_path

# Maps a `model` value to the LoRA adapter it names, or None for a base model.
AdapterResolver = Callable[[str], str | None]


def no_adapters(model: str) -> str | None:
    return None


_API_BY_PATH = {
    "/v1/completions": Api.COMPLETIONS,
    "/v1/chat/completions": Api.CHAT,
    "/v1/embeddings": Api.EMBEDDINGS,
    "/v1/responses": Api.RESPONSES,
}

_json_decoder = msgspec.json.Decoder()
DEFAULT_LIMITS = RequestLimits()


def api_of(path: str) -> Api:
    return _API_BY_PATH.get(normalize_path(path), Api.OTHER)


def parse_request(
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    request_id: str,
    adapter_resolver: AdapterResolver = no_adapters,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> LLMRequest:
    """Parses one request; raises RequestError (400) for bodies an OpenAI server rejects
    and (404) for paths outside `limits.allowed_paths`."""
    limits.check_path(path)
    api = api_of(path)
    header_map = headers if isinstance(headers, dict) else dict(headers)
    session_id = header_map.get("x-session-id")
    if not body:
        if api is not Api.OTHER:
            raise RequestError.bad_request("request body is empty; expected a JSON object")
        return LLMRequest(request_id, path, api, "", headers=header_map, session_id=session_id)
    try:
        document = _json_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise RequestError.bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        # msgspec recurses once per level: far deeper than the limit, so refused the same way.
        raise limits.too_deep() from None
    if not isinstance(document, dict):
        raise RequestError.bad_request("request body must be a JSON object")
    limits.check_shape(document)

    model = document.get("model")
    if model is None:
        if api is not Api.OTHER:
            raise RequestError.bad_request("you must provide a model parameter", "model")
        model = ""
    elif not isinstance(model, str) or (not model and api is not Api.OTHER):
        raise RequestError.bad_request("'model' must be a non-empty string", "model")

    stream = document.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError.bad_request("'stream' must be a boolean", "stream")

    request = LLMRequest(
        request_id=request_id,
        path=path,
        api=api,
        model=model,
        stream=stream,
        adapter=adapter_resolver(model) if model else None,
        cache_salt=_optional_str(document, "cache_salt"),
        max_tokens=_max_tokens(document),
        session_id=session_id,
        headers=header_map,
        body=body,
    )
    if api is Api.COMPLETIONS:
        _read_prompt(request, document, "prompt", required=True)
    elif api is Api.EMBEDDINGS:
        _read_prompt(request, document, "input", required=True)
    elif api is Api.CHAT:
        request.messages = _chat_messages(document)
        request.chat_template_args = _chat_template_args(document)
    elif api is Api.RESPONSES:
        _read_responses_input(request, document)
    return request


def _optional_str(document: dict[str, Any], key: str) -> str | None:
    value = document.get(key)
    if value is not None and not isinstance(value, str):
        raise RequestError.bad_request(f"'{key}' must be a string", key)
    return value


def _max_tokens(document: dict[str, Any]) -> int | None:
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = document.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RequestError.bad_request(f"'{key}' must be a non-negative integer", key)
        return value
    return None


def _is_token_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _read_prompt(request: LLMRequest, document: dict[str, Any], key: str, required: bool) -> None:
    """Completions `prompt` / embeddings `input`: a string, strings, token ids, or lists of ids.

    A batch becomes one text (or one id sequence) in order: the scheduler routes the whole
    request to one pod, whose cache then holds all of it.
    """
    value = document.get(key)
    if value is None:
        if required:
            raise RequestError.bad_request(f"you must provide a '{key}' parameter", key)
        return
    if isinstance(value, str):
        request.prompt = value
        return
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            request.prompt = "".join(value)
            return
        if _is_token_ids(value):
            check_token_ids(value, key)
            request.prompt_token_ids = value
            return
        if all(isinstance(v, list) and _is_token_ids(v) for v in value):
            request.prompt_token_ids = [t for ids in value for t in ids]
            check_token_ids(request.prompt_token_ids, key)
            return
    raise RequestError.bad_request(
        f"'{key}' must be a string, a list of strings, a list of token ids, "
        "or a list of token id lists",
        key,
    )


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return
    raise RequestError.bad_request(
        f"'{where}.content' must be a string or a list of content parts", where
    )


def _chat_messages(document: dict[str, Any]) -> list[dict[str, Any]]:
    messages = document.get("messages")
    if messages is None:
        raise RequestError.bad_request("you must provide a 'messages' parameter", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError.bad_request("'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError.bad_request(f"'{where}' must be an object", where)
        if not isinstance(message.get("role"), str):
            raise RequestError.bad_request(f"'{where}.role' must be a string", where)
        _check_content(message.get("content"), where)
    return messages


def _chat_template_args(document: dict[str, Any]) -> dict[str, Any] | None:
    """The chat fields vLLM passes to the chat template, checked as vLLM checks them."""
    args = {key: document[key] for key in TEMPLATE_FIELDS if document.get(key) is not None}
    if not args:
        return None
    for key in ("add_generation_prompt", "continue_final_message"):
        if key in args and not isinstance(args[key], bool):
            raise RequestError.bad_request(f"'{key}' must be a boolean", key)
    if args.get("add_generation_prompt") and args.get("continue_final_message"):
        raise RequestError.bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    kwargs = args.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError.bad_request(
            "'chat_template_kwargs' must be an object", "chat_template_kwargs"
        )
    tools = args.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError.bad_request("'tools' must be a list", "tools")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError.bad_request(
                    f"'tools[{i}]' must be an object with a 'function' that has a 'name'",
                    f"tools[{i}]",
                )
    documents = args.get("documents")
    if documents is not None and (
        not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents)
    ):
        raise RequestError.bad_request("'documents' must be a list of objects", "documents")
    return args


def _read_responses_input(request: LLMRequest, document: dict[str, Any]) -> None:
    """Responses API: `input` is a string or a list of input items (messages)."""
    instructions = _optional_str(document, "instructions")
    value = document.get("input")
    if value is None:
        raise RequestError.bad_request("you must provide an 'input' parameter", "input")
    if isinstance(value, str):
        request.prompt = (instructions or "") + value
        return
    if not isinstance(value, list):
        raise RequestError.bad_request("'input' must be a string or a list of items", "input")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError.bad_request(f"'{where}' must be an object", where)
        _check_content(item.get("content"), where)
        messages.append(item)
    request.messages = messages

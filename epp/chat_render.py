"""What vLLM hands its chat template, reproduced so a prompt tokenizes as the engine does.

vLLM (0.32) does not render the client's messages as sent. It normalizes the conversation
(text parts joined with newlines, a missing content as "", tool-call arguments parsed from
JSON strings into objects), serializes tool definitions through its own models (null
`description`/`parameters` kept, unknown keys dropped), and passes `documents`,
`add_generation_prompt`, `continue_final_message`, `reasoning_effort` and the request's
`chat_template_kwargs` to the template, then trims the rendered text after the final
message when `continue_final_message` is set, as Hugging Face's `apply_chat_template`
does. A gateway that skipped any of this would predict the wrong prefix for every
tool-using (agentic) chat.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

# A template that loops over a message's content parts takes them as a list ("openai");
# any other gets them joined into one string (vLLM's automatic detection).
_LOOPS_OVER_CONTENT = re.compile(
    r"\{%-?\s*for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)"
)


def content_format(template: str | None) -> ContentFormat:
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


# Chat request fields that reach the chat template.
TEMPLATE_FIELDS = (
    "tools",
    "documents",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "reasoning_effort",
)


def template_kwargs(args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments vLLM renders the template with (besides messages and tools):
    the request's `chat_template_kwargs`, overridden by the request fields that are set."""
    args = args or {}
    user = dict(args.get("chat_template_kwargs") or {})
    effort = args.get("reasoning_effort")
    extra: dict[str, Any] = {
        "add_generation_prompt": args.get("add_generation_prompt", True),
        "continue_final_message": args.get("continue_final_message", False),
        "documents": args.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    # vLLM's merge_kwargs: request fields left unset (None, "auto") do not override.
    return user | {k: v for k, v in extra.items() if v is not None and v != "auto"}


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool definitions as vLLM's ChatCompletionToolsParam.model_dump() gives them."""
    if tools is None:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function") or {}
        fn: dict[str, Any] = {
            "name": function.get("name"),
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        for optional in ("strict", "defer_loading"):
            if function.get(optional) is not None:
                fn[optional] = function[optional]
        if tool.get("defer_loading") is not None and "defer_loading" not in fn:
            fn["defer_loading"] = tool["defer_loading"]
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": fn}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


def _text_of(content: Any, fmt: ContentFormat) -> Any:
    if content is None:
        return "" if fmt == "string" else []
    if isinstance(content, str):
        return content if fmt == "string" else [{"type": "text", "text": content}]
    if isinstance(content, list) and fmt == "string":
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and "text" in p]
        if len(texts) == len(content):
            return "\n".join(texts)
    return content  # structured parts the template handles itself


def _arguments(value: Any) -> Any:
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], fmt: ContentFormat = "string"
) -> list[dict[str, Any]]:
    """The conversation as vLLM's chat parser hands it to the template."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        entry: dict[str, Any] = {"role": role, "content": _text_of(message.get("content"), fmt)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                entry["tool_calls"] = [
                    {
                        **call,
                        "function": {
                            **(call.get("function") or {}),
                            "arguments": _arguments((call.get("function") or {}).get("arguments")),
                        },
                    }
                    for call in calls
                ]
            reasoning = message.get("reasoning")
            if reasoning is not None:
                entry["reasoning"] = reasoning
                entry["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                entry["tool_call_id"] = message["tool_call_id"]
            entry["content"] = _text_of(message.get("content"), "string")
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        out.append(entry)
    return out


def trim_to_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """`continue_final_message`: cut the rendered chat right after the last message's
    text, so the model continues it (Hugging Face's rule)."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):
        texts = [p["text"] for p in final if isinstance(p, dict) and "text" in p]
        if not texts:
            raise ValueError("continue_final_message: the final message has no text")
        final = texts[-1]
    if not isinstance(final, str) or final.strip() not in rendered:
        raise ValueError("continue_final_message: the final message is not in the rendered chat")
    at = rendered.rindex(final.strip())
    if rendered[at : at + len(final.lstrip())] == final:
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]


__all__ = [
    "TEMPLATE_FIELDS",
    "content_format",
    "normalize_messages",
    "normalize_tools",
    "template_kwargs",
    "trim_to_final_message",
]

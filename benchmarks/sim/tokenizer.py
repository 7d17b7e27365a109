"""Prompt tokenization for the simulator: a built-in deterministic tokenizer, or a Hugging
Face tokenizer directory (``tokenizer.json`` + chat template) rendered the way vLLM does.

Completions prompts get the tokenizer's special tokens (BOS); chat prompts are rendered by
the chat template with ``add_generation_prompt=True`` and encoded without special tokens,
which is what vLLM 0.32 feeds its engine and what ``/tokenize`` returns.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2.sandbox

Message = dict[str, Any]


class PromptTokenizer(Protocol):
    vocab_size: int

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Message]) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content`` (a string or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type", "text") != "text":
                raise ValueError("only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ValueError("message content must be a string or a list of text parts")


_WORD = re.compile(r"\s*\S+")
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "be", "do", "fu", "ga")


class BuiltinTokenizer:
    """Deterministic, dependency-free tokenizer: one token per whitespace-led word.

    A word's id is a CRC32 of its bytes folded into the vocabulary, so equal text always
    gives equal ids (prefix caching behaves as with a real tokenizer) at roughly the token
    counts of an English BPE vocabulary. Decoding yields a stable pseudo-word per id.
    """

    BOS = 1
    EOS = 2
    _SPECIAL = 16  # ids below this are reserved for control tokens
    _ROLE_IDS = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
    _END_OF_TURN = 7

    def __init__(self, vocab_size: int = 32000):
        if vocab_size <= self._SPECIAL:
            raise ValueError("vocab_size too small")
        self.vocab_size = vocab_size
        self._span = vocab_size - self._SPECIAL

    def _words(self, text: str) -> list[int]:
        span, base = self._span, self._SPECIAL
        return [base + zlib.crc32(w.encode()) % span for w in _WORD.findall(text)]

    def encode_prompt(self, text: str) -> list[int]:
        return [self.BOS, *self._words(text)]

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids.append(self._ROLE_IDS.get(str(m.get("role", "user")), self._ROLE_IDS["user"]))
            ids.extend(self._words(message_text(m.get("content"))))
            ids.append(self._END_OF_TURN)
        ids.append(self._ROLE_IDS["assistant"])
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        out = []
        for t in token_ids:
            if t < self._SPECIAL:
                continue
            a, b = divmod(t, len(_SYLLABLES))
            out.append(" " + _SYLLABLES[b] + _SYLLABLES[a % len(_SYLLABLES)])
        return "".join(out)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer with its chat template (no transformers)."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        d = Path(directory)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found")
        self._tok = Tokenizer.from_file(str(tok_file))
        self.vocab_size = self._tok.get_vocab_size()
        cfg_file = d / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        tmpl_file = d / "chat_template.jinja"
        if tmpl_file.is_file():
            template = tmpl_file.read_text()
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        self._template = env.from_string(template) if isinstance(template, str) else None
        self._specials = {
            k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token")
        }

    def encode_prompt(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: Sequence[Message]) -> str:
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        msgs = [{**m, "content": message_text(m.get("content"))} for m in messages]
        return self._template.render(messages=msgs, add_generation_prompt=True, **self._specials)

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        return self._tok.encode(self.render_chat(messages), add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(directory: str | Path | None, vocab_size: int = 32000) -> PromptTokenizer:
    """The tokenizer in ``directory``, or the built-in one when none is given."""
    return HFTokenizer(directory) if directory else BuiltinTokenizer(vocab_size)

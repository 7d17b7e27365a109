"""Prompt tokenization for the precise prefix scorers.

Two ways, chosen per model:

- `PodTokenizer` (the default, nothing to configure): POST the prompt to a pod's
  `/tokenize` endpoint — chat requests as `messages` + `add_generation_prompt`, so the pod
  applies its own chat template. It always agrees with the pods.
- `LocalTokenizer` (the fast path): the model's tokenizer.json through the `tokenizers`
  library, and its chat template rendered the way vLLM renders it (a sandboxed Jinja
  environment with trim_blocks/lstrip_blocks; the rendered chat is tokenized without
  adding special tokens, a plain prompt with them).

Both keep an LRU of results, bounded in bytes. The local path also caches per segment
between special tokens (chat turn markers), so a long conversation whose earlier turns
were seen before only tokenizes its new turns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar

import aiohttp
import msgspec
import xxhash
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from prometheus_client import Counter
from tokenizers import Tokenizer

from ..framework.scheduling import DEFAULT_TOKENIZER_CACHE_BYTES, PromptTokenizer
from ..framework.types import LLMRequest, PodState
from .chat_render import (
    content_format,
    normalize_messages,
    normalize_tools,
    template_kwargs,
    trim_to_final_message,
)

if TYPE_CHECKING:
    from .tokenizer_discovery import TokenizerDiscovery

log = logging.getLogger(__name__)

TOKENIZE_TOTAL = Counter(
    "smart_epp_tokenize_total",
    "Prompt tokenizations by path and outcome",
    ["path", "result"],
)

K = TypeVar("K")
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """A least-recently-used map bounded by the total weight of its values.

    Safe to share between the event loop and the tokenizer thread (large prompts are
    tokenized off the loop): every operation holds a lock for a few dictionary steps."""

    def __init__(self, max_weight: int, weigh: Callable[[K, V], int]) -> None:
        self.max_weight = max_weight
        self.weight = 0
        self._weigh = weigh
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            found = self._data.get(key)
            if found is None:
                return None
            self._data.move_to_end(key)
            return found[0]

    def put(self, key: K, value: V) -> None:
        weight = self._weigh(key, value)
        if weight > self.max_weight:
            return  # larger than the whole cache: keeping it would evict everything
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.weight -= old[1]
            self._data[key] = (value, weight)
            self.weight += weight
            while self.weight > self.max_weight:
                _, (_, dropped) = self._data.popitem(last=False)
                self.weight -= dropped

    def __len__(self) -> int:
        return len(self._data)


# Token ids are kept as 4-byte unsigned ints (every vocabulary vLLM serves fits), a tenth
# of a list of Python ints; a long prompt cached a thousand times stays in megabytes.
# (array is not subscriptable at runtime before Python 3.12.)
if TYPE_CHECKING:
    TokenArray: TypeAlias = array[int]
else:
    TokenArray = array
DEFAULT_CACHE_BYTES = DEFAULT_TOKENIZER_CACHE_BYTES


def _ids_weight(key: object, ids: TokenArray) -> int:
    return 64 + ids.itemsize * len(ids)


def _segment_weight(text: str, ids: TokenArray) -> int:
    return 64 + len(text) + ids.itemsize * len(ids)


def _pack(ids: Sequence[int]) -> TokenArray:
    return array("I", ids)


def request_cache_key(request: LLMRequest) -> bytes | None:
    """A compact key for the prompt (a 128-bit digest, so long prompts stay cheap to keep)."""
    if request.messages is not None:
        chat: Any = request.messages
        if request.chat_template_args:
            chat = [request.messages, request.chat_template_args]
        text = "chat\0" + json.dumps(chat, sort_keys=True, separators=(",", ":"))
    elif request.prompt is not None:
        text = "text\0" + request.prompt
    else:
        return None
    return xxhash.xxh3_128_digest(f"{request.model}\0{text}".encode())


# --------------------------------------------------------------------------- local

# Bodies larger than this are tokenized on a worker thread: the tokenizers library
# releases the GIL while it encodes, so a long new prompt (tens of milliseconds of BPE)
# does not stall every other request's decision. Smaller ones stay on the event loop,
# where they cost less than the hand-off.
OFFLOAD_BODY_BYTES = 16 * 1024
_worker: ThreadPoolExecutor | None = None


def tokenizer_thread() -> ThreadPoolExecutor:
    """The one thread large prompts are tokenized on (one: encodes are already parallel
    inside the library, and the caches stay simple)."""
    global _worker
    if _worker is None:
        _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
    return _worker


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def chat_template_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment Hugging Face (and so vLLM) renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


# Long texts are tokenized in chunks of about this many characters (see _encode_text).
CHUNK_CHARS = 1024


def _chunks(text: str, size: int) -> list[str]:
    """`text` cut about every `size` characters, each cut just before a space that follows
    a non-space and precedes a letter. Cuts depend only on the text before them, so two
    texts sharing a prefix share its chunks."""
    out: list[str] = []
    start, end = 0, len(text)
    while end - start > 2 * size:
        at = start + size
        cut = -1
        while True:
            at = text.find(" ", at, end - 1)
            if at < 0:
                break
            if not text[at - 1].isspace() and text[at + 1].isalpha():
                cut = at
                break
            at += 1
        if cut < 0:
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


class LocalTokenizer:
    """One model's tokenizer and chat template, in-process."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        special_tokens: Mapping[str, str] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self._tok = tokenizer
        self._template = (
            chat_template_environment().from_string(chat_template) if chat_template else None
        )
        self._content_format = content_format(chat_template)
        self._special_tokens = dict(special_tokens or {})
        self._cache: LRUCache[bytes, TokenArray] = LRUCache(cache_bytes // 2, _ids_weight)
        self._segments: LRUCache[str, TokenArray] = LRUCache(cache_bytes // 2, _segment_weight)
        self._added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._split = (
            re.compile(
                "("
                + "|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))
                + ")"
            )
            if self._added
            else None
        )
        self._prefix, self._suffix = self._special_affixes()
        self._chunked = self._chunking_is_exact()
        self._segmented = self._split is not None and self._segmenting_is_exact()

    @classmethod
    def from_model_dir(
        cls,
        path: str | Path,
        *,
        tokenizer_file: str | Path | None = None,
        chat_template_file: str | Path | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> LocalTokenizer:
        """Loads tokenizer.json, tokenizer_config.json and chat_template.jinja from `path`."""
        folder = Path(path)
        tokenizer = Tokenizer.from_file(str(tokenizer_file or folder / "tokenizer.json"))
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.exists():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        template: str | None = None
        template_path = (
            Path(chat_template_file) if chat_template_file else folder / "chat_template.jinja"
        )
        if template_path.exists():
            template = template_path.read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        specials = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(config.get(key))
            if text is not None:
                specials[key] = text
        return cls(tokenizer, template, specials, cache_bytes)

    def _special_affixes(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor adds around a plain prompt (e.g. BOS)."""
        probe = "probe text"
        bare = self._tok.encode(probe, add_special_tokens=False).ids
        full = self._tok.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start], full[start + len(bare) :]
        return [], []

    def _segmenting_is_exact(self) -> bool:
        # Splitting at special tokens matches whole-text encoding for byte-level BPE, but
        # not for pre-tokenizers that treat the start of the text specially (Metaspace
        # "first"); check on a probe rather than trusting the tokenizer family.
        tokens = list(self._added)[:3]
        probe = f" hello{tokens[0]}world  x{tokens[-1]}\n tail" if tokens else "x"
        return (
            self._encode_segmented(probe) == self._tok.encode(probe, add_special_tokens=False).ids
        )

    def _encode_segmented(self, text: str) -> list[int]:
        assert self._split is not None
        pieces = self._split.split(text)
        if len(pieces) == 1:  # no special token: the request-level cache covers it
            return self._encode_text(text)
        out: list[int] = []
        for piece in pieces:
            if not piece:
                continue
            special = self._added.get(piece)
            if special is not None:
                out.append(special)
            else:  # a segment between special tokens: likely to come again, so cached
                out.extend(self._encode_text(piece) if self._long(piece) else self._cached(piece))
        return out

    def _chunking_is_exact(self) -> bool:
        # Cutting text before a space that follows a word and precedes a letter keeps
        # every pre-token whole for regex pre-tokenizers (GPT-2, Llama 3, Qwen), where a
        # space starts the next word's pre-token; not for ones that add a marker at the
        # start of the text (Metaspace "first") or merge across spaces. Check on a probe
        # with the cut far smaller than in use, so it is cut at many places.
        probe = (
            "The picker routes 128 requests/s: it's cheap, isn't it? Yes -- mostly. "
            "Prefix caches hold KV blocks;  two  spaces,\ttabs\nand new lines\n\n end. "
            "Ünïcödé wörds, 数字 123456 and émojis 🙂 follow: x=y+1, {'key': [1, 2]}."
        ) * 3
        whole = self._tok.encode(probe, add_special_tokens=False).ids
        pieces = [self._tok.encode(c, add_special_tokens=False).ids for c in _chunks(probe, 8)]
        return len(pieces) > 10 and [i for p in pieces for i in p] == whole

    def _cached(self, text: str) -> TokenArray:
        """`text`'s ids (no special tokens), from the segment cache or encoded into it."""
        ids = self._segments.get(text)
        if ids is None:
            ids = _pack(self._tok.encode(text, add_special_tokens=False).ids)
            self._segments.put(text, ids)
        return ids

    def _long(self, text: str) -> bool:
        return self._chunked and len(text) > 2 * CHUNK_CHARS

    def _encode_text(self, text: str) -> list[int]:
        """Text without special tokens. A long text is cut into chunks at word starts,
        each tokenized once and cached: prompts sharing a long prefix (a system prompt,
        a document) only tokenize what follows it."""
        if not self._long(text):
            return self._tok.encode(text, add_special_tokens=False).ids
        out: list[int] = []
        for chunk in _chunks(text, CHUNK_CHARS):
            out.extend(self._cached(chunk))
        return out

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._segmented:
            body = self._encode_segmented(text)
        elif self._chunked:
            body = self._encode_text(text)
        else:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return [*self._prefix, *body, *self._suffix] if add_special_tokens else body

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        template_args: Mapping[str, Any] | None = None,
    ) -> str:
        """Renders a chat as vLLM does: its normalized conversation and tools, the
        request's template arguments (`template_args`, the chat fields as sent)."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        args = dict(template_args or {})
        args.setdefault("add_generation_prompt", add_generation_prompt)
        kwargs = template_kwargs(args)
        conversation = normalize_messages(messages, self._content_format)
        rendered = self._template.render(
            messages=conversation,
            tools=normalize_tools(args.get("tools")),
            **{**self._special_tokens, **kwargs},
        )
        if kwargs.get("continue_final_message"):
            rendered = trim_to_final_message(rendered, conversation)
        return rendered

    def tokenize_sync(self, request: LLMRequest) -> list[int] | None:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        key = request_cache_key(request)
        if key is None:
            return None
        cached = self._cache.get(key)
        if cached is not None:
            TOKENIZE_TOTAL.labels("local", "cache_hit").inc()
            return cached.tolist()
        if request.messages is not None:
            # vLLM tokenizes a rendered chat without adding special tokens: the template
            # already wrote them.
            rendered = self.render_chat(request.messages, template_args=request.chat_template_args)
            ids = self.encode(rendered, add_special_tokens=False)
        else:
            ids = self.encode(request.prompt or "", add_special_tokens=True)
        self._cache.put(key, _pack(ids))
        TOKENIZE_TOTAL.labels("local", "ok").inc()
        return ids

    async def tokenize(self, request: LLMRequest, pods: Sequence[PodState]) -> list[int] | None:
        try:
            if len(request.body) > OFFLOAD_BODY_BYTES:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(tokenizer_thread(), self.tokenize_sync, request)
            return self.tokenize_sync(request)
        except Exception as exc:  # a template error must not fail the request
            TOKENIZE_TOTAL.labels("local", "error").inc()
            log.warning("local tokenization failed for model %s: %s", request.model, exc)
            return None


# --------------------------------------------------------------------------- via a pod


FIRST_TOKENIZE_BACKOFF_S = 0.5
MAX_TOKENIZE_BACKOFF_S = 30.0


class TokenizeAnswer(msgspec.Struct):
    """vLLM's /tokenize answer, of which only the ids matter."""

    tokens: list[int]


# The answer is thousands of ids: decoded and type-checked in C, not by json + a Python
# loop over every id (the largest per-request cost of the /tokenize path when profiled).
decode_tokenize_answer = msgspec.json.Decoder(TokenizeAnswer).decode
_encode_json = msgspec.json.Encoder().encode
_JSON_HEADERS = {"content-type": "application/json"}


class PodTokenizer:
    """Asks a pod serving the model for the token ids (vLLM's POST /tokenize)."""

    def __init__(
        self,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        timeout_s: float = 2.0,
        session_factory: Callable[[], aiohttp.ClientSession] | None = None,
        attempts: int = 2,
        clock: Callable[[], float] = time.monotonic,
        server_url: str | None = None,
        server_model: str | None = None,
    ) -> None:
        # A fixed tokenization server (e.g. a `vllm launch render` sidecar) instead of the
        # candidate pods.
        self._server_url = server_url.rstrip("/") if server_url else None
        self._server_model = server_model  # the model name that server answers to
        self._cache: LRUCache[bytes, TokenArray] = LRUCache(cache_bytes, _ids_weight)
        self._clock = clock
        # Pods whose /tokenize failed are skipped for a while (doubling per failure), so a
        # pod without the endpoint costs one failed call per back-off, not one per request.
        self._failures: dict[str, int] = {}
        self._skip_until: dict[str, float] = {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None
        self._attempts = attempts
        self._turn = 0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            factory = self._session_factory or (
                lambda: aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
                )
            )
            self._session = factory()
        return self._session

    @staticmethod
    def tokenize_body(request: LLMRequest) -> dict[str, Any] | None:
        if request.messages is not None:
            body: dict[str, Any] = {
                "model": request.model,
                "messages": request.messages,
                "add_generation_prompt": True,
            }
            args = request.chat_template_args
            if args:
                # /tokenize takes tools and the generation flags itself; documents and
                # reasoning settings only through chat_template_kwargs.
                kwargs = template_kwargs(args)
                body["add_generation_prompt"] = kwargs.pop("add_generation_prompt")
                body["continue_final_message"] = kwargs.pop("continue_final_message")
                if args.get("tools") is not None:
                    body["tools"] = args["tools"]
                if kwargs:
                    body["chat_template_kwargs"] = kwargs
            return body
        if request.prompt is not None:
            return {"model": request.model, "prompt": request.prompt}
        return None

    async def tokenize(self, request: LLMRequest, pods: Sequence[PodState]) -> list[int] | None:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        key = request_cache_key(request)
        if key is None:
            return None
        cached = self._cache.get(key)
        if cached is not None:
            TOKENIZE_TOTAL.labels("pod", "cache_hit").inc()
            return cached.tolist()
        body = self.tokenize_body(request)
        if body is None:  # unreachable: a cache key implies a prompt or messages
            return None
        if self._server_url is not None and self._server_model:
            body["model"] = self._server_model
        now = self._clock()
        skip_until = self._skip_until
        if self._server_url is not None:
            servers = [self._server_url]
        else:
            usable = [p for p in pods if p.ready] or list(pods)
            servers = [f"http://{p.address}" for p in usable]
        ready = [s for s in servers if skip_until.get(s, 0.0) <= now]
        if not ready:
            TOKENIZE_TOTAL.labels("pod", "unavailable").inc()
            return None
        for attempt in range(min(self._attempts, len(ready))):
            server = ready[(self._turn + attempt) % len(ready)]
            ids = await self._ask(server, body)
            if ids is not None:
                self._turn += 1
                self._failures.pop(server, None)
                skip_until.pop(server, None)
                self._cache.put(key, _pack(ids))
                TOKENIZE_TOTAL.labels("pod", "ok").inc()
                return ids
            failures = self._failures.get(server, 0) + 1
            self._failures[server] = failures
            skip_until[server] = self._clock() + min(
                MAX_TOKENIZE_BACKOFF_S, FIRST_TOKENIZE_BACKOFF_S * 2 ** (failures - 1)
            )
        TOKENIZE_TOTAL.labels("pod", "error").inc()
        return None

    async def _ask(self, address: str, body: dict[str, Any]) -> list[int] | None:
        """POSTs to `address` (a base URL such as http://10.0.0.5:8000)."""
        try:
            async with self._client().post(
                f"{address}/tokenize",
                data=_encode_json(body),
                headers=_JSON_HEADERS,
                timeout=self._timeout,
            ) as resp:
                if resp.status != 200:
                    log.warning("POST %s/tokenize answered %s", address, resp.status)
                    return None
                raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("POST %s/tokenize failed: %r", address, exc)
            return None
        try:
            return decode_tokenize_answer(raw).tokens
        except msgspec.DecodeError:
            log.warning("POST %s/tokenize returned no token list", address)
            return None

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


class TokenizerRouter:
    """Local tokenizers for the models that have one; a pod's /tokenize for the rest.

    With `discovery`, a model with no configured local tokenizer gets one found on disk
    once it has agreed with the pods (`epp.tokenizer_discovery`)."""

    def __init__(
        self,
        local: Mapping[str, LocalTokenizer],
        fallback: PromptTokenizer | None,
        base_model: str | None = None,
        discovery: TokenizerDiscovery | None = None,
    ) -> None:
        self.local = dict(local)
        self.fallback = fallback
        # An adapter request names the adapter as its model; it shares the base's tokenizer.
        self.base_model = base_model
        self.discovery = discovery

    async def tokenize(self, request: LLMRequest, pods: Sequence[PodState]) -> list[int] | None:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        local = self.local.get(request.model)
        if local is None and request.adapter is not None and self.base_model is not None:
            local = self.local.get(self.base_model)
        if local is not None:
            return await local.tokenize(request, pods)
        if self.discovery is not None:
            model = request.model
            if request.adapter is not None and self.base_model is not None:
                model = self.base_model
            return await self.discovery.tokenize(model, request, pods, self.fallback)
        if self.fallback is not None:
            return await self.fallback.tokenize(request, pods)
        return None

    async def aclose(self) -> None:
        if self.discovery is not None:
            await self.discovery.aclose()
        close = getattr(self.fallback, "aclose", None)
        if close is not None:
            await close()

"""vLLM 0.32's OpenAI-compatible HTTP API in front of a simulated pod (aiohttp).

Routes: /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health,
/tokenize, /detokenize, /reset_prefix_cache, /metrics. Response bodies, SSE chunks and error
bodies follow the shapes vLLM 0.32 returns (see tests/fixtures/vllm).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from .engine import RequestProgress, RequestRejected, SimRequest
from .pod import SimPod
from .prom import CONTENT_TYPE

SYSTEM_FINGERPRINT = "vllm-0.32.0-sim"
_dumps: Callable[[Any], str] = json.JSONEncoder(separators=(",", ":")).encode


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def error_response(err: ApiError) -> web.Response:
    body = {
        "error": {
            "message": err.message,
            "type": _ERROR_TYPES.get(err.status, "BadRequestError"),
            "param": err.param,
            "code": err.status,
        }
    }
    return web.json_response(body, status=err.status, dumps=_dumps)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except RequestRejected as err:
        return error_response(ApiError(str(err), param=err.param))


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("The request body must be a JSON object.")
    return body


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{name} must be an integer, got {value!r}.", param=name)
    return value


@dataclass(slots=True)
class _Parsed:
    model: str
    lora: str | None
    prompt_ids: list[int]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    return_token_ids: bool
    cache_salt: str | None
    session_id: str | None
    report_full: bool


SERVED_BY_HEADER = "x-served-by"


class SimApi:
    def __init__(self, pod: SimPod):
        self.pod = pod
        cfg = pod.config
        self.model = cfg.model
        self.loras = dict(cfg.engine.loras)
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/metrics", self.metrics)
        app.on_response_prepare.append(self._name_the_pod)
        return app

    async def _name_the_pod(self, request: web.Request, response: web.StreamResponse) -> None:
        # vLLM does not say which pod answered; the simulator does, so that a benchmark in
        # front of any router can tell where each request went.
        response.headers[SERVED_BY_HEADER] = self.pod.config.http_address

    # ------------------------------------------------------------ parsing
    def _resolve_model(self, body: dict[str, Any]) -> tuple[str, str | None]:
        name = body.get("model", self.model)
        if name is None:
            name = self.model
        if not isinstance(name, str):
            raise ApiError("model must be a string.", param="model")
        if name == self.model:
            return name, None
        if name in self.loras:
            return name, name
        raise ApiError(f"The model `{name}` does not exist.", status=404, param="model")

    def _completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.pod.tokenizer.encode_prompt(prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            vocab = self.pod.tokenizer.vocab_size
            if any(t < 0 or t >= vocab for t in prompt):
                raise ApiError(f"Token id out of vocabulary (size {vocab}).", param="prompt")
            return list(prompt)
        if prompt is None:
            raise ApiError("Either prompt or prompt_embeds must be provided.", param="prompt")
        raise ApiError(
            "prompt must be a string, a list of token ids, or a list of one string.",
            param="prompt",
        )

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError("messages must be a non-empty list.", param="messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ApiError("every message must be an object with a role.", param="messages")
        try:
            return self.pod.tokenizer.encode_chat(messages)
        except ValueError as exc:
            raise ApiError(str(exc), param="messages") from None

    def _parse(self, body: dict[str, Any], chat: bool) -> _Parsed:
        model, lora = self._resolve_model(body)
        prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        max_tokens = _int_field(body, "max_tokens", None)
        if chat and body.get("max_completion_tokens") is not None:
            max_tokens = _int_field(body, "max_completion_tokens", None)
        if not chat and max_tokens is None:
            max_tokens = 16  # the completions API default
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        n = _int_field(body, "n", 1)
        if n != 1:
            raise ApiError("Only n=1 is supported by the simulator.", param="n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError("stream must be a boolean.", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise ApiError("stream_options must be an object.", param="stream_options")
        if opts and not stream:
            raise ApiError("Stream options can only be defined when `stream=True`.")
        xargs = body.get("vllm_xargs") or {}
        if not isinstance(xargs, dict):
            raise ApiError("vllm_xargs must be an object.", param="vllm_xargs")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ApiError("Parameter 'cache_salt' must be a non-empty string.", param="cache_salt")
        session = xargs.get("session_id")
        return _Parsed(
            model=model,
            lora=lora,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stream=stream,
            include_usage=bool(opts.get("include_usage", False)),
            return_token_ids=bool(body.get("return_token_ids", False)),
            cache_salt=salt,
            session_id=str(session) if session is not None else None,
            report_full=xargs.get("kv_cache_report_mode") == "full",
        )

    def _sim_request(self, p: _Parsed, prefix: str) -> SimRequest:
        engine = self.pod.engine
        max_tokens = p.max_tokens
        if max_tokens is None:  # chat default: whatever context is left
            max_tokens = max(1, engine.max_model_len - len(p.prompt_ids))
        req = SimRequest(
            request_id=self.pod.next_request_id(prefix),
            prompt_token_ids=p.prompt_ids,
            max_tokens=max_tokens,
            lora_name=p.lora,
            cache_salt=p.cache_salt,
            session_id=p.session_id,
            report_full=p.report_full,
        )
        engine.validate(req)
        return req

    def _usage(self, prompt: int, completion: int, cached: int, stream: bool) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        details = {"cached_tokens": cached} if self.pod.config.prompt_tokens_details else None
        if details is not None or not stream:
            usage["prompt_tokens_details"] = details
        if not stream:
            usage["completion_tokens_details"] = None
        return usage

    # ------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        p = self._parse(await _json_body(request), chat)
        req = self._sim_request(p, "chatcmpl" if chat else "cmpl")
        if p.stream:
            return await self._stream(request, p, req, chat)
        tokens: list[int] = []
        last: RequestProgress | None = None
        async with contextlib.aclosing(self.pod.generate(req)) as stream:
            async for progress in stream:
                tokens.extend(progress.new_token_ids)
                last = progress
        assert last is not None
        text = self.pod.tokenizer.decode(tokens)
        usage = self._usage(len(p.prompt_ids), len(tokens), last.num_cached_tokens, False)
        rid, created = req.request_id, int(time.time())
        ids = p.return_token_ids
        if chat:
            body: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": p.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "reasoning": None,
                        },
                        "logprobs": None,
                        "finish_reason": last.finish_reason,
                        "stop_reason": None,
                        "token_ids": tokens if ids else None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "usage": usage,
                "prompt_logprobs": None,
                "prompt_token_ids": p.prompt_ids if ids else None,
                "prompt_text": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        else:
            body = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": p.model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": last.finish_reason,
                        "stop_reason": None,
                        "token_ids": tokens if ids else None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": p.prompt_ids if ids else None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "usage": usage,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        return web.Response(text=_dumps(body), content_type="application/json")

    async def _stream(
        self, request: web.Request, p: _Parsed, req: SimRequest, chat: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        rid, created = req.request_id, int(time.time())
        head = {"id": rid, "object": obj, "created": created, "model": p.model}
        count = 0
        cached = 0
        ids = p.return_token_ids

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else _dumps(payload)
            await resp.write(f"data: {data}\n\n".encode())

        if chat:
            first_choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}  # fmt: skip
            chunk = {**head, "choices": [first_choice]}
            if ids:
                chunk["prompt_token_ids"] = p.prompt_ids
            await send(chunk)
        async with contextlib.aclosing(self.pod.generate(req)) as stream:
            async for progress in stream:
                await send(self._chunk(head, p, progress, chat))
                count += len(progress.new_token_ids)
                cached = progress.num_cached_tokens
        if p.include_usage:
            usage = self._usage(len(p.prompt_ids), count, cached, True)
            await send({**head, "choices": [], "usage": usage,
                        "system_fingerprint": SYSTEM_FINGERPRINT})  # fmt: skip
        await send("[DONE]")
        await resp.write_eof()
        return resp

    def _chunk(
        self, head: dict[str, Any], p: _Parsed, progress: RequestProgress, chat: bool
    ) -> dict[str, Any]:
        ids = p.return_token_ids
        text = self.pod.tokenizer.decode(progress.new_token_ids)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": progress.finish_reason,
                "stop_reason": None,
                "token_ids": progress.new_token_ids if ids else None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": progress.finish_reason,
                "stop_reason": None,
                "prompt_token_ids": p.prompt_ids if (ids and progress.first_token) else None,
                "token_ids": progress.new_token_ids if ids else None,
            }
        return {**head, "choices": [choice]}

    # ------------------------------------------------------------ other routes
    async def models(self, request: web.Request) -> web.Response:
        def card(name: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
                "permission": [
                    {
                        "id": f"modelperm-{abs(hash((name, self.created))):016x}"[:26],
                        "object": "model_permission",
                        "created": self.created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }

        root = self.pod.config.tokenizer_dir or self.model
        data = [card(self.model, root, None, self.pod.engine.max_model_len)]
        data += [card(n, path, self.model, None) for n, path in self.loras.items()]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        self._resolve_model(body)
        ids = self._chat_prompt(body) if "messages" in body else self._completion_prompt(body)
        out = {
            "count": len(ids),
            "max_model_len": self.pod.engine.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        return web.json_response(out, dumps=_dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        self._resolve_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ApiError("tokens must be a list of token ids.", param="tokens")
        return web.json_response({"prompt": self.pod.tokenizer.decode(tokens)}, dumps=_dumps)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": self.pod.reset_prefix_cache()}, dumps=_dumps)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.pod.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

"""Small real HTTP model-server stand-ins that say which backend answered.

Each backend answers the OpenAI paths with a JSON body naming itself and describing
what it received (path, body size and digest, request id), plus a `usage` object; with
`"stream": true` it answers Server-Sent Events the way vLLM does, the last data chunk
carrying `usage`, then `data: [DONE]`.

In a test (same event loop):
    async with echo_backends(2) as (a, b): ...
As a process (benchmarks):
    python tests/support/backends.py --port 8001 --name a
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

SSE_CHUNKS = 5


def usage_for(body_bytes: int) -> dict:
    """The usage a backend reports: derived from the request so tests can predict it."""
    prompt_tokens = max(1, body_bytes // 4)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": SSE_CHUNKS,
        "total_tokens": prompt_tokens + SSE_CHUNKS,
        "prompt_tokens_details": {"cached_tokens": 16},
    }


@dataclass
class Received:
    path: str
    request_id: str | None
    destination: str | None
    body_bytes: int
    body_sha256: str
    data_parallel_rank: str | None = None  # the x-data-parallel-host-port header


@dataclass
class EchoBackend:
    name: str
    host: str = "127.0.0.1"
    port: int = 0
    received: list[Received] = field(default_factory=list)
    # Streams sent with `x-sse-hold: 1` pause after their first chunk until this is set:
    # a test holds responses open for as long as it needs, whatever the host's speed.
    held_streams_go: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> EchoBackend:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("POST", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        return web.json_response({"object": "list", "data": [], "backend": self.name})

    async def _metrics(self, request: web.Request) -> web.Response:
        # The scheduler's signals with vLLM's names: an idle server, always ready.
        page = (
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0.0\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.0\n"
        )
        return web.Response(text=page, content_type="text/plain")

    def _record(self, request: web.Request, body: bytes) -> Received:
        entry = Received(
            path=request.path,
            request_id=request.headers.get("x-request-id"),
            destination=request.headers.get("x-gateway-destination-endpoint"),
            body_bytes=len(body),
            body_sha256=hashlib.sha256(body).hexdigest(),
            data_parallel_rank=request.headers.get("x-data-parallel-host-port"),
        )
        self.received.append(entry)
        return entry

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        entry = self._record(request, body)
        status = int(request.headers.get("x-backend-status", "200"))
        try:
            document = json.loads(body) if body else {}
        except ValueError:
            document = {}
        stream = isinstance(document, dict) and document.get("stream") is True
        answer = {
            "backend": self.name,
            "path": entry.path,
            "request_id": entry.request_id,
            "body_bytes": entry.body_bytes,
            "body_sha256": entry.body_sha256,
        }
        if status != 200:
            error = {"message": "backend refused", "type": "BadRequestError", "code": status}
            return web.json_response({"error": error, **answer}, status=status)
        if not stream:
            return web.json_response({**answer, "usage": usage_for(len(body))})
        return await self._stream(request, answer, len(body))

    async def _stream(self, request: web.Request, answer: dict, size: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)  # headers at once, as vLLM sends them
        first_token = float(request.headers.get("x-first-token-delay-ms", "0")) / 1000
        if first_token:
            await asyncio.sleep(first_token)
        delay = float(request.headers.get("x-sse-delay-ms", "0")) / 1000
        hold = request.headers.get("x-sse-hold") == "1"
        for i in range(SSE_CHUNKS):
            chunk = {**answer, "choices": [{"index": 0, "text": f"t{i}"}], "usage": None}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if hold and i == 0:
                await self.held_streams_go.wait()
            if delay:
                await asyncio.sleep(delay)
        final = {**answer, "choices": [], "usage": usage_for(size)}
        await response.write(f"data: {json.dumps(final)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@contextlib.asynccontextmanager
async def echo_backends(count: int, prefix: str = "backend") -> AsyncIterator[list[EchoBackend]]:
    backends = [EchoBackend(f"{prefix}-{i}") for i in range(count)]
    try:
        for backend in backends:
            await backend.start()
        yield backends
    finally:
        for backend in backends:
            await backend.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="an echoing OpenAI-shaped HTTP backend")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="backend")
    args = parser.parse_args()

    async def serve() -> None:
        backend = EchoBackend(args.name, port=args.port)
        # A long-running process must not keep every request it ever saw.
        backend._record = lambda request, body: Received(  # type: ignore[method-assign]
            request.path, None, None, len(body), ""
        )
        await backend.start()
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(serve())
    except ImportError:
        asyncio.run(serve())


if __name__ == "__main__":
    main()

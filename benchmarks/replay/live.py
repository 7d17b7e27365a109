"""Live mode: send a workload over real HTTP to any OpenAI-compatible endpoint, streaming,
and measure time to first token and inter-token latency on the client side.

Every request ends as exactly one `RequestResult`: completed, or failed with the HTTP
status or the name of the error (connection refused, timeout, broken stream).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .report import RequestResult
from .traces import TraceRequest

# Response headers that name the pod which served the request, first match wins.
SERVED_BY_HEADERS = ("x-gateway-destination-endpoint-served", "x-served-by", "x-pod-address")


@dataclass(slots=True)
class LiveOptions:
    target: str  # base URL, e.g. http://127.0.0.1:8080
    concurrency: int = 64
    request_timeout_s: float = 300.0
    model: str | None = None  # overrides each request's model
    extra_headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class StreamTiming:
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    usage: dict[str, Any] | None = None


def request_body(req: TraceRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    """The path and JSON body for one request: chat when the source had messages."""
    body: dict[str, Any] = {
        "model": model or req.model,
        "max_tokens": req.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        # Output lengths come from the trace, so the server must not stop early.
        "ignore_eos": True,
    }
    if req.messages is not None:
        body["messages"] = req.messages
        return "/v1/chat/completions", body
    body["prompt"] = req.text()
    return "/v1/completions", body


def _chunk_has_output(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
        if choice.get("token_ids"):
            return True
    return False


async def read_stream(
    resp: aiohttp.ClientResponse, sent_at: float, *, every_choice: bool = False
) -> StreamTiming:
    """Reads an SSE response; times the first and every later chunk that carries output,
    at the moment its bytes arrived.

    With `every_choice`, every chunk with a choice counts as one token, whatever its text:
    a token can decode to no text (small vocabularies), which is what calibration needs.
    """
    timing = StreamTiming()
    last: float | None = None
    buffer = b""
    async for data in resp.content.iter_any():
        arrived = time.perf_counter()
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return timing
            chunk = json.loads(payload)
            if chunk.get("usage"):
                timing.usage = chunk["usage"]
            if not (chunk.get("choices") if every_choice else _chunk_has_output(chunk)):
                continue
            if timing.ttft_s is None:
                timing.ttft_s = arrived - sent_at
            elif last is not None:
                timing.itl_s.append(arrived - last)
            last = arrived
            timing.chunks += 1
    return timing


async def send_one(
    session: aiohttp.ClientSession,
    req: TraceRequest,
    arrival_s: float,
    opts: LiveOptions,
) -> RequestResult:
    path, body = request_body(req, opts.model)
    result = RequestResult(
        index=req.index, arrival_s=arrival_s, pod=None, ok=False, status="not-sent"
    )
    sent_at = time.perf_counter()
    try:
        async with session.post(
            opts.target.rstrip("/") + path,
            json=body,
            headers=opts.extra_headers,
            timeout=aiohttp.ClientTimeout(total=opts.request_timeout_s),
        ) as resp:
            result.status = resp.status
            result.pod = next(
                (resp.headers[h] for h in SERVED_BY_HEADERS if h in resp.headers), None
            )
            if resp.status != 200:
                await resp.read()
                return result
            timing = await read_stream(resp, sent_at)
        e2e = time.perf_counter() - sent_at
    except TimeoutError:
        result.status = "timeout"
        return result
    except aiohttp.ClientError as exc:
        result.status = type(exc).__name__
        return result
    except (json.JSONDecodeError, UnicodeDecodeError):
        result.status = "bad-stream"
        return result
    usage = timing.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    result.ok = timing.ttft_s is not None
    if not result.ok:
        result.status = "no-output"
    result.ttft_s = timing.ttft_s
    result.e2e_s = e2e
    result.prompt_tokens = int(usage.get("prompt_tokens") or req.input_tokens)
    result.cached_tokens = int(details.get("cached_tokens") or 0)
    result.output_tokens = int(usage.get("completion_tokens") or timing.chunks)
    return result


async def run_live(
    requests: Sequence[TraceRequest],
    arrivals: Sequence[float],
    opts: LiveOptions,
    on_done: Callable[[RequestResult], None] | None = None,
    stages: Sequence[int | None] | None = None,
) -> list[RequestResult]:
    """Sends request i at `arrivals[i]` seconds after the start, at most `concurrency` at
    once (a request due while the cap is reached waits for a free slot)."""
    if opts.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    slots = asyncio.Semaphore(opts.concurrency)
    connector = aiohttp.TCPConnector(limit=opts.concurrency, force_close=False)
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        delay = arrivals[i] - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots:
            r = await send_one(session, requests[i], arrivals[i], opts)
        r.stage = stages[i] if stages is not None else None
        if on_done is not None:
            on_done(r)
        return r

    async with aiohttp.ClientSession(connector=connector) as session:
        return list(await asyncio.gather(*(one(i) for i in range(len(requests)))))


async def served_requests(pod_addresses: Sequence[str]) -> dict[str, float]:
    """Requests each pod reports as finished (vLLM's `vllm:request_success_total`), read
    from its /metrics: how a live run spread over pods when responses do not say."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for address in pod_addresses:
            async with session.get(
                f"http://{address}/metrics", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                text = await resp.text()
            total = 0.0
            for family in text_string_to_metric_families(text):
                if family.name == "vllm:request_success":
                    total += sum(s.value for s in family.samples if s.name.endswith("_total"))
            counts[address] = total
    return counts

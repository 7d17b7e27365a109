"""smart-epp's KV index, fed by real vLLM events, predicts the cached tokens vLLM reports.

For every request the index is asked, before the request is sent, how many prompt
tokens the pod holds; vLLM then reports `usage.prompt_tokens_details.cached_tokens`.
The two must be equal in steady state (every earlier event applied).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import zmq.asyncio
from prometheus_client import REGISTRY
from support.net import async_wait_until
from support.paths import TINY_MODEL, TOOLS_TEMPLATE
from vllm_pods import BLOCK_SIZE, SERVED_MODEL, VllmPod, completion_body, unique_prompt

from smart_epp.epp.chat_render import TEMPLATE_FIELDS
from smart_epp.epp.tokenization import LocalTokenizer
from smart_epp.framework.types import Api, Endpoint, LLMRequest
from smart_epp.kv_index.lookup import IndexPrefixMatcher
from smart_epp.kv_index.manager import KVEventManager
from smart_epp.kv_index.memory import MemoryBlockIndex

pytestmark = pytest.mark.real_vllm


def cacheable_tokens(prompt_len: int) -> int:
    # vLLM always computes the last prompt token, so a fully cached prompt reuses one
    # block less than it holds.
    return (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


@dataclass
class Audit:
    index: MemoryBlockIndex
    tokenizer: LocalTokenizer
    rows: list[tuple[str, str, int, int]]  # (pod, request, predicted, reported)

    async def held_blocks(self, pod: VllmPod, token_ids: list[int], adapter: str | None) -> int:
        matcher = IndexPrefixMatcher(self.index, base_model=SERVED_MODEL)
        probe = LLMRequest(
            "probe", "/v1/completions", Api.COMPLETIONS, SERVED_MODEL, adapter=adapter
        )
        hits = await matcher.match(token_ids, probe, {pod.config.address: BLOCK_SIZE})
        return hits[pod.config.address].blocks

    async def send(
        self, pod: VllmPod, name: str, body: dict, adapter: str | None = None
    ) -> tuple[int, int]:
        """Predicts, sends, records; then waits until the index holds the prompt's blocks."""
        chat = "messages" in body
        request = LLMRequest(
            request_id=name,
            path="/v1/chat/completions" if chat else "/v1/completions",
            api=Api.CHAT if chat else Api.COMPLETIONS,
            model=body["model"],
            adapter=adapter,
            prompt=body.get("prompt"),
            messages=body.get("messages"),
            chat_template_args={k: body[k] for k in TEMPLATE_FIELDS if k in body} or None,
        )
        token_ids = self.tokenizer.tokenize_sync(request)
        assert token_ids is not None
        held = await self.held_blocks(pod, token_ids, adapter)
        predicted = min(held * BLOCK_SIZE, cacheable_tokens(len(token_ids)))
        response = pod.post_json(request.path, body)
        # Chat responses carry the prompt ids at the top level, completions per choice.
        echoed = response.get("prompt_token_ids") or response["choices"][0]["prompt_token_ids"]
        assert echoed == token_ids
        reported = response["usage"]["prompt_tokens_details"]["cached_tokens"] or 0
        self.rows.append((pod.config.name, name, predicted, reported))
        full_blocks = len(token_ids) // BLOCK_SIZE

        async def caught_up() -> bool:
            return await self.held_blocks(pod, token_ids, adapter) == full_blocks

        await async_wait_until(caught_up, timeout=30, what=f"index to learn {name}'s blocks")
        return predicted, reported


@pytest.fixture
async def audit(vllm_pods, prediction_rows) -> AsyncIterator[Audit]:
    index = MemoryBlockIndex()
    context = zmq.asyncio.Context()
    manager = KVEventManager(index, context=context, default_model=SERVED_MODEL)
    await manager.start()
    for pod in vllm_pods:
        await manager.add_endpoint(
            Endpoint(
                address=pod.config.address,
                kv_events=pod.config.kv_endpoint,
                kv_replay=pod.config.replay_endpoint,
                labels=(("model", SERVED_MODEL),),
            )
        )
    audit = Audit(
        index,
        LocalTokenizer.from_model_dir(TINY_MODEL, chat_template_file=TOOLS_TEMPLATE),
        prediction_rows,
    )
    try:
        # A first request per pod proves each subscription is live before predictions count.
        for pod in vllm_pods:
            await audit.send(pod, "warm-up", completion_body(unique_prompt("warm"), 40))
        del prediction_rows[-len(list(vllm_pods)) :]
        yield audit
    finally:
        await manager.stop()
        context.term()


def chat_body(system: str, user: str, max_tokens: int = 8) -> dict:
    return {
        "model": SERVED_MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


async def test_index_predicts_cached_tokens_for_completions_and_chats(
    audit: Audit, pod_a: VllmPod
) -> None:
    prefix = unique_prompt("audit", words=150)
    system = unique_prompt("system", words=120)
    plan = [
        ("completion new", completion_body(prefix + " one", 40)),
        ("completion shared prefix", completion_body(prefix + " two and a longer tail", 40)),
        ("completion repeated", completion_body(prefix + " one", 40)),
        ("chat new", chat_body(system, "first question")),
        ("chat same system", chat_body(system, "second, different question")),
        ("chat repeated", chat_body(system, "first question")),
    ]
    results = [await audit.send(pod_a, name, body) for name, body in plan]
    predicted, reported = zip(*results, strict=True)
    assert predicted == reported, audit.rows
    assert reported[0] == 0 and reported[3] == 0
    assert all(r > 0 for i, r in enumerate(reported) if i not in (0, 3))


async def test_index_keeps_adapters_apart_like_vllm(audit: Audit, pod_b: VllmPod) -> None:
    prefix = unique_prompt("lora-audit", words=150)

    def lora(adapter: str, tail: str) -> dict:
        return completion_body(prefix + tail, 8, model=adapter)

    plan = [
        ("base new", completion_body(prefix + " one", 8), None),
        ("lora-a same prompt", lora("lora-a", " one"), "lora-a"),
        ("lora-a shared prefix", lora("lora-a", " two"), "lora-a"),
        ("lora-b same prompt", lora("lora-b", " one"), "lora-b"),
        ("base shared prefix", completion_body(prefix + " three", 8), None),
    ]
    results = [await audit.send(pod_b, name, body, adapter) for name, body, adapter in plan]
    predicted, reported = zip(*results, strict=True)
    assert predicted == reported, audit.rows
    # Different adapters never share KV blocks, even for identical tokens.
    assert reported[0] == reported[1] == reported[3] == 0
    assert reported[2] > 0 and reported[4] > 0


def removed_blocks(pod: VllmPod) -> float:
    value = REGISTRY.get_sample_value(
        "smart_epp_kv_block_hashes_total", {"pod": pod.config.address, "action": "removed"}
    )
    return value or 0.0


async def test_index_follows_evictions_of_a_full_cache(audit: Audit, pod_a: VllmPod) -> None:
    removed_before = removed_blocks(pod_a)
    # Each prompt takes ~20 of the pod's blocks: the cache overflows after a handful and
    # vLLM evicts (and publishes) the least recently used blocks.
    prompts = [
        unique_prompt(f"evict{i}", words=260) for i in range(pod_a.config.num_gpu_blocks // 16)
    ]
    for i, prompt in enumerate(prompts):
        await audit.send(pod_a, f"fill {i}", completion_body(prompt, 2))
    assert removed_blocks(pod_a) > removed_before
    # Oldest first: some of these lost blocks to eviction, the last ones are whole.
    for i in (0, 1, len(prompts) - 1):
        await audit.send(pod_a, f"again {i}", completion_body(prompts[i] + " again", 2))
    rows = audit.rows[-(len(prompts) + 3) :]
    assert [r[2] for r in rows] == [r[3] for r in rows], rows
    assert rows[-1][3] > 0


async def test_index_predicts_cached_tokens_for_a_tool_calling_chat(
    audit: Audit, pod_a: VllmPod
) -> None:
    system = unique_prompt("agent", words=120)
    tools = [{"type": "function", "function": {
        "name": "lookup", "description": unique_prompt("tool", words=40),
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip
    first = [{"role": "system", "content": system}, {"role": "user", "content": "find x"}]
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
            "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]}  # fmt: skip
    second = [*first, call, {"role": "tool", "tool_call_id": "1", "content": "x is 42"}]

    def body(messages: list[dict], **extra: object) -> dict:
        # tool_choice "none": the pods run no tool-call parser; the tools still reach the
        # template.
        fixed = {"temperature": 0, "ignore_eos": True, "return_token_ids": True,
                 "tool_choice": "none"}  # fmt: skip
        return {"model": SERVED_MODEL, "messages": messages, "tools": tools, "max_tokens": 8,
                **fixed, **extra}  # fmt: skip

    plan = [
        ("tool chat new", body(first)),
        ("tool chat after the call", body(second)),
        ("tool chat repeated", body(second)),
        ("tool chat, thinking off", body(second, chat_template_kwargs={"enable_thinking": False})),
    ]
    results = [await audit.send(pod_a, name, b) for name, b in plan]
    predicted, reported = zip(*results, strict=True)
    assert predicted == reported, audit.rows
    assert reported[0] == 0 and all(r > 0 for r in reported[1:])

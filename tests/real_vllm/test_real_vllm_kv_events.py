"""Real vLLM KV-cache events, received over a real ZMQ SUB and decoded by smart-epp."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import zmq.asyncio
from vllm_kv_wire import KvEventSubscriber, ReceivedBatch, vllm_block_ids
from vllm_pods import BLOCK_SIZE, VllmPod, completion_body, unique_prompt

from smart_epp.kv_index.events import BlockStored, decode_batch
from smart_epp.kv_index.subscriber import ReplayClient, parse_topic

pytestmark = pytest.mark.real_vllm


def stored_events(batches: list[ReceivedBatch]) -> list[BlockStored]:
    return [ev for b in batches for ev in b.batch.events if isinstance(ev, BlockStored)]


def stored_tokens(batches: list[ReceivedBatch]) -> list[int]:
    return [t for ev in stored_events(batches) for t in ev.token_ids]


def run_completion_and_collect(
    pod: VllmPod, prompt: str, max_tokens: int = 4
) -> tuple[dict, list[int], list[ReceivedBatch]]:
    """Sends one completion; returns the response, its prompt ids and the batches it caused."""
    with KvEventSubscriber(pod.config.kv_endpoint, pod.config.topic) as sub:
        response = pod.post_json("/v1/completions", completion_body(prompt, max_tokens))
        prompt_ids = response["choices"][0]["prompt_token_ids"]
        full = len(prompt_ids) // BLOCK_SIZE * BLOCK_SIZE
        # Only blocks vLLM did not already hold are published, prompt blocks first (one
        # batch per engine step); stop once all of them did.
        new = full - response["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert new > 0, "the prompt has no new full block: nothing would be published"
        batches = sub.collect_until(lambda got: len(stored_tokens(got)) >= new)
    return response, prompt_ids, batches


def test_prompt_blocks_arrive_as_block_stored_with_vllm_hashes(pod_a: VllmPod) -> None:
    _, prompt_ids, batches = run_completion_and_collect(pod_a, unique_prompt("events"))
    full_blocks = len(prompt_ids) // BLOCK_SIZE
    assert full_blocks >= 3

    assert {b.topic for b in batches} == {pod_a.config.topic}
    assert parse_topic(batches[0].topic.encode()) == (pod_a.config.address, "tiny")
    seqs = [b.seq for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers have gaps"

    events = stored_events(batches)
    prompt_block_tokens = full_blocks * BLOCK_SIZE
    assert stored_tokens(batches)[:prompt_block_tokens] == prompt_ids[:prompt_block_tokens]
    assert events[0].parent_block_hash is None  # a new prompt chain starts at the root
    assert all(ev.block_size == BLOCK_SIZE for ev in events)
    assert all(ev.medium == "GPU" and ev.lora_name is None for ev in events)
    published = [h for ev in events for h in ev.block_hashes][:full_blocks]
    assert published == vllm_block_ids(prompt_ids, BLOCK_SIZE)
    # Block ids are unsigned 64-bit: decoding must keep every bit.
    assert all(0 <= h < 2**64 for h in published)
    for prev, ev in itertools.pairwise(events):
        assert ev.parent_block_hash == prev.block_hashes[-1]


def test_reused_prefix_publishes_only_new_blocks(pod_a: VllmPod) -> None:
    prefix = unique_prompt("reuse", words=120)
    _, first_ids, _ = run_completion_and_collect(pod_a, prefix + " first tail")
    # A tail of ~100 tokens: at least two blocks past the shared part are new.
    response, second_ids, batches = run_completion_and_collect(
        pod_a, prefix + " " + unique_prompt("tail", words=40)
    )
    shared_blocks = 0
    while (end := (shared_blocks + 1) * BLOCK_SIZE) and first_ids[:end] == second_ids[:end]:
        shared_blocks += 1
    assert shared_blocks >= 2

    first_new = stored_events(batches)[0]
    assert first_new.parent_block_hash == vllm_block_ids(first_ids, BLOCK_SIZE)[shared_blocks - 1]
    assert (
        first_new.token_ids[:BLOCK_SIZE]
        == second_ids[shared_blocks * BLOCK_SIZE : (shared_blocks + 1) * BLOCK_SIZE]
    )
    details = response["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == shared_blocks * BLOCK_SIZE


async def test_replay_socket_resends_the_batches_seen_live(pod_a: VllmPod) -> None:
    _, _, live = run_completion_and_collect(pod_a, unique_prompt("replay"))
    client = ReplayClient(zmq.asyncio.Context.instance(), pod_a.config.replay_endpoint, 10.0)
    replayed = {}
    async with asyncio.timeout(30):
        async for topic, seq, payload in client.fetch(live[0].seq):
            replayed[seq] = (topic.decode(), payload)
    for batch in live:
        assert replayed[batch.seq] == (batch.topic, batch.payload)
        assert decode_batch(replayed[batch.seq][1])[0] == batch.batch

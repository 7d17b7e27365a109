"""Simulated pods over real HTTP and real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from simfix import captured_requests, decoded_batches, scenario_file
from simnet import events_of, replay, sample, scrape, stream_completion, subscriber
from support.net import async_wait_until
from support.paths import TINY_MODEL

from smart_epp.benchmarks.sim.pool import run_pool

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu")  # fmt: skip


def words(n: int, offset: int = 0) -> str:
    return " ".join(f"{WORDS[(i + offset) % len(WORDS)]}{(i + offset) // 7}" for i in range(n))


async def complete(session, url, **body) -> dict:
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_shared_prefix_reports_cached_tokens_and_lower_ttft():
    async with run_pool(1, time_scale=1.0) as pool, aiohttp.ClientSession() as s:
        url = pool.pods[0].url
        prefix = words(3000)
        body = {"model": "sim-model", "max_tokens": 3, "stream_options": {"include_usage": True}}
        ttft_1, _, chunks_1 = await stream_completion(
            s, f"{url}/v1/completions", {**body, "prompt": prefix + " first tail"}
        )
        ttft_2, _, chunks_2 = await stream_completion(
            s, f"{url}/v1/completions", {**body, "prompt": prefix + " second tail"}
        )
        usage_1, usage_2 = chunks_1[-1]["usage"], chunks_2[-1]["usage"]
        assert usage_1["prompt_tokens_details"]["cached_tokens"] == 0
        cached = usage_2["prompt_tokens_details"]["cached_tokens"]
        assert cached == (usage_2["prompt_tokens"] - 2) // 16 * 16 > 2900
        assert ttft_2 < ttft_1 / 2  # ~0.12 s of prefill skipped on a simulated H100
        m = await scrape(s, pool.pods[0].metrics_url)
        assert sample(m, "vllm:prefix_cache_hits_total") == cached
        assert sample(m, "vllm:time_to_first_token_seconds_count") == 2


async def test_small_cache_evicts_and_reset_clears_over_zmq():
    async with (
        run_pool(1, block_size=4, num_blocks=17, time_scale=0.01) as pool,
        aiohttp.ClientSession() as s,
    ):
        pod = pool.pods[0]
        async with subscriber(pod.kv_events_endpoint, pod.topic) as sub:
            # 16 blocks hold one 11-block prompt: every later prompt evicts. Keep sending
            # until the subscription is live.
            n = 0
            while not sub.batches or n < 3:
                await complete(s, pod.url, prompt=words(40, offset=n * 50), max_tokens=2)
                n += 1
                assert n < 200, "SUB never received a batch"
            async with s.post(f"{pod.url}/reset_prefix_cache") as resp:
                assert await resp.json() == {"success": True}
            await complete(s, pod.url, prompt=words(40, offset=99_999), max_tokens=2)
            await async_wait_until(
                lambda: events_of(sub.batches, "AllBlocksCleared"), what="AllBlocksCleared on SUB"
            )
        batches = await replay(pod.replay_endpoint)
        assert [b["seq"] for b in batches] == list(range(len(batches)))
        assert all(b["topic"] == pod.topic for b in batches)
        stored = {h for e in events_of(batches, "BlockStored") for h in e["block_hashes"]}
        removed = [h for e in events_of(batches, "BlockRemoved") for h in e["block_hashes"]]
        assert removed and set(removed) <= stored
        last = batches[-1]["events"]
        assert last[0] == {"type": "AllBlocksCleared"}
        assert last[1]["type"] == "BlockStored" and last[1]["parent_block_hash"] is None


async def test_restart_restarts_sequence_numbers_and_replay_fills_gaps():
    async with run_pool(1, block_size=16, time_scale=0.01) as pool, aiohttp.ClientSession() as s:
        pod = pool.pods[0]
        async with subscriber(pod.kv_events_endpoint, pod.topic) as sub:
            for i in range(3):
                await complete(s, pod.url, prompt=words(40, offset=i * 100), max_tokens=20)
            first = await replay(pod.replay_endpoint)
            assert [b["seq"] for b in first] == list(range(len(first))) and len(first) >= 3
            # Whatever the SUB missed while connecting, the replay socket has.
            seen = {b["seq"] for b in sub.batches}
            missed = [b for b in first if b["seq"] not in seen]
            assert {b["seq"] for b in missed} | seen == set(range(len(first)))

            pod = await pool.restart(0)
            assert await replay(pod.replay_endpoint) == []  # a new process buffers nothing yet
            before = len(sub.batches)
            n = 0
            while len(sub.batches) == before:
                await complete(s, pod.url, prompt=words(40, offset=1000 + n * 100), max_tokens=2)
                n += 1
                assert n < 200, "SUB never received a batch after the restart"
            second = await replay(pod.replay_endpoint)
            assert [b["seq"] for b in second] == list(range(len(second)))
            assert sub.batches[before]["seq"] < len(second) <= n * 2
            # Same tokens, same hashes across restarts (deterministic default seed).
            await complete(s, pod.url, prompt=words(40, offset=0), max_tokens=20)
            again = (await replay(pod.replay_endpoint))[len(second)]
            assert again["events"][0]["block_hashes"] == first[0]["events"][0]["block_hashes"]


async def _lora_scenario(mode: str):
    loras = {"lora-a": "/models/tiny-lora-a", "lora-b": "/models/tiny-lora-b"}
    async with (
        run_pool(1, loras=loras, max_loras=1, time_scale=0.3, lora_info_mode=mode) as pool,
        aiohttp.ClientSession() as s,
    ):
        pod = pool.pods[0]
        base = {"max_tokens": 60, "stream_options": {"include_usage": True}}
        url = f"{pod.url}/v1/completions"
        t_a = time.monotonic()
        task_a = asyncio.create_task(
            stream_completion(s, url, {**base, "model": "lora-a", "prompt": words(50)})
        )
        await async_wait_until(
            lambda: pod.pod.engine.snapshot_metrics().num_requests_running == 1, what="a running"
        )
        t_b = time.monotonic()
        task_b = asyncio.create_task(
            stream_completion(s, url, {**base, "model": "lora-b", "prompt": words(50)})
        )
        seen: dict = {}

        async def b_waits() -> bool:
            m = await scrape(s, pod.metrics_url)
            seen.update(m)
            return sample(m, "vllm:num_requests_waiting") == 1

        await async_wait_until(b_waits, what="lora-b waiting")
        info = {
            dict(lbl)["running_lora_adapters"]: (dict(lbl)["waiting_lora_adapters"], v)
            for (n, lbl), v in seen.items()
            if n == "vllm:lora_requests_info"
        }
        newest = max(info, key=lambda k: info[k][1])
        _, a_total, _ = await task_a
        b_first, _, _ = await task_b
        return newest, info[newest][0], t_a + a_total, t_b + b_first


async def test_second_adapter_waits_for_the_lora_slot_as_vllm_reports_it():
    running, waiting, a_done, b_first = await _lora_scenario("vllm")
    assert (running, waiting) == ("lora-a", "lora-a")  # vLLM 0.32 omits the queued adapter
    # lora-b's first token comes only after lora-a's 60 tokens (about 0.12 s here).
    assert b_first > a_done - 0.005


async def test_exact_lora_info_reports_the_waiting_adapter():
    running, waiting, _, _ = await _lora_scenario("exact")
    assert (running, waiting) == ("lora-a", "lora-b")


async def test_metrics_parse_and_move_while_requests_run():
    async with run_pool(1, time_scale=0.2, max_num_seqs=1) as pool, aiohttp.ClientSession() as s:
        pod = pool.pods[0]
        before = await scrape(s, pod.metrics_url)
        assert sample(before, "vllm:num_requests_running") == 0
        assert sample(before, "vllm:kv_cache_usage_perc") == 0
        labels = next(dict(lbl) for (n, lbl) in before if n == "vllm:cache_config_info")
        assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == str(457_000 // 16)
        body = {"model": "sim-model", "prompt": words(200), "max_tokens": 100}
        tasks = [asyncio.create_task(complete(s, pod.url, **body)) for _ in range(2)]
        during: dict = {}

        async def busy() -> bool:
            during.update(await scrape(s, pod.metrics_url))
            return sample(during, "vllm:num_requests_waiting") == 1

        await async_wait_until(busy, what="one running, one waiting")
        assert sample(during, "vllm:num_requests_running") == 1
        assert 0 < sample(during, "vllm:kv_cache_usage_perc") < 0.01
        await asyncio.gather(*tasks)
        after: dict = {}

        async def idle() -> bool:
            # Gauges change at step end, as vLLM's do: the step that finished the last
            # request can publish them just after its final chunk reached the client.
            after.update(await scrape(s, pod.metrics_url))
            return sample(after, "vllm:num_requests_running") == 0

        await async_wait_until(idle, what="the pod idle at the next step end")
        assert sample(after, "vllm:generation_tokens_total") == 200
        assert sample(after, "vllm:request_success_total", finished_reason="length") == 2
        assert sample(after, "vllm:e2e_request_latency_seconds_count") == 2
        assert sample(after, "vllm:request_queue_time_seconds_count") == 2
        assert sample(after, "vllm:inter_token_latency_seconds_count") == 198
        assert sample(after, "vllm:prefix_cache_queries_total") > 0


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"model": "sim-model"}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": [1, -5]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000000}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", b'{"prompt": "hi", "model": "other"}', 404, "model"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}', 400, "messages"),
    ("/tokenize", b'{"prompt": 5}', 400, "prompt"),
    ("/detokenize", b'{"tokens": "abc"}', 400, "tokens"),
]


async def test_bad_requests_get_vllm_style_errors_and_the_pod_keeps_serving():
    async with run_pool(1, time_scale=0.01) as pool, aiohttp.ClientSession() as s:
        url = pool.pods[0].url
        for path, raw, status, param in BAD_REQUESTS:
            async with s.post(f"{url}{path}", data=raw) as resp:
                assert resp.status == status, (path, raw)
                body = await resp.json()
            err = body["error"]
            assert set(body) == {"error"} and set(err) == {"message", "type", "param", "code"}
            assert err["code"] == status and err["param"] == param and err["message"]
            assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
        assert (await complete(s, url, prompt="still fine", max_tokens=2))["usage"]


async def test_tiny_model_pod_speaks_like_the_captured_vllm():
    loras = {"lora-a": "/models/tiny-lora-a", "lora-b": "/models/tiny-lora-b"}
    async with (
        run_pool(1, model="tiny", tokenizer_dir=str(TINY_MODEL), block_size=32,
                 max_model_len=1024, loras=loras, time_scale=0.01) as pool,
        aiohttp.ClientSession() as s,
    ):  # fmt: skip
        pod = pool.pods[0]
        async with s.get(f"{pod.url}/health") as resp:
            assert resp.status == 200
        async with s.get(f"{pod.url}/v1/models") as resp:
            models = await resp.json()
        real = json.loads(scenario_file("lora", "models.json").read_text())
        assert [(m["id"], m["parent"], m["root"]) for m in models["data"]][1:] == [
            (m["id"], m["parent"], m["root"]) for m in real["data"]
        ][1:]
        for mine, theirs in zip(models["data"], real["data"], strict=True):
            assert list(mine) == list(theirs)
            assert list(mine["permission"][0]) == list(theirs["permission"][0])
        assert models["data"][0]["max_model_len"] == 1024

        reqs = {r.name: r for r in captured_requests("basic")}
        for name in ("prefix_a", "chat_1"):
            r = reqs[name]
            tok_body = {k: v for k, v in r.body.items() if k in ("model", "prompt", "messages")}
            async with s.post(f"{pod.url}/tokenize", json=tok_body) as resp:
                tok = await resp.json()
            assert tok == {"count": len(r.prompt_token_ids), "max_model_len": 1024,
                           "tokens": r.prompt_token_ids, "token_strs": None}  # fmt: skip
        async with s.post(f"{pod.url}/detokenize", json={"tokens": [0, 266, 322]}) as resp:
            assert (await resp.json())["prompt"].strip().startswith("request")

        # The captured prompt stores the very blocks vLLM stored for it.
        out = await complete(s, pod.url, **{**reqs["prefix_a"].body, "max_tokens": 1})
        assert out["choices"][0]["prompt_token_ids"] == reqs["prefix_a"].prompt_token_ids
        real_out = reqs["prefix_a"].response
        assert list(out) == list(real_out)
        assert list(out["choices"][0]) == list(real_out["choices"][0])
        assert list(out["usage"]) == list(real_out["usage"])
        chat = reqs["chat_1"]
        async with s.post(f"{pod.url}/v1/chat/completions", json=chat.body) as resp:
            chat_out = await resp.json()
        assert list(chat_out) == list(chat.response)
        assert list(chat_out["choices"][0]) == list(chat.response["choices"][0])
        assert list(chat_out["choices"][0]["message"]) == list(
            chat.response["choices"][0]["message"]
        )
        assert chat_out["prompt_token_ids"] == chat.prompt_token_ids
        got = (await replay(pod.replay_endpoint))[0]["events"][0]
        real_first = decoded_batches("basic")[0]["payload"][1][0]
        assert got == real_first
        # Token-id prompts pass through unchanged.
        ids = [0, 5, 6, 7, 8]
        out = await complete(s, pod.url, prompt=ids, max_tokens=1, return_token_ids=True)
        assert out["choices"][0]["prompt_token_ids"] == ids


def test_cli_registers_the_sim_subcommand():
    from smart_epp.epp.cli import build_parser

    args = build_parser().parse_args(
        ["sim", "--port", "8100", "--lora", "a=/p/a", "--lora", "b", "--max-loras", "2"]
    )
    from smart_epp.benchmarks.sim.cli import pool_kwargs

    kw = pool_kwargs(args)
    assert kw["base_port"] == 8100 and kw["kv_base_port"] == 5557
    assert kw["loras"] == {"a": "/p/a", "b": "/models/b"} and kw["max_loras"] == 2


async def test_cli_runs_a_pool_of_pods(tmp_path):
    import sys

    from support.net import free_port_block

    base = free_port_block(6)  # HTTP; KV PUB, then replay: one block, so none overlap
    kv = base + 2
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from smart_epp.epp.cli import main; main()",
        "sim", "--pods", "2", "--base-port", str(base), "--kv-events-port", str(kv),
        "--replay-port", str(kv + 2), "--time-scale", "0.01",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 30)).decode() for _ in range(2)]
        assert lines[0].startswith(f"pod 0: http://127.0.0.1:{base} ")
        assert f"topic kv@127.0.0.1:{base + 1}@sim-model" in lines[1]
        async with aiohttp.ClientSession() as s:
            for port in (base, base + 1):
                out = await complete(s, f"http://127.0.0.1:{port}", prompt="hi there", max_tokens=2)
                assert out["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, err.decode()


async def test_malformed_replay_request_is_dropped_and_the_socket_keeps_serving():
    import zmq
    import zmq.asyncio

    async with run_pool(1, time_scale=0.01) as pool, aiohttp.ClientSession() as s:
        pod = pool.pods[0]
        await complete(s, pod.url, prompt=words(40), max_tokens=2)
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(pod.replay_endpoint)
        try:
            await sock.send_multipart([b"", b"bad"])
            await sock.send_multipart([b"", (0).to_bytes(8, "big")])
            first = await asyncio.wait_for(sock.recv_multipart(), 5)
            assert first[2] == (0).to_bytes(8, "big")  # the good request's first batch
        finally:
            sock.close(linger=0)
        assert (
            len(await replay(pod.replay_endpoint, start_seq=1))
            == len(await replay(pod.replay_endpoint)) - 1
        )


def test_cli_rejects_bad_settings_with_a_message(capsys):
    from smart_epp.epp.cli import build_parser

    for argv in (["sim", "--time-scale", "0"], ["sim", "--pods", "2", "--topic", "t"]):
        args = build_parser().parse_args(argv)
        assert args.func(args) == 2
        assert "epp sim:" in capsys.readouterr().err


async def test_pods_can_connect_their_publisher_to_a_bound_subscriber():
    import zmq
    import zmq.asyncio
    from simnet import decode
    from support.net import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind(endpoint)
    try:
        async with (
            run_pool(2, kv_events_endpoint=endpoint, time_scale=0.01) as pool,
            aiohttp.ClientSession() as s,
        ):
            topics: set[str] = set()
            for i in range(200):
                pod = pool.pods[i % 2]
                await complete(s, pod.url, prompt=words(40, offset=i * 50), max_tokens=2)
                while await sub.poll(0):
                    topics.add(decode(*await sub.recv_multipart())["topic"])
                if len(topics) == 2:
                    break
            assert topics == {p.topic for p in pool.pods}
    finally:
        sub.close(linger=0)


async def test_every_response_names_the_pod_that_answered():
    async with run_pool(2, time_scale=0.01) as pool, aiohttp.ClientSession() as s:
        for pod in pool.pods:
            body = {"model": "sim-model", "prompt": "hi", "max_tokens": 2, "stream": True}
            async with s.post(f"{pod.url}/v1/completions", json=body) as resp:
                await resp.read()
                assert resp.headers["x-served-by"] == pod.url.removeprefix("http://")
            async with s.get(f"{pod.url}/v1/models") as resp:
                assert resp.headers["x-served-by"] == pod.url.removeprefix("http://")

"""``epp sim``: run one simulated vLLM pod, or N of them in one process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from .profiles import DEFAULT_PROFILE, builtin_names, get_profile
from .vllm_hash import HASH_ALGOS


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="run simulated vLLM pods (HTTP API, /metrics, KV events)",
        description="Simulated vLLM 0.32 pods: OpenAI HTTP API, /metrics and ZMQ KV events.",
    )
    p.add_argument("--port", type=int, default=8000, help="HTTP port (single pod)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--kv-events-port", type=int, default=5557, help="ZMQ PUB port (pod 0)")
    p.add_argument("--replay-port", type=int, default=None,
                   help="ZMQ ROUTER replay port (default: KV port + number of pods)")  # fmt: skip
    p.add_argument("--no-kv-events", action="store_true", help="publish no KV events")
    p.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                   help="publish here instead (connects unless it has a '*')")  # fmt: skip
    p.add_argument("--topic", default=None, help="KV-event topic (default kv@<ip:port>@<model>)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="default: the profile's KV size")
    p.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|FILE",
                   help=f"latency profile: {', '.join(builtin_names())}, or a profile YAML file "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--print-profile", metavar="NAME|FILE",
                   help="print a profile in the YAML schema and exit")  # fmt: skip
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per simulated GPU second (0.01 = 100x faster)")  # fmt: skip
    p.add_argument("--lora", action="append", default=[], metavar="NAME[=PATH]",
                   help="a LoRA adapter (repeatable); PATH is hashed into its blocks")  # fmt: skip
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--lora-info", choices=("vllm", "exact"), default="vllm",
                   help="vllm: as vLLM 0.32 reports it; exact: real waiting adapters")  # fmt: skip
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="Hugging Face tokenizer directory (default: built-in)")  # fmt: skip
    p.add_argument("--seed", default=None, help="NONE_HASH seed (default: PYTHONHASHSEED)")
    p.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--event-encoding", choices=("map", "array"), default="map",
                   help="map: vLLM 0.32 events; array: older positional events")  # fmt: skip
    p.add_argument("--pods", type=int, default=1, help="number of pods in this process")
    p.add_argument("--base-port", type=int, default=None, help="pod i listens on BASE+i")
    p.set_defaults(func=run)


def parse_loras(specs: list[str]) -> dict[str, str]:
    loras: dict[str, str] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name:
            raise ValueError(f"bad --lora {spec!r}")
        loras[name] = path or f"/models/{name}"
    return loras


def pool_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    base = args.base_port if args.base_port is not None else args.port
    kwargs: dict[str, Any] = {
        "base_port": base,
        "host": args.host,
        "kv_events": not args.no_kv_events,
        "kv_base_port": args.kv_events_port,
        "replay_base_port": args.replay_port,
        "model": args.model,
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "profile": get_profile(args.profile),
        "time_scale": args.time_scale,
        "loras": parse_loras(args.lora),
        "max_loras": args.max_loras,
        "lora_info_mode": args.lora_info,
        "tokenizer_dir": args.tokenizer,
        "hash_seed": args.seed,
        "hash_algo": args.hash_algo,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "event_encoding": args.event_encoding,
    }
    if args.kv_events_endpoint:
        kwargs["kv_events_endpoint"] = args.kv_events_endpoint
    if args.topic is not None:
        if args.pods > 1:
            raise ValueError("--topic applies to a single pod; pools use kv@<ip:port>@<model>")
        kwargs["topic"] = args.topic
    return kwargs


async def serve(pods: int, kwargs: dict[str, Any]) -> None:
    from .pool import run_pool

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with run_pool(pods, **kwargs) as pool:
        for h in pool.pods:
            print(
                f"pod {h.index}: http://{h.http_address} kv-events {h.kv_events_endpoint} "
                f"replay {h.replay_endpoint} topic {h.topic}",
                flush=True,
            )
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    if args.print_profile:
        try:
            print(get_profile(args.print_profile).to_yaml(), end="")
        except ValueError as exc:
            print(f"epp sim: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        kwargs = pool_kwargs(args)
        if args.time_scale <= 0:
            raise ValueError("--time-scale must be positive")
        if args.pods < 1:
            raise ValueError("--pods must be at least 1")
    except ValueError as exc:
        print(f"epp sim: {exc}", file=sys.stderr)
        return 2
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve(args.pods, kwargs))
    except (ValueError, OSError) as exc:  # bad engine settings, port in use
        print(f"epp sim: {exc}", file=sys.stderr)
        return 1
    return 0

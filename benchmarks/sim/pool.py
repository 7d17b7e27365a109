"""N simulated vLLM pods in one process, each with its own HTTP port and KV-event sockets.

For tests and demos of other parts of the project::

    async with run_pool(3, block_size=16, time_scale=0.01) as pool:
        for pod in pool.pods:
            pod.url, pod.kv_events_endpoint, pod.replay_endpoint, pod.topic
        await pool.restart(0)     # same ports, fresh engine: KV-event seq restarts at 0

Ports left as None are picked free. Extra keyword options go to ``PodConfig`` (model,
time_scale, tokenizer_dir, lora_info_mode, event_encoding, prompt_tokens_details) or to
``EngineConfig`` (block_size, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len,
loras, max_loras, enable_prefix_caching, hash_algo, hash_seed, vocab_size); ``profile`` may be
a profile name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ...framework.types import Endpoint
from .engine import EngineConfig
from .http_api import SimApi
from .pod import PodConfig, SimPod
from .profiles import LatencyProfile, get_profile
from .tokenizer import PromptTokenizer, load_tokenizer

_POD_FIELDS = {f.name for f in dataclasses.fields(PodConfig)} - {"port", "engine"}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def free_tcp_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports (all held open together, so none is handed out twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                 for _ in range(n)]  # fmt: skip
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def split_options(opts: dict[str, Any]) -> tuple[dict[str, Any], EngineConfig]:
    """Splits run_pool keyword options into PodConfig fields and an EngineConfig."""
    pod_opts: dict[str, Any] = {}
    engine_opts: dict[str, Any] = {}
    for key, value in opts.items():
        if key == "profile" and isinstance(value, str):
            value = get_profile(value)
        if key in _POD_FIELDS:
            pod_opts[key] = value
        elif key in _ENGINE_FIELDS:
            engine_opts[key] = value
        else:
            raise TypeError(f"unknown simulator option {key!r}")
    if isinstance(engine_opts.get("profile"), LatencyProfile) or "profile" not in engine_opts:
        return pod_opts, EngineConfig(**engine_opts)
    raise TypeError("profile must be a profile name or a LatencyProfile")


@dataclass(slots=True)
class PodHandle:
    """Where one running pod can be reached."""

    index: int
    pod: SimPod
    runner: web.AppRunner
    http_address: str  # "ip:port"
    kv_events_endpoint: str | None  # tcp://ip:port for a SUB socket
    replay_endpoint: str | None  # tcp://ip:port for a DEALER socket
    topic: str

    @property
    def url(self) -> str:
        return f"http://{self.http_address}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def endpoint(self) -> Endpoint:
        """The pod as the gateway's discovery describes it."""
        return Endpoint(
            address=self.http_address,
            kv_events=self.kv_events_endpoint,
            kv_replay=self.replay_endpoint,
        )


async def start_pod(
    config: PodConfig, index: int = 0, tokenizer: PromptTokenizer | None = None
) -> PodHandle:
    """Starts one pod (engine loop, ZMQ sockets, HTTP server)."""
    pod = SimPod(config, tokenizer)
    await pod.start()
    runner = web.AppRunner(SimApi(pod).app(), access_log=None)
    try:
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
    except BaseException:
        await runner.cleanup()
        await pod.stop()
        raise
    kv = pod.publisher.endpoint if pod.publisher is not None else None
    if kv is not None and "*" in kv:
        kv = kv.replace("*", config.host)
    replay = pod.publisher.replay_endpoint if pod.publisher is not None else None
    return PodHandle(index, pod, runner, config.http_address, kv, replay, pod.topic)


async def stop_pod(handle: PodHandle) -> None:
    await handle.runner.cleanup()
    await handle.pod.stop()


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


class SimPool:
    def __init__(self, configs: list[PodConfig], tokenizer: PromptTokenizer):
        self.configs = configs
        self.tokenizer = tokenizer
        self.pods: list[PodHandle] = []

    async def start(self) -> None:
        for i, cfg in enumerate(self.configs):
            self.pods.append(await start_pod(self._fresh(cfg), i, self.tokenizer))
            self._pin_ports(i)

    async def stop(self) -> None:
        for handle in self.pods:
            await stop_pod(handle)
        self.pods.clear()

    async def restart(self, index: int) -> PodHandle:
        """Stops pod ``index`` and starts a new process-equivalent on the same ports."""
        await stop_pod(self.pods[index])
        handle = await start_pod(self._fresh(self.configs[index]), index, self.tokenizer)
        self.pods[index] = handle
        return handle

    def _pin_ports(self, index: int) -> None:
        """Records the ZMQ ports a pod got, so a restart binds the same ones."""
        cfg, handle = self.configs[index], self.pods[index]
        if cfg.kv_events_port == 0 and handle.kv_events_endpoint:
            cfg.kv_events_port = _port_of(handle.kv_events_endpoint)
        if cfg.replay_port == 0 and handle.replay_endpoint:
            cfg.replay_port = _port_of(handle.replay_endpoint)

    @staticmethod
    def _fresh(cfg: PodConfig) -> PodConfig:
        # Each start gets its own engine config: a pod must never share mutable state.
        return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine))


def pool_configs(
    n: int,
    *,
    base_port: int | None = None,
    kv_base_port: int | None = None,
    replay_base_port: int | None = None,
    kv_events: bool = True,
    replay: bool = True,
    host: str = "127.0.0.1",
    **opts: Any,
) -> list[PodConfig]:
    """Pod i listens on base_port+i, publishes on kv_base_port+i, replays on
    replay_base_port+i (default kv_base_port+n+i); None picks free ports."""
    if n < 1:
        raise ValueError("a pool needs at least one pod")
    pod_opts, engine = split_options(opts)
    if replay_base_port is None and kv_base_port is not None:
        replay_base_port = kv_base_port + n
    http_ports = (
        [base_port + i for i in range(n)] if base_port is not None else free_tcp_ports(n, host)
    )
    configs = []
    for i, port in enumerate(http_ports):
        kv_port = replay_port = None  # 0 below: ZMQ binds any free port, race-free
        if kv_events:
            kv_port = kv_base_port + i if kv_base_port is not None else 0
            if replay:
                replay_port = replay_base_port + i if replay_base_port is not None else 0
        configs.append(
            PodConfig(
                port=port,
                host=host,
                engine=dataclasses.replace(engine),
                kv_events_port=kv_port,
                replay_port=replay_port,
                **pod_opts,
            )
        )
    return configs


@contextlib.asynccontextmanager
async def run_pool(n: int, **kwargs: Any) -> AsyncIterator[SimPool]:
    """Runs ``n`` pods for the duration of the block (see ``pool_configs`` for options)."""
    configs = pool_configs(n, **kwargs)
    first = configs[0]
    tokenizer = load_tokenizer(first.tokenizer_dir, first.engine.vocab_size)
    pool = SimPool(configs, tokenizer)
    try:
        await pool.start()
        yield pool
    finally:
        await pool.stop()

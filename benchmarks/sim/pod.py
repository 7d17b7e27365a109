"""One simulated vLLM pod: the engine driven in real time, plus its KV-event publisher.

The engine runs in simulated GPU seconds; ``time_scale`` maps them to wall seconds (0.01 runs
a pod 100x faster than a GPU would). Each engine step is "executed" by sleeping its scaled
duration; its tokens are then delivered and its KV events published as one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from .engine import (
    EngineConfig,
    RequestProgress,
    SimEngine,
    SimRequest,
)
from .kv_events import Encoding, KVEventPublisher
from .prom import LoraInfoMode, PodMetrics
from .tokenizer import PromptTokenizer, load_tokenizer

log = logging.getLogger(__name__)
_MIN_SLEEP_S = 0.002


def kv_topic(http_address: str, model: str) -> str:
    """The project's topic convention: ``kv@<ip:port>@<model>``."""
    return f"kv@{http_address}@{model}"


@dataclass(slots=True)
class PodConfig:
    port: int
    host: str = "127.0.0.1"
    model: str = "sim-model"
    engine: EngineConfig = field(default_factory=EngineConfig)
    time_scale: float = 1.0
    kv_events_port: int | None = None  # None: no KV events; 0: any free port
    replay_port: int | None = None  # None: no replay socket; 0: any free port
    kv_events_endpoint: str | None = None  # overrides kv_events_port (e.g. a connect address)
    topic: str | None = None  # default kv@<host:port>@<model>
    event_encoding: Encoding = "map"
    tokenizer_dir: str | None = None
    lora_info_mode: LoraInfoMode = "vllm"
    prompt_tokens_details: bool = True  # usage.prompt_tokens_details.cached_tokens

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.port}"


def _tcp(host: str, port: int | None) -> str | None:
    if port is None:
        return None
    return f"tcp://{host}:{port or '*'}"


class SimPod:
    def __init__(self, config: PodConfig, tokenizer: PromptTokenizer | None = None):
        if config.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer_dir, config.engine.vocab_size)
        if config.tokenizer_dir:
            config.engine.vocab_size = self.tokenizer.vocab_size
        self.engine = SimEngine(config.engine)
        self.metrics = PodMetrics(
            self.engine,
            config.model,
            lora_info_mode=config.lora_info_mode,
            with_lora=bool(config.engine.loras),
            clock=self.model_now,
        )
        self.topic = config.topic or kv_topic(config.http_address, config.model)
        endpoint = config.kv_events_endpoint or _tcp(config.host, config.kv_events_port)
        replay = _tcp(config.host, config.replay_port)
        # A port means "bind here"; an explicit endpoint binds only when it has a wildcard.
        bind = None if config.kv_events_endpoint else True
        self.publisher = (
            KVEventPublisher(
                endpoint, self.topic, replay, bind=bind, encoding=config.event_encoding
            )
            if endpoint
            else None
        )
        self._streams: dict[str, asyncio.Queue[RequestProgress]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._model_end = 0.0
        self._busy = False
        self._ids = itertools.count()

    def _wall_model(self) -> float:
        return (time.monotonic() - self._t0) / self.config.time_scale

    def model_now(self) -> float:
        """The engine's clock: simulated seconds since the pod started.

        While the engine is busy, simulated time advances by step durations only, so host
        CPU lag (amplified by 1/time_scale) never shows up as simulated GPU latency; an
        arrival during a step is stamped no later than that step's end.
        """
        wall = self._wall_model()
        return min(wall, self._model_end) if self._busy else wall

    async def start(self) -> None:
        self._t0 = time.monotonic()
        if self.publisher is not None:
            self.publisher.start()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.publisher is not None:
            await self.publisher.close()

    def next_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids):016x}"

    async def generate(self, req: SimRequest) -> AsyncGenerator[RequestProgress, None]:
        """Runs ``req`` (validate it first) and yields its progress step by step."""
        queue: asyncio.Queue[RequestProgress] = asyncio.Queue()
        self._streams[req.request_id] = queue
        self.engine.add_request(req, self.model_now())
        self._wake.set()
        finished = False
        try:
            while not finished:
                p = await queue.get()
                finished = p.finished
                yield p
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:
                self.engine.abort(req.request_id, self.model_now())

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    async def _run(self) -> None:
        engine, scale = self.engine, self.config.time_scale
        while True:
            if not engine.has_unfinished():
                self._busy = False
                self._wake.clear()
                await self._wake.wait()
            if not self._busy:
                self._model_end = max(self._model_end, self._wall_model())
                self._busy = True
            out = engine.step(self._model_end)
            self._model_end = out.end
            delay = self._t0 + out.end * scale - time.monotonic()
            # Event-loop timers tick in ~1 ms: shorter steps run back to back and catch
            # up on wall time once the debt is worth a sleep.
            await asyncio.sleep(delay if delay > _MIN_SLEEP_S else 0)
            if out.events and self.publisher is not None:
                self.publisher.publish(out.events, time.time())
            self.metrics.record_step(engine, time.time())
            for p in out.progress:
                stream = self._streams.get(p.request_id)
                if stream is not None:
                    stream.put_nowait(p)
            if not out.progress and out.duration == 0.0 and engine.has_unfinished():
                # Nothing could be scheduled (should not happen); wait for a change.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.05)

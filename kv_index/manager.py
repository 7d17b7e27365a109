"""Keeps one KV-event subscription per pool member, driven by the gateway's datastore.

Two modes:
- dial (default): a SUB socket per pod connects to the pod's publisher (the endpoint's
  `kv_events`, else tcp://<pod ip>:<default_events_port>);
- central: the gateway binds one SUB socket, pods' publishers connect to it (vLLM
  connects instead of binding when its `endpoint` names a concrete host), and each
  batch's topic `kv@<ip:port>@<model>` says which pod sent it. With `curve`, only
  publishers holding an allowed CURVE key can connect (see kv_index/curve.py).
Replay goes to the endpoint's `kv_replay`, else tcp://<pod ip>:<default_replay_port>
(vLLM offsets both ports by the data-parallel rank).

Key scope model: in central mode the model named in the topic; in dial mode the
endpoint's label `model` when present, else `model_of(endpoint)` when given (e.g. the
base model the pod lists on /v1/models), else the manager's `default_model`.
Pod identity everywhere is the pod's HTTP address "ip:port".

`reset_pod(address)` drops what a pod published and replays its buffer from 0: for
restarts that the event stream cannot show (the first batches of the new process lost
before the SUB reconnected, and nothing published since), seen instead as a new
process start time on the pod's /metrics. `set_model` re-keys a pod the same way when
its base model becomes known late.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import zmq
import zmq.asyncio

from ..framework.types import Endpoint
from . import metrics
from .api import BlockIndex
from .curve import CurveGuard, CurveServerConfig
from .ingest import IngestState
from .memory import MemoryBlockIndex
from .subscriber import (
    PodEventStream,
    ReplayClient,
    cancel_and_wait,
    central_loop,
    dial_loop,
    drain_queue,
)

log = logging.getLogger(__name__)

CENTRAL_QUEUE_LIMIT = 10_000  # batches; beyond it the batch is dropped and later replayed


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def _offset_port(endpoint: str, offset: int) -> str:
    if offset == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + offset}"


@dataclass(slots=True)
class _Subscription:
    endpoint: Endpoint
    stream: PodEventStream
    task: asyncio.Task[None] | None = None
    queue: asyncio.Queue[tuple[bytes, int, bytes]] | None = None


class KVEventManager:
    def __init__(
        self,
        index: BlockIndex,
        ingest: IngestState | None = None,
        *,
        mode: Literal["dial", "central"] = "dial",
        bind: str = "tcp://*:5557",
        default_model: str = "",
        default_events_port: int = 5557,
        default_replay_port: int | None = 5558,
        replay_timeout_s: float = 2.0,
        context: zmq.asyncio.Context | None = None,
        model_of: Callable[[Endpoint], str | None] | None = None,
        curve: CurveServerConfig | None = None,
    ) -> None:
        if mode not in ("dial", "central"):
            raise ValueError(f"unknown KV event mode {mode!r}")
        if curve is not None and mode != "central":
            raise ValueError("CURVE authentication applies to the central socket only")
        self.curve = curve
        self._curve_guard: CurveGuard | None = None
        self.index = index
        self.ingest = ingest if ingest is not None else IngestState()
        self.mode = mode
        self.bind = bind
        self.default_model = default_model
        self.default_events_port = default_events_port
        self.default_replay_port = default_replay_port
        self.replay_timeout_s = replay_timeout_s
        self.model_of = model_of
        self._ctx = context or zmq.asyncio.Context.instance()
        self._subs: dict[str, _Subscription] = {}
        self._central_sock: zmq.asyncio.Socket | None = None
        self._central_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._started = False

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        index = self.index
        local = index if isinstance(index, MemoryBlockIndex) else getattr(index, "local", None)
        if isinstance(local, MemoryBlockIndex):
            metrics.INDEX_ENTRIES.set_function(lambda: local.entries)
            metrics.INDEX_BLOCKS.set_function(lambda: local.blocks)
        if self.mode == "central":
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
            if self.curve is not None:
                self._curve_guard = CurveGuard(self._ctx, self.curve)
                self._curve_guard.secure(sock)
            sock.bind(self.bind)
            self._central_sock = sock
            self._central_task = asyncio.create_task(central_loop(sock, self._route))
        for sub in self._subs.values():
            self._launch(sub)

    async def stop(self) -> None:
        self._started = False
        await cancel_and_wait(self._central_task)
        self._central_task = None
        if self._central_sock is not None:
            self._central_sock.close(linger=0)
            self._central_sock = None
        if self._curve_guard is not None:
            self._curve_guard.stop()
            self._curve_guard = None
        for sub in self._subs.values():
            await cancel_and_wait(sub.task)
            sub.task = None
        for task in list(self._background):
            await cancel_and_wait(task)

    @property
    def central_endpoint(self) -> str | None:
        """Where pods should publish in central mode (the bound address, port resolved)."""
        if self._central_sock is None:
            return None
        endpoint = self._central_sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)  # a string option
        return endpoint.decode()

    # ---- datastore listeners -------------------------------------------------------------

    def on_endpoint_added(self, endpoint: Endpoint) -> None:
        self._spawn(self.add_endpoint(endpoint))

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self._spawn(self.remove_endpoint(endpoint.address))

    async def add_endpoint(self, endpoint: Endpoint) -> None:
        existing = self._subs.get(endpoint.address)
        if existing is not None:
            if existing.endpoint == endpoint:
                return
            await self.remove_endpoint(endpoint.address)
        model = endpoint.label("model") or self._looked_up_model(endpoint) or self.default_model
        stream = PodEventStream(
            endpoint.address,
            model,
            self.ingest,
            self.index,
            replay=self._replay_factory(endpoint),
            model_from_topic=self.mode == "central",
        )
        sub = _Subscription(endpoint=endpoint, stream=stream)
        self._subs[endpoint.address] = sub
        if self._started:
            self._launch(sub)

    async def remove_endpoint(self, address: str) -> None:
        """The pod left the pool: close its socket and purge everything it published."""
        sub = self._subs.pop(address, None)
        if sub is None:
            return
        await cancel_and_wait(sub.task)
        self.ingest.forget_pod(address)
        await self.index.clear_pod(address)
        metrics.forget_pod(address)

    async def reset_pod(self, address: str) -> bool:
        """The pod restarted: forget what it published, reset its sequence tracking and
        replay its buffer from 0. False when the pod has no subscription."""
        sub = self._subs.get(address)
        if sub is None:
            return False
        await sub.stream.rebuild()
        return True

    async def set_model(self, address: str, model: str) -> bool:
        """Re-keys a pod under another base model (its keys depend on it): drops its
        entries and replays its buffer from 0. False when nothing changed."""
        sub = self._subs.get(address)
        if sub is None or not model or sub.stream.model == model:
            return False
        if self.mode == "central" or sub.endpoint.label("model"):
            return False  # the topic or the label names the model; they win
        log.info("kv events: %s keyed by model %r from now on", address, model)
        await sub.stream.rebuild(model)
        return True

    def _looked_up_model(self, endpoint: Endpoint) -> str | None:
        if self.model_of is None or self.mode == "central":
            return None
        try:
            return self.model_of(endpoint)
        except Exception:
            log.exception("kv events: model lookup failed for %s", endpoint.address)
            return None

    def stream(self, address: str) -> PodEventStream | None:
        sub = self._subs.get(address)
        return None if sub is None else sub.stream

    # ---- internals ---------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _replay_factory(self, endpoint: Endpoint) -> Callable[[int], ReplayClient] | None:
        base = endpoint.kv_replay
        if base is None and self.default_replay_port is not None:
            base = f"tcp://{_host(endpoint.address)}:{self.default_replay_port}"
        if base is None:
            return None
        ctx, timeout = self._ctx, self.replay_timeout_s
        return lambda rank: ReplayClient(ctx, _offset_port(base, rank), timeout)

    def _launch(self, sub: _Subscription) -> None:
        if self.mode == "dial":
            events = sub.endpoint.kv_events or (
                f"tcp://{_host(sub.endpoint.address)}:{self.default_events_port}"
            )
            sub.task = asyncio.create_task(dial_loop(self._ctx, events, sub.stream))
        else:
            sub.queue = asyncio.Queue(maxsize=CENTRAL_QUEUE_LIMIT)
            sub.task = asyncio.create_task(self._central_worker(sub))

    async def _central_worker(self, sub: _Subscription) -> None:
        assert sub.queue is not None
        await sub.stream.resync()
        await drain_queue(sub.queue, sub.stream)

    def _route(self, topic: bytes, pod: str, seq: int, payload: bytes) -> bool:
        sub = self._subs.get(pod)
        if sub is None or sub.queue is None:
            return False
        try:
            sub.queue.put_nowait((topic, seq, payload))
        except asyncio.QueueFull:
            log.warning("kv events: queue of %s full, batch %d left to replay", pod, seq)
        return True

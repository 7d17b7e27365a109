"""Discrete-event replay in virtual time: N simulated vLLM engines behind one router.

The router is any `Scheduler` (smart-epp's real one, a peer policy, or the full-information
reference), driven
through the gateway's own `RequestFlow` on the simulation's virtual clock: candidates,
in-flight accounting, the routed and outcome hooks are production code. It learns about
the pods only the way a gateway does in production:
- from KV-event batches each engine publishes after a step, encoded to msgpack by the
  simulator and decoded by smart-epp's real decoder, delivered `kv_event_delay_s` later;
- from metrics snapshots taken every `scrape_interval_s`;
- from its own bookkeeping of the requests it has in flight per pod (the flow's).
Only the full-information reference reads the engines directly.

Nothing reads a clock or an unseeded random source, so a seed fixes the result.
"""

from __future__ import annotations

import argparse
import gc
import heapq
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ...epp.config import LoadedConfig
from ...epp.datastore import Datastore
from ...epp.errors import RequestError
from ...epp.flow import RequestFlow
from ...epp.flowcontrol.admission import AdmissionController, AdmissionRefused
from ...epp.flowcontrol.build import build_admission
from ...epp.flowcontrol.objectives import OBJECTIVE_HEADER, ObjectiveTable
from ...framework.lifecycle import FlowRequest
from ...framework.scheduling import Scheduler
from ...framework.types import Api, Endpoint, LLMRequest, PodMetrics, PodState, Usage
from ..sim.engine import (
    EngineConfig,
    EngineMetrics,
    RequestRejected,
    SimEngine,
    SimRequest,
    StepOutcome,
)
from ..sim.kv_events import encode_batch
from ..sim.profiles import DEFAULT_PROFILE, get_profile
from ..sim.routing_latency import DEFAULT_ROUTING_LATENCY_S
from .report import RequestResult
from .traces import DEFAULT_MODEL, TraceRequest

# Receives one pod's KV-event message (pod address, sequence number, msgpack payload).
KVEventSink = Callable[[str, int, bytes], Awaitable[None]]


@dataclass(slots=True)
class SimConfig:
    pods: int = 8
    profile: str = DEFAULT_PROFILE
    block_size: int = 16
    kv_event_delay_s: float = 0.05  # publish -> ZMQ -> decoder -> index
    scrape_interval_s: float = 0.05  # the Inference Extension's default metrics refresh
    max_model_len: int | None = None  # None: the profile's limit
    model: str = DEFAULT_MODEL
    num_blocks: int | None = None  # None: the profile's KV capacity
    routing_latency_s: float = DEFAULT_ROUTING_LATENCY_S  # tokenization + decision
    # Each pod's step time as a multiple of the profile's, pod 0 first; pods past the end
    # run at the profile's speed. Real pools are rarely identical: mixed GPU SKUs, a
    # throttled card, a noisy neighbour on the host.
    pod_slowdowns: tuple[float, ...] = ()
    # Several pickers of one pool (replicas behind one Envoy) exchange their shared state
    # this often: a busy pool's pickers send and read change notices about once per
    # notice gap (epp/shared_state/sync.py, DEFAULT_NOTICE_GAP_S).
    sync_interval_s: float = 0.02
    # smart-epp's pickers send a prompt only to engines whose max_model_len holds it and
    # refuse one none holds, as `epp serve` does with the pods' /v1/models
    # (epp/context_limit.py). Off by default: the committed policy grids predate it.
    context_limits: bool = False

    def slowdown(self, i: int) -> float:
        """Pod `i`'s step time as a multiple of the profile's."""
        return self.pod_slowdowns[i] if i < len(self.pod_slowdowns) else 1.0


@dataclass(slots=True)
class RoutedPolicy:
    """A policy as the simulation drives it."""

    name: str
    scheduler: Scheduler
    kv_events: KVEventSink | None = None  # None: the policy does not use KV events
    # Its own view of the pods when several pickers share the pool (None: the pool's).
    datastore: Datastore | None = None
    # One exchange with the other pickers' shared state, run every `sync_interval_s`.
    sync: Callable[[], Awaitable[object]] | None = None


def parse_slowdowns(text: str) -> tuple[float, ...]:
    """`1,1.1,1.25`: each pod's step time as a multiple of the profile's, pod 0 first
    (a command-line option's type: a bad value is an `ArgumentTypeError` naming it)."""
    try:
        factors = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        factors = ()
    if not factors or not all(0 < f < float("inf") for f in factors):
        raise argparse.ArgumentTypeError(
            f"pod slowdowns are comma-separated positive numbers such as 1,1.1,1.25, not {text!r}"
        )
    return factors


def pod_address(i: int) -> str:
    return f"10.0.0.{i + 1}:8000"


@dataclass(slots=True)
class _Tracked:
    req: TraceRequest
    flow: FlowRequest
    result: RequestResult
    arrival: float
    picker: RequestFlow  # the picker that routed it hears its answer
    first_token_at: float | None = None


@dataclass(slots=True)
class SimPool:
    """The engines and the router-side view of them (what scrapes and bookkeeping show)."""

    config: SimConfig
    engines: dict[str, SimEngine] = field(default_factory=dict)
    datastore: Datastore = field(default_factory=Datastore)
    # Further pickers' views of the same pods, scraped alike.
    views: list[Datastore] = field(default_factory=list)

    @classmethod
    def build(cls, config: SimConfig) -> SimPool:
        pool = cls(config)
        profile = get_profile(config.profile)
        for i in range(config.pods):
            address = pod_address(i)
            pool.engines[address] = SimEngine(
                EngineConfig(
                    block_size=config.block_size,
                    profile=profile.slowed(config.slowdown(i)),
                    max_model_len=config.max_model_len,
                    num_blocks=config.num_blocks,
                    hash_seed="replay",
                )
            )
        pool._add_endpoints(pool.datastore)
        return pool

    def _add_endpoints(self, datastore: Datastore) -> None:
        datastore.set_endpoints(Endpoint(address=address) for address in self.engines)
        for pod in datastore.pods():
            pod.metrics.block_size = self.config.block_size

    def add_view(self) -> Datastore:
        """Another picker's view of the pods: scraped like the pool's own, booked apart."""
        view = Datastore()
        self._add_endpoints(view)
        self.views.append(view)
        return view

    def state(self, address: str) -> PodState:
        pod = self.datastore.get(address)
        assert pod is not None, address
        return pod

    def scrape(self, now: float) -> None:
        for address, engine in self.engines.items():
            metrics = engine.snapshot_metrics(now)
            _copy_metrics(metrics, engine, self.state(address).metrics, now)
            for view in self.views:
                pod = view.get(address)
                assert pod is not None, address
                _copy_metrics(metrics, engine, pod.metrics, now)


def _copy_metrics(m: EngineMetrics, engine: SimEngine, out: PodMetrics, now: float) -> None:
    out.waiting = m.num_requests_waiting
    out.running = m.num_requests_running
    out.kv_usage = m.kv_cache_usage_perc
    out.running_adapters = frozenset(m.running_lora_adapters)
    out.waiting_adapters = frozenset(m.waiting_lora_adapters)
    out.max_loras = engine.max_loras
    out.block_size = engine.block_size
    out.num_gpu_blocks = engine.pool.num_usable
    out.prefix_cache_queries = float(m.stats.prefix_cache_queries)
    out.prefix_cache_hits = float(m.stats.prefix_cache_hits)
    out.mark_scraped(now, out)
    out.consecutive_failures = 0


@contextmanager
def _collector_relaxed() -> Iterator[None]:
    """Runs a simulation with rare full garbage collections.

    A replay keeps millions of long-lived containers (block pools, index maps, requests)
    and allocates short-lived ones by the million; with the default thresholds, the
    collector rescans the long-lived ones over and over, about a third of the run time.
    Collecting less often only delays freeing the reference cycles a run makes, and those
    are freed when it ends: left to the relaxed thresholds they would outlive it, and the
    next run in the same process (a grid worker, `epp replay` over several policies)
    would freeze them with what it found, where no collection reaches them. A 16-pod,
    800-request cell left 100-250 MB of cycles per policy that way.
    """
    thresholds = gc.get_threshold()
    gc.freeze()  # what exists before the run is never garbage it made
    gc.set_threshold(max(thresholds[0], 50_000), max(thresholds[1], 50), max(thresholds[2], 100))
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        gc.collect()  # also whatever garbage the caller had when the run froze it


# Event kinds, in the order they run when due at the same instant: results of a finished
# step first (they free capacity), then what the router hears, then new arrivals, then
# requests flow control lets go.
# Exchanges between several pickers come last: an instant's decisions ride the next one.
_STEP_DONE, _KV_DELIVERY, _SCRAPE, _ARRIVAL, _STEP_START, _DISPATCH, _SYNC = range(7)


class Simulation:
    """`policy` is the router; several policies are the pickers of one pool (replicas
    behind one Envoy, which hands them requests in turn), each with its own view of the
    pods (`RoutedPolicy.datastore`) and exchanging shared state (`RoutedPolicy.sync`)."""

    def __init__(
        self,
        config: SimConfig,
        policy: RoutedPolicy | Sequence[RoutedPolicy],
        pool: SimPool | None = None,
        on_request_done: Callable[[RequestResult], None] | None = None,
        hooks: Sequence[object] = (),
        flow_control: LoadedConfig | None = None,
        objectives: ObjectiveTable | None = None,
    ) -> None:
        self.config = config
        self.pickers = [policy] if isinstance(policy, RoutedPolicy) else list(policy)
        if not self.pickers:
            raise ValueError("a simulation needs a router")
        self.policy = self.pickers[0]
        self.pool = pool or SimPool.build(config)
        self.now = 0.0
        if flow_control is not None and len(self.pickers) > 1:
            raise ValueError("flow control is simulated for one picker only")
        # Admission and flow control as `epp serve` runs them, on the virtual clock.
        self.admission: AdmissionController | None = None
        if flow_control is not None:
            self.admission = build_admission(
                flow_control,
                self.pool.datastore.ready_pods,
                clock=self._clock,
                objectives=objectives,
            )
        self.flows = [
            RequestFlow(
                picker.scheduler,
                self.pool.datastore if picker.datastore is None else picker.datastore,
                clock=self._clock,
                hooks=hooks,
                admission=self.admission,
            )
            for picker in self.pickers
        ]
        self.flow = self.flows[0]
        self._turn = 0  # the picker the next request goes to
        self._syncs = [picker.sync for picker in self.pickers if picker.sync is not None]
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._busy: dict[str, bool] = dict.fromkeys(self.pool.engines, False)
        self._kv_seq: dict[str, int] = dict.fromkeys(self.pool.engines, 0)
        self._tracked: dict[str, _Tracked] = {}
        self._pending = 0  # requests not yet finished or failed
        self._on_done = on_request_done

    def _clock(self) -> float:
        return self.now

    def _push(self, at: float, kind: int, data: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, kind, self._seq, data))

    async def run(
        self,
        requests: Sequence[TraceRequest],
        arrivals: Sequence[float],
        stages: Sequence[int | None] | None = None,
    ) -> list[RequestResult]:
        results: list[RequestResult] = []
        for i, req in enumerate(requests):
            result = RequestResult(
                index=req.index,
                arrival_s=arrivals[i],
                pod=None,
                ok=False,
                status="pending",
                prompt_tokens=req.input_tokens,
                stage=stages[i] if stages is not None else None,
                objective=req.objective,
                slo_ttft_s=req.slo_ttft_s,
            )
            results.append(result)
            # The router decides, and the pod receives, once tokenization and the decision
            # are done; TTFT still counts from the client's arrival.
            self._push(arrivals[i] + self.config.routing_latency_s, _ARRIVAL, (req, result))
        self._pending = len(requests)
        self.pool.scrape(0.0)
        if requests:
            self._push(self.config.scrape_interval_s, _SCRAPE, None)
            if self._syncs:
                self._push(0.0, _SYNC, None)
        with _collector_relaxed():
            await self._drain()
        return results

    async def _drain(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        sinks = [p.kv_events for p in self.pickers if p.kv_events is not None]
        arrive, start_step, finish_step = self._arrive, self._start_step, self._finish_step
        scrape, interval = self.pool.scrape, self.config.scrape_interval_s
        while heap:
            at, kind, _, data = pop(heap)
            self.now = at
            if kind == _STEP_DONE:
                finish_step(*data)
            elif kind == _KV_DELIVERY:
                # Every picker subscribes to every pod's events.
                for sink in sinks:
                    await sink(*data)
            elif kind == _STEP_START:
                start_step(data)
            elif kind == _ARRIVAL:
                await arrive(*data)
            elif kind == _SCRAPE:
                scrape(at)
                for flow in self.flows:
                    flow.pump()  # fresh metrics: queued requests may go now (or expire)
                if self._pending:
                    self._push(at + interval, _SCRAPE, None)
            elif kind == _DISPATCH:
                await self._dispatch(*data)
            elif kind == _SYNC:
                for sync in self._syncs:
                    await sync()
                if self._pending:
                    self._push(at + self.config.sync_interval_s, _SYNC, None)

    # -------------------------------------------------------------------- routing
    async def _arrive(self, req: TraceRequest, result: RequestResult) -> None:
        llm = LLMRequest(
            request_id=f"req-{req.index}",
            path="/v1/completions",
            api=Api.COMPLETIONS,
            model=req.model,
            stream=True,
            prompt_token_ids=req.token_ids(),
            max_tokens=req.output_tokens,
            headers={OBJECTIVE_HEADER: req.objective} if req.objective else {},
        )
        flow = self.flows[self._turn]
        self._turn = (self._turn + 1) % len(self.flows)
        tracked = flow.start(llm)

        def wake(error: RequestError | None) -> None:
            self._push(self.now, _DISPATCH, (req, result, tracked, error, flow))

        try:
            admitted = flow.admit(tracked, wake)
        except RequestError as error:
            self._refuse(result, error)
            return
        if admitted:
            await self._route(req, result, tracked, flow)

    async def _dispatch(
        self,
        req: TraceRequest,
        result: RequestResult,
        tracked: FlowRequest,
        error: RequestError | None,
        flow: RequestFlow,
    ) -> None:
        if error is not None:
            self._refuse(result, error)
        else:
            await self._route(req, result, tracked, flow)

    def _refuse(self, result: RequestResult, error: RequestError) -> None:
        if isinstance(error, AdmissionRefused):
            result.refused = error.reason.value
        self._fail(result, error.status)

    async def _route(
        self, req: TraceRequest, result: RequestResult, tracked: FlowRequest, flow: RequestFlow
    ) -> None:
        llm = tracked.request
        try:
            await flow.route(tracked, admitted=True)
        except RequestError as error:
            if error.status == 400:
                # Refused by the picker itself (a prompt no engine's context holds): the
                # reason's first sentence, which names the limit and not the prompt.
                result.error = "picker: " + error.message.split(". ")[0]
            self._fail(result, error.status)
            return
        flow.routed(tracked)
        address = tracked.served
        assert address is not None
        result.pod = address
        predicted = tracked.decision.predicted_ttft_s if tracked.decision is not None else None
        if predicted is not None:
            result.predicted_ttft_s = self.now - result.arrival_s + predicted
        engine = self.pool.engines[address]
        sim_req = SimRequest(
            request_id=llm.request_id,
            prompt_token_ids=llm.prompt_token_ids or [],
            max_tokens=req.output_tokens,
        )
        try:
            engine.add_request(sim_req, self.now)
        except RequestRejected as exc:
            result.error = exc.reason
            flow.finish(tracked, ok=False, status=400)
            self._fail(result, 400)
            return
        # Latencies count from arrival: time spent waiting in flow control included.
        self._tracked[llm.request_id] = _Tracked(req, tracked, result, result.arrival_s, flow)
        if not self._busy[address]:
            self._busy[address] = True
            self._push(self.now, _STEP_START, address)

    def _fail(self, result: RequestResult, status: int) -> None:
        result.ok = False
        result.status = status
        self._pending -= 1
        if self._on_done is not None:
            self._on_done(result)

    # -------------------------------------------------------------------- engines
    def _start_step(self, address: str) -> None:
        engine = self.pool.engines[address]
        if not engine.has_unfinished():
            self._busy[address] = False
            return
        outcome = engine.step(self.now)
        if outcome.duration <= 0 and not outcome.progress:
            # Nothing could be scheduled (all waiting requests blocked); the next arrival
            # or finished step wakes the engine again.
            self._busy[address] = False
            if outcome.events:
                self._publish(address, outcome)
            return
        self._push(outcome.end, _STEP_DONE, (address, outcome))

    def _publish(self, address: str, outcome: StepOutcome) -> None:
        if self.policy.kv_events is None or not outcome.events:
            return
        payload = encode_batch(outcome.events, outcome.end)
        seq = self._kv_seq[address]
        self._kv_seq[address] = seq + 1
        self._push(
            outcome.end + self.config.kv_event_delay_s, _KV_DELIVERY, (address, seq, payload)
        )

    def _finish_step(self, address: str, outcome: StepOutcome) -> None:
        self._publish(address, outcome)
        for p in outcome.progress:
            t = self._tracked.get(p.request_id)
            if t is None:
                continue
            if p.first_token:
                t.first_token_at = outcome.end
                t.result.cached_tokens = p.num_cached_tokens
                t.picker.first_byte(t.flow)
            if p.finished:
                del self._tracked[p.request_id]
                self._complete(t, outcome.end, p.num_prompt_tokens, p.num_cached_tokens)
        self._start_step(address)

    def _complete(self, t: _Tracked, end: float, prompt_tokens: int, cached: int) -> None:
        r = t.result
        r.ok = True
        r.status = 200
        r.ttft_s = (t.first_token_at if t.first_token_at is not None else end) - t.arrival
        r.e2e_s = end - t.arrival
        r.output_tokens = t.req.output_tokens
        r.prompt_tokens = prompt_tokens
        r.cached_tokens = cached
        self._pending -= 1
        usage = Usage(
            prompt_tokens=prompt_tokens, completion_tokens=r.output_tokens, cached_tokens=cached
        )
        t.picker.finish(t.flow, ok=True, status=200, usage=usage)
        if self._on_done is not None:
            self._on_done(r)

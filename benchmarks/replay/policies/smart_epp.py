"""smart-epp's real scheduler in the simulation: any EndpointPickerConfig (built-in name or
file), its real KV index fed through the real event stream (decoder, ingest, sequence
tracking), on the simulation's virtual clock; alone, or as several pickers of one pool
sharing state through the real shared-state code and an in-process store."""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client import CollectorRegistry

from ....epp.scheduler import PipelineScheduler, build_scheduler
from ....epp.shared_state.store import LocalPoolStore
from ....epp.shared_state.wiring import connect_shared_state
from ....kv_index.ingest import IngestState
from ....kv_index.memory import DEFAULT_SPECULATIVE_TTL_S, MemoryBlockIndex
from ....kv_index.subscriber import PodEventStream
from ..sim import RoutedPolicy
from .context import PolicyContext, policy_label

PICKER_SEED_STRIDE = 7919  # a prime: pickers' seeds stay apart from other runs' seeds


def build_config_policy(name: str, ctx: PolicyContext) -> RoutedPolicy:
    return _build(name, ctx, MemoryBlockIndex(clock=ctx.clock))


def build_config_pickers(name: str, ctx: PolicyContext, count: int) -> list[RoutedPolicy]:
    """`count` pickers of one pool, as `epp serve --shared-state` replicas: each with its
    own block index (fed every pod's events), view of the pods and learning, sharing
    in-flight loads, routed prefixes and learned answers through one store."""
    store = LocalPoolStore(clock=ctx.clock)
    pickers = []
    for i in range(count):
        datastore = ctx.pool.datastore if i == 0 else ctx.pool.add_view()
        index = MemoryBlockIndex(clock=ctx.clock)
        shared, scheduler_index = connect_shared_state(
            "local",
            url="",
            pool_name="replay",
            datastore=datastore,
            index=index,
            registry=CollectorRegistry(),
            interval_s=ctx.pool.config.sync_interval_s,
            speculative_ttl_s=DEFAULT_SPECULATIVE_TTL_S,
            notices=False,  # the simulation runs every exchange on its own schedule
            store=store,
            picker_id=f"picker-{i}",
            clock=ctx.clock,
        )
        assert shared is not None  # a store was given
        # Each replica draws its own coin tosses (ties), as separate processes do.
        own = ctx if i == 0 else dataclasses.replace(ctx, seed=ctx.seed + PICKER_SEED_STRIDE * i)
        policy = _build(name, own, scheduler_index, index)
        assert isinstance(policy.scheduler, PipelineScheduler)  # _build's is one
        shared.share_learning(policy.scheduler.plugins.plugins.values)
        policy.datastore = datastore
        policy.sync = shared.sync_once
        pickers.append(policy)
    return pickers


def _build(
    name: str, ctx: PolicyContext, index: Any, events_index: Any | None = None
) -> RoutedPolicy:
    """`index` is what the scheduler writes through; KV events go to `events_index`
    (default: the same)."""
    ingest = IngestState()
    streams = {
        address: PodEventStream(
            address, ctx.model, ingest, events_index or index, wall_clock=ctx.clock
        )
        for address in ctx.pool.engines
    }

    scheduler = build_scheduler(
        name,
        index=index,
        tokenizer=False,  # replayed requests carry their token ids
        ingest_state=ingest,
        base_model=ctx.model,
        clock=ctx.clock,
        seed=ctx.seed,
        # What `epp serve` reads from each pod's /v1/models.
        context_limit_of=(
            (lambda address: ctx.pool.engines[address].max_model_len)
            if ctx.context_limits
            else None
        ),
    )

    async def deliver(pod: str, seq: int, payload: bytes) -> None:
        await streams[pod].handle(seq, payload)

    return RoutedPolicy(policy_label(name), scheduler, kv_events=deliver)


__all__ = ["build_config_pickers", "build_config_policy"]

"""smart-epp's real scheduler in the simulation: any EndpointPickerConfig (built-in name or
file), its real KV index fed through the real event stream (decoder, ingest, sequence
tracking), on the simulation's virtual clock."""

from __future__ import annotations

from ....epp.scheduler import build_scheduler
from ....kv_index.ingest import IngestState
from ....kv_index.memory import MemoryBlockIndex
from ....kv_index.subscriber import PodEventStream
from ..sim import RoutedPolicy
from .context import PolicyContext, policy_label


def build_config_policy(name: str, ctx: PolicyContext) -> RoutedPolicy:
    index = MemoryBlockIndex(clock=ctx.clock)
    ingest = IngestState()
    streams = {
        address: PodEventStream(address, ctx.model, ingest, index, wall_clock=ctx.clock)
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
    )

    async def deliver(pod: str, seq: int, payload: bytes) -> None:
        await streams[pod].handle(seq, payload)

    return RoutedPolicy(policy_label(name), scheduler, kv_events=deliver)

"""Two pickers' datastores and block indexes joined through the shared pool state:
what one books or routes, the other sees; a store outage leaves each routing on its own
state, and the store's return reconciles them. Outages use a real Redis-protocol server
stopped and restarted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry
from support.net import async_wait_until
from support.redis_server import RedisServer, redis_server_fixture

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.shared_state.redis_store import RedisPoolStore
from smart_epp.epp.shared_state.store import LocalPoolStore, PoolStateStore
from smart_epp.epp.shared_state.sync import CounterRates, PublishingIndex, SharedPoolState
from smart_epp.framework.types import Endpoint
from smart_epp.kv_index.memory import MemoryBlockIndex
from smart_epp.scorers.predicted_ttft_scorer import PredictedTTFTParams, PredictedTTFTScorer
from smart_epp.scorers.ttft_model import Snapshot

redis_server = redis_server_fixture
PODS = ["10.0.0.1:8000", "10.0.0.2:8000"]


@dataclass
class Picker:
    datastore: Datastore
    index: MemoryBlockIndex
    scheduler_index: PublishingIndex
    shared: SharedPoolState
    registry: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def make_picker(store: PoolStateStore, name: str) -> Picker:
    datastore = Datastore()
    datastore.set_endpoints(Endpoint(address) for address in PODS)
    index = MemoryBlockIndex(10_000)
    registry = CollectorRegistry()
    shared = SharedPoolState(
        store, datastore, index=index, picker_id=name, interval_s=0.02, retry_s=0.05,
        timeout_s=0.3, registry=registry,
    )  # fmt: skip
    return Picker(datastore, index, PublishingIndex(index, shared), shared, registry)


@pytest.fixture
async def local_pickers() -> AsyncIterator[tuple[Picker, Picker]]:
    store = LocalPoolStore()
    a, b = make_picker(store, "a"), make_picker(store, "b")
    a.shared.start()
    b.shared.start()
    yield a, b
    await a.shared.close()
    await b.shared.close()


async def test_a_booking_on_one_picker_shows_in_the_others_counts(
    local_pickers: tuple[Picker, Picker],
) -> None:
    a, b = local_pickers
    a.datastore.book(PODS[0], 500, None)
    a.datastore.book(PODS[0], 300, None)
    b.datastore.book(PODS[0], 100, None)
    seen = b.datastore.get(PODS[0])
    assert seen is not None

    await async_wait_until(lambda: seen.inflight.requests == 3, 5, "b seeing a's bookings")
    assert (seen.inflight.peer_requests, seen.inflight.peer_prefilling_tokens) == (2, 800)
    assert seen.inflight.prompt_tokens == 900
    assert b.datastore.own_load(PODS[0]) == (1, 100, 1, 100, 0.0)
    assert b.metric("smart_epp_shared_state_peer_inflight_requests", pod=PODS[0]) == 2

    a.datastore.prefilled(PODS[0], 500)
    a.datastore.release(PODS[0], 500, None)
    await async_wait_until(lambda: seen.inflight.requests == 2, 5, "b seeing a's release")
    assert seen.inflight.peer_prefilling == 1
    a.datastore.release(PODS[0], 300, None, prefilling=True)
    await async_wait_until(lambda: seen.inflight.peer_requests == 0, 5, "a's load gone")
    assert seen.inflight.requests == 1  # b's own booking is untouched


async def test_prefill_one_picker_routes_reaches_the_other_as_a_rate(
    local_pickers: tuple[Picker, Picker],
) -> None:
    a, b = local_pickers
    seen = b.datastore.get(PODS[0])
    assert seen is not None
    a.datastore.book(PODS[0], 100, None, prefill_s=5.0)
    # A counter first seen says nothing of when it grew: no rate yet.
    await async_wait_until(lambda: seen.inflight.peer_requests == 1, 5, "b seeing a")
    assert seen.inflight.peer_prefill_rate == 0.0
    a.datastore.book(PODS[0], 100, None, prefill_s=0.3)
    a.datastore.book(PODS[0], 100, None, prefill_s=0.3)
    await async_wait_until(lambda: seen.inflight.peer_requests == 3, 5, "b seeing a's rate")
    # 0.6 s of prefill routed: read over at least the one-second window (longer when an
    # exchange came late), so at most 0.6 per second.
    assert 0.4 < seen.inflight.peer_prefill_rate <= 0.6 + 1e-9
    assert b.datastore.own_load(PODS[0])[4] == 0.0  # b itself routed none
    assert a.datastore.own_load(PODS[0])[4] == pytest.approx(5.6)
    # Once a routes nothing for a window, the rate falls back to 0.
    await async_wait_until(lambda: seen.inflight.peer_prefill_rate == 0.0, 5, "rate decays")


async def test_what_one_picker_learns_of_the_pods_the_other_learns_too(
    local_pickers: tuple[Picker, Picker],
) -> None:
    """Only a's pods answered: b, which answered nothing, prices them as a does (same
    prior, same answers in the same order: the same fit), and a third scorer that is not
    sharing still holds its prior."""
    a, b = local_pickers
    scorers = [PredictedTTFTScorer("ttft", PredictedTTFTParams()) for _ in range(3)]
    a.shared.share_learning(lambda: [scorers[0]])
    b.shared.share_learning(lambda: [scorers[1]])
    for i in range(40):
        prompt = 500 + 100 * i
        # A pod computing 25k tokens/s with 10 ms fixed cost; the prior says 10k/s.
        ttft = 0.010 + prompt / 25_000
        scorers[0].observe(PODS[i % 2], ttft, prompt, 0, Snapshot(0.0, 0.0, 0.0))

    def learned(scorer: PredictedTTFTScorer) -> dict[str, float]:
        return scorer.learned_cold_ttft(4_000)

    await async_wait_until(lambda: learned(scorers[1]) == learned(scorers[0]), 5, "b learning")
    assert learned(scorers[0])[PODS[0]] == pytest.approx(0.010 + 4_000 / 25_000, rel=0.1)
    assert learned(scorers[2]) == {}
    assert b.metric("smart_epp_shared_state_learned_samples_total", direction="applied") == 40
    assert a.metric("smart_epp_shared_state_learned_samples_total", direction="published") == 40


def test_counter_rates_read_a_window_and_restart_when_a_counter_shrinks() -> None:
    rates = CounterRates(window_s=1.0)
    assert rates.update(0.0, {"p": 10.0}) == {"p": 0.0}
    assert rates.update(0.5, {"p": 10.5}) == {"p": pytest.approx(0.5)}  # over a whole window
    assert rates.update(2.0, {"p": 12.5}) == {"p": pytest.approx(2.0 / 1.5)}
    assert rates.update(3.0, {"p": 14.5}) == {"p": pytest.approx(2.0)}
    assert rates.update(3.5, {"p": 1.0}) == {"p": 0.0}  # a peer left: its count went
    assert rates.update(4.0, {}) == {}
    assert rates.update(4.5, {"p": 3.0}) == {"p": 0.0}  # forgotten while absent


async def test_a_prefix_routed_by_one_picker_is_held_on_the_other(
    local_pickers: tuple[Picker, Picker],
) -> None:
    a, b = local_pickers
    keys = [11, 12, 13, 14]
    a.scheduler_index.add_speculative_sync(PODS[1], keys, 2.0)

    async def held() -> bool:
        return (await b.index.lookup(keys)).get(PODS[1]) is not None

    await async_wait_until(held, 5, "b holding a's routed prefix")
    assert (await b.index.lookup(keys))[PODS[1]].blocks == 4
    assert b.metric("smart_epp_shared_state_routed_entries_total", direction="applied") == 1
    # Applied to b's index directly, not echoed back to the store.
    assert b.metric("smart_epp_shared_state_routed_entries_total", direction="published") == 0


@pytest.mark.redis
async def test_store_outage_falls_back_to_local_state_and_reconciles(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    a = make_picker(RedisPoolStore.from_url(url, pool_name="p"), "a")
    b = make_picker(RedisPoolStore.from_url(url, pool_name="p"), "b")
    a.shared.start()
    b.shared.start()
    try:
        pod_on_b = b.datastore.get(PODS[0])
        assert pod_on_b is not None
        a.datastore.book(PODS[0], 400, None)
        await async_wait_until(lambda: pod_on_b.inflight.peer_requests == 1, 5, "sharing")

        redis_server.stop()
        await async_wait_until(lambda: a.shared.up is False and b.shared.up is False, 10,
                               "both pickers noticing the outage")  # fmt: skip
        # Each routes on its own state: peers' loads are gone, its own bookings stay.
        assert pod_on_b.inflight.requests == 0
        b.datastore.book(PODS[0], 50, None)
        assert pod_on_b.inflight.requests == 1
        a.datastore.book(PODS[1], 70, None)  # made during the outage
        a.scheduler_index.add_speculative_sync(PODS[1], [21, 22], 5.0)
        assert b.metric("smart_epp_shared_state_up") == 0
        assert b.metric("smart_epp_shared_state_transitions_total", to="down") == 1

        redis_server.start()  # empty, on the same port
        await async_wait_until(lambda: a.shared.up is True and b.shared.up is True, 10,
                               "both pickers reconnecting")  # fmt: skip
        pod1_on_b = b.datastore.get(PODS[1])
        assert pod1_on_b is not None
        await async_wait_until(
            lambda: pod_on_b.inflight.requests == 2 and pod1_on_b.inflight.requests == 1,
            5,
            "b seeing a's whole table again",
        )

        async def held() -> bool:
            return (await b.index.lookup([21, 22])).get(PODS[1]) is not None

        await async_wait_until(held, 5, "the outage's routed prefix reaching b")
        a_on_b = a.datastore.get(PODS[0])
        assert a_on_b is not None
        await async_wait_until(lambda: a_on_b.inflight.peer_requests == 1, 5, "a seeing b")
        assert b.metric("smart_epp_shared_state_transitions_total", to="up") == 2
        assert a.shared.outages == 1
    finally:
        await a.shared.close()
        await b.shared.close()

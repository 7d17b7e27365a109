"""Two pickers' datastores and block indexes joined through the shared pool state:
what one books or routes, the other sees; a store outage leaves each routing on its own
state, and the store's return reconciles them. Outages use a real Redis-protocol server
stopped and restarted."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from support.http_server import LocalHTTPServer
from support.net import async_wait_until
from support.paths import VLLM_FIXTURES
from support.redis_server import RedisServer, redis_server_fixture

from smart_epp.epp.datastore import Datastore
from smart_epp.epp.scrape import MetricsScraper
from smart_epp.epp.shared_state.redis_store import RedisPoolStore
from smart_epp.epp.shared_state.store import LocalPoolStore, PoolStateStore
from smart_epp.epp.shared_state.sync import (
    NOTICE_BURST,
    CounterRates,
    Pacer,
    PublishingIndex,
    SharedPoolState,
    per_pod,
)
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


def make_picker(store: PoolStateStore, name: str, **options: Any) -> Picker:
    datastore = Datastore()
    datastore.set_endpoints(Endpoint(address) for address in PODS)
    index = MemoryBlockIndex(10_000)
    registry = CollectorRegistry()
    options = {"interval_s": 0.02, "retry_s": 0.05, "timeout_s": 0.3} | options
    shared = SharedPoolState(
        store, datastore, index=index, picker_id=name, registry=registry, **options
    )
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


async def test_a_peer_joining_with_its_whole_count_brings_no_rate() -> None:
    # A picker that (re)joins the store, as every picker does once an emptied store is
    # back, writes its whole routed-prefill count at once: that is history, not a rate.
    store = LocalPoolStore()
    a, reader = make_picker(store, "a"), make_picker(store, "reader")
    late = make_picker(store, "late")
    seen = reader.datastore.get(PODS[0])
    assert seen is not None
    a.datastore.book(PODS[0], 100, None, prefill_s=5.0)
    late.datastore.book(PODS[0], 100, None, prefill_s=7.0)
    a.shared.start()
    reader.shared.start()
    try:
        await async_wait_until(lambda: seen.inflight.peer_requests == 1, 5, "reader seeing a")
        late.shared.start()
        await async_wait_until(lambda: seen.inflight.peer_requests == 2, 5, "reader seeing late")
        assert seen.inflight.peer_prefill_rate == 0.0
        a.datastore.book(PODS[0], 100, None, prefill_s=0.5)
        await async_wait_until(lambda: seen.inflight.peer_requests == 3, 5, "a's new booking")
        assert 0.3 < seen.inflight.peer_prefill_rate <= 0.5 + 1e-9  # only what is new
    finally:
        for picker in (a, reader, late):
            await picker.shared.close()


def test_counter_rates_are_summed_per_pod_over_peers() -> None:
    rates: CounterRates[tuple[str, str]] = CounterRates(window_s=1.0)
    rates.update(0.0, {("a", "p"): 10.0, ("a", "q"): 1.0})
    read = rates.update(1.0, {("a", "p"): 11.0, ("a", "q"): 1.0, ("b", "p"): 40.0})
    assert per_pod(read) == {"p": pytest.approx(1.0), "q": 0.0}


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


def test_a_pacer_lets_a_burst_through_then_one_per_interval() -> None:
    pacer = Pacer(interval_s=0.02, burst=3)
    for _ in range(3):
        assert pacer.wait(10.0) == 0.0
        pacer.take(10.0)
    assert pacer.wait(10.0) == pytest.approx(0.02)
    assert pacer.wait(10.01) == pytest.approx(0.01)
    assert pacer.wait(10.02) == 0.0
    pacer.take(10.02)
    assert pacer.wait(10.02) == pytest.approx(0.02)
    assert pacer.wait(20.0) == 0.0  # refilled while quiet, never past the burst
    for _ in range(3):
        pacer.take(20.0)
    assert pacer.wait(20.0) > 0.0


def test_counter_rates_read_a_window_and_restart_when_a_counter_shrinks() -> None:
    rates = CounterRates(window_s=1.0)
    assert rates.update(0.0, {"p": 10.0}) == {"p": 0.0}
    assert rates.update(0.5, {"p": 10.5}) == {"p": pytest.approx(0.5)}  # over a whole window
    assert rates.update(2.0, {"p": 12.5}) == {"p": pytest.approx(2.0 / 1.5)}
    assert rates.update(3.0, {"p": 14.5}) == {"p": pytest.approx(2.0)}
    assert rates.update(3.5, {"p": 1.0}) == {"p": 0.0}  # the counter restarted
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


async def test_a_routed_prefix_keeps_its_life_on_the_other_picker() -> None:
    # A prompt predicted to wait in a pod's queue is routed with a long speculative life;
    # the other picker counts it held for that life too (what is left of it), in virtual
    # time, so that its own followers of that prefix find the pod before it computes it.
    now = [100.0]

    def clock() -> float:
        return now[0]

    store = LocalPoolStore(clock=clock)
    a = make_picker(store, "a", clock=clock)
    b = make_picker(store, "b", clock=clock)
    a.index = MemoryBlockIndex(10_000, clock=clock)
    b.index = b.shared.index = MemoryBlockIndex(10_000, clock=clock)
    scheduler_index = PublishingIndex(a.index, a.shared)
    keys = [31, 32, 33]
    scheduler_index.add_speculative_sync(PODS[0], keys, 12.0)
    now[0] += 1.0
    assert await a.shared.sync_once() and await b.shared.sync_once()
    now[0] += 9.0  # 10 s after routing: long past the default 2 s life
    assert (await b.index.lookup(keys))[PODS[0]].blocks == 3
    now[0] += 2.5
    assert await b.index.lookup(keys) == {}


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


# A heartbeat no test waits out: whatever a picker reads within a test, a notice woke.
NO_HEARTBEAT_S = 600.0


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
async def quiet_pickers(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Picker, Picker]]:
    """Two pickers whose loops exchange only for their own changes and peers' notices."""
    if request.param == "local":
        store = LocalPoolStore()
        stores: list[PoolStateStore] = [store, store]
    else:
        server = request.getfixturevalue("redis_server")
        stores = [RedisPoolStore.from_url(server.url, pool_name="p") for _ in range(2)]
    a, b = (
        make_picker(store, name, interval_s=NO_HEARTBEAT_S, notice_gap_s=0.05)
        for store, name in zip(stores, "ab", strict=True)
    )
    a.shared.start()
    b.shared.start()
    await async_wait_until(
        lambda: (
            a.shared.up
            and b.shared.up
            and a.metric("smart_epp_shared_state_watching")
            and b.metric("smart_epp_shared_state_watching")
        ),
        5,
        "both pickers connected and subscribed",
    )
    yield a, b
    await a.shared.close()
    await b.shared.close()


async def test_a_peers_decision_reaches_a_picker_through_its_notice_not_its_heartbeat(
    quiet_pickers: tuple[Picker, Picker],
) -> None:
    a, b = quiet_pickers
    keys = [31, 32, 33]
    a.datastore.book(PODS[1], 300, None)
    a.scheduler_index.add_speculative_sync(PODS[1], keys, 5.0)
    seen = b.datastore.get(PODS[1])
    assert seen is not None

    async def held() -> bool:
        return (await b.index.lookup(keys)).get(PODS[1]) is not None

    await async_wait_until(held, 5, "b holding a's routed prefix")
    await async_wait_until(lambda: seen.inflight.peer_requests == 1, 5, "b seeing a's booking")
    assert a.metric("smart_epp_shared_state_notices_total", direction="sent") >= 1
    assert b.metric("smart_epp_shared_state_notices_total", direction="received") >= 1
    # b changed nothing, so it sent no notice, and a read nothing new of b's.
    assert b.metric("smart_epp_shared_state_notices_total", direction="sent") <= 1  # first
    # Work leaving a pod wakes no exchange and sends no notice: it rides a's next one.
    sent = a.metric("smart_epp_shared_state_notices_total", direction="sent")
    a.datastore.release(PODS[1], 300, None, prefilling=True)
    assert not a.shared._wake.is_set()  # the release woke nothing
    a.datastore.book(PODS[0], 100, None)
    await async_wait_until(lambda: seen.inflight.peer_requests == 0, 5, "b seeing the release")
    assert a.metric("smart_epp_shared_state_notices_total", direction="sent") == sent + 1


async def test_a_burst_of_changes_is_announced_and_read_at_most_once_per_gap(
    quiet_pickers: tuple[Picker, Picker],
) -> None:
    """a changes its load 40 times, each in its own exchange: past the first burst it
    sends at most one notice per gap, b exchanges at most once per gap, and b still ends
    up with every change (the last one's notice went out when its turn came)."""
    a, b = quiet_pickers
    seen = b.datastore.get(PODS[0])
    assert seen is not None
    before = b.shared.exchanges
    started = time.monotonic()
    for i in range(40):
        # One change per exchange of a's: each is its own notice.
        exchanged = a.shared.exchanges
        a.datastore.book(PODS[0], 10, None)
        await async_wait_until(lambda n=exchanged: a.shared.exchanges > n, 5, f"a's {i}th")
    await async_wait_until(lambda: seen.inflight.peer_requests == 40, 5, "b seeing all 40")
    elapsed = time.monotonic() - started
    woken = b.shared.exchanges - before
    sent = a.metric("smart_epp_shared_state_notices_total", direction="sent")
    # A burst, then one per 0.05 s (the fixture's gap).
    assert 2 <= sent <= NOTICE_BURST + elapsed / 0.05 + 1, (sent, elapsed)
    assert woken <= NOTICE_BURST + elapsed / 0.05 + 2, (woken, elapsed)
    assert sent < 40 and woken < 40


@pytest.mark.redis
async def test_notices_come_back_after_a_store_outage(redis_server: RedisServer) -> None:
    a, b = (
        make_picker(RedisPoolStore.from_url(redis_server.url, pool_name="p"), name,
                    interval_s=0.05, notice_gap_s=0.0)
        for name in "ab"
    )  # fmt: skip
    a.shared.start()
    b.shared.start()
    try:
        watching = "smart_epp_shared_state_watching"
        await async_wait_until(lambda: b.metric(watching) == 1, 5, "b subscribed")
        redis_server.stop()
        await async_wait_until(lambda: b.metric(watching) == 0, 10, "b's subscription lost")
        redis_server.start()
        await async_wait_until(lambda: b.metric(watching) == 1, 10, "b subscribed again")
        await async_wait_until(lambda: a.shared.up is True, 10, "a reconnected")
        received = b.metric("smart_epp_shared_state_notices_total", direction="received")
        a.datastore.book(PODS[0], 10, None)
        await async_wait_until(
            lambda: (
                b.metric("smart_epp_shared_state_notices_total", direction="received") > received
            ),
            5,
            "a's notice reaching b after the outage",
        )
    finally:
        await a.shared.close()
        await b.shared.close()


class MetricsPage(LocalHTTPServer):
    """A pod's /metrics page, which the test rewrites."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.page = page

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.page, content_type="text/plain")

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self._metrics)


async def test_a_changed_metrics_page_reaches_the_picker_that_does_not_fetch_it() -> None:
    """One pod, two pickers sharing its scrapes, no heartbeat within the test and no
    takeover of a quiet owner: a page that changes reaches the picker that does not fetch
    it through the fetching picker's change notice."""
    page = (VLLM_FIXTURES / "basic" / "metrics.during.txt").read_text()
    waiting = 'vllm:num_requests_waiting{engine="0",model_name="tiny"} '
    assert waiting + "0.0" in page
    server = MetricsPage(page)
    await server.start()
    store = LocalPoolStore()
    pickers: list[tuple[SharedPoolState, MetricsScraper, Datastore, CollectorRegistry]] = []
    for name in "ab":
        datastore = Datastore()
        datastore.set_endpoints([Endpoint(server.address)])
        registry = CollectorRegistry()
        shared = SharedPoolState(
            store, datastore, picker_id=name, interval_s=NO_HEARTBEAT_S, notice_gap_s=0.01,
            registry=registry,
        )  # fmt: skip
        scraper = MetricsScraper(datastore, interval_s=0.02, stale_after_s=NO_HEARTBEAT_S)
        shared.share_scrapes(scraper)
        pickers.append((shared, scraper, datastore, registry))
    try:
        for shared, scraper, _, _ in pickers:
            shared.start()
            await scraper.start()

        def fetching() -> list[float]:
            return [
                registry.get_sample_value("smart_epp_shared_state_fetched_pods") or 0.0
                for *_, registry in pickers
            ]

        await async_wait_until(lambda: sorted(fetching()) == [0.0, 1.0], 5, "one fetcher")
        pods = [datastore.pods()[0] for _, _, datastore, _ in pickers]
        server.page = page.replace(waiting + "0.0", waiting + "9.0")
        await async_wait_until(
            lambda: all(pod.metrics.waiting == 9 for pod in pods), 5, "both seeing the change"
        )
        assert sorted(fetching()) == [0.0, 1.0]  # the other never fetched it itself
    finally:
        for shared, scraper, _, _ in pickers:
            await scraper.stop()
            await shared.close()
        await server.stop()

"""The pool-state store's exchange, the same contract on the in-process store and on a
real Redis-protocol server: peers see each other's loads and routed prefixes, never
their own, once each; a picker that stops exchanging is forgotten; an emptied store is
noticed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio
import redis.exceptions
from support.net import async_wait_until
from support.redis_server import RedisServer, redis_server_fixture

from smart_epp.epp.shared_state.redis_store import RedisPoolStore
from smart_epp.epp.shared_state.store import (
    LocalPoolStore,
    PickerUpdate,
    PodLoad,
    PoolStateStore,
    RoutedEntry,
    SharedScrape,
    decode_learned,
    decode_scrape,
    encode_learned,
    encode_scrape,
)
from smart_epp.framework.plugins import LearnedSample
from smart_epp.framework.types import PodMetrics

redis_server = redis_server_fixture

StoreFactory = Callable[..., PoolStateStore]


@pytest.fixture(params=["local", "redis"])
async def stores(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """A factory of stores that share one backing store (one per picker, as in life)."""
    made: list[PoolStateStore] = []
    if request.param == "local":
        local = LocalPoolStore(picker_ttl_s=0.3)

        def factory() -> PoolStateStore:
            return local

        yield factory
        return
    server: RedisServer = request.getfixturevalue("redis_server")

    def redis_factory() -> PoolStateStore:
        store = RedisPoolStore.from_url(server.url, pool_name="p", picker_ttl_s=0.3)
        made.append(store)
        return store

    yield redis_factory
    for store in made:
        await store.close()


async def test_peers_see_each_others_loads_not_their_own(stores: StoreFactory) -> None:
    a, b = stores(), stores()
    await a.exchange(PickerUpdate("a", {"pod1": PodLoad(2, 300, 1, 100)}, replace=True))
    view_b = await b.exchange(PickerUpdate("b", {"pod1": PodLoad(1, 10, 1, 10)}, replace=True))
    assert view_b.loads == {"pod1": PodLoad(2, 300, 1, 100)}
    assert view_b.peers == 1
    view_a = await a.exchange(PickerUpdate("a", {"pod2": PodLoad(1, 5, 0, 0)}))
    assert view_a.loads == {"pod1": PodLoad(1, 10, 1, 10)}
    # A changed pod2 only: pod1 stays as written; an empty load removes the pod.
    view_b = await b.exchange(PickerUpdate("b", {}))
    assert view_b.loads == {"pod1": PodLoad(2, 300, 1, 100), "pod2": PodLoad(1, 5, 0, 0)}
    await a.exchange(PickerUpdate("a", {"pod1": PodLoad()}))
    view_b = await b.exchange(PickerUpdate("b", {}))
    assert view_b.loads == {"pod2": PodLoad(1, 5, 0, 0)}


async def test_each_peers_prefill_counter_comes_apart_from_the_sum(
    stores: StoreFactory,
) -> None:
    a, b, c = stores(), stores(), stores()
    await a.exchange(PickerUpdate("a", {"pod1": PodLoad(1, 10, 1, 10, 4.5)}, replace=True))
    await b.exchange(PickerUpdate("b", {"pod1": PodLoad(2, 20, 0, 0, 1.25)}, replace=True))
    view = await c.exchange(PickerUpdate("c", {}, replace=True))
    assert view.loads["pod1"].routed_prefill_s == pytest.approx(5.75)
    assert view.routed_prefill_s == {("a", "pod1"): 4.5, ("b", "pod1"): 1.25}


async def test_routed_entries_reach_every_other_picker_once(stores: StoreFactory) -> None:
    a, b, c = stores(), stores(), stores()
    for store, name in ((a, "a"), (b, "b"), (c, "c")):
        await store.exchange(PickerUpdate(name, {}, replace=True))
    entry = RoutedEntry("pod1", (1, 2**64 - 1, 3), 2.0)
    view_a = await a.exchange(PickerUpdate("a", {}, [entry]))
    assert view_a.routed == []  # never its own
    for store, name in ((b, "b"), (c, "c")):
        view = await store.exchange(PickerUpdate(name, {}))
        [got] = view.routed
        assert (got.pod, got.keys) == ("pod1", entry.keys)
        assert 1.0 < got.ttl_s <= 2.0
        assert (await store.exchange(PickerUpdate(name, {}))).routed == []


async def test_expired_routed_entries_are_not_delivered(stores: StoreFactory) -> None:
    a, b = stores(), stores()
    await b.exchange(PickerUpdate("b", {}, replace=True))
    await a.exchange(PickerUpdate("a", {}, [RoutedEntry("pod1", (7,), 0.05)], replace=True))
    await asyncio.sleep(0.1)  # the entry's own lifetime is what is under test
    assert (await b.exchange(PickerUpdate("b", {}))).routed == []


async def test_a_picker_that_stops_exchanging_is_forgotten(stores: StoreFactory) -> None:
    a, b = stores(), stores()
    await a.exchange(PickerUpdate("a", {"pod1": PodLoad(3, 30, 3, 30)}, replace=True))
    view = await b.exchange(PickerUpdate("b", {}, replace=True))
    assert view.loads["pod1"].requests == 3

    async def forgotten() -> bool:
        view = await b.exchange(PickerUpdate("b", {}))
        return view.loads == {} and view.peers == 0

    await async_wait_until(forgotten, 5, "a's entry expiring")


@pytest.mark.redis
async def test_an_emptied_store_is_noticed(redis_server: RedisServer) -> None:
    store = RedisPoolStore.from_url(redis_server.url, pool_name="p")
    try:
        first = await store.exchange(PickerUpdate("a", {}, replace=True))
        assert not first.store_reset
        assert not (await store.exchange(PickerUpdate("a", {}))).store_reset
        redis_server.stop()
        redis_server.start()
        view = None
        for _ in range(3):  # the first call after the restart finds its connection closed
            try:
                view = await store.exchange(PickerUpdate("a", {}))
                break
            except redis.exceptions.ConnectionError:
                continue
        assert view is not None and view.store_reset
        assert not (await store.exchange(PickerUpdate("a", {}, replace=True))).store_reset
    finally:
        await store.close()


async def test_learned_samples_reach_every_other_picker_once_and_late_joiners_too(
    stores: StoreFactory,
) -> None:
    a, b = stores(), stores()
    await a.exchange(PickerUpdate("a", {}, replace=True))
    await b.exchange(PickerUpdate("b", {}, replace=True))
    sample = LearnedSample("ttft", "pod1", (0.25, 1600.0, 0.0, 3200.0, 5.0e6, 2.0))
    view_a = await a.exchange(PickerUpdate("a", {}, learned=[sample]))
    assert view_a.learned == []  # never its own
    assert (await b.exchange(PickerUpdate("b", {}))).learned == [sample]
    assert (await b.exchange(PickerUpdate("b", {}))).learned == []  # once
    # A picker that starts now learns from what the others wrote before it came.
    late = stores()
    assert (await late.exchange(PickerUpdate("c", {}, replace=True))).learned == [sample]


@pytest.mark.redis
async def test_a_malformed_learned_batch_is_counted_and_dropped(redis_server: RedisServer) -> None:
    store = RedisPoolStore.from_url(redis_server.url, pool_name="p")
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await store.exchange(PickerUpdate("a", {}, replace=True))
        good = LearnedSample("ttft", "pod1", (0.1, 100.0, 0.0, 0.0, 0.0, 0.0))
        for blob in ("not json", '[["ttft", "pod1", ["NaN"]]]', encode_learned([good])):
            await client.xadd("smart-epp:{p}:learned", {"p": "intruder", "d": blob})
        view = await store.exchange(PickerUpdate("a", {}))
        assert view.malformed_learned == 2
        assert view.learned == [good]
    finally:
        await client.aclose()
        await store.close()


async def test_scrapes_reach_the_other_pickers_with_their_age_and_the_live_pickers_are_named(
    stores: StoreFactory,
) -> None:
    a, b = stores(), stores()
    await a.exchange(PickerUpdate("a", {}, replace=True))
    first = await b.exchange(PickerUpdate("b", {}, replace=True))
    assert first.peer_ids == ("a",)
    metrics = PodMetrics(waiting=3, running=7, kv_usage=0.25, running_adapters=frozenset({"x"}),
                         max_loras=2, block_size=16, num_gpu_blocks=900,
                         process_start_time=1234.5)  # fmt: skip
    payload = encode_scrape(metrics)
    view_a = await a.exchange(
        PickerUpdate("a", {}, scrapes=[SharedScrape("pod1", "a", 1, 0.2, payload)])
    )
    assert view_a.scrapes == []  # never its own
    [seen] = (await b.exchange(PickerUpdate("b", {}))).scrapes
    assert (seen.pod, seen.picker, seen.seq, seen.payload) == ("pod1", "a", 1, payload)
    assert 0.2 <= seen.age_s < 1.0
    assert decode_scrape(seen.payload) == metrics
    # Only the newest scrape of a pod is kept, and a picker that starts late gets it.
    failed = encode_scrape(None, 3)
    await a.exchange(PickerUpdate("a", {}, scrapes=[SharedScrape("pod1", "a", 2, 0.0, failed)]))
    late = await stores().exchange(PickerUpdate("c", {}, replace=True))
    assert [(s.seq, decode_scrape(s.payload)) for s in late.scrapes] == [(2, 3)]
    assert late.peer_ids == ("a", "b")


@pytest.mark.parametrize(
    "payload",
    ["not json", '{"m": [1, 2]}', '{"failed": -1}',
     '{"m": [-1, 0, 0.1, [], [], 0, null, null, 0, 0, null]}',
     '{"m": [0, 0, NaN, [], [], 0, null, null, 0, 0, null]}'],
)  # fmt: skip
def test_a_malformed_shared_scrape_is_refused(payload: str) -> None:
    with pytest.raises(ValueError, match="malformed shared scrape"):
        decode_scrape(payload)


async def test_change_notices_go_to_the_other_pickers_only_when_asked(
    stores: StoreFactory,
) -> None:
    a, b = stores(), stores()
    heard: dict[str, list[str]] = {"a": [], "b": []}
    subscribed: list[str] = []

    def watch(store: PoolStateStore, name: str) -> asyncio.Task[None]:
        notice = lambda: heard[name].append("notice")  # noqa: E731
        return asyncio.create_task(store.watch(name, notice, lambda: subscribed.append(name)))

    watches = [watch(a, "a"), watch(b, "b")]
    try:
        await async_wait_until(lambda: sorted(subscribed) == ["a", "b"], 5, "both subscribed")
        await a.exchange(PickerUpdate("a", {"pod1": PodLoad(1, 10, 1, 10)}, replace=True))
        await a.exchange(PickerUpdate("a", {"pod1": PodLoad(2, 20, 2, 20)}, notify=True))
        await async_wait_until(lambda: heard["b"], 5, "b hearing a's notice")
        # Notices arrive in the order sent: had the first exchange sent one, it would be
        # here by now. Nobody hears their own.
        await b.exchange(PickerUpdate("b", {}, notify=True))
        await async_wait_until(lambda: heard["a"], 5, "a hearing b's notice")
        assert heard == {"a": ["notice"], "b": ["notice"]}
    finally:
        for watch in watches:
            watch.cancel()
        await asyncio.gather(*watches, return_exceptions=True)


def test_records_about_a_request_keep_its_id_and_rows_of_other_shapes_are_refused() -> None:
    routed = LearnedSample("ttft", "pod1", (1.0, 900.0, 4.0e5, 0.09, 0.3), "req-7")
    answer = LearnedSample("ttft", "pod1", (0.1, 100.0, 0.0, 0.0, 0.0, 0.0))
    assert decode_learned(encode_learned([routed, answer])) == [routed, answer]
    for blob in ('[["ttft", "pod1", [1.0], "req-7", "extra"]]', '[["ttft", "pod1"]]'):
        with pytest.raises(ValueError, match="malformed"):
            decode_learned(blob)

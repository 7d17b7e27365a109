"""One picker's side of the shared pool state: publish what it decided, fold in what
the others decided, and keep routing on local state while the store is away.

The decision path never waits for the store. It books in-flight load and writes
speculative index entries locally, as a picker alone does; each such change wakes a
background loop that exchanges this picker's changes for its peers' state in one round
trip (changes made while an exchange is in flight ride the next one, so there is at
most one write per decision and usually fewer). An exchange that added work (a booking)
or routed prefixes sends the other pickers a change notice, and a notice wakes their
loops to read it: a lone decision reaches the other pickers about two round trips after
it was made. A /metrics page this picker fetched for the pool that differs from the pod's
last one is news too (`scrapes.ScrapeSharing.on_news`); an idle pool sends none.
Work leaving a pod (a first byte, a release) neither wakes the loop nor sends a notice:
it rides the next exchange, at most `interval_s` later. A peer that has not seen it yet
counts a request more on that pod for that long, which costs a placement little, while
announcing it would double or triple the exchanges every request causes on every peer.
Both ends are paced (`Pacer`): a picker sends, and reads for its peers' notices, at most
one time per `notice_gap_s` on average, with bursts of `NOTICE_BURST` at once. A quiet
pool's few notices (a request's booking, a changed scrape) thus go out and are read at
once; in a busy pool a change waits for the pace (a change made meanwhile is announced
when its turn comes), so a peer's state is at most about a gap (and a round trip) old
and costs at most one exchange per gap. Without bookings or notices the loop still
exchanges every `interval_s`: the heartbeat that keeps this picker's entry alive, writes
the work that left, brings in what sends no notice (unchanged scrapes, learned answers),
and is the fallback while the notices' connection is down.

Peers' loads are folded into the datastore's per-pod in-flight counts; their routed
prefixes go into the local block index as speculative entries with what is left of
their expiry; the records their learning plugins made (answers learned from, requests
routed and answered) go to this picker's instance of the same plugin (`SharedLearning`),
so every picker learns from them all and prices the pods' queues with all their requests;
their /metrics scrapes are applied as this picker's own (`scrapes.ScrapeSharing`).

Store outage: an exchange that fails or times out marks the store down (one log line,
a counter, the `smart_epp_shared_state_up` gauge); peers' loads are dropped, since
nothing refreshes them, and the picker routes on its own state. Routed entries made
meanwhile wait in a bounded outbox (expired ones dropped). When an exchange succeeds
again, the picker writes its whole load table and the outbox (reconcile), and logs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ...framework.plugins import LearnedSample, SharedLearning
from ..datastore import Datastore
from ..scrape import MetricsScraper
from .scrapes import ScrapeSharing
from .store import PeerView, PickerUpdate, PodLoad, PoolStateStore, RoutedEntry

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.1
# Notices are sent, and exchanges woken by them start, this far apart on average: in a
# busy pool a peer's decisions are about this old (plus a round trip) when a decision
# reads them, as with the 20 ms polling notices replaced, and a picker makes at most 50
# notice-driven exchanges a second (benchmarks/RESULTS.md: shared_state_freshness) ...
DEFAULT_NOTICE_GAP_S = 0.02
# ... after a burst of this many at once: a few requests' bookings, and a changed scrape,
# are announced and read without waiting.
NOTICE_BURST = 4
# Off by default (inf): decisions use what the background sync brought in. A finite
# value makes a decision read the store first unless an exchange started this recently,
# waiting at most `DEFAULT_READ_BUDGET_S`: fresher, but every such decision sleeps on a
# socket, and a busy machine is slow to wake a sleeping process (benchmarks/RESULTS.md).
DEFAULT_MAX_STALENESS_S = float("inf")
DEFAULT_READ_BUDGET_S = 0.001
DEFAULT_TIMEOUT_S = 0.5
DEFAULT_RETRY_S = 0.5
MAX_OUTBOX = 10_000
# Answers kept for the peers while the store is away: enough to tell them how the pods
# ran through a short outage, small enough to write in one exchange when it returns.
MAX_LEARNED_OUTBOX = 1_000
# Peers' routed prefill is read as a rate over this window, the window over which the
# predicted-TTFT scorer counts its own (UTILISATION_WINDOW_S), so the two add up.
PEER_RATE_WINDOW_S = 1.0


def new_picker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class SharedStateMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge(
            "smart_epp_shared_state_up",
            "1 while the shared pool-state store answers, 0 while this picker routes on "
            "local state alone",
            registry=registry,
        )
        self.transitions = Counter(
            "smart_epp_shared_state_transitions_total",
            "Shared pool-state store reachability changes, by the state entered",
            ["to"],
            registry=registry,
        )
        self.exchanges = Counter(
            "smart_epp_shared_state_exchanges_total",
            "Round trips to the shared pool-state store, by result",
            ["result"],
            registry=registry,
        )
        self.exchange_seconds = Histogram(
            "smart_epp_shared_state_exchange_seconds",
            "Duration of one exchange with the shared pool-state store",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5),
            registry=registry,
        )
        self.routed = Counter(
            "smart_epp_shared_state_routed_entries_total",
            "Routed-prefix entries: published by this picker, or applied from its peers",
            ["direction"],
            registry=registry,
        )
        self.learned = Counter(
            "smart_epp_shared_state_learned_samples_total",
            "Learning plugins' records (answers learned from, requests routed and answered): "
            "published by this picker, applied from its peers, or dropped (a malformed "
            "batch counts once)",
            ["direction"],
            registry=registry,
        )
        self.scrapes = Counter(
            "smart_epp_shared_state_scrapes_total",
            "Pod /metrics scrapes shared: published by this picker, applied from its "
            "peers, or dropped (malformed)",
            ["direction"],
            registry=registry,
        )
        self.fetched_pods = Gauge(
            "smart_epp_shared_state_fetched_pods",
            "Pods whose /metrics this picker fetches itself; its peers' scrapes of the "
            "others are applied",
            registry=registry,
        )
        self.peers = Gauge(
            "smart_epp_shared_state_peers",
            "Other live pickers sharing the pool state, at the last exchange",
            registry=registry,
        )
        self.notices = Counter(
            "smart_epp_shared_state_notices_total",
            "Change notices: sent by this picker's exchanges (it booked requests or "
            "routed prefixes), or received from its peers (each wakes an exchange)",
            ["direction"],
            registry=registry,
        )
        self.watching = Gauge(
            "smart_epp_shared_state_watching",
            "1 while this picker is subscribed to its peers' change notices; 0 while it "
            "reads their state only at its heartbeat",
            registry=registry,
        )
        self.peer_requests = Gauge(
            "smart_epp_shared_state_peer_inflight_requests",
            "Requests other pickers have in flight on the pod, at the last exchange",
            ["pod"],
            registry=registry,
        )


class Pacer:
    """A token bucket: on average one event per `interval_s`, up to `burst` at once."""

    def __init__(self, interval_s: float, burst: int) -> None:
        self.interval_s = interval_s
        self.burst = float(burst)
        self._tokens = float(burst)
        self._at = float("-inf")

    def _refill(self, now: float) -> None:
        if self.interval_s <= 0:
            self._tokens = self.burst
        else:
            self._tokens = min(self.burst, self._tokens + (now - self._at) / self.interval_s)
        self._at = now

    def wait(self, now: float) -> float:
        """Seconds until the next event may go (0: now)."""
        self._refill(now)
        # A hair short of a token counts as one: a timer set for the exact moment must
        # find it there despite rounding.
        if self._tokens >= 1.0 - 1e-9:
            return 0.0
        return (1.0 - self._tokens) * self.interval_s

    def take(self, now: float) -> None:
        self._refill(now)
        self._tokens -= 1.0


K = TypeVar("K", bound=Hashable)


class CounterRates(Generic[K]):
    """Rates of counters read at each exchange (per peer and pod: the peer's routed
    prefill seconds), over the last `window_s`. A counter seen for the first time has
    rate 0 until a second reading: a peer that joins (or writes again after a store
    outage) brings its whole count, which is no rate."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: dict[K, deque[tuple[float, float]]] = {}

    def update(self, now: float, totals: Mapping[K, float]) -> dict[K, float]:
        for key in self._samples.keys() - totals.keys():
            del self._samples[key]
        rates: dict[K, float] = {}
        for key, total in totals.items():
            samples = self._samples.setdefault(key, deque())
            if samples and total < samples[-1][1]:
                samples.clear()  # the counter restarted
            samples.append((now, total))
            while len(samples) > 1 and samples[1][0] <= now - self.window_s:
                samples.popleft()
            since, base = samples[0]
            # Over at least a whole window: a first sample moments old gives no spike.
            rates[key] = (total - base) / max(now - since, self.window_s)
        return rates


def per_pod(rates: Mapping[tuple[str, str], float]) -> dict[str, float]:
    """(peer, pod) rates summed per pod."""
    summed: dict[str, float] = {}
    for (_, pod), rate in rates.items():
        summed[pod] = summed.get(pod, 0.0) + rate
    return summed


class SharedPoolState:
    """Connects one picker's datastore and block index to a `PoolStateStore`."""

    def __init__(
        self,
        store: PoolStateStore,
        datastore: Datastore,
        *,
        index: Any = None,
        picker_id: str | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_s: float = DEFAULT_RETRY_S,
        max_staleness_s: float = DEFAULT_MAX_STALENESS_S,
        read_budget_s: float = DEFAULT_READ_BUDGET_S,
        notices: bool = True,
        notice_gap_s: float = DEFAULT_NOTICE_GAP_S,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.datastore = datastore
        # Injected so that the replay can run several pickers in virtual time.
        self._clock = clock
        # Peers' routed prefixes are written straight into this (untapped) index.
        self.index = index
        self.picker_id = picker_id or new_picker_id()
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.max_staleness_s = max_staleness_s
        self.read_budget_s = read_budget_s
        self.notices = notices
        self.notice_gap_s = notice_gap_s
        self._view_at = float("-inf")  # when the last successful exchange started
        self._noticed = False  # a peer's notice came since the last exchange started
        self._sending = Pacer(notice_gap_s, NOTICE_BURST)  # this picker's notices
        self._reading = Pacer(notice_gap_s, NOTICE_BURST)  # exchanges notices woke
        self._owe_notice = False  # a change went out unannounced: its notice is due
        self._notice_timer: asyncio.TimerHandle | None = None
        self._new_scrape = False  # a fetched page changed since the last exchange
        self._watch_task: asyncio.Task[None] | None = None
        self._current: asyncio.Task[bool] | None = None
        self.metrics = SharedStateMetrics(registry or CollectorRegistry())
        self.up: bool | None = None  # None until the first exchange
        self.outages = 0
        self.exchanges = 0
        self._changed: set[str] = set()
        self._added = False  # a booking since the last exchange: its notice is news
        self._published: dict[str, PodLoad] = {}
        self._replace = True
        # (monotonic time recorded, entry)
        self._outbox: deque[tuple[float, RoutedEntry]] = deque(maxlen=MAX_OUTBOX)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._peer_pods: set[str] = set()
        self._peer_prefill: CounterRates[tuple[str, str]] = CounterRates(PEER_RATE_WINDOW_S)
        self._plugins: Callable[[], Iterable[object]] = tuple
        self._learned_outbox: deque[LearnedSample] = deque(maxlen=MAX_LEARNED_OUTBOX)
        self.scrape_sharing: ScrapeSharing | None = None
        datastore.on_change = self._load_changed

    def share_scrapes(self, scraper: MetricsScraper) -> None:
        """Each pod's /metrics is fetched by one picker of the pool; the others apply
        its scrape through `scraper` (see `scrapes`)."""
        self.scrape_sharing = ScrapeSharing(
            self.picker_id,
            scraper,
            self.datastore,
            scrapes=self.metrics.scrapes,
            fetched_pods=self.metrics.fetched_pods,
        )
        if self.notices:
            self.scrape_sharing.on_news = self._scrape_news

    def _scrape_news(self) -> None:
        self._new_scrape = True
        self._wake.set()

    def share_learning(self, plugins: Callable[[], Iterable[object]]) -> None:
        """The scheduler's plugins (asked at each exchange, so a reloaded configuration's
        are used): those that learn hand their answers to the other pickers and get the
        other pickers' (matched by plugin name)."""
        self._plugins = plugins

    def _learners(self) -> dict[str, SharedLearning]:
        learners: dict[str, SharedLearning] = {}
        for plugin in self._plugins():
            if isinstance(plugin, SharedLearning):
                name = getattr(plugin, "name", None)
                if isinstance(name, str):
                    learners[name] = plugin
        return learners

    # ------------------------------------------------------------------ decision path

    def _load_changed(self, address: str, added: bool) -> None:
        self._changed.add(address)
        if added:
            self._added = True
            self._wake.set()
        elif not self.notices:
            self._wake.set()  # polling peers read the store as it is: keep it current

    async def refresh(self) -> None:
        """Before a decision: makes the peers' state at most `max_staleness_s` old, by
        joining the exchange in flight or starting one, waiting at most
        `read_budget_s`. Returns at once while the store is down (local state)."""
        if self.up is not True or self._clock() - self._view_at <= self.max_staleness_s:
            return
        task = self._kick()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), self.read_budget_s)

    def _kick(self) -> asyncio.Task[bool]:
        """The exchange in flight, or a new one: never two at once."""
        if self._current is None or self._current.done():
            self._current = asyncio.ensure_future(self.sync_once())
        return self._current

    def routed(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        """A prompt's blocks were marked held by `pod` on this picker: tell the others."""
        if keys and ttl_s > 0:
            self._outbox.append((self._clock(), RoutedEntry(pod, tuple(keys), ttl_s)))
            self._wake.set()

    # ------------------------------------------------------------------ the loop

    def start(self) -> None:
        self._wake.set()  # the first exchange (this picker's whole table) at once
        self._task = asyncio.create_task(self._run(), name="shared-pool-state")
        if self.notices:
            self._watch_task = asyncio.create_task(self._watch(), name="shared-state-notices")

    def _notice(self) -> None:
        self.metrics.notices.labels("received").inc()
        self._noticed = True
        self._wake.set()

    async def _watch(self) -> None:
        """Subscribed to the peers' change notices for as long as the store allows; the
        heartbeat carries their state meanwhile."""
        while not self._closing:
            try:
                await self.store.watch(
                    self.picker_id, self._notice, lambda: self.metrics.watching.set(1)
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("change notices: %s; subscribing again", exc)
            finally:
                self.metrics.watching.set(0)
            # Whatever came while unsubscribed is read by the next exchange.
            self._noticed = True
            self._wake.set()
            await asyncio.sleep(self.retry_s)

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
            self._watch_task = None
        if self._task is not None:
            # Python 3.11's wait_for can swallow a cancel that meets a wake-up; the flag
            # ends the loop then.
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._notice_timer is not None:
            self._notice_timer.cancel()
        if self._current is not None and not self._current.done():
            self._current.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._current
        await self.store.close()

    async def _run(self) -> None:
        while not self._closing:
            woken = True
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except TimeoutError:
                woken = False  # the heartbeat
            self._wake.clear()
            if self._closing:
                return
            own = (self._changed or self._outbox or self._replace or self._owe_notice
                   or self._new_scrape)  # fmt: skip
            if woken and not own:
                if not self._noticed:
                    continue  # the exchange since the wake-up read what woke it
                # Woken by peers alone: at the reading pace.
                wait = self._reading.wait(self._clock())
                if wait > 0:
                    await asyncio.sleep(wait)
                self._reading.take(self._clock())
            if not await asyncio.shield(self._kick()):
                await asyncio.sleep(self.retry_s)

    def _update(self) -> PickerUpdate:
        now = self._clock()
        routed: list[RoutedEntry] = []
        for recorded, entry in self._outbox:
            left = entry.ttl_s - (now - recorded)
            if left > 0:
                routed.append(RoutedEntry(entry.pod, entry.keys, left))
        own = self.datastore.own_load
        pool = {pod.address for pod in self.datastore.pods()}
        if self._replace:
            loads = {address: PodLoad(*own(address)) for address in pool}
            loads = {address: load for address, load in loads.items() if not load.empty}
        else:
            # Changed pods, and pods that left the pool (their load goes to 0).
            addresses = self._changed | (self._published.keys() - pool)
            loads = {}
            for address in addresses:
                load = PodLoad(*own(address))
                if self._published.get(address, PodLoad()) != load:
                    loads[address] = load
        for learner in self._learners().values():
            self._learned_outbox.extend(learner.take_learned(now))
        notify = False
        news = self._added or routed or self._replace or self._owe_notice or self._new_scrape
        self._new_scrape = False
        self._added = False
        if self.notices and news:
            wait = self._sending.wait(now)
            notify = wait == 0.0
            if notify:
                self._sending.take(now)
            self._owe_notice = not notify
            if self._owe_notice and self._notice_timer is None:
                self._notice_timer = asyncio.get_running_loop().call_later(wait, self._notice_due)
        return PickerUpdate(
            self.picker_id,
            loads,
            routed,
            list(self._learned_outbox),
            self.scrape_sharing.outgoing() if self.scrape_sharing is not None else (),
            replace=self._replace,
            notify=notify,
        )

    def _notice_due(self) -> None:
        self._notice_timer = None
        self._wake.set()

    async def sync_once(self) -> bool:
        """One exchange; False when the store did not answer."""
        update = self._update()
        sent_outbox = len(self._outbox)
        changed = self._changed
        self._changed = set()
        started_at = self._clock()
        started = time.perf_counter()
        # This exchange reads everything a notice received so far announced.
        self._noticed = False
        try:
            view = await asyncio.wait_for(self.store.exchange(update), self.timeout_s)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            self.metrics.exchanges.labels("error").inc()
            self._changed |= changed
            self._went_down(exc)
            return False
        self.metrics.exchanges.labels("ok").inc()
        self.metrics.exchange_seconds.observe(time.perf_counter() - started)
        self.exchanges += 1
        self._view_at = started_at
        if update.replace:
            self._published = dict(update.loads)
        else:
            for address, load in update.loads.items():
                if load.empty:
                    self._published.pop(address, None)
                else:
                    self._published[address] = load
        for _ in range(min(sent_outbox, len(self._outbox))):
            self._outbox.popleft()
        # Samples taken while the exchange was in flight wait for the next one.
        for _ in range(min(len(update.learned), len(self._learned_outbox))):
            self._learned_outbox.popleft()
        if update.learned:
            self.metrics.learned.labels("published").inc(len(update.learned))
        if update.routed:
            self.metrics.routed.labels("published").inc(len(update.routed))
        if update.notify:
            self.metrics.notices.labels("sent").inc()
        if self.scrape_sharing is not None:
            self.scrape_sharing.sent(update.scrapes)
        was_replace = update.replace
        self._replace = False
        if view.store_reset:
            self._replace = True  # the store lost what we wrote before: write it all again
            self._wake.set()
        self._apply(view)
        if self.up is not True:
            self._came_up(was_replace, len(update.loads), len(update.routed), view.peers)
        return True

    def _apply(self, view: PeerView) -> None:
        prefill_rates = per_pod(self._peer_prefill.update(self._clock(), view.routed_prefill_s))
        self.datastore.set_peer_loads(
            {
                pod: (
                    load.requests,
                    load.prompt_tokens,
                    load.prefilling,
                    load.prefilling_tokens,
                    prefill_rates.get(pod, 0.0),
                )
                for pod, load in view.loads.items()
            }
        )
        self.metrics.peers.set(view.peers)
        for pod in self._peer_pods - view.loads.keys():
            self.metrics.peer_requests.labels(pod).set(0)
        for pod, load in view.loads.items():
            self.metrics.peer_requests.labels(pod).set(load.requests)
        self._peer_pods = set(view.loads)
        add = getattr(self.index, "add_speculative_sync", None)
        if add is not None and view.routed:
            known = {pod.address for pod in self.datastore.pods()}
            applied = 0
            for entry in view.routed:
                if entry.pod in known:
                    add(entry.pod, entry.keys, entry.ttl_s)
                    applied += 1
            self.metrics.routed.labels("applied").inc(applied)
        if view.malformed_learned:
            self.metrics.learned.labels("dropped").inc(view.malformed_learned)
        learners = self._learners() if view.learned else {}
        if learners:
            by_plugin: dict[str, list[LearnedSample]] = {}
            for sample in view.learned:
                by_plugin.setdefault(sample.plugin, []).append(sample)
            for name, samples in by_plugin.items():
                learner = learners.get(name)
                if learner is None:
                    self.metrics.learned.labels("dropped").inc(len(samples))
                    continue
                learner.learn_from_peers(samples, self._clock())
                self.metrics.learned.labels("applied").inc(len(samples))
        if self.scrape_sharing is not None:
            self.scrape_sharing.exchanged(view)

    def _went_down(self, exc: BaseException) -> None:
        self._replace = True  # the store may come back empty
        if self.up is False:
            return
        self.up = False
        self.outages += 1
        self.metrics.up.set(0)
        self.metrics.transitions.labels("down").inc()
        self.datastore.set_peer_loads({})  # nothing refreshes them any more
        self._peer_prefill = CounterRates(PEER_RATE_WINDOW_S)
        self.metrics.peers.set(0)
        if self.scrape_sharing is not None:
            self.scrape_sharing.disconnected()
        log.warning(
            "shared pool state unreachable (%s); routing on this picker's own state until "
            "it returns",
            str(exc) or type(exc).__name__,
        )

    def _came_up(self, replaced: bool, loads: int, routed: int, peers: int) -> None:
        first = self.up is None
        self.up = True
        self.metrics.up.set(1)
        self.metrics.transitions.labels("up").inc()
        if first:
            log.info("shared pool state connected as picker %s; %d peers", self.picker_id, peers)
        else:
            log.warning(
                "shared pool state back; reconciled: wrote %d pods' loads%s and %d routed "
                "entries, read %d peers",
                loads,
                " (whole table)" if replaced else "",
                routed,
                peers,
            )


class PublishingIndex:
    """A block index whose speculative entries are also handed to the shared state.

    The scheduler writes through this; everything else (KV events, peers' entries)
    goes to the wrapped index directly.
    """

    def __init__(self, inner: Any, shared: SharedPoolState) -> None:
        self.inner = inner
        self.shared = shared

    def add_speculative_sync(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        self.inner.add_speculative_sync(pod, keys, ttl_s)
        self.shared.routed(pod, keys, ttl_s)

    async def add_speculative(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        self.add_speculative_sync(pod, keys, ttl_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


__all__ = [
    "CounterRates",
    "PublishingIndex",
    "SharedPoolState",
    "SharedStateMetrics",
    "new_picker_id",
    "per_pod",
]

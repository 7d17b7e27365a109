"""Shared /metrics scrapes: each pod is fetched by one picker of the pool and the others
apply that picker's scrape, so N pickers cost the pods (and themselves) one scrape per
interval instead of N. A fetch whose page differs from the pod's last one is news the
others' decisions should read soon: it wakes an exchange with a change notice; an idle
pod's unchanged page waits for the heartbeat.

Which picker fetches a pod: rendezvous hashing of (picker id, pod) over the live pickers
the last exchange named, so a picker joining or leaving moves only its own share of the
pods. A picker fetches every pod itself before its first exchange and while the store is
down. It also takes over a pod whose owner's scrapes stop arriving for half of the
scraper's staleness limit (the owner died, or lost the store): the pod's metrics then
never go stale while the dead owner's entry waits out its expiry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from prometheus_client import Counter, Gauge

from ...framework.types import PodMetrics, PodState
from ..datastore import Datastore
from ..scrape import MetricsScraper
from .store import PeerView, SharedScrape, decode_scrape, encode_scrape


def rendezvous_weight(picker: str, pod: str) -> int:
    digest = hashlib.blake2b(f"{picker}\0{pod}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner_of(pod: str, pickers: Sequence[str]) -> str:
    """The picker that fetches `pod` among `pickers` (highest random weight)."""
    return max(pickers, key=lambda picker: rendezvous_weight(picker, pod))


class ScrapeSharing:
    """One picker's side of the shared scrapes: what it fetches, what it publishes, and
    applying the others' scrapes to its datastore through its own scraper."""

    def __init__(
        self,
        picker_id: str,
        scraper: MetricsScraper,
        datastore: Datastore,
        *,
        scrapes: Counter,
        fetched_pods: Gauge,
    ) -> None:
        self.picker_id = picker_id
        self.scraper = scraper
        self.datastore = datastore
        self.scrapes = scrapes  # by direction: published, applied, dropped
        self.fetched_pods = fetched_pods
        # Metrics older than the scraper's stale limit are ignored by the scorers: take a
        # silent owner's pods over at half of it.
        self.takeover_after_s = scraper.stale_after_s / 2
        self.connected = False
        self._pickers: tuple[str, ...] = (picker_id,)
        self._owners: dict[str, str] = {}
        # pod -> scraper-clock time of the newest scrape from its owner (or of when that
        # picker became its owner: its first scrape is on its way).
        self._owner_heard: dict[str, float] = {}
        self._seq: dict[str, int] = {}
        self._outbox: dict[str, tuple[int, float, str]] = {}  # pod -> (seq, taken at, payload)
        self._applied: dict[str, tuple[str, int]] = {}  # pod -> (picker, seq) last applied
        self._last_payload: dict[str, str] = {}  # pod -> what its last fetch said
        # Called when a fetch says something the last fetch of that pod did not: the
        # other pickers' decisions should read it soon (a change notice).
        self.on_news: Callable[[], None] | None = None
        scraper.should_scrape = self.fetches
        scraper.on_fetched = self._fetched

    # ------------------------------------------------------------------ this picker's

    def fetches(self, pod: str) -> bool:
        """Whether this picker fetches `pod`'s /metrics itself now."""
        if not self.connected or self._owner(pod) == self.picker_id:
            return True
        now = self.scraper.clock()
        heard = self._owner_heard.setdefault(pod, now)
        return now - heard > self.takeover_after_s

    def _owner(self, pod: str) -> str:
        owner = self._owners.get(pod)
        if owner is None:
            owner = self._owners[pod] = owner_of(pod, self._pickers)
        return owner

    def _fetched(self, pod: PodState, metrics: PodMetrics | None) -> None:
        seq = self._seq.get(pod.address, 0) + 1
        self._seq[pod.address] = seq
        payload = encode_scrape(metrics, pod.metrics.consecutive_failures)
        self._outbox[pod.address] = (seq, self.scraper.clock(), payload)
        if self._last_payload.get(pod.address) != payload:
            self._last_payload[pod.address] = payload
            if self.on_news is not None:
                self.on_news()

    def outgoing(self) -> list[SharedScrape]:
        """This picker's newest fetch of each pod not yet written to the store."""
        now = self.scraper.clock()
        return [
            SharedScrape(pod, self.picker_id, seq, max(0.0, now - taken), payload)
            for pod, (seq, taken, payload) in self._outbox.items()
        ]

    def sent(self, scrapes: Sequence[SharedScrape]) -> None:
        """The store holds these: a fetch taken since stays for the next exchange."""
        for scrape in scrapes:
            pending = self._outbox.get(scrape.pod)
            if pending is not None and pending[0] == scrape.seq:
                del self._outbox[scrape.pod]
        self.scrapes.labels("published").inc(len(scrapes))

    # ------------------------------------------------------------------ the others'

    def exchanged(self, view: PeerView) -> None:
        """After an exchange: the live pickers (ownership) and the others' scrapes."""
        self.connected = True
        now = self.scraper.clock()
        pickers = tuple(sorted({self.picker_id, *view.peer_ids}))
        if pickers != self._pickers:
            self._pickers = pickers
            self._owners.clear()
            self._owner_heard = dict.fromkeys(self._owner_heard, now)
        known = {pod.address: pod for pod in self.datastore.pods()}
        counter = self.scrapes
        for scrape in view.scrapes:
            pod = known.get(scrape.pod)
            if pod is None or self._applied.get(scrape.pod) == (scrape.picker, scrape.seq):
                continue
            self._applied[scrape.pod] = (scrape.picker, scrape.seq)
            try:
                result = decode_scrape(scrape.payload)
            except ValueError:
                counter.labels("dropped").inc()
                continue
            taken = now - scrape.age_s
            if scrape.picker == self._owner(scrape.pod):
                heard = self._owner_heard.get(scrape.pod, taken)
                self._owner_heard[scrape.pod] = max(heard, taken)
            if isinstance(result, int):
                self.scraper.apply_failures(pod, result, scrape.picker)
            elif taken > pod.metrics.scraped_at:
                self.scraper.apply_scrape(pod, result, taken)
            counter.labels("applied").inc()
        tables = (self._owners, self._owner_heard, self._seq, self._outbox, self._applied,
                  self._last_payload)  # fmt: skip
        for table in tables:
            for address in table.keys() - known.keys():
                del table[address]
        self.fetched_pods.set(sum(1 for address in known if self.fetches(address)))

    def disconnected(self) -> None:
        """The store is away: fetch every pod again."""
        self.connected = False
        self.fetched_pods.set(len(self.datastore.pods()))


__all__ = ["ScrapeSharing", "owner_of", "rendezvous_weight"]

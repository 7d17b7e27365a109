"""How far each pod has got through the prefill of the prompts this gateway sent it, from
the pod's own KV events.

vLLM caches a prompt's full blocks as it schedules them (`allocate_slots` caches up to the
tokens computed in that step), so a `BlockStored` for a request's blocks goes out with the
engine step that computes them: a chunked prefill of a long prompt shows up chunk by chunk,
and a request still waiting shows nothing. The gateway knows each prompt's block keys (it
looked them up to find the cached prefix), so the events tell it, per request in flight,
how many of its uncached blocks are computed: a measured queue, where the alternative is
each request's predicted prefill time.

A block is watched by the first request sent to the pod that needs it: a later request
sharing the prefix will find it cached when admitted. Pods whose events never confirm a
watched block (no KV events, or keys that do not match the pod's) are not `confirmed`, so
callers keep their predicted queue for them. State is bounded: the oldest watched
requests are dropped beyond `max_requests` or `max_blocks`.

Events reach the gateway some time after the pod stored the blocks (the publisher's
batching, the network, the gateway's own event loop): the view is of the pod as it was
that long ago. `lag_s` is that delay per pod, from each live batch's publish time against
the gateway's clock (the same reading as the `smart_epp_kv_event_lag_seconds` histogram),
so that callers can age the view by it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_MAX_REQUESTS = 65_536
# About 100 MB at most: far more than the uncached blocks of every request a pool has in
# flight (1,000 requests of 8k uncached tokens at 16-token blocks are 512k).
DEFAULT_MAX_BLOCKS = 1 << 20
# Weight of one batch's lag in the running mean: about the last 20 batches, a fraction of
# a second on a busy pod, so a publisher or network that falls behind is followed quickly.
LAG_WEIGHT = 0.05


@dataclass(slots=True)
class _Watched:
    address: str
    blocks: int  # uncached blocks of the prompt
    block_size: int
    keys: list[int] = field(default_factory=list)  # those no earlier request computes
    # Leading uncached blocks computed: a pod stores a prompt's blocks in order, so a
    # stored block means every block before it is computed (by this request or by the
    # earlier one it shares them with).
    computed: int = 0


class PrefillProgress:
    """Per request in flight: (tokens computed, tokens watched) of its uncached blocks."""

    def __init__(
        self, max_requests: int = DEFAULT_MAX_REQUESTS, max_blocks: int = DEFAULT_MAX_BLOCKS
    ) -> None:
        self.max_requests = max_requests
        self.max_blocks = max_blocks
        self._requests: OrderedDict[str, _Watched] = OrderedDict()
        # address -> block key -> (the request that computes it, its position in that
        # request's uncached blocks, from 1)
        self._owners: dict[str, dict[int, tuple[str, int]]] = {}
        self._confirmed: set[str] = set()
        self.blocks = 0  # watched blocks in all
        self._lag_s: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def watch(self, request_id: str, address: str, keys: Sequence[int], block_size: int) -> None:
        """`keys`: the blocks of the request's prompt that `address` does not hold (in
        prompt order), which its prefill will store."""
        if request_id in self._requests:
            self.forget(request_id)
        owners = self._owners.setdefault(address, {})
        watched = _Watched(address, len(keys), block_size)
        for position, key in enumerate(keys, 1):
            if key not in owners:
                owners[key] = (request_id, position)
                watched.keys.append(key)
        self._requests[request_id] = watched
        self.blocks += len(watched.keys)
        while self._requests and (
            len(self._requests) > self.max_requests or self.blocks > self.max_blocks
        ):
            self.forget(next(iter(self._requests)))

    def forget(self, request_id: str) -> None:
        watched = self._requests.pop(request_id, None)
        if watched is None:
            return
        self.blocks -= len(watched.keys)
        owners = self._owners.get(watched.address)
        if owners is None:
            return
        for key in watched.keys:
            owner = owners.get(key)
            if owner is not None and owner[0] == request_id:
                del owners[key]

    def stored(self, address: str, keys: Sequence[int]) -> None:
        """Blocks the pod's events say it stored (its GPU tier)."""
        owners = self._owners.get(address)
        if not owners:
            return
        requests = self._requests
        for key in keys:
            owner = owners.pop(key, None)
            if owner is None:
                continue
            watched = requests.get(owner[0])
            if watched is not None:
                if owner[1] > watched.computed:
                    watched.computed = owner[1]
                self._confirmed.add(address)

    def computed(self, request_id: str) -> tuple[int, int] | None:
        """(tokens computed, tokens watched) of the request's uncached blocks, or None
        when it is not watched."""
        watched = self._requests.get(request_id)
        if watched is None:
            return None
        size = watched.block_size
        return watched.computed * size, watched.blocks * size

    def heard(self, address: str, lag_s: float) -> None:
        """A live batch from the pod arrived `lag_s` after the pod published it. A
        timestamp that is not a number (a corrupt or forged batch) says nothing."""
        if not math.isfinite(lag_s):
            return
        lag_s = max(0.0, lag_s)
        old = self._lag_s.get(address)
        self._lag_s[address] = lag_s if old is None else old + LAG_WEIGHT * (lag_s - old)

    def lag_s(self, address: str) -> float:
        """How late the pod's events arrive, as a running mean (0 until a batch has)."""
        return self._lag_s.get(address, 0.0)

    def confirmed(self, address: str) -> bool:
        """Whether the pod's events have shown the prefill of a watched block: only then
        does a request with nothing computed mean one still waiting."""
        return address in self._confirmed

    def confirmed_pods(self) -> int:
        return len(self._confirmed)

    def reset_pod(self, address: str) -> None:
        """The pod restarted or cleared its cache: its requests are lost or recomputed,
        and its events must confirm the keys again."""
        self._confirmed.discard(address)
        self._lag_s.pop(address, None)
        for request_id in [r for r, w in self._requests.items() if w.address == address]:
            self.forget(request_id)
        self._owners.pop(address, None)

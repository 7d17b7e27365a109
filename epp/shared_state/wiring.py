"""`epp serve --shared-state`: builds the store and connects it to one picker."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from ..datastore import Datastore
from .redis_store import RedisPoolStore
from .store import LocalPoolStore, PoolStateStore
from .sync import (
    DEFAULT_MAX_STALENESS_S,
    DEFAULT_NOTICE_GAP_S,
    PublishingIndex,
    SharedPoolState,
)

SharedStateKind = Literal["local", "redis"]


def connect_shared_state(
    kind: SharedStateKind,
    *,
    url: str,
    pool_name: str,
    datastore: Datastore,
    index: Any,
    registry: CollectorRegistry,
    interval_s: float,
    speculative_ttl_s: float,
    max_staleness_s: float = DEFAULT_MAX_STALENESS_S,
    notices: bool = True,
    notice_gap_s: float = DEFAULT_NOTICE_GAP_S,
    store: PoolStateStore | None = None,
    picker_id: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[SharedPoolState | None, Any]:
    """The shared state (None for `local` without a store given: a picker alone) and the
    index the scheduler should write through (the same index when nothing is shared).

    A block index that is itself shared (Redis) already carries routed prefixes to the
    other pickers; then only the in-flight load goes through the shared state.
    """
    if kind == "local" and store is None:
        return None, index
    if store is None:
        store = RedisPoolStore.from_url(
            url,
            pool_name=pool_name,
            max_routed_ttl_s=max(1.0, 2 * speculative_ttl_s),
        )
    local_index = index if hasattr(index, "add_speculative_sync") else None
    shared = SharedPoolState(
        store,
        datastore,
        index=local_index,
        interval_s=interval_s,
        max_staleness_s=max_staleness_s,
        notices=notices,
        notice_gap_s=notice_gap_s,
        registry=registry,
        picker_id=picker_id,
        clock=clock,
    )
    return shared, PublishingIndex(index, shared) if local_index is not None else index


__all__ = ["LocalPoolStore", "SharedStateKind", "connect_shared_state"]

"""Ends routed requests from Envoy's access-log records (the default response path).

When Envoy does not stream the response through ext_proc, the ext_proc stream ends as
soon as the request has been routed, and the request's outcome arrives later as one
access-log record (`proto.access_log`). `ResponseLog` keeps the routed requests by
request id until their record comes, then tells the flow which endpoint answered, when
the first body byte arrived and how it ended. Because nothing on the response path waits
for the picker, a response keeps flowing if the picker dies after routing it.

A record that never comes (Envoy restarted, a log batch was dropped) must not hold a
pod's in-flight count forever: `expire` ends requests older than a bound as lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import Counter

from ..framework.lifecycle import FlowRequest
from ..proto.access_log import ResponseRecord
from .flow import RequestFlow

log = logging.getLogger(__name__)

# Longer than any response is expected to last (Envoy's stream idle timeout is 300 s,
# but a stream that keeps producing tokens can run longer).
DEFAULT_MAX_AGE_S = 3600.0

RECORDS_TOTAL = Counter(
    "smart_epp_access_log_records_total",
    "Envoy access-log records received, by whether they matched a request this picker routed",
    ["result"],
)
EXPIRED_TOTAL = Counter(
    "smart_epp_access_log_expired_total",
    "Routed requests ended as lost because their access-log record never came",
)
_MATCHED = RECORDS_TOTAL.labels("matched")
_UNMATCHED = RECORDS_TOTAL.labels("unmatched")


class ResponseLog:
    """Routed requests waiting for their access-log record."""

    def __init__(self, flow: RequestFlow, *, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        self.flow = flow
        self.max_age_s = max_age_s
        # Request ids are unique in practice; a client reusing one gets its records
        # matched in routing order.
        self._waiting: dict[str, list[FlowRequest]] = {}
        self.unmatched = 0  # records of requests this picker did not route
        # Workers sharing one port: Envoy's log stream reaches one of them, so records
        # of requests another worker routed are handed on (shared_state.records).
        self.on_unmatched: Callable[[list[ResponseRecord]], None] | None = None
        self.expired = 0  # requests ended as lost because no record came

    def __len__(self) -> int:
        return sum(len(v) for v in self._waiting.values())

    def expect(self, tracked: FlowRequest) -> None:
        request_id = tracked.request.request_id
        waiting = self._waiting.get(request_id)
        if waiting is None:
            self._waiting[request_id] = [tracked]
        else:
            waiting.append(tracked)

    def _take(self, request_id: str) -> FlowRequest | None:
        waiting = self._waiting.get(request_id)
        if not waiting:
            return None
        tracked = waiting.pop(0)
        if not waiting:
            del self._waiting[request_id]
        return tracked

    def on_records(self, records: Iterable[ResponseRecord], *, handed_on: bool = False) -> None:
        """Ends the requests these records tell of; `handed_on`: the records came from
        another worker, which matched none of them (so they are not handed on again)."""
        unmatched: list[ResponseRecord] = []
        for record in records:
            tracked = self._take(record.request_id)
            if tracked is None:
                # Routed by an earlier run of the picker (a restart), or by another one.
                if not handed_on:
                    self.unmatched += 1
                    _UNMATCHED.inc()
                    unmatched.append(record)
                continue
            _MATCHED.inc()
            try:
                self._end(tracked, record)
            except Exception:  # bookkeeping must never break the log stream
                log.exception("request %s: response record failed", record.request_id)
        if unmatched and self.on_unmatched is not None:
            self.on_unmatched(unmatched)

    def _end(self, tracked: FlowRequest, record: ResponseRecord) -> None:
        flow = self.flow
        if record.upstream:
            flow.served_by(tracked, record.upstream)
        start = tracked.routed_at
        if record.first_body_byte_s is not None:
            flow.first_byte(tracked, at=start + record.first_body_byte_s)
        done = record.upstream_done_s
        # Any response flag (reset, timeout, connect failure) means the answer was cut.
        ok = 200 <= record.status < 400 and not record.flags and done is not None
        flow.finish(
            tracked,
            ok=ok,
            status=record.status,
            ended_at=start + done if done is not None else None,
        )

    def expire(self) -> int:
        """Ends requests whose record is overdue as lost; returns how many."""
        deadline = self.flow.clock() - self.max_age_s
        ended = 0
        for request_id in list(self._waiting):
            waiting = self._waiting[request_id]
            keep = []
            for tracked in waiting:
                if tracked.finished:
                    continue
                if tracked.routed_at < deadline:
                    self.flow.finish(tracked, ok=False)
                    ended += 1
                else:
                    keep.append(tracked)
            if keep:
                self._waiting[request_id] = keep
            else:
                del self._waiting[request_id]
        if ended:
            log.warning("%d routed requests got no access-log record; ended as lost", ended)
        self.expired += ended
        EXPIRED_TOTAL.inc(ended)
        return ended


__all__ = ["DEFAULT_MAX_AGE_S", "ResponseLog"]

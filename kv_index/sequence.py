"""Sequence tracking of one event stream (pure state machine, no I/O).

vLLM numbers its batches 0, 1, 2, ... per engine process and rank. What a new sequence
number means:
- the expected one: apply it;
- a later one: batches were lost; replay from the first missing one, then apply;
- an earlier one with a newer engine timestamp: the pod restarted (vLLM publishes
  nothing at shutdown; the only sign is the numbering starting again at 0);
- an earlier one that is not newer: a batch seen twice (the SUB queue and a replay can
  overlap), dropped.
- a later one far beyond any plausible loss (a corrupt or forged frame, e.g. 2^64-1):
  suspect, never trusted as a gap to count or a restart to wipe for until verified.
A restart whose first batches were all lost looks like a gap; the replay that fills it
tells the two apart (see `anchor`): the pod's buffer must still hold our last applied
batch, with the same timestamp, if it is the same process. The same check verifies a
suspect frame or an apparent restart before anything is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Verdict(Enum):
    APPLY = "apply"
    GAP = "gap"
    RESTART = "restart"
    DUPLICATE = "duplicate"
    SUSPECT = "suspect"


# vLLM's replay buffer keeps 10,000 batches by default; a jump of more than a million
# batches is not a loss a replay could ever fill, so it is not believed.
MAX_PLAUSIBLE_GAP = 1 << 20


@dataclass(slots=True)
class SequenceTracker:
    expected: int | None = None  # None until the stream's first batch
    last_ts: float = float("-inf")  # engine timestamp of batch `expected - 1`

    def observe(self, seq: int, ts: float) -> tuple[Verdict, int]:
        """Classifies batch `seq`; the int is where a replay should start (GAP)."""
        expected = self.expected
        if expected is None:
            if seq == 0:
                return Verdict.APPLY, seq
            return (Verdict.SUSPECT, 0) if seq > MAX_PLAUSIBLE_GAP else (Verdict.GAP, 0)
        if seq == expected:
            return Verdict.APPLY, seq
        if seq > expected:
            if seq - expected > MAX_PLAUSIBLE_GAP:
                return Verdict.SUSPECT, expected
            return Verdict.GAP, expected
        if ts > self.last_ts:
            return Verdict.RESTART, 0
        return Verdict.DUPLICATE, seq

    def anchor(self) -> int | None:
        """The last applied sequence number, which a same-process replay must repeat."""
        return None if not self.expected else self.expected - 1

    def wants(self, seq: int) -> bool:
        """Whether a replayed batch `seq` is still missing."""
        return self.expected is None or seq >= self.expected

    def applied(self, seq: int, ts: float) -> None:
        self.expected = seq + 1
        self.last_ts = ts

    def reset(self) -> None:
        self.expected = None
        self.last_ts = float("-inf")

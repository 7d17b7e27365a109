from __future__ import annotations

from smart_epp.kv_index.sequence import MAX_PLAUSIBLE_GAP, SequenceTracker, Verdict


def test_in_order_stream() -> None:
    t = SequenceTracker()
    for seq in range(3):
        assert t.observe(seq, 10.0 + seq) == (Verdict.APPLY, seq)
        t.applied(seq, 10.0 + seq)
    assert t.expected == 3 and t.anchor() == 2


def test_first_batch_after_others_is_a_gap_from_zero() -> None:
    assert SequenceTracker().observe(5, 1.0) == (Verdict.GAP, 0)


def test_gap_restart_and_duplicate() -> None:
    t = SequenceTracker()
    for seq in range(4):
        t.applied(seq, 100.0 + seq)
    assert t.observe(7, 200.0) == (Verdict.GAP, 4)
    assert t.observe(0, 500.0) == (Verdict.RESTART, 0)  # numbering restarted, newer engine time
    assert t.observe(2, 102.0) == (Verdict.DUPLICATE, 2)  # seen already
    assert t.wants(4) and not t.wants(3)
    t.reset()
    assert t.expected is None and t.anchor() is None and t.wants(0)


def test_implausible_jumps_are_suspect_not_gaps() -> None:
    t = SequenceTracker()
    assert t.observe(2**64 - 2, 1.0) == (Verdict.SUSPECT, 0)  # as a stream's first frame
    t.applied(0, 1.0)
    assert t.observe(1 + MAX_PLAUSIBLE_GAP, 2.0) == (Verdict.GAP, 1)
    assert t.observe(2 + MAX_PLAUSIBLE_GAP, 2.0) == (Verdict.SUSPECT, 1)

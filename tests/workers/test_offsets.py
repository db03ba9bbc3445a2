"""Offset bookkeeping: only the unbroken run of finished offsets is ever committed."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from workers.serving.offsets import OffsetTracker

P = ("inferq.jobs.normal", 0)


def make_tracker(offsets) -> OffsetTracker:
    tracker = OffsetTracker()
    for o in offsets:
        tracker.track(P, o)
    return tracker


def test_commits_the_unbroken_run_only():
    tracker = make_tracker(range(34, 41))
    for o in (34, 35, 36, 38, 39, 40):
        tracker.ack(P, o)
    assert tracker.committable() == {P: 37}
    tracker.committed({P: 37})
    assert tracker.committable() == {}
    tracker.ack(P, 37)
    assert tracker.committable() == {P: 41}


def test_gaps_the_consumer_never_delivered_do_not_block():
    tracker = make_tracker([10, 12, 15])  # 11, 13, 14: compacted away or transaction markers
    for o in (10, 12, 15):
        tracker.ack(P, o)
    assert tracker.committable() == {P: 16}


def test_unknown_and_repeated_acks_are_ignored():
    tracker = make_tracker([5, 6])
    tracker.ack(P, 6)
    tracker.ack(P, 6)
    tracker.ack(P, 99)
    tracker.ack(("other", 1), 5)
    assert tracker.committable() == {P: 5}


def test_forget_drops_revoked_partitions():
    tracker = make_tracker([1, 2])
    tracker.forget([P])
    assert tracker.committable() == {}
    tracker.ack(P, 1)  # a late ack for a revoked partition changes nothing
    assert tracker.committable() == {}


@given(st.lists(st.integers(0, 200), min_size=1, max_size=60, unique=True), st.randoms())
def test_never_commits_past_an_unfinished_offset(offsets, rnd: random.Random):
    offsets.sort()
    tracker = make_tracker(offsets)
    order = offsets[:]
    rnd.shuffle(order)
    done: set[int] = set()
    for o in order:
        tracker.ack(P, o)
        done.add(o)
        committed = tracker.committable().get(P)
        if committed is not None:
            tracker.committed({P: committed})
            assert all(x in done for x in offsets if x < committed)
    assert tracker.safe_offset(P) == max(offsets) + 1

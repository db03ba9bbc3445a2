"""TokenOrder: a job's token events once each, each attempt in seq order, holes held until given up."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from schemas.jobs import TokenEvent
from workers.client.token_order import TokenOrder


def event(attempt: int, seq: int) -> TokenEvent:
    return TokenEvent(job_id="j", attempt=attempt, seq=seq, text=f"{attempt}.{seq}", token_ids=[seq])


def feed(order: TokenOrder, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(e.attempt, e.seq) for p in pairs for e in order.add(event(*p))]


def test_an_early_event_waits_for_the_ones_before_it():
    order = TokenOrder()
    assert feed(order, [(1, 0), (1, 2)]) == [(1, 0)]
    assert order.gap and order.next_seq == 1
    assert feed(order, [(1, 3), (1, 1)]) == [(1, 1), (1, 2), (1, 3)]
    assert not order.gap


def test_copies_and_replaced_attempts_are_dropped():
    order = TokenOrder()
    got = feed(order, [(1, 0), (1, 0), (1, 1), (2, 0), (1, 2), (2, 1), (2, 1), (1, 3)])
    assert got == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_a_new_attempt_forgets_the_hole_of_the_old_one():
    order = TokenOrder()
    assert feed(order, [(1, 0), (1, 2)]) == [(1, 0)]
    assert feed(order, [(2, 0)]) == [(2, 0)] and not order.gap


def test_skip_gap_hands_on_what_waits_in_order_across_several_holes():
    order = TokenOrder()
    assert feed(order, [(1, 5), (1, 2), (1, 3)]) == []
    assert [e.seq for e in order.skip_gap()] == [2, 3, 5]
    assert not order.gap and order.next_seq == 6
    assert feed(order, [(1, 4), (1, 6)]) == [(1, 6)]  # a late one from before the hole stays dropped


@given(st.permutations(range(12)), st.lists(st.integers(0, 11), max_size=6))
def test_any_arrival_order_with_copies_yields_each_seq_once_in_order(seqs, copies):
    order = TokenOrder()
    arrivals = list(seqs)
    for i, c in enumerate(copies):
        arrivals.insert(min(len(arrivals), 2 * i + 1), c)
    assert [s for _, s in feed(order, [(1, s) for s in arrivals])] == list(range(12))
    assert not order.gap

"""TokenOrder: a job's token events once each, each attempt in seq order, holes held until given up."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from schemas.jobs import TokenEvent, Usage
from workers.client.token_order import ContinuousOutput, TokenOrder


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


# ---- ContinuousOutput: a resumed attempt continues the text, never repeats or restarts it -------------


def span(attempt: int, seq: int, pieces: list[str], start: int, end: int, **kw) -> TokenEvent:
    """The event of tokens [start, end) of a sample whose token i added pieces[i] to its text."""
    return TokenEvent(
        job_id="j",
        attempt=attempt,
        seq=seq,
        text="".join(pieces[start:end]),
        token_ids=list(range(start, end)),
        offset=start,
        text_offset=len("".join(pieces[:start])),
        **kw,
    )


def shown(events: list[TokenEvent]) -> tuple[str, list[int], bool]:
    order, output = TokenOrder(), ContinuousOutput()
    text, ids, restarted = "", [], False
    for e in events:
        for ready in order.add(e):
            new = output.take(ready)
            if new is None:
                continue
            if new.restarted:
                text, ids, restarted = "", [], True
            text += new.text
            ids += new.token_ids
    return text, ids, restarted


def test_a_resumed_attempt_continues_what_was_shown_without_repeating_it():
    pieces = ["He", "llo", "", " wo", "rld", "!"]
    first = [span(1, 0, pieces, 0, 2), span(1, 1, pieces, 2, 4)]  # streamed up to token 4; saved up to 2
    second = [
        span(2, 0, pieces, 0, 2),
        span(2, 1, pieces, 2, 5),
        span(2, 2, pieces, 5, 6, finish_reason="stop"),
    ]
    text, ids, restarted = shown(first + [span(1, 2, pieces, 4, 5)] + second)  # a late one of attempt 1 too
    assert (text, ids, restarted) == ("Hello world!", list(range(6)), False)
    output = ContinuousOutput()
    assert [output.take(e) for e in first][1] is first[1]  # new through and through: passed on as it is
    assert output.take(second[0]) is None  # the restatement: nothing new
    cut = output.take(second[1])
    assert (cut.text, cut.token_ids, cut.offset, cut.text_offset) == ("rld", [4], 4, 8)


def test_only_an_attempt_that_starts_over_restarts_the_output():
    pieces = ["a", "b", "c"]
    other = ["x", "y"]
    text, ids, restarted = shown(
        [
            span(1, 0, pieces, 0, 2),
            span(2, 0, other, 0, 2, restarted=True, usage=Usage(prompt_tokens=1, completion_tokens=2)),
        ]
    )
    assert (text, restarted) == ("xy", True)
    output = ContinuousOutput()
    output.take(span(1, 0, pieces, 0, 2))
    again = output.take(span(2, 0, other, 0, 1, restarted=True))
    assert again.restarted and again.text == "x"
    assert output.take(span(2, 1, other, 1, 2, restarted=True)).restarted is False  # said once


def test_events_of_workers_older_than_offsets_restart_on_each_new_attempt():
    def legacy(attempt, seq, text):
        return TokenEvent(job_id="j", attempt=attempt, seq=seq, text=text, token_ids=[seq])

    assert shown([legacy(1, 0, "ab"), legacy(1, 1, "c"), legacy(2, 0, "ab"), legacy(2, 1, "cd")]) == (
        "abcd",
        [0, 1],
        True,
    )


def test_a_sample_that_ended_is_not_ended_again_and_the_final_event_always_comes():
    pieces = ["a", "b"]
    output = ContinuousOutput()
    assert output.take(span(1, 0, pieces, 0, 2, finish_reason="stop")).finish_reason == "stop"
    usage = Usage(prompt_tokens=1, completion_tokens=2)
    final = output.take(span(2, 0, pieces, 0, 2, finish_reason="stop", usage=usage))
    assert final is not None and final.final and final.finish_reason is None and final.text == ""


@given(st.data())
def test_any_break_and_any_coalescing_show_each_position_once(data):
    n = data.draw(st.integers(1, 30))
    pieces = data.draw(st.lists(st.text(max_size=3), min_size=n, max_size=n))
    streamed = data.draw(st.integers(0, n))  # attempt 1 streamed this many tokens
    saved = data.draw(st.integers(0, streamed))  # and saved this many: attempt 2 resumes there

    def cuts(start: int, end: int) -> list[int]:
        inner = data.draw(st.lists(st.integers(start + 1, max(start + 1, end - 1)), max_size=4))
        return sorted({start, end, *(c for c in inner if start < c < end)})

    def events(attempt: int, bounds: list[int], last: bool) -> list[TokenEvent]:
        out = []
        for seq, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            end = last and b == n
            out.append(span(attempt, seq, pieces, a, b, finish_reason="stop" if end else None))
        return out

    first = events(1, cuts(0, streamed), False) if streamed else []
    restate = [span(2, 0, pieces, 0, saved)]
    rest = events(2, cuts(saved, n), True) if saved < n else []
    second = restate + [e.model_copy(update={"seq": e.seq + 1}) for e in rest]
    late = data.draw(st.integers(0, len(first)))  # attempt 1's last events arrive after attempt 2 began
    text, ids, restarted = shown(first[:late] + second[:1] + first[late:] + second[1:])
    assert (text, ids, restarted) == ("".join(pieces), list(range(n)), False)

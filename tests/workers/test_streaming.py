"""Token events: coalesced per job, numbered per attempt, concatenating to the output."""

from __future__ import annotations

import time

from schemas.jobs import TokenEvent, Usage
from workers.serving.streaming.stream import TokenStreamer


def make_streamer(coalesce_s: float = 60.0) -> tuple[TokenStreamer, list[TokenEvent]]:
    sent: list[TokenEvent] = []
    return TokenStreamer(lambda event, tenant: sent.append(event), coalesce_s), sent


def test_first_delta_goes_at_once_later_ones_coalesce_and_the_last_event_goes_at_once():
    streamer, sent = make_streamer()
    streamer.start("a", attempt=2)
    streamer.add("a", "he", (0,))
    streamer.flush_due()  # the first token is never held back
    for i, piece in enumerate(["l", "lo"], start=1):
        streamer.add("a", piece, (i,))
    streamer.flush_due()
    assert len(sent) == 1  # the rest is not due yet
    streamer.flush_due(force=True)
    streamer.add("a", "!", (3,))
    streamer.finish("a", "stop", Usage(prompt_tokens=4, completion_tokens=4))
    assert [(e.seq, e.text, e.token_ids, e.finish_reason) for e in sent] == [
        (0, "he", [0], None),
        (1, "llo", [1, 2], None),
        (2, "!", [3], "stop"),
    ]
    assert {e.attempt for e in sent} == {2}
    assert sent[-1].usage.completion_tokens == 4


def test_a_later_delta_is_due_once_it_is_the_coalescing_interval_old(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])  # the streamer's clock, stepped by hand
    streamer, sent = make_streamer(coalesce_s=0.5)
    streamer.start("a", 1)
    streamer.add("a", "x", (7,))
    streamer.flush_due()  # the first delta: due at once
    streamer.add("a", "y", (8,))
    now[0] += 0.25
    streamer.flush_due()
    assert [e.text for e in sent] == ["x"]  # "y" is 0.25 s old: held back
    now[0] += 0.25
    streamer.flush_due()
    assert [(e.seq, e.text) for e in sent] == [(0, "x"), (1, "y")]


def test_a_token_held_back_for_utf8_still_counts():
    streamer, sent = make_streamer(coalesce_s=0.0)
    streamer.start("a", 1)
    streamer.add("a", "", (200,))  # half of a multi-byte character: no text yet
    streamer.flush_due()
    assert [(e.text, e.token_ids) for e in sent] == [("", [200])]


def test_dropped_jobs_send_nothing_more():
    streamer, sent = make_streamer(coalesce_s=0.0)
    streamer.start("a", 1)
    streamer.add("a", "x", (1,))
    streamer.drop("a")
    streamer.flush_due(force=True)
    streamer.finish("a", "stop", Usage(prompt_tokens=1, completion_tokens=1))
    assert sent == []


def test_every_event_comes_with_its_jobs_tenant():
    tenants: list[tuple[str, str]] = []
    streamer = TokenStreamer(lambda event, tenant: tenants.append((event.job_id, tenant)), 0.0)
    streamer.start("a", 1, "acme")
    streamer.start("b", 1)
    streamer.add("a", "x", (1,))
    streamer.add("b", "y", (2,))
    streamer.flush_due()
    streamer.finish("a", "stop", Usage(prompt_tokens=1, completion_tokens=1))
    assert tenants == [("a", "acme"), ("b", "default"), ("a", "acme")]


def test_events_say_where_they_start_in_their_sample_and_a_restatement_goes_apart():
    streamer, sent = make_streamer()
    streamer.start("a", attempt=2)
    streamer.restate("a", 0, "Hello wor", (1, 2, 3))  # what attempt 1 saved: at once, alone
    streamer.add("a", "ld", (4,))
    streamer.add("a", "!", (5,))
    streamer.finish("a", "stop", Usage(prompt_tokens=1, completion_tokens=5))
    assert [(e.seq, e.offset, e.text_offset, e.text, e.token_ids) for e in sent] == [
        (0, 0, 0, "Hello wor", [1, 2, 3]),
        (1, 3, 9, "ld!", [4, 5]),
    ]
    assert not any(e.restarted for e in sent)


def test_each_sample_counts_its_own_positions():
    streamer, sent = make_streamer(coalesce_s=0.0)
    streamer.start("a", 1)
    streamer.add("a", "ab", (1, 2), index=0)
    streamer.add("a", "x", (9,), index=1)
    streamer.flush_due()
    streamer.add("a", "c", (3,), index=0)
    streamer.end_sample("a", 1, "length")
    streamer.finish("a", "stop", Usage(prompt_tokens=1, completion_tokens=4), {0: "stop", 1: "length"})
    assert [(e.index, e.offset, e.text_offset, e.text) for e in sent] == [
        (0, 0, 0, "ab"),
        (1, 0, 0, "x"),
        (1, 1, 1, ""),
        (0, 2, 2, "c"),
    ]


def test_an_attempt_that_does_not_resume_says_it_starts_over():
    streamer, sent = make_streamer(coalesce_s=0.0)
    streamer.start("a", 3, restarted=True)
    streamer.add("a", "x", (1,))
    streamer.flush_due()
    streamer.finish("a", "stop", Usage(prompt_tokens=1, completion_tokens=1))
    assert [(e.offset, e.restarted) for e in sent] == [(0, True), (1, True)]


def test_a_delta_longer_than_an_event_may_carry_goes_as_several_that_join_to_it():
    from workers.serving.streaming.stream import MAX_EVENT_TOKENS

    streamer, sent = make_streamer()
    streamer.start("a", 2)
    ids = tuple(range(2 * MAX_EVENT_TOKENS + 5))
    text = "".join(chr(0x61 + i % 26) for i in range(3 * len(ids)))
    streamer.restate("a", 0, text, ids)
    assert [len(e.token_ids) for e in sent] == [MAX_EVENT_TOKENS, MAX_EVENT_TOKENS, 5]
    assert "".join(e.text for e in sent) == text and [t for e in sent for t in e.token_ids] == list(ids)
    assert [(e.offset, e.text_offset) for e in sent] == [
        (0, 0),
        (MAX_EVENT_TOKENS, len(sent[0].text)),
        (2 * MAX_EVENT_TOKENS, len(sent[0].text) + len(sent[1].text)),
    ]
    assert [e.seq for e in sent] == [0, 1, 2]

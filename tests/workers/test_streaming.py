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

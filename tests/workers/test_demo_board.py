"""The demo's board: streamed text per job (retries, duplicates), timings, and what the views print."""

from __future__ import annotations

from rich.console import Console

from schemas.jobs import TokenEvent, Usage
from workers.cli.demo import _verdict
from workers.demo.board import DemoBoard, DemoJob, render_live, render_plain

JOBS = [
    DemoJob("j-high", "high", "acme", "What is the capital of France?", submitted_s=100.0),
    DemoJob("j-low", "low", "globex", "Write a haiku.", submitted_s=100.0),
]


def event(job_id, seq, text, tokens=1, attempt=0, finish=None, completion=None):
    usage = Usage(prompt_tokens=9, completion_tokens=completion) if completion is not None else None
    return TokenEvent(
        job_id=job_id,
        attempt=attempt,
        seq=seq,
        text=text,
        token_ids=list(range(tokens)),
        finish_reason=finish,
        usage=usage,
    )


def test_text_grows_per_job_and_timings_come_at_the_end():
    board = DemoBoard(JOBS)
    assert board.apply(event("j-high", 0, "The capital", tokens=2), now=100.25) is not None
    assert board.apply(event("j-low", 0, "Queues"), now=100.5) is not None
    stream = board.apply(event("j-high", 1, " is Paris.", tokens=4, finish="stop", completion=6), now=101.25)
    assert stream is not None and stream.done and not board.done
    assert board.texts() == {"j-high": "The capital is Paris.", "j-low": "Queues"}
    assert stream.ttft_ms == 250.0 and stream.tokens == 6 and stream.tokens_per_s == 5.0
    assert board.apply(event("other-job", 0, "x"), now=102) is None


def test_duplicates_are_ignored_and_a_retry_starts_the_text_again():
    board = DemoBoard(JOBS)
    board.apply(event("j-low", 0, "Que"), now=101)
    assert board.apply(event("j-low", 0, "Que"), now=101.1) is None  # the producer resent seq 0
    board.apply(event("j-low", 0, "Queues", attempt=1), now=105)  # another worker redid the job
    assert board.apply(event("j-low", 1, "ues", attempt=0), now=105.5) is None  # late, from attempt 0
    board.apply(event("j-low", 1, " hum.", attempt=1, finish="stop", completion=4), now=106)
    assert board.texts()["j-low"] == "Queues hum." and board.streams["j-low"].ttft_ms == 5000.0


def test_live_view_shows_priority_tenant_text_and_timings():
    board = DemoBoard(JOBS)
    board.apply(event("j-high", 0, "Paris.", tokens=3, finish="stop", completion=3), now=100.5)
    board.apply(event("j-low", 0, "Queues"), now=100.5)
    console = Console(record=True, width=100, color_system=None)
    console.print(render_live(board))
    shown = console.export_text()
    assert "high · acme · j-high" in shown and "low · globex · j-low" in shown
    assert "Paris." in shown and "TTFT 500 ms" in shown and "streaming…" in shown


def test_plain_block_holds_the_whole_answer_once():
    board = DemoBoard(JOBS)
    board.apply(event("j-high", 0, "The capital\nis Paris.", tokens=4), now=100.1)
    stream = board.apply(event("j-high", 1, "", tokens=0, finish="stop", completion=4), now=100.4)
    block = render_plain(stream)
    assert block.startswith("[high · acme · j-high] What is the capital of France?\nThe capital\nis Paris.\n")
    assert "TTFT 100 ms · 10.0 tok/s · 4 tokens · finish stop" in block


def test_verdict_requires_success_and_equal_texts(capsys):
    rows = [
        {"job_id": "a", "status": "succeeded", "output_text": "Paris."},
        {"job_id": "b", "status": "succeeded", "output_text": "Queues hum."},
    ]
    assert _verdict(rows, {"a": "Paris.", "b": "Queues hum."}) == 0
    assert "every streamed text equals its stored row" in capsys.readouterr().out
    assert _verdict(rows, {"a": "Paris.", "b": "Queues"}) == 1
    assert "streamed text differs from the row: b" in capsys.readouterr().out
    assert _verdict(rows[:1], {"a": "Paris.", "b": "Queues hum."}) == 1
    assert "no row for: b" in capsys.readouterr().out

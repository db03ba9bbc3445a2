"""A stream's chunks from what its job's follow delivers, without services: token events in order, a job the
engine refused (its last event says `rejected`, its result says why) ending in an error event, and a stream
whose last events never came completed from the job's result."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from types import SimpleNamespace

from schemas.jobs import Choice, JobResult, TokenEvent, Usage
from workers.api import serving_engine
from workers.api.protocol import LiveOptions
from workers.api.serving_completion import ServingCompletion
from workers.bulk.batch_format import BatchLine
from workers.kafka_io import Record
from workers.settings import Settings

JOB = "cmpl-1"


class _Followed:
    """What a follow of one job delivers, queued in advance; nothing more once they are read."""

    def __init__(self, items: list) -> None:
        self.items = deque(items)
        self.queue = asyncio.Queue()
        self.follower = SimpleNamespace(rewind=lambda: 1)
        self.closed = False

    async def get(self, timeout_s: float):
        if self.items:
            return self.items.popleft()
        await asyncio.sleep(min(timeout_s, 0.01))
        return None

    def is_result(self, item) -> bool:
        return item.topic == "p.results"

    def close(self) -> None:
        self.closed = True


def _event(seq: int, text: str, finish: str | None = None, final: bool = False) -> Record:
    usage = Usage(prompt_tokens=3, completion_tokens=seq + 1) if final else None
    event = TokenEvent(
        job_id=JOB, attempt=1, seq=seq, text=text, token_ids=[seq], finish_reason=finish, usage=usage
    )
    return Record("p.tokens", 0, seq, JOB.encode(), event.model_dump_json().encode(), 0)


def _result(status: str, text: str = "", error: str | None = None) -> Record:
    finish = {"succeeded": "length", "rejected": "rejected"}[status]
    choices = [Choice(index=0, text=text, finish_reason=finish)] if text else []
    used = Usage(prompt_tokens=3, completion_tokens=len(text))
    result = JobResult(job_id=JOB, status=status, tenant="acme", output_text=text, finish_reason=finish,
                       error=error, usage=used, choices=choices)  # fmt: skip
    return Record("p.results", 0, 0, JOB.encode(), result.model_dump_json().encode(), 0)


def _stream(items: list) -> list[str]:
    settings = Settings(api_heartbeat_s=0.05)
    engine = ServingCompletion(SimpleNamespace(settings=settings), fleet=None, starts=None)
    line = BatchLine(1, JOB, "/v1/completions", "tiny", {})
    req = SimpleNamespace(job_id=JOB, tenant="acme", line=line, created=1, live=LiveOptions(stream=True),
                          key=SimpleNamespace(idempotency_key=None))  # fmt: skip
    followed = _Followed(items)
    stream = serving_engine._Stream(engine, req, followed, SimpleNamespace(release=lambda: None))

    async def collect() -> list[str]:
        return [text async for text in engine._sse(stream, deque())]

    out = asyncio.run(collect())
    assert stream.finished
    return [line.strip() for line in out if line.startswith("data: ")]


def _data(lines: list[str]) -> list:
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_token_events_become_chunks_in_order_then_done():
    lines = _stream([_event(0, "ab"), _event(1, "c", "length", final=True)])
    chunks = _data(lines)
    assert [c["choices"][0]["text"] for c in chunks] == ["ab", "c"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and lines[-1] == "data: [DONE]"


def test_a_job_the_engine_refused_ends_its_stream_with_the_reason():
    lines = _stream(
        [_event(0, "", "rejected", final=True), _result("rejected", error="larger than the KV cache")]
    )
    [error] = _data(lines)
    assert (
        error["error"]["message"] == "larger than the KV cache"
        and error["error"]["code"] == "invalid_request"
    )


def test_a_stream_whose_last_events_never_came_is_completed_from_the_result(monkeypatch):
    monkeypatch.setattr(serving_engine, "RESULT_GRACE_S", 0.1)
    lines = _stream([_event(0, "ab"), _result("succeeded", text="abcd")])
    chunks = _data(lines)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abcd"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_result_that_is_not_the_streams_ends_it_with_an_error(monkeypatch):
    monkeypatch.setattr(serving_engine, "RESULT_GRACE_S", 0.1)
    lines = _stream([_event(0, "ab"), _result("succeeded", text="different")])
    assert "error" in _data(lines)[-1]


def _attempt(attempt: int, seq: int, offset: int, text_offset: int, ids: list[int], text: str,
             final: bool = False, restarted: bool = False) -> Record:  # fmt: skip
    """An event of one attempt that says where it starts in the output (a resumable worker's)."""
    usage = Usage(prompt_tokens=3, completion_tokens=offset + len(ids)) if final else None
    finish = "length" if final else None
    event = TokenEvent(
        job_id=JOB,
        attempt=attempt,
        seq=seq,
        text=text,
        token_ids=ids,
        offset=offset,
        text_offset=text_offset,
        restarted=restarted,
        finish_reason=finish,
        usage=usage,
    )
    return Record("p.tokens", 0, 10 * attempt + seq, JOB.encode(), event.model_dump_json().encode(), 0)


def test_a_resumed_attempts_restated_text_is_not_sent_again():
    """Attempt 1 streamed 5 tokens and saved 3, then its worker died; attempt 2 restates the 3 saved ones,
    then generates tokens 4-6 again (the same text) and goes on: each piece of text is sent once."""
    lines = _stream(
        [
            _attempt(1, 0, 0, 0, [1, 2, 3], "Hel"),
            _attempt(1, 1, 3, 3, [4, 5], "lo"),
            _attempt(2, 0, 0, 0, [1, 2, 3], "Hel"),  # the restatement
            _attempt(2, 1, 3, 3, [4, 5, 6], "lo w"),
            _attempt(2, 2, 6, 7, [7, 8], "orld", final=True),
        ]
    )
    chunks = _data(lines)
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo", " w", "orld"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and lines[-1] == "data: [DONE]"


def test_an_attempt_that_restarted_is_completed_from_its_own_text(monkeypatch):
    """An attempt that could not resume starts the output over (`restarted`): what was sent stays sent, and
    a stream whose last events never came is completed from the result past the new attempt's text."""
    monkeypatch.setattr(serving_engine, "RESULT_GRACE_S", 0.1)
    lines = _stream(
        [
            _attempt(1, 0, 0, 0, [1, 2], "ab"),
            _attempt(2, 0, 0, 0, [7, 8], "xy", restarted=True),
            _result("succeeded", text="xyz"),
        ]
    )
    chunks = _data(lines)
    assert [c["choices"][0]["text"] for c in chunks] == ["ab", "xy", "z"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

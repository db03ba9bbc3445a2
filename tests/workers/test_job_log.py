"""Per-job log lines: written in order by the job log's thread, and through inferq's formatters made
without a LogRecord (`format_event`) yet the same lines logging itself would write for those records."""

from __future__ import annotations

import io
import logging
import time

import pytest

from workers import logs
from workers.serving.loop import job_log


@pytest.fixture
def configured():
    """logs.configure into a buffer; the root logger as it was afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level

    def configure(log_format: str, level: str = "INFO") -> io.StringIO:
        buffer = io.StringIO()
        logs.configure(level, log_format, "w-log", stream=buffer)
        return buffer

    yield configure
    job_log.flush()
    root.handlers[:], _ = saved
    root.setLevel(saved[1])


def events() -> list[tuple[str, str, dict]]:
    return [
        ("admitted", "j-1", {"tenant": "acme", "attempt": 1, "prompt_tokens": 5, "max_tokens": 8}),
        ("started", "j-1", {"attempt": 1, "queue_ms": 12.34567}),
        ("finished", "j-1", {"status": "succeeded", "error": None, "e2e_ms": 40.0}),
        ("rejected", "j-2", {"reason": "invalid", "error": "max_tokens: «many» is not an integer"}),
    ]


AT = 1_765_000_000.25  # when the events happened (a binary fraction: its milliseconds are exact)
STAMP = "2025-12-06 05:46:40,250"  # AT in UTC, as logging's asctime writes it
# the lines written, spelled out (not made by the module under test)
MESSAGES = [
    "job admitted j-1 priority=high tenant=acme attempt=1 prompt_tokens=5 max_tokens=8",
    "job started j-1 priority=high attempt=1 queue_ms=12.346",
    "job finished j-1 priority=high status=succeeded e2e_ms=40.0",
    "job rejected j-2 priority=high reason=invalid error=max_tokens: «many» is not an integer",
]
TEXT_LINES = [f"{STAMP} INFO inferq.jobs: {m}" for m in MESSAGES]
HEAD = '{"time": "2025-12-06T05:46:40.250+00:00", "level": "INFO", "logger": "inferq.jobs", '
JSON_LINES = [
    HEAD + '"message": "job admitted j-1 priority=high tenant=acme attempt=1 prompt_tokens=5 max_tokens=8", '
    '"worker_id": "w-log", "event": "admitted", "job_id": "j-1", "priority": "high", "tenant": "acme", '
    '"attempt": 1, "prompt_tokens": 5, "max_tokens": 8}',
    HEAD + '"message": "job started j-1 priority=high attempt=1 queue_ms=12.346", "worker_id": "w-log", '
    '"event": "started", "job_id": "j-1", "priority": "high", "attempt": 1, "queue_ms": 12.346}',
    HEAD + '"message": "job finished j-1 priority=high status=succeeded e2e_ms=40.0", "worker_id": "w-log", '
    '"event": "finished", "job_id": "j-1", "priority": "high", "status": "succeeded", "e2e_ms": 40.0}',
    HEAD + '"message": "job rejected j-2 priority=high reason=invalid error=max_tokens: «many» is not an '
    'integer", "worker_id": "w-log", "event": "rejected", "job_id": "j-2", "priority": "high", '
    '"reason": "invalid", "error": "max_tokens: «many» is not an integer"}',
]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_lines_are_the_ones_logging_would_write_for_the_same_records(configured, monkeypatch, log_format):
    buffer = configured(log_format)
    (handler,) = logging.getLogger().handlers
    handler.formatter.converter = time.gmtime  # text stamps in UTC whatever the machine's zone (JSON's are)
    with monkeypatch.context() as m:
        m.setattr(job_log.time, "time", lambda: AT)
        for event, job_id, fields in events():
            job_log.job_event(event, job_id, "high", **fields)
    job_log.flush()
    written = buffer.getvalue().splitlines()
    assert written == (TEXT_LINES if log_format == "text" else JSON_LINES)
    # and what logging itself makes of the same records
    assert written == [handler.format(job_log._Line(AT, e, j, "high", f).record) for e, j, f in events()]


def test_no_line_below_the_configured_level(configured):
    buffer = configured("text", level="WARNING")
    job_log.job_event("finished", "j-3", "low", status="failed")
    job_log.flush()
    assert buffer.getvalue() == ""

"""Progress text of `bulk status` / `bulk wait` (no services)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from workers.bulk.status_text import bar, eta_s, progress_line, status_text

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def progress_row(**values) -> dict:
    base = {"bulk_id": "bulk-p", "tenant": "acme", "priority": "low", "status": "running",
            "endpoint": "/v1/completions", "total_lines": 110, "invalid_lines": 10, "submitted_lines": 110,
            "expected_jobs": 100, "done": 25, "queued": 70, "running": 5, "succeeded": 24, "failed": 1,
            "expired": 0, "cancelled": 0, "rejected": 0, "prompt_tokens": 500, "completion_tokens": 1000,
            "total_tokens": 1500, "started_at": NOW - timedelta(seconds=60),
            "first_started_at": NOW - timedelta(seconds=50), "last_finished_at": NOW}  # fmt: skip
    return base | values


def test_eta_extrapolates_the_average_rate():
    assert eta_s(25, 100, 50.0) == 150.0
    assert eta_s(0, 100, 50.0) is None
    assert eta_s(100, 100, 50.0) == 0.0


def test_bar_fills_in_proportion():
    assert bar(25, 100, width=8) == "[##......] 25/100  25%"
    assert bar(0, 0, width=4) == "[####] 0/0 100%"


def test_status_and_progress_lines_show_counts_throughput_and_eta():
    p = progress_row()
    text = status_text(p, now=NOW)
    assert "25/100 done: 24 succeeded, 1 failed" in text
    assert "1500" in text and "20.0 completion tok/s" in text and "ETA         2m30s" in text
    line = progress_line(p, now=NOW)
    assert "25/100" in line and "failed 1" in line and "ETA 2m30s" in line


def test_finished_job_rate_uses_its_own_duration_not_the_clock():
    p = progress_row(status="completed", done=100, last_finished_at=NOW - timedelta(seconds=40))
    assert "100.0 completion tok/s" in status_text(p, now=NOW + timedelta(hours=5))
    assert "ETA" not in status_text(p, now=NOW)

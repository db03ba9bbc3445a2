"""Bulk job progress as text: counts, throughput, ETA and a progress bar (from a bulk_progress row)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from schemas.statuses import BULK_FINISHED_STATUSES
from workers.clock import utcnow


def eta_s(done: int, expected: int, elapsed_s: float) -> float | None:
    """Remaining time at the average rate so far; None before the first job is done."""
    if done <= 0 or elapsed_s <= 0 or expected <= done:
        return None if done < expected else 0.0
    return (expected - done) * elapsed_s / done


def _elapsed(p: dict[str, Any], now: datetime) -> float:
    start = p.get("first_started_at") or p.get("started_at")
    end = p.get("last_finished_at") if p.get("status") in BULK_FINISHED_STATUSES else now
    return max(0.0, (end - start).total_seconds()) if start and end else 0.0


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def bar(done: int, total: int, width: int = 30) -> str:
    fraction = min(1.0, done / total) if total > 0 else 1.0
    filled = int(round(fraction * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {fraction:4.0%}"


def progress_line(p: dict[str, Any], now: datetime | None = None) -> str:
    """One line for `bulk wait`: bar, failures, tokens/s, ETA."""
    now = now or utcnow()
    elapsed = _elapsed(p, now)
    rate = p["completion_tokens"] / elapsed if elapsed > 0 else 0.0
    bad = p["failed"] + p["expired"] + p["cancelled"] + p["rejected"]
    return (
        f"{bar(p['done'], p['expected_jobs'])}  failed {bad}  {rate:7.1f} tok/s  "
        f"ETA {_duration(eta_s(p['done'], p['expected_jobs'], elapsed))}  ({p['status']})"
    )


def status_text(p: dict[str, Any], now: datetime | None = None, final: dict[str, int] | None = None) -> str:
    """The report of `bulk status`; `final`: the line counts of the written files, once there are some."""
    now = now or utcnow()
    elapsed = _elapsed(p, now)
    rate = p["completion_tokens"] / elapsed if elapsed > 0 else 0.0
    lines = [
        f"bulk {p['bulk_id']}  tenant {p['tenant']}  class {p['priority']}  {p['endpoint'] or ''}",
        f"status      {p['status']}",
        f"lines       {p['total_lines']} ({p['invalid_lines']} invalid), "
        f"{p['submitted_lines']} handed to Kafka",
        f"jobs        {p['done']}/{p['expected_jobs']} done: {p['succeeded']} succeeded, "
        f"{p['failed']} failed, {p['expired']} expired, {p['cancelled']} cancelled, "
        f"{p['rejected']} rejected; {p['running']} running, {p['queued']} queued",
        f"tokens      {p['prompt_tokens']} prompt + {p['completion_tokens']} completion "
        f"= {p['total_tokens']}",
        f"throughput  {rate:.1f} completion tok/s over {_duration(elapsed)}",
    ]
    if final:
        lines.append(
            f"files       {final['succeeded']} lines in output; errors: {final['failed']} failed, "
            f"{final['invalid']} invalid, {final['unfinished']} never finished"
        )
    if p["status"] not in BULK_FINISHED_STATUSES:
        lines.append(f"ETA         {_duration(eta_s(p['done'], p['expected_jobs'], elapsed))}")
    lines.append(f"progress    {bar(p['done'], p['expected_jobs'])}")
    return "\n".join(lines)

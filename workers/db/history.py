"""Job history queries: thin wrappers over the SQL functions and views of migration 0002.

The SQL lives in the migration so that psql users and `inferq history` get the same answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, text

BUCKETS = ("hour", "day")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([mhdw])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


@dataclass(frozen=True)
class Window:
    since: datetime
    until: datetime
    bucket: str = "hour"

    def __post_init__(self) -> None:
        if self.bucket not in BUCKETS:
            raise ValueError(f"bucket must be one of {BUCKETS}, got {self.bucket!r}")


@dataclass(frozen=True)
class Report:
    """Rows of one history query, with column names in order (for tables, CSV and JSON alike)."""

    name: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


def parse_age(value: str) -> timedelta:
    """`30d`, `12h`, `90m`, `2w`: a positive age."""
    match = _DURATION.match(value.strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"not an age: {value!r} (try 30d, 12h, 90m or 2w)")
    return timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})


def parse_time(value: str, now: datetime) -> datetime:
    """`24h`, `90m`, `7d`, `2w` (ago), or an ISO date/time (UTC unless it says otherwise)."""
    match = _DURATION.match(value.strip())
    if match:
        return now - timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"not a time: {value!r} (try 24h, 7d, 90m or 2026-12-01T08:00)") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _report(conn: Connection, name: str, sql: str, params: dict[str, Any]) -> Report:
    result = conn.execute(text(sql), params)
    return Report(name, tuple(result.keys()), tuple(tuple(r) for r in result))


def job_stats(
    conn: Connection, window: Window, tenant: str | None = None, model: str | None = None
) -> Report:
    """Per bucket × tenant × class × model (the base's name or an adapter's): counts by status, tokens,
    TTFT/ITL/e2e/queue p50/p95/p99."""
    clauses = [f"{column} = :{column}" for column, value in (("tenant", tenant), ("model", model)) if value]
    where = "WHERE " + " AND ".join(clauses) if clauses else ""
    order = "ORDER BY bucket_start, tenant, priority, model"
    sql = f"SELECT * FROM job_stats(:bucket, :since, :until) {where} {order}"
    params = {"bucket": window.bucket, "since": window.since, "until": window.until}
    return _report(conn, "jobs", sql, {**params, "tenant": tenant, "model": model})


def worker_stats(conn: Connection, window: Window) -> Report:
    """Per bucket × worker: jobs, tokens, busy seconds (union of job intervals), tokens per busy second."""
    sql = "SELECT * FROM worker_stats(:bucket, :since, :until) ORDER BY bucket_start, worker_id"
    return _report(
        conn, "workers", sql, {"bucket": window.bucket, "since": window.since, "until": window.until}
    )


def bulk_progress(
    conn: Connection, since: datetime | None = None, tenant: str | None = None, bulk_id: str | None = None
) -> Report:
    """Per bulk job: progress by status and cost in tokens."""
    clauses, params = [], {}
    for column, value in (("tenant", tenant), ("bulk_id", bulk_id)):
        if value is not None:
            clauses.append(f"{column} = :{column}")
            params[column] = value
    if since is not None:
        clauses.append("(finished_at IS NULL OR finished_at >= :since)")
        params["since"] = since
    where = "WHERE " + " AND ".join(clauses) if clauses else ""
    return _report(conn, "bulk", f"SELECT * FROM bulk_progress {where} ORDER BY created_at", params)

"""Factories for history tests: known jobs rows, and a bulk synthetic history built inside Postgres."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.dialects.postgresql import insert

from schemas.tables import jobs

T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


def make_job(job_id: str, **overrides: Any) -> dict[str, Any]:
    """A finished jobs row created at T0 by worker w1; override any column."""
    created = overrides.pop("created_at", T0)
    row: dict[str, Any] = {
        "job_id": job_id,
        "tenant": "acme",
        "priority": "normal",
        "status": "succeeded",
        "prompt": "hi",
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "attempts": 1,
        "worker_id": "w1",
        "created_at": created,
        "started_at": created + timedelta(milliseconds=5),
        "finished_at": created + timedelta(seconds=1),
        "ttft_ms": 50.0,
        "mean_itl_ms": 10.0,
        "e2e_ms": 1000.0,
        "queue_ms": 5.0,
    }
    row.update(overrides)
    return row


def insert_jobs(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """One statement per row: rows may set different columns."""
    for row in rows:
        conn.execute(insert(jobs).values(**row))


# One statement, generated server-side: ~1M rows in seconds instead of a million round trips.
# created_at spreads over `days` days before `end`; latencies are skewed (power of random()) so
# percentiles differ from means; 2% failed, 1% expired, 1% cancelled.
SYNTHETIC = """
INSERT INTO jobs (job_id, tenant, priority, status, prompt_tokens, completion_tokens, attempts,
                  worker_id, created_at, started_at, first_token_at, finished_at,
                  ttft_ms, mean_itl_ms, e2e_ms, queue_ms, updated_at)
SELECT 'syn-' || g,
       'tenant-' || (g % :tenants),
       (ARRAY['high', 'normal', 'low'])[1 + g % 3],
       CASE WHEN g % 100 < 96 THEN 'succeeded' WHEN g % 100 < 98 THEN 'failed'
            WHEN g % 100 < 99 THEN 'expired' ELSE 'cancelled' END,
       16 + g % 200, 1 + g % 256, 1,
       'worker-' || (g % 4),
       c, c + q * interval '1 millisecond', c + (q + t) * interval '1 millisecond',
       c + (q + e) * interval '1 millisecond',
       t, i, e, q, c + (q + e) * interval '1 millisecond'
FROM (
    SELECT g, :end_at - (random() * :days) * interval '1 day' AS c,
           5 + 100 * random() ^ 3 AS q, 20 + 400 * random() ^ 4 AS t, 5 + 30 * random() ^ 2 AS i,
           200 + 5000 * random() ^ 2 AS e
    FROM generate_series(1, :rows) AS g
) s
"""


def insert_synthetic_history(
    conn: Connection, rows: int, *, days: int = 30, tenants: int = 20, end_at: datetime = T0
) -> None:
    conn.execute(text("SELECT setseed(0.42)"))
    conn.execute(text(SYNTHETIC), {"rows": rows, "days": days, "tenants": tenants, "end_at": end_at})
    conn.execute(text("ANALYZE jobs"))


def migrated_engine(url: str) -> Engine:
    """An engine on `url` after `alembic upgrade head` (the same path `inferq db upgrade` takes)."""
    from workers.db.migrate import upgrade

    upgrade(url)
    return create_engine(url)


def percentile(values: list[float], q: float) -> float:
    """percentile_cont: linear interpolation between the two nearest ranks."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

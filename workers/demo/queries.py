"""Questions about job history a user would ask PostgreSQL: the demo shows the SQL, then the answer."""

from __future__ import annotations

from workers.db.connect import make_engine
from workers.db.job_queries import run_sql

HISTORY_QUERIES: tuple[tuple[str, str], ...] = (
    (
        "Who used the service in the last hour, and how fast did their first tokens come?",
        """SELECT tenant, count(*) AS jobs, sum(completion_tokens) AS tokens_out,
       round(avg(ttft_ms)::numeric) AS avg_ttft_ms
FROM jobs
WHERE created_at > now() - interval '1 hour'
GROUP BY tenant
ORDER BY tokens_out DESC NULLS LAST""",
    ),
    (
        "Does priority pay off? Latency percentiles by class over the last day",
        """SELECT priority, count(*) AS jobs,
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ttft_ms)::numeric) AS ttft_p50_ms,
       round(percentile_cont(0.95) WITHIN GROUP (ORDER BY e2e_ms)::numeric) AS e2e_p95_ms
FROM jobs
WHERE status = 'succeeded' AND created_at > now() - interval '1 day'
GROUP BY priority
ORDER BY array_position(ARRAY['high', 'normal', 'low'], priority::text)""",
    ),
    (
        "The hourly history function (migration 0002): this day's buckets by tenant, class and model",
        """SELECT bucket_start, tenant, priority, model, jobs, succeeded, completion_tokens,
       round(ttft_p99_ms::numeric) AS ttft_p99_ms
FROM job_stats('hour', now() - interval '1 day', now())
ORDER BY bucket_start DESC, tenant, priority, model
LIMIT 10""",
    ),
)


def run_history_queries(database_url: str) -> list[tuple[str, str, list[dict]]]:
    """Each query's title, SQL and rows."""
    db = make_engine(database_url)
    try:
        with db.connect() as conn:
            return [(title, sql, run_sql(conn, sql)) for title, sql in HISTORY_QUERIES]
    finally:
        db.dispose()

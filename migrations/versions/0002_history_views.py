"""History views: per tenant/class/bucket, per worker, per bulk job.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

The time-bounded answers are SQL functions, `job_stats(bucket, since, until)` and
`worker_stats(bucket, since, until)`: the planner inlines them, so the range filter on created_at
(finished_at) and an outer `WHERE tenant = ...` both reach the existing (tenant, created_at) and
finished_at indexes. The views are the same functions over all history, for quick looks in psql.
Buckets are in UTC.
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Latency percentiles: one sort per metric (array form of percentile_cont), NULLs ignored, so a job
# that never produced a token does not count towards TTFT.
JOB_STATS = """
CREATE FUNCTION job_stats(bucket text, since timestamptz, until timestamptz)
RETURNS TABLE (
    bucket_start timestamptz, tenant varchar, priority varchar,
    jobs bigint, succeeded bigint, failed bigint, rejected bigint, cancelled bigint, expired bigint,
    in_flight bigint, prompt_tokens bigint, completion_tokens bigint,
    ttft_p50_ms float8, ttft_p95_ms float8, ttft_p99_ms float8,
    itl_p50_ms float8, itl_p95_ms float8, itl_p99_ms float8,
    e2e_p50_ms float8, e2e_p95_ms float8, e2e_p99_ms float8,
    queue_p50_ms float8, queue_p95_ms float8, queue_p99_ms float8
)
LANGUAGE sql STABLE AS $$
SELECT b, tenant, priority, jobs, succeeded, failed, rejected, cancelled, expired, in_flight,
       prompt_tokens, completion_tokens,
       ttft[1], ttft[2], ttft[3], itl[1], itl[2], itl[3], e2e[1], e2e[2], e2e[3], q[1], q[2], q[3]
FROM (
    SELECT date_trunc(bucket, created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS b,
           tenant, priority,
           count(*) AS jobs,
           count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE status = 'rejected') AS rejected,
           count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
           count(*) FILTER (WHERE status = 'expired') AS expired,
           count(*) FILTER (WHERE status IN ('queued', 'running')) AS in_flight,
           coalesce(sum(prompt_tokens), 0)::bigint AS prompt_tokens,
           coalesce(sum(completion_tokens), 0)::bigint AS completion_tokens,
           percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ttft_ms) AS ttft,
           percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY mean_itl_ms) AS itl,
           percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY e2e_ms) AS e2e,
           percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY queue_ms) AS q
    FROM jobs
    WHERE created_at >= since AND created_at < until
    GROUP BY 1, 2, 3
) s
$$
"""

# Busy time is the union of the [started_at, finished_at] intervals of the jobs a worker finished in the
# bucket (gaps and islands), so overlapping jobs of one batch count once. A job is booked in the bucket it
# finished in.
WORKER_STATS = """
CREATE FUNCTION worker_stats(bucket text, since timestamptz, until timestamptz)
RETURNS TABLE (
    bucket_start timestamptz, worker_id varchar, jobs bigint, succeeded bigint,
    prompt_tokens bigint, completion_tokens bigint, busy_s float8, tokens_per_busy_s float8,
    first_started_at timestamptz, last_finished_at timestamptz
)
LANGUAGE sql STABLE AS $$
WITH iv AS (
    SELECT date_trunc(bucket, finished_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS b, worker_id,
           coalesce(started_at, finished_at) AS s, finished_at AS f,
           (status = 'succeeded')::int AS ok, prompt_tokens AS pt, completion_tokens AS ct
    FROM jobs
    WHERE finished_at >= since AND finished_at < until AND worker_id IS NOT NULL
), marked AS (
    SELECT *, CASE WHEN s <= max(f) OVER (PARTITION BY b, worker_id ORDER BY s, f
                                          ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
                   THEN 0 ELSE 1 END AS opens
    FROM iv
), islands AS (
    SELECT *, sum(opens) OVER (PARTITION BY b, worker_id ORDER BY s, f ROWS UNBOUNDED PRECEDING) AS island
    FROM marked
), spans AS (
    SELECT b, worker_id, min(s) AS s, max(f) AS f, count(*) AS jobs, sum(ok) AS ok,
           sum(pt) AS pt, sum(ct) AS ct
    FROM islands GROUP BY b, worker_id, island
)
SELECT b, worker_id, sum(jobs)::bigint, sum(ok)::bigint,
       coalesce(sum(pt), 0)::bigint, coalesce(sum(ct), 0)::bigint,
       extract(epoch FROM sum(f - s))::float8,
       (coalesce(sum(ct), 0) / nullif(extract(epoch FROM sum(f - s)), 0))::float8,
       min(s), max(f)
FROM spans GROUP BY b, worker_id
$$
"""

# One row per bulk job; the LATERAL aggregate reads only that bulk's jobs through ix_jobs_bulk_id.
BULK_PROGRESS = """
CREATE VIEW bulk_progress AS
SELECT b.bulk_id, b.tenant, b.priority, b.status, b.endpoint,
       b.total_lines, b.invalid_lines, b.submitted_lines,
       b.total_lines - b.invalid_lines AS expected_jobs,
       coalesce(j.jobs, 0) AS jobs,
       coalesce(j.queued, 0) AS queued, coalesce(j.running, 0) AS running,
       coalesce(j.succeeded, 0) AS succeeded, coalesce(j.failed, 0) AS failed,
       coalesce(j.rejected, 0) AS rejected, coalesce(j.cancelled, 0) AS cancelled,
       coalesce(j.expired, 0) AS expired,
       coalesce(j.jobs - j.queued - j.running, 0) AS done,
       coalesce(j.prompt_tokens, 0) AS prompt_tokens,
       coalesce(j.completion_tokens, 0) AS completion_tokens,
       coalesce(j.prompt_tokens + j.completion_tokens, 0) AS total_tokens,
       b.created_at, b.started_at, j.first_started_at, j.last_finished_at, b.finished_at,
       (j.completion_tokens / nullif(extract(epoch FROM j.last_finished_at - j.first_started_at), 0))::float8
           AS completion_tokens_per_s
FROM bulk_jobs b
LEFT JOIN LATERAL (
    SELECT count(*) AS jobs,
           count(*) FILTER (WHERE status = 'queued') AS queued,
           count(*) FILTER (WHERE status = 'running') AS running,
           count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE status = 'rejected') AS rejected,
           count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
           count(*) FILTER (WHERE status = 'expired') AS expired,
           coalesce(sum(prompt_tokens), 0) AS prompt_tokens,
           coalesce(sum(completion_tokens), 0) AS completion_tokens,
           min(started_at) AS first_started_at, max(finished_at) AS last_finished_at
    FROM jobs WHERE jobs.bulk_id = b.bulk_id
) j ON true
"""

VIEWS = {
    "job_stats_hourly": "SELECT * FROM job_stats('hour', '-infinity', 'infinity')",
    "job_stats_daily": "SELECT * FROM job_stats('day', '-infinity', 'infinity')",
    "worker_stats_hourly": "SELECT * FROM worker_stats('hour', '-infinity', 'infinity')",
    "worker_stats_daily": "SELECT * FROM worker_stats('day', '-infinity', 'infinity')",
}


def upgrade() -> None:
    op.execute(JOB_STATS)
    op.execute(WORKER_STATS)
    for name, query in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {query}")
    op.execute(BULK_PROGRESS)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS bulk_progress")
    for name in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.execute("DROP FUNCTION IF EXISTS worker_stats(text, timestamptz, timestamptz)")
    op.execute("DROP FUNCTION IF EXISTS job_stats(text, timestamptz, timestamptz)")

"""The result outbox: a terminal row is the durable record of its result until `published_at` is set.

Results are always built from the stored row, so a result published twice (the one window left: a worker
killed after the broker took the result but before `published_at` was committed) is byte-for-byte the
same message, and consumers can drop the second by job_id.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import Connection, Row, func, select

from schemas.jobs import JobResult, Timings, Usage
from schemas.tables import TERMINAL_STATUSES, jobs

# Engine finish reasons that are not in the contract's FinishReasonName map to these.
_FINISH_REASONS = {"stop", "length", "abort", "expired", "rejected", "error"}


def result_from_row(row: Row) -> JobResult:
    usage = None
    if row.prompt_tokens is not None or row.completion_tokens is not None:
        usage = Usage(prompt_tokens=row.prompt_tokens or 0, completion_tokens=row.completion_tokens or 0)
    finish = row.finish_reason if row.finish_reason in _FINISH_REASONS else None
    params = row.params or {}
    return JobResult(
        job_id=row.job_id,
        status=row.status,
        tenant=row.tenant,
        priority=row.priority,
        output_text=row.output_text,
        finish_reason=finish,
        usage=usage,
        timings=Timings(
            created_at=row.created_at,
            started_at=row.started_at,
            first_token_at=row.first_token_at,
            finished_at=row.finished_at,
            queue_ms=row.queue_ms,
            ttft_ms=row.ttft_ms,
            mean_itl_ms=row.mean_itl_ms,
            e2e_ms=row.e2e_ms,
        ),
        attempt=row.attempts,
        worker_id=row.worker_id,
        bulk_id=row.bulk_id,
        error=row.error,
        metadata=params.get("metadata") or {},
    )


def unpublished(conn: Connection, job_ids: Sequence[str]) -> list[Row]:
    """Terminal rows among these whose result has not been published yet."""
    if not job_ids:
        return []
    query = select(*jobs.c).where(
        jobs.c.job_id.in_(list(job_ids)),
        jobs.c.status.in_(TERMINAL_STATUSES),
        jobs.c.published_at.is_(None),
    )
    return list(conn.execute(query))


def mark_published(conn: Connection, job_ids: Sequence[str], now: datetime) -> None:
    if job_ids:
        conn.execute(jobs.update().where(jobs.c.job_id.in_(list(job_ids))).values(published_at=now))


def count_unpublished(conn: Connection) -> int:
    query = select(func.count()).where(jobs.c.status.in_(TERMINAL_STATUSES), jobs.c.published_at.is_(None))
    return int(conn.execute(query).scalar_one())

"""The bulk_jobs table (owned by bulk tasks) and the read-only queries bulk tasks run on jobs."""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, func, literal, select, text
from sqlalchemy.dialects.postgresql import JSONB

from schemas.statuses import BULK_OPEN_STATUSES
from schemas.tables import TERMINAL_STATUSES, bulk_jobs, jobs
from workers.clock import utcnow

Row = Mapping[str, Any]  # a row as a mapping of column names (a bulk_jobs row, or a jobs row)
# Bulk jobs that still need a task: resumed when a bulk worker starts, and by the periodic sweep.
OPEN_STATUSES = tuple(s for s in BULK_OPEN_STATUSES if s != "validating")  # submitted: ticks advance them


def new_bulk_id(now: datetime | None = None) -> str:
    now = now or utcnow()
    return f"bulk-{now:%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def create(conn: Connection, bulk_id: str, **values: Any) -> None:
    conn.execute(bulk_jobs.insert().values(bulk_id=bulk_id, status="submitting", **values))


def get(conn: Connection, bulk_id: str) -> Row | None:
    row = conn.execute(select(bulk_jobs).where(bulk_jobs.c.bulk_id == bulk_id)).mappings().first()
    return dict(row) if row else None


def transition(
    conn: Connection, bulk_id: str, from_statuses: tuple[str, ...], to: str, **values: Any
) -> bool:
    """Move to `to` only from one of `from_statuses` (so a cancel is never overwritten by a late task)."""
    result = conn.execute(
        bulk_jobs.update()
        .where(bulk_jobs.c.bulk_id == bulk_id, bulk_jobs.c.status.in_(from_statuses))
        .values(status=to, **values)
        .returning(bulk_jobs.c.bulk_id)
    )
    return result.first() is not None


def set_submitted(conn: Connection, bulk_id: str, submitted: int) -> None:
    conn.execute(bulk_jobs.update().where(bulk_jobs.c.bulk_id == bulk_id).values(submitted_lines=submitted))


def set_files(
    conn: Connection, bulk_id: str, output_path: str, error_path: str, counts: dict[str, int]
) -> None:
    """Record the written files and their line counts (metadata.final): after a cancel, rows the worker
    wrote for jobs that never reached it carry no bulk_id, so bulk_progress cannot count them."""
    conn.execute(
        bulk_jobs.update()
        .where(bulk_jobs.c.bulk_id == bulk_id)
        .values(
            output_path=output_path,
            error_path=error_path,
            metadata=func.coalesce(bulk_jobs.c.metadata, literal({}, JSONB)).op("||", return_type=JSONB)(
                literal({"final": counts}, JSONB)
            ),
        )
    )


def open_bulk_ids(conn: Connection, topic_prefix: str) -> list[tuple[str, str]]:
    """(bulk_id, status) of this deployment's bulk jobs a task must still advance, oldest first;
    includes cancelled ones whose files were never written."""
    cancelled_unwritten = (bulk_jobs.c.status == "cancelled") & bulk_jobs.c.output_path.is_(None)
    query = (
        select(bulk_jobs.c.bulk_id, bulk_jobs.c.status)
        .where(bulk_jobs.c.status.in_(OPEN_STATUSES) | cancelled_unwritten)
        .where(bulk_jobs.c.metadata["topic_prefix"].astext == topic_prefix)
        .order_by(bulk_jobs.c.created_at)
    )
    return [(r.bulk_id, r.status) for r in conn.execute(query)]


def job_counts(conn: Connection, bulk_id: str, tenant: str) -> dict[str, int]:
    """status → number of jobs rows of this bulk job (its tenant's: another tenant's job that names the
    same bulk_id is not one of them)."""
    query = (
        select(jobs.c.status, func.count())
        .where(jobs.c.bulk_id == bulk_id, jobs.c.tenant == tenant)
        .group_by(jobs.c.status)
    )
    return {status: n for status, n in conn.execute(query)}


def token_sums(conn: Connection, bulk_id: str, tenant: str) -> dict[str, int]:
    """The tokens of this bulk job's jobs so far: prompt_tokens, completion_tokens, cached_tokens."""
    query = select(
        func.coalesce(func.sum(jobs.c.prompt_tokens), 0),
        func.coalesce(func.sum(jobs.c.completion_tokens), 0),
        func.coalesce(func.sum(jobs.c.cached_tokens), 0),
    ).where(jobs.c.bulk_id == bulk_id, jobs.c.tenant == tenant)
    prompt, completion, cached = conn.execute(query).one()
    return {"prompt_tokens": int(prompt), "completion_tokens": int(completion), "cached_tokens": int(cached)}


def terminal_jobs(counts: dict[str, int]) -> int:
    return sum(n for status, n in counts.items() if status in TERMINAL_STATUSES)


def rows_for(conn: Connection, tenant: str, job_ids: list[str]) -> dict[str, Row]:
    """The rows of these job ids of one tenant (a bulk job's own), by job_id."""
    query = select(
        jobs.c.job_id, jobs.c.status, jobs.c.output_text, jobs.c.choices, jobs.c.finish_reason,
        jobs.c.prompt_tokens, jobs.c.completion_tokens, jobs.c.cached_tokens, jobs.c.error, jobs.c.created_at,
        jobs.c.finished_at, jobs.c.attempts, jobs.c.model,
    ).where(jobs.c.job_id.in_(job_ids), jobs.c.tenant == tenant)  # fmt: skip
    return {r["job_id"]: dict(r) for r in conn.execute(query).mappings()}


def unfinished_job_ids(conn: Connection, bulk_id: str, tenant: str) -> list[str]:
    query = select(jobs.c.job_id).where(
        jobs.c.bulk_id == bulk_id, jobs.c.tenant == tenant, jobs.c.status.not_in(TERMINAL_STATUSES)
    )
    return list(conn.execute(query).scalars())


def progress(conn: Connection, bulk_id: str) -> Row | None:
    row = (
        conn.execute(text("SELECT * FROM bulk_progress WHERE bulk_id = :b"), {"b": bulk_id})
        .mappings()
        .first()
    )
    return dict(row) if row else None


def is_free(engine: Engine, bulk_id: str) -> bool:
    """Whether no task holds the bulk job's lock right now."""
    with bulk_lock(engine, bulk_id) as got:
        return got


@contextmanager
def bulk_lock(engine: Engine, bulk_id: str) -> Iterator[bool]:
    """A session advisory lock per bulk job: one task advances a bulk job at a time, and the lock goes
    away with the connection if the Celery worker dies."""
    with engine.connect() as conn:
        key = conn.execute(
            text("SELECT hashtextextended(:k, 0)"), {"k": f"inferq-bulk:{bulk_id}"}
        ).scalar_one()
        got = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar_one()
        conn.commit()
        try:
            yield bool(got)
        finally:
            if got:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()

"""History retention: deleting terminal jobs and finished bulk jobs (with their files) older than a cutoff.

Run on request (`inferq history purge --older-than 30d`), or every minute by the bulk worker's beat when
INFERQ_RETENTION_DAYS is set; never as a side effect of anything else. A job of a bulk job that is still
open is kept, so that bulk job's output can still be written.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import Connection, text

from schemas.statuses import BULK_FINISHED_STATUSES, BULK_OPEN_STATUSES, TERMINAL_STATUSES

PURGE_BATCH = 10_000
_OPEN_BULK = repr(BULK_OPEN_STATUSES)
_DONE_BULK = repr(BULK_FINISHED_STATUSES)
_JOBS_WHERE = (
    f"finished_at < :cutoff AND status IN {TERMINAL_STATUSES!r} AND NOT EXISTS (SELECT 1 FROM bulk_jobs b "
    f"WHERE b.bulk_id = j.bulk_id AND b.status IN {_OPEN_BULK})"
)
_BULK_WHERE = f"finished_at < :cutoff AND status IN {_DONE_BULK}"


@dataclass(frozen=True)
class Purged:
    jobs: int
    bulk_jobs: int
    dry_run: bool


def delete_in_batches(conn: Connection, sql: str, params: dict) -> int:
    """Run a DELETE bounded by `LIMIT :batch` until it deletes less than a batch; return the rows deleted.

    Each batch commits on its own: deleting millions of rows never holds locks for long."""
    total = 0
    while True:
        n = conn.execute(text(sql), {**params, "batch": PURGE_BATCH}).rowcount
        conn.commit()
        total += n
        if n < PURGE_BATCH:
            return total


def purge(conn: Connection, cutoff: datetime, state_dir: Path | None = None, dry_run: bool = False) -> Purged:
    """Delete (or with `dry_run`, count) what finished before `cutoff`; commits in short batches so a purge
    of millions of rows never holds locks for long."""
    params = {"cutoff": cutoff}
    if dry_run:
        jobs = conn.execute(text(f"SELECT count(*) FROM jobs j WHERE {_JOBS_WHERE}"), params).scalar_one()
        bulk = conn.execute(text(f"SELECT count(*) FROM bulk_jobs WHERE {_BULK_WHERE}"), params).scalar_one()
        return Purged(int(jobs), int(bulk), True)
    sql = f"DELETE FROM jobs WHERE job_id IN (SELECT job_id FROM jobs j WHERE {_JOBS_WHERE} LIMIT :batch)"
    jobs = delete_in_batches(conn, sql, params)
    gone = conn.execute(
        text(f"DELETE FROM bulk_jobs WHERE {_BULK_WHERE} RETURNING bulk_id"), params
    ).scalars().all()  # fmt: skip
    conn.commit()
    if state_dir is not None:
        for bulk_id in gone:
            shutil.rmtree(state_dir / "bulk" / bulk_id, ignore_errors=True)
    return Purged(jobs, len(gone), False)

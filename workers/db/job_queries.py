"""Read-only queries over the jobs table, for the client, the command line and the demo."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Column, Connection, Row, select, text

from schemas.tables import jobs
from workers.db.jobs import SUMMARY_COLUMNS


def job_row(conn: Connection, job_id: str, tenant: str | None = None) -> Row | None:
    """A job's row: that tenant's (job ids are per tenant), or, without one, any tenant's."""
    query = select(*jobs.c).where(jobs.c.job_id == job_id)
    if tenant is not None:
        query = query.where(jobs.c.tenant == tenant)
    return conn.execute(query).first()


def posted(conn: Connection, job_id: str, tenant: str) -> tuple[datetime, bool] | None:
    """When a job was posted, and whether it asked for token events (its `stream`); None: no such row."""
    query = select(jobs.c.created_at, jobs.c.params["stream"].as_boolean())
    row = conn.execute(query.where(jobs.c.job_id == job_id, jobs.c.tenant == tenant)).first()
    return None if row is None else (row[0], row[1] is not False)  # rows older than the field streamed


def started(conn: Connection, keys: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
    """Those of these (tenant, job_id) whose row has left `queued` (running, or ended)."""
    wanted, found = set(keys), set()
    for i in range(0, len(keys), 1000):
        ids = [job_id for _, job_id in keys[i : i + 1000]]
        query = select(jobs.c.tenant, jobs.c.job_id).where(jobs.c.job_id.in_(ids), jobs.c.status != "queued")
        found |= {(t, j) for t, j in conn.execute(query) if (t, j) in wanted}
    return found


def summaries(conn: Connection, job_ids: Sequence[str], *extra: str) -> list[dict[str, Any]]:
    """The summary columns (and `extra` ones) of these jobs' rows, in no particular order."""
    cols = [*SUMMARY_COLUMNS, *(jobs.c[name] for name in extra)]
    return [dict(r._mapping) for r in conn.execute(select(*cols).where(jobs.c.job_id.in_(job_ids)))]


def recent(conn: Connection, limit: int, extra: Sequence[str] = (), **equal: Any) -> list[dict[str, Any]]:
    """The newest rows first; `equal` filters by columns (a None value does not filter)."""
    cols: list[Column] = [*SUMMARY_COLUMNS, *(jobs.c[name] for name in extra)]
    query = select(*cols).order_by(jobs.c.created_at.desc()).limit(limit)
    for name, value in equal.items():
        if value is not None:
            query = query.where(jobs.c[name] == value)
    return [dict(r._mapping) for r in conn.execute(query)]


def run_sql(conn: Connection, sql: str) -> list[dict[str, Any]]:
    """An operator's own read-only SQL, rows as dicts (the demo shows history questions this way)."""
    return [dict(r._mapping) for r in conn.execute(text(sql))]

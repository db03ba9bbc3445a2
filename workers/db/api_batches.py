"""The api_batches table: OpenAI Batch objects; their lines are jobs rows with bulk_id = batch_id.

Every status change is a compare-and-set (`transition`), so two API processes advancing the same batch,
or a cancel racing its completion, never overwrite each other's verdict.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, select, tuple_

from schemas.tables import api_batches
from workers.db.cursors import UnknownCursor

Row = Mapping[str, Any]
OPEN = ("validating", "in_progress", "finalizing", "cancelling")
FINISHED = ("completed", "failed", "expired", "cancelled")


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def create(conn: Connection, batch_id: str, **values: Any) -> Row:
    conn.execute(api_batches.insert().values(batch_id=batch_id, status="validating", **values))
    return get_any(conn, batch_id)


def get_any(conn: Connection, batch_id: str) -> Row | None:
    row = conn.execute(select(api_batches).where(api_batches.c.batch_id == batch_id)).mappings().first()
    return dict(row) if row else None


def get(conn: Connection, tenant: str, batch_id: str) -> Row | None:
    """The batch, only to its own tenant."""
    row = (
        conn.execute(
            select(api_batches).where(api_batches.c.batch_id == batch_id, api_batches.c.tenant == tenant)
        )
        .mappings()
        .first()
    )
    return dict(row) if row else None


def list_batches(conn: Connection, tenant: str, limit: int, after: str | None) -> list[Row]:
    """Newest first; `after`: a batch_id of this tenant, the page starts past it (an unknown one raises
    UnknownCursor)."""
    query = select(api_batches).where(api_batches.c.tenant == tenant)
    if after is not None:
        anchor = conn.execute(
            select(api_batches.c.created_at).where(
                api_batches.c.batch_id == after, api_batches.c.tenant == tenant
            )
        ).scalar_one_or_none()
        if anchor is None:
            raise UnknownCursor(after)
        query = query.where(tuple_(api_batches.c.created_at, api_batches.c.batch_id) < tuple_(anchor, after))
    query = query.order_by(api_batches.c.created_at.desc(), api_batches.c.batch_id.desc()).limit(limit)
    return [dict(r) for r in conn.execute(query).mappings()]


def transition(
    conn: Connection, batch_id: str, from_statuses: tuple[str, ...], to: str, **values: Any
) -> bool:
    """Move to `to` only from one of `from_statuses`; whether it moved."""
    result = conn.execute(
        api_batches.update()
        .where(api_batches.c.batch_id == batch_id, api_batches.c.status.in_(from_statuses))
        .values(status=to, **values)
        .returning(api_batches.c.batch_id)
    )
    return result.first() is not None


def update(conn: Connection, batch_id: str, **values: Any) -> None:
    conn.execute(api_batches.update().where(api_batches.c.batch_id == batch_id).values(**values))


def open_batches(conn: Connection, topic_prefix: str) -> list[Row]:
    """This deployment's batches an API process must still advance (open ones, and finished ones whose
    event is not published yet), oldest first."""
    unpublished = api_batches.c.status.in_(FINISHED) & api_batches.c.event_published_at.is_(None)
    query = (
        select(api_batches.c.batch_id, api_batches.c.tenant, api_batches.c.status)
        .where(api_batches.c.topic_prefix == topic_prefix)
        .where(api_batches.c.status.in_(OPEN) | unpublished)
        .order_by(api_batches.c.created_at)
    )
    return [dict(r) for r in conn.execute(query).mappings()]


def expired(row: Row, now: datetime) -> bool:
    return row["status"] in ("validating", "in_progress") and row["expires_at"] <= now


def open_with_input(conn: Connection, tenant: str, file_id: str) -> list[str]:
    """The unfinished batches reading this file (it must not be deleted under them)."""
    query = select(api_batches.c.batch_id).where(
        api_batches.c.tenant == tenant,
        api_batches.c.input_file_id == file_id,
        api_batches.c.status.in_(OPEN),
    )
    return list(conn.execute(query).scalars())

"""The api_files table: OpenAI Files (Batch inputs, and the output and error files batches write).

Content lives in the row (bytea), so every API process serves every file; a file is written in one
statement, so no reader ever sees half of one. A file past its `expires_at` is served no more (every read
here leaves it out) and is deleted by `purge_expired`.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, func, or_, select, tuple_

from schemas.tables import api_batches, api_files
from workers.db.api_batches import OPEN

Row = Mapping[str, Any]
_META = (
    api_files.c.file_id,
    api_files.c.tenant,
    api_files.c.purpose,
    api_files.c.filename,
    api_files.c.bytes,
    api_files.c.created_at,
    api_files.c.expires_at,
)
_LIVE = or_(api_files.c.expires_at.is_(None), api_files.c.expires_at > func.now())


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def create(
    conn: Connection,
    tenant: str,
    purpose: str,
    filename: str,
    content: bytes,
    lifetime_s: int | None = None,
) -> Row:
    """`lifetime_s`: the file expires that long after its creation (created_at, the database's clock)."""
    file_id = new_file_id()
    expires_at = None if lifetime_s is None else func.now() + timedelta(seconds=lifetime_s)
    row = conn.execute(
        api_files.insert()
        .values(
            file_id=file_id,
            tenant=tenant,
            purpose=purpose,
            filename=filename,
            bytes=len(content),
            content=content,
            expires_at=expires_at,
        )  # fmt: skip
        .returning(*_META)
    )
    return dict(row.mappings().one())


def get(conn: Connection, tenant: str, file_id: str) -> Row | None:
    """The file's metadata, only to its own tenant."""
    query = select(*_META).where(api_files.c.file_id == file_id, api_files.c.tenant == tenant, _LIVE)
    row = conn.execute(query).mappings().first()
    return dict(row) if row else None


def content(conn: Connection, tenant: str, file_id: str) -> bytes | None:
    query = select(api_files.c.content).where(
        api_files.c.file_id == file_id, api_files.c.tenant == tenant, _LIVE
    )
    return conn.execute(query).scalar_one_or_none()


def list_files(
    conn: Connection, tenant: str, purpose: str | None, limit: int, after: str | None
) -> list[Row]:
    """Newest first; `after`: a file_id, the page starts past it (as the file ids of OpenAI's cursor)."""
    query = select(*_META).where(api_files.c.tenant == tenant, _LIVE)
    if purpose is not None:
        query = query.where(api_files.c.purpose == purpose)
    if after is not None:
        anchor = conn.execute(
            select(api_files.c.created_at).where(api_files.c.file_id == after, api_files.c.tenant == tenant)
        ).scalar_one_or_none()
        if anchor is not None:
            query = query.where(tuple_(api_files.c.created_at, api_files.c.file_id) < tuple_(anchor, after))
    query = query.order_by(api_files.c.created_at.desc(), api_files.c.file_id.desc()).limit(limit)
    return [dict(r) for r in conn.execute(query).mappings()]


def delete(conn: Connection, tenant: str, file_id: str) -> bool:
    result = conn.execute(
        api_files.delete()
        .where(api_files.c.file_id == file_id, api_files.c.tenant == tenant)
        .returning(api_files.c.file_id)
    )
    return result.first() is not None


def purge_expired(conn: Connection, limit: int = 1000) -> int:
    """Delete up to `limit` files past their expiry (none that an unfinished batch still reads); how many."""
    in_use = select(api_batches.c.input_file_id).where(api_batches.c.status.in_(OPEN))
    doomed = (
        select(api_files.c.file_id)
        .where(api_files.c.expires_at <= func.now(), api_files.c.file_id.not_in(in_use))
        .limit(limit)
        .scalar_subquery()
    )
    return conn.execute(api_files.delete().where(api_files.c.file_id.in_(doomed))).rowcount

"""The api_files table and its chunks: OpenAI Files (Batch inputs, and the output and error files batches
write), their content in PostgreSQL so every API process serves every file.

Content is stored and read a chunk (FILE_CHUNK_BYTES) at a time, each in a short statement of its own: an
upload of any size is written as it arrives and a read streams, with no process holding a whole file and
no connection held between chunks. A file being written has status `uploading` and no reader sees it; it
becomes `processed` in one statement once complete (a batch's output files in the transaction of its final
status). One left `uploading` by a process that died is removed by `sweep_abandoned`. A file past its
`expires_at` is served no more (every read here leaves it out) and is deleted by `purge_expired`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, delete, func, or_, select, tuple_

from schemas.tables import FILE_CHUNK_BYTES, api_batches, api_file_chunks, api_files
from workers.db.api_batches import OPEN
from workers.db.cursors import UnknownCursor

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
READ_CHUNKS = 4  # chunks fetched per statement when reading a file
# a file its tenant may see: complete, and not past its expiry
_VISIBLE = (api_files.c.status == "processed") & or_(
    api_files.c.expires_at.is_(None), api_files.c.expires_at > func.now()
)


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


# ---- writing -------------------------------------------------------------------------------------------
def begin(conn: Connection, tenant: str, purpose: str, filename: str, lifetime_s: int | None = None) -> str:
    """A new file, `uploading` (invisible) until `finish`; its id. `lifetime_s`: it expires that long after
    its creation (created_at, the database's clock); None: never."""
    file_id = new_file_id()
    expires_at = None if lifetime_s is None else func.now() + timedelta(seconds=lifetime_s)
    conn.execute(
        api_files.insert().values(
            file_id=file_id,
            tenant=tenant,
            purpose=purpose,
            filename=filename,
            bytes=0,
            status="uploading",
            expires_at=expires_at,
        )  # fmt: skip
    )
    return file_id


def append(conn: Connection, file_id: str, seq: int, data: bytes) -> None:
    """The file's chunk `seq` (0, 1, 2...); every chunk but the last must hold FILE_CHUNK_BYTES."""
    conn.execute(api_file_chunks.insert().values(file_id=file_id, seq=seq, data=data))


def finish(conn: Connection, file_id: str, size: int) -> Row:
    """The file complete (`size` bytes): visible from now on; its metadata."""
    row = conn.execute(
        api_files.update()
        .where(api_files.c.file_id == file_id)
        .values(bytes=size, status="processed")
        .returning(*_META)
    )
    return dict(row.mappings().one())


def set_lifetime(conn: Connection, file_id: str, lifetime_s: int) -> Row:
    """The file expires `lifetime_s` after its creation; its metadata."""
    row = conn.execute(
        api_files.update()
        .where(api_files.c.file_id == file_id)
        .values(expires_at=api_files.c.created_at + timedelta(seconds=lifetime_s))
        .returning(*_META)
    )
    return dict(row.mappings().one())


def discard(conn: Connection, file_id: str) -> None:
    """A file whose upload failed (its chunks go with it)."""
    conn.execute(delete(api_files).where(api_files.c.file_id == file_id))


def create(
    conn: Connection, tenant: str, purpose: str, filename: str, content: bytes, lifetime_s: int | None = None
) -> Row:
    """A whole file in one transaction (a batch's output files, tests, tools)."""
    file_id = begin(conn, tenant, purpose, filename, lifetime_s)
    for seq, start in enumerate(range(0, max(1, len(content)), FILE_CHUNK_BYTES)):
        append(conn, file_id, seq, content[start : start + FILE_CHUNK_BYTES])
    return finish(conn, file_id, len(content))


def sweep_abandoned(conn: Connection, before: datetime) -> int:
    """Remove files left `uploading` since before `before` (their writer died); how many."""
    result = conn.execute(
        delete(api_files).where(api_files.c.status == "uploading", api_files.c.created_at < before)
    )
    return result.rowcount or 0


# ---- reading -------------------------------------------------------------------------------------------
def get(conn: Connection, tenant: str, file_id: str) -> Row | None:
    """The file's metadata, only to its own tenant, once complete and until it expires."""
    query = select(*_META).where(api_files.c.file_id == file_id, api_files.c.tenant == tenant, _VISIBLE)
    row = conn.execute(query).mappings().first()
    return dict(row) if row else None


def chunks(conn: Connection, file_id: str, first_seq: int, count: int = READ_CHUNKS) -> list[bytes]:
    """Up to `count` chunks of the file from `first_seq` on, in order ([] past its end)."""
    query = (
        select(api_file_chunks.c.data)
        .where(api_file_chunks.c.file_id == file_id, api_file_chunks.c.seq >= first_seq)
        .order_by(api_file_chunks.c.seq)
        .limit(count)
    )
    return [bytes(data) for data in conn.execute(query).scalars()]


def read(db: Engine, file_id: str, offset: int = 0) -> Iterator[bytes]:
    """The file's bytes from `offset` on, a chunk at a time (each fetch a connection of its own, held only
    for that fetch)."""
    seq, skip = divmod(offset, FILE_CHUNK_BYTES)
    while True:
        with db.connect() as conn:
            found = chunks(conn, file_id, seq)
        for data in found:
            yield data[skip:] if skip else data
            skip = 0
        if len(found) < READ_CHUNKS:
            return
        seq += len(found)


def lines(db: Engine, file_id: str, offset: int = 0, max_line_bytes: int = 64 * 1024 * 1024):
    """The file's lines from byte `offset` (a line's start) on, each with the offset just past it. A line
    longer than `max_line_bytes` is cut there (it cannot be valid: a job's message is far smaller), so the
    memory a line takes is bounded whatever the file holds."""
    pending, at, cut = bytearray(), offset, False
    for data in read(db, file_id, offset):
        start = 0
        while True:
            newline = data.find(b"\n", start)
            stop = len(data) if newline < 0 else newline + 1
            if not cut:
                room = max_line_bytes - len(pending)
                pending += data[start : min(stop, start + room)]
                cut = stop - start > room  # the rest of this line is skipped
            at += stop - start
            if newline < 0:
                break
            yield bytes(pending), at
            pending.clear()
            cut = False
            start = stop
    if pending:
        yield bytes(pending), at


def list_files(
    conn: Connection, tenant: str, purpose: str | None, limit: int, after: str | None
) -> list[Row]:
    """Newest first; `after`: a file_id of this tenant, the page starts past it (OpenAI's cursor); an
    unknown one raises UnknownCursor (a listing that silently started over would repeat pages)."""
    visible = (api_files.c.tenant == tenant) & _VISIBLE
    query = select(*_META).where(visible)
    if purpose is not None:
        query = query.where(api_files.c.purpose == purpose)
    if after is not None:
        anchor = conn.execute(
            select(api_files.c.created_at).where(visible, api_files.c.file_id == after)
        ).scalar_one_or_none()
        if anchor is None:
            raise UnknownCursor(after)
        query = query.where(tuple_(api_files.c.created_at, api_files.c.file_id) < tuple_(anchor, after))
    query = query.order_by(api_files.c.created_at.desc(), api_files.c.file_id.desc()).limit(limit)
    return [dict(r) for r in conn.execute(query).mappings()]


def delete_file(conn: Connection, tenant: str, file_id: str) -> bool:
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

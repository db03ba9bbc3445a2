"""The Files routes: `POST /v1/files` (multipart, purpose `batch`), `GET /v1/files[/{id}[/content]]`,
`DELETE /v1/files/{id}`. A file is its tenant's only: another tenant's id is answered 404, as unknown.

Uploads are stored as they arrive and content is sent as it is read, a chunk at a time (uploads.py,
db/api_files.py): no request holds a whole file in memory, whatever its size.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from workers.api import auth
from workers.api.errors import APIError, not_found
from workers.api.protocol import FILE_PURPOSES, check_file_form, file_object, page, upload_lifetime
from workers.api.uploads import receive_upload
from workers.db import api_batches, api_files
from workers.db.cursors import UnknownCursor

router = APIRouter()


@router.post("/v1/files")
async def create_file(request: Request, tenant: str = Depends(auth.tenant)) -> dict:
    ctx = auth.context(request)
    upload = await receive_upload(request, ctx, tenant)
    stored = upload.file
    try:
        check_file_form([*upload.fields, *(["file"] if stored is not None else [])])
        lifetime = upload_lifetime(upload.fields)
        purpose = upload.fields.get("purpose")
        if purpose != "batch":
            raise APIError(
                400, f"purpose must be 'batch', got {purpose!r}", param="purpose", code="invalid_value"
            )
        if stored is None:
            raise APIError(400, "Missing the 'file' part", param="file", code="missing_required_parameter")
    except APIError:
        if stored is not None:  # stored as it came: removed again

            def drop() -> None:
                with ctx.db.begin() as conn:
                    api_files.discard(conn, stored["file_id"])

            await ctx.run_db(drop)
        raise
    if lifetime is not None:  # the form's fields may come after the file: its expiry is set once complete

        def expire() -> dict:
            with ctx.db.begin() as conn:
                return api_files.set_lifetime(conn, stored["file_id"], lifetime)

        stored = await ctx.run_db(expire)
    return file_object(stored)


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = 10000,
    after: str | None = None,
    order: str = "desc",
    tenant: str = Depends(auth.tenant),
) -> dict:
    ctx = auth.context(request)
    if purpose is not None and purpose not in FILE_PURPOSES:
        raise APIError(400, f"purpose must be one of {', '.join(FILE_PURPOSES)}", param="purpose")
    if not 1 <= limit <= 10000:
        raise APIError(400, "limit must be within 1..10000", param="limit", code="invalid_value")
    if order != "desc":
        raise APIError(400, "only order=desc is supported", param="order", code="invalid_value")

    def fetch() -> list:
        with ctx.db.connect() as conn:
            return api_files.list_files(conn, tenant, purpose, limit + 1, after)

    try:
        rows = await ctx.run_db(fetch)
    except UnknownCursor:
        raise unknown_cursor("file", after) from None
    return page([file_object(r) for r in rows[:limit]], len(rows) > limit)


def unknown_cursor(what: str, after: str | None) -> APIError:
    return APIError(
        400, f"after: no {what} {after!r} of yours to list after", param="after", code="invalid_cursor"
    )


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str, tenant: str = Depends(auth.tenant)) -> dict:
    ctx = auth.context(request)

    def fetch():
        with ctx.db.connect() as conn:
            return api_files.get(conn, tenant, file_id)

    row = await ctx.run_db(fetch)
    if row is None:
        raise not_found("file", file_id, "file_id")
    return file_object(row)


@router.get("/v1/files/{file_id}/content")
async def file_content(
    request: Request, file_id: str, tenant: str = Depends(auth.tenant)
) -> StreamingResponse:
    ctx = auth.context(request)

    def fetch():
        with ctx.db.connect() as conn:
            return api_files.get(conn, tenant, file_id)

    row = await ctx.run_db(fetch)
    if row is None:
        raise not_found("file", file_id, "file_id")

    async def content() -> AsyncIterator[bytes]:
        seq = 0
        while True:

            def read(first: int = seq) -> list[bytes]:
                with ctx.db.connect() as conn:
                    return api_files.chunks(conn, file_id, first)

            found = await ctx.run_db(read)
            for data in found:
                yield data
            if len(found) < api_files.READ_CHUNKS:
                return
            seq += len(found)

    headers = {"Content-Length": str(row["bytes"])}
    return StreamingResponse(content(), media_type="application/jsonl", headers=headers)


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str, tenant: str = Depends(auth.tenant)) -> dict:
    ctx = auth.context(request)

    def remove() -> str | None:
        """None when deleted; else why not."""
        with ctx.db.begin() as conn:
            if api_files.get(conn, tenant, file_id) is None:
                return "missing"
            if api_batches.open_with_input(conn, tenant, file_id):
                return "in use"
            api_files.delete_file(conn, tenant, file_id)
            return None

    why = await ctx.run_db(remove)
    if why == "missing":
        raise not_found("file", file_id, "file_id")
    if why is not None:
        raise APIError(409, f"File {file_id} is the input of a batch still running; cancel it first",
                       param="file_id", code="file_in_use")  # fmt: skip
    return {"id": file_id, "object": "file", "deleted": True}

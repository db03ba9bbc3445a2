"""The Files routes: `POST /v1/files` (multipart, purpose `batch`), `GET /v1/files[/{id}[/content]]`,
`DELETE /v1/files/{id}`. A file is its tenant's only: another tenant's id is answered 404, as unknown."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from workers.api import auth
from workers.api.errors import APIError, not_found
from workers.api.protocol import FILE_PURPOSES, check_file_form, file_object, page, upload_lifetime
from workers.db import api_batches, api_files

router = APIRouter()
_FORM_OVERHEAD = 64 * 1024  # multipart headers and the purpose field, beyond the file itself


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The file is larger than this deployment's limit of {limit} bytes",
                    param="file", code="file_too_large")  # fmt: skip


@router.post("/v1/files")
async def create_file(request: Request, tenant: str = Depends(auth.tenant)) -> dict:
    ctx = auth.context(request)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > ctx.max_file_bytes + _FORM_OVERHEAD:
        raise _too_large(ctx.max_file_bytes)
    try:
        form = await request.form(max_files=1, max_fields=4)
    except Exception as exc:  # noqa: BLE001 - not multipart, or a broken one
        raise APIError(400, f"Expected a multipart/form-data body: {exc}") from None
    check_file_form(form.keys())
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != "batch":
        raise APIError(
            400, f"purpose must be 'batch', got {purpose!r}", param="purpose", code="invalid_value"
        )
    if not isinstance(upload, UploadFile):
        raise APIError(400, "Missing the 'file' part", param="file", code="missing_required_parameter")
    lifetime = upload_lifetime(form)
    content = await upload.read(ctx.max_file_bytes + 1)
    if len(content) > ctx.max_file_bytes:
        raise _too_large(ctx.max_file_bytes)
    if not content.strip():
        raise APIError(400, "The file is empty", param="file", code="empty_file")
    filename = upload.filename or "upload.jsonl"

    def store() -> dict:
        with ctx.db.begin() as conn:
            return api_files.create(conn, tenant, "batch", filename, content, lifetime)

    return file_object(await run_in_threadpool(store))


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

    rows = await run_in_threadpool(fetch)
    return page([file_object(r) for r in rows[:limit]], len(rows) > limit)


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str, tenant: str = Depends(auth.tenant)) -> dict:
    ctx = auth.context(request)

    def fetch():
        with ctx.db.connect() as conn:
            return api_files.get(conn, tenant, file_id)

    row = await run_in_threadpool(fetch)
    if row is None:
        raise not_found("file", file_id, "file_id")
    return file_object(row)


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str, tenant: str = Depends(auth.tenant)) -> Response:
    ctx = auth.context(request)

    def fetch():
        with ctx.db.connect() as conn:
            return api_files.content(conn, tenant, file_id)

    content = await run_in_threadpool(fetch)
    if content is None:
        raise not_found("file", file_id, "file_id")
    return Response(content, media_type="application/jsonl")


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
            api_files.delete(conn, tenant, file_id)
            return None

    why = await run_in_threadpool(remove)
    if why == "missing":
        raise not_found("file", file_id, "file_id")
    if why is not None:
        raise APIError(409, f"File {file_id} is the input of a batch still running; cancel it first",
                       param="file_id", code="file_in_use")  # fmt: skip
    return {"id": file_id, "object": "file", "deleted": True}

"""The Batch routes: `POST /v1/batches`, `GET /v1/batches[/{id}]`, `POST /v1/batches/{id}/cancel`.

A route only records what was asked (a row, a status); the batch driver (batch_driver.py) does the work,
in this process or in any other API process of the deployment.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from workers.api import auth
from workers.api.batch_driver import describe, expiry
from workers.api.errors import APIError, not_found
from workers.api.files import unknown_cursor
from workers.api.protocol import BatchCreate, batch_object, page
from workers.api.request_body import json_body
from workers.clock import utcnow
from workers.db import api_batches, api_files
from workers.db.cursors import UnknownCursor

router = APIRouter()
CANCELLABLE = ("validating", "in_progress")


def _wake(request: Request) -> None:
    driver = getattr(request.app.state, "driver", None)
    if driver is not None:
        driver.wake()


@router.post("/v1/batches")
async def create_batch(request: Request, tenant: str = Depends(auth.tenant)) -> dict:
    ctx = auth.context(request)
    try:
        asked = BatchCreate.model_validate(await json_body(request, ctx.settings.api_max_body_bytes))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from None

    def create() -> dict | None:
        with ctx.db.begin() as conn:
            source = api_files.get(conn, tenant, asked.input_file_id)
            if source is None:
                return None
            if source["purpose"] != "batch":
                raise APIError(400, f"File {asked.input_file_id} has purpose {source['purpose']}, not batch",
                               param="input_file_id", code="invalid_value")  # fmt: skip
            now = utcnow()
            row = api_batches.create(
                conn, api_batches.new_batch_id(), tenant=tenant, topic_prefix=ctx.settings.topic_prefix,
                endpoint=asked.endpoint, input_file_id=asked.input_file_id,
                completion_window=asked.completion_window, metadata=asked.metadata, created_at=now,
                expires_at=expiry(ctx, now),
                output_expires_after=asked.output_expires_after and asked.output_expires_after.seconds,
            )  # fmt: skip
            return batch_object(row, {"total": 0, "completed": 0, "failed": 0})

    batch = await ctx.run_db(create)
    if batch is None:
        raise not_found("file", asked.input_file_id, "input_file_id")
    _wake(request)
    return batch


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str, tenant: str = Depends(auth.tenant)) -> dict:
    ctx = auth.context(request)

    def fetch() -> dict | None:
        with ctx.db.connect() as conn:
            row = api_batches.get(conn, tenant, batch_id)
            return None if row is None else describe(conn, row)

    batch = await ctx.run_db(fetch)
    if batch is None:
        raise not_found("batch", batch_id, "batch_id")
    return batch


@router.get("/v1/batches")
async def list_batches(
    request: Request, limit: int = 20, after: str | None = None, tenant: str = Depends(auth.tenant)
) -> dict:
    ctx = auth.context(request)
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be within 1..100", param="limit", code="invalid_value")

    def fetch() -> tuple[list[dict], bool]:
        with ctx.db.connect() as conn:
            rows = api_batches.list_batches(conn, tenant, limit + 1, after)
            return [describe(conn, r) for r in rows[:limit]], len(rows) > limit

    try:
        data, has_more = await ctx.run_db(fetch)
    except UnknownCursor:
        raise unknown_cursor("batch", after) from None
    return page(data, has_more)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str, tenant: str = Depends(auth.tenant)) -> dict:
    ctx = auth.context(request)

    def cancel() -> dict | None:
        with ctx.db.begin() as conn:
            row = api_batches.get(conn, tenant, batch_id)
            if row is None:
                return None
            if row["status"] in CANCELLABLE:
                api_batches.transition(conn, batch_id, CANCELLABLE, "cancelling", cancelling_at=utcnow())
            elif row["status"] not in ("cancelling", "cancelled"):
                raise APIError(409, f"Batch {batch_id} is {row['status']}: it cannot be cancelled",
                               param="batch_id", code="batch_not_cancellable")  # fmt: skip
            row = api_batches.get(conn, tenant, batch_id)
            return describe(conn, row)

    batch = await ctx.run_db(cancel)
    if batch is None:
        raise not_found("batch", batch_id, "batch_id")
    _wake(request)
    return batch

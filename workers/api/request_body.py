"""Request bodies read with a bound, however they arrive: a declared Content-Length over the bound is refused
before any byte is read, and a body sent without one (chunked transfer) is refused as soon as it passes the
bound, so no request makes the process hold more than the bound."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from workers.api.errors import APIError


def too_large(
    limit: int, what: str = "request body", code: str = "request_too_large", param: str | None = None
):
    return APIError(
        413, f"The {what} is larger than this deployment's limit of {limit} bytes", param=param, code=code
    )


def declared_length(request: Request) -> int | None:
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.strip().isdigit() else None


async def bounded_stream(request: Request, limit: int, error: APIError) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; `error` (a 413) once more than `limit` bytes came or were
    declared."""
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise error
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise error
        if chunk:
            yield chunk


async def read_body(request: Request, limit: int) -> bytes:
    parts = [chunk async for chunk in bounded_stream(request, limit, too_large(limit))]
    return b"".join(parts)


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    raw = await read_body(request, limit)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    return body

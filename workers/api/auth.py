"""`Authorization: Bearer KEY` on every /v1 route: the key, never the body, decides the tenant."""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from workers.api.errors import APIError
from workers.db import api_keys


def context(request: Request):
    return request.app.state.api


async def tenant(request: Request) -> str:
    """The tenant of the request's key (a FastAPI dependency); 401 in OpenAI's shape otherwise."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise APIError(
            401, "You didn't provide an API key: send 'Authorization: Bearer KEY'.", code="invalid_api_key"
        )
    ctx = context(request)

    def look_up() -> str | None:
        with ctx.db.connect() as conn:
            return api_keys.tenant_of(conn, key)

    found = await run_in_threadpool(look_up)
    if found is None:
        raise APIError(401, "Incorrect API key provided (unknown or revoked).", code="invalid_api_key")
    request.state.tenant = found
    return found

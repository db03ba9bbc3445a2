"""`Authorization: Bearer KEY` on every /v1 route: the key, never the body, decides the tenant.

A key found live is remembered for `KEY_CACHE_S` by the process that looked it up: the look-up costs a
database round trip (~3 ms on a loaded host, most of a request's own time), and a revoked key is refused by
every API process at most that long after `inferq api-key revoke`. Unknown keys are never remembered.
"""

from __future__ import annotations

import time

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from workers.api.errors import APIError
from workers.db import api_keys

KEY_CACHE_S = 1.0
_MAX_CACHED = 10_000


class KeyCache:
    """Key hash -> (tenant, until when it may be trusted without asking the database again)."""

    def __init__(self, ttl_s: float = KEY_CACHE_S) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[str, float]] = {}

    def get(self, key_hash: str) -> str | None:
        entry = self._entries.get(key_hash)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    def put(self, key_hash: str, tenant: str) -> None:
        if len(self._entries) >= _MAX_CACHED:
            self._entries.clear()
        self._entries[key_hash] = (tenant, time.monotonic() + self.ttl_s)


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
    hashed = api_keys.key_hash(key)
    found = ctx.keys.get(hashed)
    if found is None:

        def look_up() -> str | None:
            with ctx.db.connect() as conn:
                return api_keys.tenant_of(conn, key)

        found = await run_in_threadpool(look_up)
        if found is None:
            raise APIError(401, "Incorrect API key provided (unknown or revoked).", code="invalid_api_key")
        ctx.keys.put(hashed, found)
    request.state.tenant = found
    ctx.limits.admit(found)  # the tenant's requests per minute (off by default): 429 when over
    return found

"""`Authorization: Bearer KEY` on every /v1 route: the key, never the body, decides the tenant.

A key found live is remembered for `KEY_CACHE_S` by the process that looked it up: the look-up costs a
database round trip (~3 ms on a loaded host, most of a request's own time), and a revoked key is refused by
every API process at most that long after `inferq api-key revoke`. A key found unknown (or revoked) is
remembered as such for `BAD_KEY_CACHE_S`: a client retrying a bad key, or trying many, costs the database one
query per key, not one per request (the cache is bounded: it forgets its oldest entries first). Requests
with a bad key are also counted per client address (INFERQ_API_BAD_KEY_RPM a minute, default 60): past that
an address gets 429 before its key is even looked at, whatever keys it tries.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from fastapi import Request

from workers.api.errors import APIError
from workers.api.limits import TokenBuckets
from workers.db import api_keys

KEY_CACHE_S = 1.0
BAD_KEY_CACHE_S = 30.0  # a key created after being tried unknown works at most this much later
_MAX_CACHED = 10_000


class KeyCache:
    """Key hash -> (tenant, or None for a bad key; until when that may be trusted without asking again)."""

    def __init__(self, ttl_s: float = KEY_CACHE_S, bad_ttl_s: float = BAD_KEY_CACHE_S, bad_key_rpm: int = 0):
        self.ttl_s, self.bad_ttl_s = ttl_s, bad_ttl_s
        self._entries: OrderedDict[str, tuple[str | None, float]] = OrderedDict()
        self.bad_keys = TokenBuckets(bad_key_rpm)  # per client address (0: off)
        self._asking: dict[str, asyncio.Future] = {}  # key hash -> its look-up in flight

    async def look_up(self, key_hash: str, ask: Callable[[], Awaitable[str | None]]) -> str | None:
        """The key's tenant (None: bad) from the database, asked once however many requests wait for it at
        once (when a live key's entry lapses under load, every request with it misses together)."""
        asking = self._asking.get(key_hash)
        if asking is None:
            asking = asyncio.ensure_future(ask())
            self._asking[key_hash] = asking
            asking.add_done_callback(lambda _: self._asking.pop(key_hash, None))
        found = await asyncio.shield(asking)
        self.put(key_hash, found)
        return found

    def get(self, key_hash: str) -> str | None:
        """The tenant of a key found live lately; None: ask the database (or see `bad`)."""
        entry = self._entries.get(key_hash)
        return entry[0] if entry is not None and entry[1] >= time.monotonic() else None

    def bad(self, key_hash: str) -> bool:
        """Whether the key was found unknown (or revoked) lately."""
        entry = self._entries.get(key_hash)
        return entry is not None and entry[0] is None and entry[1] >= time.monotonic()

    def put(self, key_hash: str, tenant: str | None) -> None:
        ttl = self.ttl_s if tenant is not None else self.bad_ttl_s
        self._entries[key_hash] = (tenant, time.monotonic() + ttl)
        self._entries.move_to_end(key_hash)
        while len(self._entries) > _MAX_CACHED:
            self._entries.popitem(last=False)


def context(request: Request):
    return request.app.state.api


def _bad_key(request: Request, message: str) -> APIError:
    """A bad key: it costs the client's address one of its allowance (429 once none is left)."""
    ctx = context(request)
    ctx.keys.bad_keys.take(_address(request), "requests with a bad API key from this address")
    return APIError(401, message, code="invalid_api_key")


def _address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


async def tenant(request: Request) -> str:
    """The tenant of the request's key (a FastAPI dependency); 401 in OpenAI's shape otherwise."""
    ctx = context(request)
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise _bad_key(request, "You didn't provide an API key: send 'Authorization: Bearer KEY'.")
    hashed = api_keys.key_hash(key)
    found = ctx.keys.get(hashed)
    if found is None and not ctx.keys.bad(hashed):
        # an address out of bad-key allowance is not given a database query for a key nobody knows here
        ctx.keys.bad_keys.check(_address(request), "requests with a bad API key from this address")

        def look_up() -> str | None:
            with ctx.db.connect() as conn:
                return api_keys.tenant_of(conn, key)

        found = await ctx.keys.look_up(hashed, lambda: ctx.run_db(look_up))
    if found is None:
        raise _bad_key(request, "Incorrect API key provided (unknown or revoked).")
    request.state.tenant = found
    ctx.limits.admit(found)  # the tenant's requests per minute (off by default): 429 when over
    return found

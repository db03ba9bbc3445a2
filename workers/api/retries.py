"""Retries that never duplicate a job: a request sent again reattaches to the job the first one posted.

Two ways a request says it is a retry:
- `Idempotency-Key: K` (any client): the tenant's key K names one job for 24 hours (the api_requests row is
  written before the job is posted). The same key with the same body reattaches, from any API process, also
  after the job ended (its answer comes from the row); the same key with another body is refused (422).
- OpenAI's SDKs retry on their own (a 5xx, a 409, a 429, a timeout), sending the same body with
  `x-stainless-retry-count: N` (N >= 1) and no key that stays the same across tries (openai-python makes
  an idempotency key per request but sends it to no server; its only stable trace is the body). So when a
  request is answered without its result while its job lives on (a 504, a 503 after the post may have
  reached the broker), the tenant's request fingerprint (endpoint, body, priority) is remembered with its
  job; a request with a retry count >= 1 and that fingerprint reattaches to it. A first try (count 0, or a
  client that is not an SDK) always posts a job of its own: two users asking the same thing get two answers.

Reattaching means: the job's row ended -> its answer; it exists -> wait for it (or stream it); no row yet
-> post it again under the same job_id (a job id already posted runs once: the worker keeps one row and
one run per id), then wait.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from workers.api.context import APIContext
from workers.api.errors import APIError
from workers.clock import utcnow
from workers.db import api_requests
from workers.db.api_requests import Attached

log = logging.getLogger(__name__)

IDEMPOTENCY_HEADER = "idempotency-key"
RETRY_COUNT_HEADER = "x-stainless-retry-count"
READ_TIMEOUT_HEADER = "x-stainless-read-timeout"
MAX_KEY_CHARS = 255
CLIENT_MARGIN_S = 1.0  # answer (504) this long before the client's own read timeout would fire


@dataclass(frozen=True)
class RequestKey:
    """How a request may be retried: its fingerprint, its Idempotency-Key, whether it is an SDK retry."""

    fingerprint: str
    idempotency_key: str | None
    retry: bool  # an SDK's retry (x-stainless-retry-count >= 1)
    sdk: bool  # sent by an SDK that retries on its own (it says its retry count)

    @property
    def explicit(self) -> str | None:
        return f"key:{self.idempotency_key}" if self.idempotency_key is not None else None

    @property
    def implicit(self) -> str:
        return f"retry:{self.fingerprint}"


def request_key(request: Request, url: str, body: dict[str, Any], live: dict[str, Any]) -> RequestKey:
    canonical = json.dumps({"url": url, "body": body, "live": live}, sort_keys=True, separators=(",", ":"))
    fingerprint = hashlib.sha256(canonical.encode()).hexdigest()
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is not None and not 0 < len(key) <= MAX_KEY_CHARS:
        raise APIError(400, f"Idempotency-Key must be 1-{MAX_KEY_CHARS} characters", param="Idempotency-Key",
                       code="invalid_value")  # fmt: skip
    count = request.headers.get(RETRY_COUNT_HEADER)
    retried = count is not None and count.strip().isdigit() and int(count) >= 1
    return RequestKey(fingerprint, key, retried, count is not None)


def client_deadline(request: Request) -> float | None:
    """When to answer at the latest so that the client is there to read it: the SDK says how long it
    reads before it gives up (and retries); past that, an answer is lost and a retry would find no trace."""
    value = request.headers.get(READ_TIMEOUT_HEADER)
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    if seconds is None or seconds <= CLIENT_MARGIN_S * 2:
        return None
    return time.monotonic() + seconds - CLIENT_MARGIN_S


async def attach(ctx: APIContext, tenant: str, key: RequestKey, new_job_id: str) -> Attached | None:
    """The job this request reattaches to, if any; for an Idempotency-Key, the key is bound to `new_job_id`
    when it names nothing yet (then the result's job_id is `new_job_id`: post it)."""
    explicit = key.explicit
    if explicit is None and not key.retry:
        return None

    def look_up() -> Attached | None:
        with ctx.db.begin() as conn:
            if explicit is not None:
                return api_requests.claim(conn, tenant, explicit, key.fingerprint, new_job_id, utcnow())
            return api_requests.find(conn, tenant, key.implicit, utcnow())

    found = await ctx.run_db(look_up)
    if found is not None and found.fingerprint != key.fingerprint:
        raise APIError(
            422, "This Idempotency-Key was used with another request body; use a new key for a new request",
            param="Idempotency-Key", code="idempotency_key_reused",
        )  # fmt: skip
    return found


async def remember(ctx: APIContext, tenant: str, key: RequestKey, job_id: str) -> None:
    """A request answered without its result: its SDK retry (same fingerprint) reattaches to `job_id`.
    Best effort: the database away costs only that a retry posts a job of its own."""
    if key.explicit is not None or not key.sdk:
        return  # a key names its job already; a client that does not retry on its own needs nothing

    def write() -> None:
        with ctx.db.begin() as conn:
            api_requests.remember(conn, tenant, key.implicit, key.fingerprint, job_id, utcnow())

    try:
        await ctx.run_db(write)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not remember job %s for a retry of its request: %s", job_id, exc)

"""The api_requests table: requests a retry reattaches to instead of posting another job.

A row maps a tenant's request key to the job it posted, with the request's fingerprint (its endpoint and
body), until it expires: `key:<Idempotency-Key>` rows are written before their job is posted (a key used
again with another body is refused), `retry:<fingerprint>` rows when a request is answered without its
result (a 504), so that the SDK's own retry of it finds the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection, delete, select
from sqlalchemy.dialects.postgresql import insert

from schemas.tables import api_requests

KEEP = timedelta(hours=24)  # how long a request can be retried (OpenAI keeps idempotency keys 24 h)


@dataclass(frozen=True)
class Attached:
    """The job a request key names."""

    job_id: str
    fingerprint: str
    created_at: datetime


def claim(conn: Connection, tenant: str, key: str, fingerprint: str, job_id: str, now: datetime) -> Attached:
    """The job this key names: `job_id` if the key is new (or its row expired), else the one it named
    first."""
    stmt = insert(api_requests).values(
        tenant=tenant, request_key=key, fingerprint=fingerprint, job_id=job_id, created_at=now,
        expires_at=now + KEEP,
    )  # fmt: skip
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[api_requests.c.tenant, api_requests.c.request_key],
            set_={"fingerprint": fingerprint, "job_id": job_id, "created_at": now, "expires_at": now + KEEP},
            where=api_requests.c.expires_at <= now,
        )
    )
    found = find(conn, tenant, key, now)
    assert found is not None
    return found


def remember(conn: Connection, tenant: str, key: str, fingerprint: str, job_id: str, now: datetime) -> None:
    """Point the key at `job_id` (the latest request of that fingerprint wins)."""
    stmt = insert(api_requests).values(
        tenant=tenant, request_key=key, fingerprint=fingerprint, job_id=job_id, created_at=now,
        expires_at=now + KEEP,
    )  # fmt: skip
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[api_requests.c.tenant, api_requests.c.request_key],
            set_={"fingerprint": fingerprint, "job_id": job_id, "created_at": now, "expires_at": now + KEEP},
        )
    )


def find(conn: Connection, tenant: str, key: str, now: datetime) -> Attached | None:
    query = select(api_requests.c.job_id, api_requests.c.fingerprint, api_requests.c.created_at).where(
        api_requests.c.tenant == tenant, api_requests.c.request_key == key, api_requests.c.expires_at > now
    )
    row = conn.execute(query).first()
    return Attached(*row) if row else None


def purge(conn: Connection, now: datetime) -> int:
    return conn.execute(delete(api_requests).where(api_requests.c.expires_at <= now)).rowcount or 0

"""The api_keys table: bearer keys of the HTTP API, stored as their sha256 (a key is shown once, at creation).

Keys are 256 random bits, so a plain sha256 is enough to make the stored hash useless to whoever reads
the table (no dictionary to try), and it lets a request find its key with one indexed look-up.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, select

from schemas.tables import api_keys
from schemas.validation import check_tenant
from workers.clock import utcnow

KEY_PREFIX = "iq-"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create(conn: Connection, tenant: str, name: str | None = None) -> tuple[str, str]:
    """A new key of `tenant`: (key_id, key). Only the key's hash is stored. A tenant no job could name
    (JobRequest.tenant's rule) raises InvalidMessage: every request of the key would be refused."""
    check_tenant(tenant)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    key_id = "key_" + secrets.token_hex(8)
    conn.execute(api_keys.insert().values(key_id=key_id, tenant=tenant, name=name, key_hash=key_hash(key)))
    return key_id, key


def tenant_of(conn: Connection, key: str) -> str | None:
    """The tenant of a live key; None for an unknown or revoked one."""
    query = select(api_keys.c.tenant).where(
        api_keys.c.key_hash == key_hash(key), api_keys.c.revoked_at.is_(None)
    )
    return conn.execute(query).scalar_one_or_none()


def list_keys(conn: Connection, tenant: str | None = None) -> list[Mapping[str, Any]]:
    query = select(
        api_keys.c.key_id, api_keys.c.tenant, api_keys.c.name, api_keys.c.created_at, api_keys.c.revoked_at
    ).order_by(api_keys.c.created_at)
    if tenant is not None:
        query = query.where(api_keys.c.tenant == tenant)
    return [dict(r) for r in conn.execute(query).mappings()]


def revoke(conn: Connection, key_id: str) -> bool:
    """Whether a live key of that id was revoked."""
    result = conn.execute(
        api_keys.update()
        .where(api_keys.c.key_id == key_id, api_keys.c.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .returning(api_keys.c.key_id)
    )
    return result.first() is not None

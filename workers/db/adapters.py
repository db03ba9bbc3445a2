"""The adapters table: the fleet's registry of LoRA adapters (`inferq adapter add|list|remove`).

A row is a name a job's `model` may give, the PEFT directory every worker reads it from, and the one
tenant allowed to use it (NULL: every tenant). Workers look names up when they admit jobs that name them,
so what this table says is what the next admitted job gets.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, or_, select
from sqlalchemy.dialects.postgresql import insert

from schemas.tables import adapters


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    tenant: str | None  # None: every tenant may use it
    created_at: datetime | None = None

    def allows(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant


def _adapter(row) -> Adapter:
    return Adapter(row.name, row.path, row.tenant, row.created_at)


def add(conn: Connection, name: str, path: str, tenant: str | None) -> Adapter | None:
    """Register an adapter; None if the name is taken (the existing row stays as it is)."""
    stmt = (
        insert(adapters)
        .values(name=name, path=path, tenant=tenant)
        .on_conflict_do_nothing(index_elements=[adapters.c.name])
        .returning(*adapters.c)
    )
    row = conn.execute(stmt).first()
    return None if row is None else _adapter(row)


def remove(conn: Connection, name: str) -> Adapter | None:
    """Unregister an adapter; what was removed, or None if there was no such name."""
    row = conn.execute(adapters.delete().where(adapters.c.name == name).returning(*adapters.c)).first()
    return None if row is None else _adapter(row)


def lookup(conn: Connection, names: Collection[str]) -> dict[str, Adapter]:
    """The registered adapters among `names`, by name (one indexed statement)."""
    if not names:
        return {}
    query = select(*adapters.c).where(adapters.c.name.in_(sorted(set(names))))
    return {row.name: _adapter(row) for row in conn.execute(query)}


def listed(conn: Connection, tenant: str | None = None) -> list[Adapter]:
    """Every adapter by name; with `tenant`, those that tenant may use (its own and the shared ones)."""
    query = select(*adapters.c).order_by(adapters.c.name)
    if tenant is not None:
        query = query.where(or_(adapters.c.tenant.is_(None), adapters.c.tenant == tenant))
    return [_adapter(row) for row in conn.execute(query)]

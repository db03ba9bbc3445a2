"""The served_models table: which model each live worker of a deployment serves (what `/v1/models` lists).

A worker writes its row at start and renews `heartbeat_at` while it runs (serving/announcer.py); a graceful
stop removes it. A worker that died leaves a row whose heartbeat grows old: readers ignore rows older than
`STALE_S`, and the next announcement of the deployment removes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection, delete, select
from sqlalchemy.dialects.postgresql import insert

from schemas.tables import served_models

HEARTBEAT_S = 10.0  # how often a worker renews its row
STALE_S = 3 * HEARTBEAT_S  # a row not renewed for this long belongs to a worker that is gone


@dataclass(frozen=True)
class ServedModel:
    """One live worker's model."""

    worker_id: str
    model: str
    max_model_len: int | None
    started_at: datetime


def announce(
    conn: Connection, worker_id: str, topic_prefix: str, model: str, max_model_len: int | None, now: datetime
) -> None:
    """Write (or renew) this worker's row; rows of the deployment's workers that stopped renewing go."""
    stmt = insert(served_models).values(
        worker_id=worker_id, topic_prefix=topic_prefix, model=model, max_model_len=max_model_len,
        started_at=now, heartbeat_at=now,
    )  # fmt: skip
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[served_models.c.worker_id],
            set_={
                "topic_prefix": topic_prefix,
                "model": model,
                "max_model_len": max_model_len,
                "heartbeat_at": now,
            },
        )  # fmt: skip
    )
    conn.execute(
        delete(served_models).where(
            served_models.c.topic_prefix == topic_prefix,
            served_models.c.heartbeat_at < now - timedelta(seconds=10 * STALE_S),
        )
    )


def withdraw(conn: Connection, worker_id: str) -> None:
    conn.execute(delete(served_models).where(served_models.c.worker_id == worker_id))


def live(conn: Connection, topic_prefix: str, now: datetime) -> list[ServedModel]:
    """The deployment's workers that renewed their row within STALE_S, oldest first."""
    query = (
        select(
            served_models.c.worker_id,
            served_models.c.model,
            served_models.c.max_model_len,
            served_models.c.started_at,
        )  # fmt: skip
        .where(
            served_models.c.topic_prefix == topic_prefix,
            served_models.c.heartbeat_at >= now - timedelta(seconds=STALE_S),
        )
        .order_by(served_models.c.started_at, served_models.c.worker_id)
    )
    return [ServedModel(*row) for row in conn.execute(query)]

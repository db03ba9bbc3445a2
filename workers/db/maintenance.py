"""Periodic upkeep of the database: release jobs of dead workers, drop the Celery broker's delivered
messages. (Purging job history is retention.py, and only when configured.)

Every statement is conditional on the state it changes, so it never races a worker's own writes: a worker
that finishes a job first wins, and a row we reset is one no live worker owns.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Connection, inspect, text

from workers.db.retention import delete_in_batches

# How long a job of a worker that left the consumer group may sit before it is released: covers the
# moments of a rebalance, when a live worker is briefly not a member.
DEAD_WORKER_GRACE_S = 60.0


def release_dead_workers(conn: Connection, topic_prefix: str, live: set[str], now: datetime,
                         grace_s: float = DEAD_WORKER_GRACE_S) -> list[str]:  # fmt: skip
    """Jobs of this deployment (topic prefix) left queued/running by a worker that is gone go back to
    `queued` with no owner.

    Kafka redelivers them (their offsets were never committed); the next worker's intake takes them
    over. Until then history and `bulk status` show them waiting, not running on a ghost.
    """
    result = conn.execute(
        text(
            "UPDATE jobs SET status = 'queued', worker_id = NULL, updated_at = :now "
            "WHERE status IN ('queued', 'running') AND worker_id IS NOT NULL "
            "AND left(source_topic, length(:topics)) = :topics "
            "AND NOT (worker_id = ANY(:live)) AND updated_at < :cutoff RETURNING job_id"
        ),
        {
            "now": now,
            "topics": f"{topic_prefix}.jobs.",
            "live": sorted(live),
            "cutoff": now - timedelta(seconds=grace_s),
        },  # fmt: skip
    )
    return [r.job_id for r in result]


def purge_broker_messages(conn: Connection, now: datetime) -> int:
    """Celery's SQLAlchemy transport keeps delivered messages (visible = false) forever: those older than a
    day go (the broker's own housekeeping, not job history)."""
    if not inspect(conn).has_table("kombu_message"):
        return 0
    return delete_in_batches(
        conn,
        "DELETE FROM kombu_message WHERE id IN (SELECT id FROM kombu_message WHERE visible = false "
        "AND timestamp < :cutoff LIMIT :batch)",
        {"cutoff": (now - timedelta(days=1)).replace(tzinfo=None)},
    )

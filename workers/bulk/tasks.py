"""Celery tasks of bulk jobs: produce (long, one per bulk job), tick (advance open bulk jobs), maintenance."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from celery import Celery

from workers.bulk import advance, maintenance, store
from workers.bulk.celery_app import MAINTENANCE, PRODUCE, TICK
from workers.bulk.produce import produce
from workers.settings import Settings

log = logging.getLogger(__name__)


def register(app: Celery, settings: Settings) -> None:
    from workers.store import make_engine

    engine = make_engine(settings.database_url)  # connects lazily; shared by the worker's threads

    @app.task(name=PRODUCE)
    def produce_task(bulk_id: str) -> None:
        from workers.client import JobClient

        with store.bulk_lock(engine, bulk_id) as got:
            if not got:
                log.info("bulk %s: another task holds it; skipping", bulk_id)
                return
            client = JobClient(settings)
            try:
                status = produce(engine, bulk_id, client)
            finally:
                client.close()
            if status == "running":
                advance.maybe_finalize(engine, bulk_id)

    @app.task(name=TICK)
    def tick_task() -> None:
        advance.tick(engine, settings.topic_prefix, lambda bulk_id: app.send_task(PRODUCE, args=[bulk_id]))

    @app.task(name=MAINTENANCE)
    def maintenance_task() -> None:
        from workers.kafka_io import group_client_ids

        now = datetime.now(UTC)
        with engine.connect() as conn:
            try:
                live = maintenance.live_worker_ids(
                    group_client_ids(
                        settings.kafka_connection, maintenance.worker_group(settings.topic_prefix)
                    )
                )
            except Exception as exc:  # Kafka unreachable: cannot tell who is dead, so release nobody
                log.warning("maintenance: no consumer group view (%s); not releasing jobs", exc)
            else:
                released = maintenance.release_dead_workers(conn, settings.topic_prefix, live, now)
                conn.commit()
                if released:
                    log.warning("maintenance: %d jobs of dead workers back to queued", len(released))
            counts = maintenance.purge(conn, settings.retention_days, now, settings.state_dir)
        if any(counts.values()):
            log.info("maintenance: purged %s", counts)

"""Celery tasks of bulk jobs: produce (long, one per bulk job), tick (advance open bulk jobs), maintenance
(and history retention, when INFERQ_RETENTION_DAYS is set)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from celery import Celery

from workers.bulk import advance
from workers.bulk.celery_app import MAINTENANCE, PRODUCE, TICK
from workers.bulk.produce import produce
from workers.clock import utcnow
from workers.db import Engine, maintenance, retention
from workers.db import bulk_jobs as store
from workers.naming import live_worker_ids, worker_group
from workers.settings import Settings

log = logging.getLogger(__name__)


def register(app: Celery, settings: Settings) -> None:
    from workers.db.connect import make_engine

    engine = make_engine(settings.database_url)  # connects lazily; shared by the worker's threads
    model_name = settings.served_model_name or None  # echoed in Batch responses

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
                advance.maybe_finalize(engine, bulk_id, model_name=model_name)

    @app.task(name=TICK)
    def tick_task() -> None:
        def start_producer(bulk_id: str) -> None:
            app.send_task(PRODUCE, args=[bulk_id])

        advance.tick(engine, settings.topic_prefix, start_producer, model_name)

    @app.task(name=MAINTENANCE)
    def maintenance_task() -> None:
        maintain(engine, settings, utcnow())


def maintain(engine: Engine, settings: Settings, now: datetime) -> None:
    """The beat's minute of upkeep: release jobs of dead workers, drop delivered broker messages, and purge
    history past INFERQ_RETENTION_DAYS when (only when) that is set."""
    from workers.kafka_io import group_client_ids

    with engine.connect() as conn:
        try:
            live = live_worker_ids(
                group_client_ids(settings.kafka_connection, worker_group(settings.topic_prefix))
            )
        except Exception as exc:  # Kafka unreachable: cannot tell who is dead, so release nobody
            log.warning("maintenance: no consumer group view (%s); not releasing jobs", exc)
        else:
            released = maintenance.release_dead_workers(conn, settings.topic_prefix, live, now)
            conn.commit()
            if released:
                log.warning("maintenance: %d jobs of dead workers back to queued", len(released))
        messages = maintenance.purge_broker_messages(conn, now)
        if messages:
            log.info("maintenance: %d delivered broker messages removed", messages)
        if settings.retention_days is not None:
            cutoff = now - timedelta(days=settings.retention_days)
            purged = retention.purge(conn, cutoff, settings.state_dir)
            if purged.jobs or purged.bulk_jobs:
                log.info("retention: %d jobs and %d bulk jobs older than %g days purged",
                         purged.jobs, purged.bulk_jobs, settings.retention_days)  # fmt: skip

"""The Celery app of bulk jobs. Broker and result backend default to the project's PostgreSQL.

Built by a function, not at import time, so settings come from the caller (and tests).
"""

from __future__ import annotations

from celery import Celery

from workers.settings import Settings

PRODUCE = "inferq.bulk.produce"
TICK = "inferq.bulk.tick"
MAINTENANCE = "inferq.bulk.maintenance"
TICK_S = 2.0  # how often open bulk jobs are checked (finalised, or their producer restarted)
MAINTENANCE_S = 60.0


def queue(settings: Settings) -> str:
    """One task queue per deployment (topic prefix), so bulk workers of two deployments sharing a
    database never take each other's tasks."""
    return f"{settings.topic_prefix}.bulk"


def result_backend(settings: Settings) -> str:
    return "db+" + settings.database_url


def make_app(settings: Settings | None = None) -> Celery:
    """The app as a client sees it (send_task only); a bulk worker adds the tasks with tasks.register."""
    settings = settings or Settings.from_env()
    app = Celery("inferq", broker=settings.celery_broker_url, backend=result_backend(settings))
    app.conf.update(
        task_default_queue=queue(settings),
        task_ignore_result=True,  # tasks report through bulk_jobs; the backend only holds failures
        task_store_errors_even_if_ignored=True,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        timezone="UTC",
        beat_schedule={
            # expires: a tick that waited in the queue longer than its interval is stale; drop it
            "bulk-tick": {"task": TICK, "schedule": TICK_S, "options": {"expires": TICK_S * 5}},
            "maintenance": {
                "task": MAINTENANCE,
                "schedule": MAINTENANCE_S,
                "options": {"expires": MAINTENANCE_S},
            },
        },
    )
    return app

"""What the demo shows: live token events of a set of jobs, then their rows."""

from __future__ import annotations

import subprocess
import time

from sqlalchemy import select

from schemas.jobs import TokenEvent
from schemas.tables import TERMINAL_STATUSES, jobs
from workers.kafka_io import TopicReader
from workers.settings import Settings
from workers.store import SUMMARY_COLUMNS, make_engine


def follow_tokens(
    settings: Settings,
    labels: dict[str, str],
    since_ms: int,
    timeout_s: float,
    worker: subprocess.Popen | None = None,
) -> dict[str, str]:
    """Print each token event as a line `label | delta` until every job's final event; returns the texts."""
    reader = TopicReader(settings.kafka_connection, settings.topics.tokens, since_ms, "inferq-demo")
    texts: dict[str, str] = {job_id: "" for job_id in labels}
    attempts: dict[str, int] = {}
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while done != set(labels) and time.monotonic() < deadline:
            if worker is not None and worker.poll() is not None:
                raise RuntimeError(f"the worker exited with code {worker.returncode}; see its log")
            for record in reader.poll(0.2):
                event = TokenEvent.model_validate_json(record.value or b"{}")
                if event.job_id not in labels or event.job_id in done:
                    continue
                if attempts.setdefault(event.job_id, event.attempt) != event.attempt:
                    attempts[event.job_id] = event.attempt  # a retry restarts the text
                    texts[event.job_id] = ""
                texts[event.job_id] += event.text
                end = f"  [{event.finish_reason}]" if event.finish_reason else ""
                print(f"{labels[event.job_id]} | {event.text!r}{end}", flush=True)
                if event.finish_reason:
                    done.add(event.job_id)
    finally:
        reader.close()
    return texts


def wait_for_rows(settings: Settings, job_ids: list[str], timeout_s: float) -> list[dict]:
    """The jobs' rows once all are terminal (results are published only after the rows commit)."""
    db = make_engine(settings.database_url)
    cols = [*SUMMARY_COLUMNS, jobs.c.attempts, jobs.c.output_text]
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with db.connect() as conn:
                rows = [
                    dict(r._mapping) for r in conn.execute(select(*cols).where(jobs.c.job_id.in_(job_ids)))
                ]
            if (len(rows) == len(job_ids) and all(r["status"] in TERMINAL_STATUSES for r in rows)) or (
                time.monotonic() > deadline
            ):
                order = {job_id: i for i, job_id in enumerate(job_ids)}
                return sorted(rows, key=lambda r: order[r["job_id"]])
            time.sleep(0.2)
    finally:
        db.dispose()

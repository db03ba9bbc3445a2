"""Producing a bulk job's lines as Kafka jobs, resumable from the last checkpoint.

A checkpoint (bulk_jobs.submitted_lines) is written only after the broker acknowledged every job before
it, so a restart re-sends at most one checkpoint's worth of jobs; their job_ids are deterministic and
the worker skips a job_id it has already finished, so nothing runs twice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from schemas.jobs import JobRequest
from workers.bulk.batch_format import BatchLine, read_batch, to_job
from workers.clock import utcnow
from workers.db import Engine
from workers.db import bulk_jobs as store

log = logging.getLogger(__name__)

CHECKPOINT_LINES = 200


class Submitter(Protocol):  # workers.client.JobClient
    def submit_many(self, jobs: Sequence[JobRequest], priority: str = "normal") -> Sequence[object]:
        """Returns once the broker has every job; raises otherwise."""


def produce(engine: Engine, bulk_id: str, client: Submitter, checkpoint: int = CHECKPOINT_LINES) -> str:
    """Send the lines after the checkpoint; returns the bulk job's status afterwards.

    The caller holds the bulk job's lock. Stops early (leaving the checkpoint) when the job is cancelled.
    """
    with engine.begin() as conn:
        row = store.get(conn, bulk_id)
        if row is None or row["status"] != "submitting":
            return row["status"] if row else "missing"
        if not Path(row["input_path"]).is_file():  # e.g. the state dir is not shared with this machine
            error = f"input file {row['input_path']} is not readable by this bulk worker"
            store.transition(conn, bulk_id, ("submitting",), "failed", error=error, finished_at=utcnow())
            log.error("bulk %s: %s", bulk_id, error)
            return "failed"
        if row["started_at"] is None:
            store.transition(conn, bulk_id, ("submitting",), "submitting", started_at=utcnow())
    start, done = row["submitted_lines"], row["submitted_lines"]
    log.info("bulk %s: producing from line item %d", bulk_id, start)
    chunk: list[JobRequest] = []
    for index, item in enumerate(read_batch(Path(row["input_path"])), start=1):
        if index <= start:
            continue
        if isinstance(item, BatchLine):
            chunk.append(to_job(item, bulk_id=bulk_id, tenant=row["tenant"]))
        done = index
        if index % checkpoint == 0:
            client.submit_many(chunk, priority=row["priority"])
            chunk = []
            with engine.begin() as conn:
                store.set_submitted(conn, bulk_id, index)
                status = store.get(conn, bulk_id)["status"]
            if status != "submitting":
                log.info("bulk %s: %s at line item %d; producer stops", bulk_id, status, index)
                return status
    client.submit_many(chunk, priority=row["priority"])
    with engine.begin() as conn:
        store.set_submitted(conn, bulk_id, done)
        store.transition(conn, bulk_id, ("submitting",), "running")
        status = store.get(conn, bulk_id)["status"]
    log.info("bulk %s: %d line items produced; %s", bulk_id, done, status)
    return status

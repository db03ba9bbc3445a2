"""Moving bulk jobs forward: finalise those whose jobs are all terminal; find the ones that need a producer.

Called by the periodic tick, so a bulk job advances whichever Celery worker died or restarted meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import datetime
from itertools import islice
from pathlib import Path

from schemas.tables import TERMINAL_STATUSES
from workers.bulk.batch_format import BatchLine, job_id_for, read_batch
from workers.bulk.finalize import FinalCounts, write_results
from workers.clock import utcnow
from workers.db import Engine
from workers.db import bulk_jobs as store

log = logging.getLogger(__name__)

# After `bulk cancel`, how long jobs already running may finish before the files are written without them.
CANCEL_GRACE_S = 30.0


def _all_rows_terminal(engine: Engine, bulk_id: str, tenant: str, input_path: Path) -> bool:
    """Exact check by job_id; a cancel recorded before its job arrived leaves a row without bulk_id."""
    lines = (i for i in read_batch(input_path) if isinstance(i, BatchLine))
    while chunk := list(islice(lines, 1000)):
        ids = [job_id_for(bulk_id, i.custom_id) for i in chunk]
        with engine.connect() as conn:
            rows = store.rows_for(conn, tenant, ids)
        if len(rows) < len(ids) or any(r["status"] not in TERMINAL_STATUSES for r in rows.values()):
            return False
    return True


def jobs_done(engine: Engine, row: store.Row) -> bool:
    with engine.connect() as conn:
        counts = store.job_counts(conn, row["bulk_id"], row["tenant"])
    if store.terminal_jobs(counts) >= row["total_lines"] - row["invalid_lines"]:
        return True
    if counts.get("queued", 0) + counts.get("running", 0) > 0:
        return False
    return _all_rows_terminal(engine, row["bulk_id"], row["tenant"], Path(row["input_path"]))


def write_files(engine: Engine, row: store.Row, model_name: str | None = None) -> FinalCounts:
    bulk_id, folder = row["bulk_id"], Path(row["input_path"]).parent
    output, errors = folder / "output.jsonl", folder / "errors.jsonl"
    with engine.connect() as conn:
        counts = write_results(
            read_batch(Path(row["input_path"])),
            bulk_id,
            lambda ids: store.rows_for(conn, row["tenant"], ids),  # the bulk job's tenant's rows only
            output,
            errors,
            unfinished_code="cancelled" if row["status"] == "cancelled" else "missing",
            model_name=model_name,
        )
    with engine.begin() as conn:
        store.set_files(conn, bulk_id, str(output), str(errors), dataclasses.asdict(counts))
        store.transition(conn, bulk_id, ("finalizing",), "completed", finished_at=utcnow())
    log.info("bulk %s: files written: %s", bulk_id, counts)
    return counts


def maybe_finalize(
    engine: Engine, bulk_id: str, now: datetime | None = None, model_name: str | None = None
) -> FinalCounts | None:
    """Write the files if the bulk job is ready; the caller holds the bulk job's lock. `model_name`: the
    served model's, echoed in the responses (INFERQ_SERVED_MODEL_NAME)."""
    now = now or utcnow()
    with engine.connect() as conn:
        row = store.get(conn, bulk_id)
    if row is None:
        return None
    if row["status"] == "running":
        if not jobs_done(engine, row):
            return None
        with engine.begin() as conn:
            if not store.transition(conn, bulk_id, ("running",), "finalizing"):
                return None
            row = store.get(conn, bulk_id)
    elif row["status"] == "cancelled":
        if row["output_path"] is not None:
            return None
        with engine.connect() as conn:
            counts = store.job_counts(conn, bulk_id, row["tenant"])
        in_flight = counts.get("queued", 0) + counts.get("running", 0)
        if in_flight and (now - row["finished_at"]).total_seconds() < CANCEL_GRACE_S:
            return None
    elif row["status"] != "finalizing":  # finalizing: a worker died while writing; write again
        return None
    return write_files(engine, row, model_name)


def tick(
    engine: Engine, topic_prefix: str, start_producer: Callable[[str], None], model_name: str | None = None
) -> None:
    """One pass over the deployment's open bulk jobs."""
    with engine.connect() as conn:
        open_jobs = store.open_bulk_ids(conn, topic_prefix)
    for bulk_id, status in open_jobs:
        if status == "submitting":
            # Free lock: no producer runs (a crash, or a lost task); the new one resumes from the checkpoint.
            # Sent after the lock is released, or the producer could find it still held and give up.
            if store.is_free(engine, bulk_id):
                start_producer(bulk_id)
            continue
        with store.bulk_lock(engine, bulk_id) as got:
            if got:  # else a finaliser is at work on it
                maybe_finalize(engine, bulk_id, model_name=model_name)

"""Cancelling a bulk job: stop its producer, and cancel every job of it not finished yet."""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice
from pathlib import Path

from schemas.statuses import BULK_OPEN_STATUSES
from schemas.tables import TERMINAL_STATUSES
from workers.bulk.batch_format import BatchLine, job_id_for, read_batch
from workers.clock import utcnow
from workers.db import Engine
from workers.db import bulk_jobs as store

CANCELLABLE = tuple(
    s for s in BULK_OPEN_STATUSES if s != "finalizing"
)  # finalizing: its files are being written


def cancel(engine: Engine, bulk_id: str, send_cancel: Callable[[str, str], None]) -> int | None:
    """Mark the bulk job cancelled and call send_cancel(job_id, tenant) for each submitted job not terminal.

    Jobs still waiting in Kafka have no row yet: they are cancelled too (the worker records a cancel
    that arrives before its job). Returns the number of cancels sent, None if not cancellable.
    """
    with engine.begin() as conn:
        if not store.transition(conn, bulk_id, CANCELLABLE, "cancelled", finished_at=utcnow()):
            return None
        row = store.get(conn, bulk_id)
    # Only after the transition is read again: the producer checks the status at each checkpoint and
    # stops there, so lines past submitted_lines + one checkpoint are never sent.
    lines = (i for i in read_batch(Path(row["input_path"])) if isinstance(i, BatchLine))
    sent = 0
    while chunk := list(islice(lines, 500)):
        ids = [job_id_for(bulk_id, i.custom_id) for i in chunk]
        with engine.connect() as conn:
            rows = store.rows_for(conn, row["tenant"], ids)
        for job_id in ids:
            found = rows.get(job_id)
            if found is None or found["status"] not in TERMINAL_STATUSES:
                send_cancel(job_id, row["tenant"])
                sent += 1
    return sent

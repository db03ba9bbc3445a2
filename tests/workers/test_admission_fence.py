"""The consumer-group generation fence, at the worker: a worker whose admission of a job came late (its
record was fetched in an older generation, and the partition's new owner already runs the job) neither
runs the job nor re-queues it under the new owner; it holds its record's offset until that run has ended,
then acks it without a second run or result. (Real PostgreSQL and a real engine; the new owner's side is
written as its admission and its terminal row would be.)"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from schemas.validation import Limits
from tests.gpu.factories import make_engine
from tests.workers.persistence_factories import accepted
from tests.workers.worker_factories import job_rows
from workers.db.jobs import Terminal, finish
from workers.db.outbox import claim, mark_published
from workers.serving.admission.admitter import Admitter
from workers.serving.loop import lifecycle as job_lifecycle
from workers.serving.loop.lifecycle import JobLifecycle
from workers.serving.metrics import WorkerMetrics
from workers.serving.offsets import OffsetTracker

pytestmark = pytest.mark.services


def settle_until(lifecycle: JobLifecycle, condition, timeout_s: float = 30.0) -> None:
    """Run the loop's admission step until `condition()` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        lifecycle.admitter.wait_urgent(0.05)
        lifecycle.admit_pending()
        time.sleep(0.02)


def test_a_late_admission_leaves_the_new_owner_its_run_and_acks_once_that_run_ended(env, monkeypatch):
    dep, db, _ = env
    monkeypatch.setattr(job_lifecycle, "RECHECK_S", 0.2)  # how soon a superseded copy is decided again
    job = f"late-{uuid.uuid4().hex[:8]}"
    new_owner = Admitter(db, "w-new")  # fetched the job in generation 8 and runs it
    new_owner.add([accepted(dep, job, offset=3, generation=8)])
    assert [d.outcome.kind for d in new_owner.run(lambda a: False)[0]] == ["start"]

    late = accepted(dep, job, offset=3, generation=7)  # the same record, fetched before the rebalance
    partition = late.record.source
    offsets, items = OffsetTracker(), []
    lifecycle = JobLifecycle(
        make_engine(),
        dep.topics,
        worker_id="w-late",
        limits=Limits(),
        coalesce_s=0.05,
        database=db,
        ready=threading.Event(),
        offsets=offsets,
        owner=SimpleNamespace(assignment={partition}),  # the late worker has not seen its revocation yet
        metrics=WorkerMetrics(),
        write=items.extend,
        send_event=lambda event, tenant: None,
    )
    lifecycle.admitter.start()
    try:
        lifecycle.intake([(late.record, late)])
        settle_until(lifecycle, lambda: bool(lifecycle._recheck))  # decided: superseded
        assert not lifecycle.jobs and not lifecycle.engine.has_unfinished()  # it does not run the job
        assert offsets.safe_offset(partition) == 3  # and holds the record's offset
        row = job_rows(db, [job])[job]
        assert (row["worker_id"], row["attempts"], row["status"], row["admitted_generation"]) == (
            "w-new", 1, "queued", 8,
        )  # fmt: skip

        # the new owner's run ends: its terminal row, its result published
        now = datetime.now(UTC)
        values = {"output_text": "done", "finish_reason": "stop", "finished_at": now, **claim("w-new", now)}
        with db.begin() as conn:
            assert finish(conn, Terminal(job, "succeeded", values, attempt=1, tenant="t-a"), now) is not None
            mark_published(conn, [("t-a", job)], "w-new", now)
        settle_until(lifecycle, lambda: offsets.safe_offset(partition) == 4)  # decided again: done, acked
        assert not lifecycle.jobs and not items  # no run, no second result
        row = job_rows(db, [job])[job]
        assert (row["worker_id"], row["attempts"], row["status"]) == ("w-new", 1, "succeeded")
    finally:
        lifecycle.admitter.close()
